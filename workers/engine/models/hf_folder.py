"""Load a torchtitan decoder from a local HF folder, and save one back as an HF folder."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torchtitan.models.common.decoder import Decoder

from workers.engine.checkpoint import find_checkpoint, load_checkpoint
from workers.engine.fields import ConfigError
from workers.engine.models.hf_config import Family, family_of, read_hf_config
from workers.engine.models.titan import build_decoder, model_config_from_hf, state_dict_adapter
from workers.engine.models.tokenizer import ChatTokenizer
from workers.engine.precision import DTYPES

# Files of an HF folder that describe the tokenizer and generation; copied as they are.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json")


@dataclass
class LoadedModel:
    model: Decoder
    tokenizer: ChatTokenizer
    hf_config: dict[str, Any]
    family: Family
    folder: Path


def load_hf_state_dict(folder: str | Path, *, field: str = "model.path",
                      shapes_only: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's *.safetensors files; a ConfigError on `field` for one it cannot read.
    `shapes_only`: meta tensors of the shapes the files' headers give, no data read."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ConfigError.on(field, f"{folder} holds no *.safetensors")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        if not path.is_file():
            raise ConfigError.on(field, f"{path} is not a file (a folder, or a link to nothing)")
        try:
            state.update(_header_shapes(path) if shapes_only else load_file(str(path)))
        except SafetensorError as exc:
            raise ConfigError.on(field, f"{path} is not a safetensors file this engine can read ({exc})") from None
        except OSError as exc:
            raise ConfigError.on(field, f"cannot read {path} ({exc.strerror or exc})") from None
    return state


def _header_shapes(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as weights:
        return {name: torch.empty(weights.get_slice(name).get_shape(), device="meta") for name in weights.keys()}


def decoder_for(hf_config: dict[str, Any], *, folder: Path, field: str, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> Decoder:
    """`build_decoder`, with a config.json that describes no model it builds a ConfigError on `field`."""
    try:
        return build_decoder(hf_config, device=device, dtype=dtype)
    except ValueError as exc:
        raise ConfigError.on(field, f"{folder}: {exc}") from None


def to_hf_state_dict(model: Decoder, hf_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    adapter = state_dict_adapter(hf_config, model.config)
    return {k: v.detach().contiguous() for k, v in adapter.to_hf(model.state_dict()).items()}


def load_hf_weights(model: Decoder, hf_config: dict[str, Any], hf_state: dict[str, torch.Tensor]) -> None:
    """ValueError, before any weight is loaded, when `hf_state` does not fit the model config.json describes."""
    adapter = state_dict_adapter(hf_config, model.config)
    try:
        titan_state = adapter.from_hf(dict(hf_state))
    except KeyError as exc:  # a name the adapter does not know
        raise ValueError(f"the weights do not fit the model config.json describes: {exc} is not one of its weights") \
            from None
    expected = model.state_dict()
    for name, tensor in titan_state.items():
        if name in expected and tensor.shape != expected[name].shape:
            raise ValueError(f"the weights do not fit the model config.json describes: {name} is "
                             f"{list(tensor.shape)}, not {list(expected[name].shape)}")
    dtype = next(model.parameters()).dtype
    titan_state = {k: v.to(dtype) for k, v in titan_state.items()}
    missing, unexpected = model.load_state_dict(titan_state, strict=False)
    # RoPE caches are non-persistent buffers; nothing else may be missing.
    if missing or unexpected:
        raise ValueError(f"the weights do not fit the model config.json describes: missing {missing}, unexpected "
                         f"{unexpected}")


def load_pretrained(
    folder: str | Path,
    *,
    family: Family | None = None,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """The model and tokenizer of an HF folder (model.path); a config.json or *.safetensors it cannot use is a
    ConfigError on model.path, a model of another family than `family` (model.family's) one on model.family, as
    preflight says it."""
    folder = Path(folder)
    hf_config = read_hf_config(folder)
    model = decoder_for(hf_config, folder=folder, field="model.path", device=device, dtype=DTYPES[dtype])
    found = family_of(hf_config)
    if family is not None and family != found:
        raise ConfigError.on("model.family", f"the folder holds a {found} model, not {family}")
    try:
        load_hf_weights(model, hf_config, load_hf_state_dict(folder))
    except ValueError as exc:
        raise ConfigError.on("model.path", f"{folder}: {exc}") from None
    return LoadedModel(model=model, tokenizer=ChatTokenizer(folder), hf_config=hf_config, family=found, folder=folder)


def check_hf_folder(folder: str | Path) -> dict[str, Any]:
    """What `load_pretrained` refuses in a folder (its config.json, tokenizer, and weights that do not fit the config),
    as the same ConfigError on model.path, without reading the weights (their shapes from the files' headers): for a
    generator that loads the folder itself (vLLM), before it does. The folder's config.json."""
    folder = Path(folder)
    hf_config = read_hf_config(folder)
    model = decoder_for(hf_config, folder=folder, field="model.path", device="meta")
    try:
        load_hf_weights(model, hf_config, load_hf_state_dict(folder, shapes_only=True))
    except ValueError as exc:
        raise ConfigError.on("model.path", f"{folder}: {exc}") from None
    ChatTokenizer(folder)
    return hf_config


def save_pretrained(model: Decoder, hf_config: dict[str, Any], tokenizer_folder: str | Path, out: str | Path) -> Path:
    """Write config.json, model.safetensors and the tokenizer files into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model_config_from_hf(hf_config)  # refuses configs the engine cannot load back
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    save_file(to_hf_state_dict(model, hf_config), str(out / "model.safetensors"), metadata={"format": "pt"})
    source = Path(tokenizer_folder)
    if source.resolve() != out.resolve():
        for name in _TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
    return out


def export_hf(checkpoint: str | Path, out: str | Path) -> Path:
    """Write the checkpoint's model as an HF folder that a new run can start from (a path that holds none, or a
    trainer.pt that is not plain data or is damaged, is a ConfigError on `checkpoint`, and loads nothing; an `out`
    that cannot be made a folder, one on `out`)."""
    checkpoint = find_checkpoint(checkpoint, field="checkpoint")
    hf_config = read_hf_config(checkpoint, field="checkpoint")
    model = decoder_for(hf_config, folder=checkpoint, field="checkpoint")
    load_checkpoint(checkpoint, model=model, restore_rng=False, field="checkpoint")
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file there, or on the way to it
        raise ConfigError.on("out", f"cannot make the folder {out} ({exc.strerror or exc})") from None
    return save_pretrained(model, hf_config, checkpoint, out)
