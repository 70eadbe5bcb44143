"""Load a torchtitan decoder from a local HF folder, and save one back as an HF folder."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torchtitan.models.common.decoder import Decoder

from workers.engine.checkpoint import find_checkpoint, load_checkpoint
from workers.engine.models.titan import Family, build_decoder, family_of, model_config_from_hf, state_dict_adapter
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


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / "config.json").read_text())


def load_hf_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(str(path)))
    return state


def to_hf_state_dict(model: Decoder, hf_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    adapter = state_dict_adapter(hf_config, model.config)
    return {k: v.detach().contiguous() for k, v in adapter.to_hf(model.state_dict()).items()}


def load_hf_weights(model: Decoder, hf_config: dict[str, Any], hf_state: dict[str, torch.Tensor]) -> None:
    adapter = state_dict_adapter(hf_config, model.config)
    titan_state = adapter.from_hf(dict(hf_state))
    dtype = next(model.parameters()).dtype
    titan_state = {k: v.to(dtype) for k, v in titan_state.items()}
    missing, unexpected = model.load_state_dict(titan_state, strict=False)
    # RoPE caches are non-persistent buffers; nothing else may be missing.
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")


def load_pretrained(
    folder: str | Path,
    *,
    family: Family | None = None,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
) -> LoadedModel:
    folder = Path(folder)
    hf_config = read_hf_config(folder)
    found = family_of(hf_config)
    if family is not None and family != found:
        raise ValueError(f"{folder} holds a {found} model, the config says {family}")
    model = build_decoder(hf_config, device=device, dtype=DTYPES[dtype])
    load_hf_weights(model, hf_config, load_hf_state_dict(folder))
    return LoadedModel(model=model, tokenizer=ChatTokenizer(folder), hf_config=hf_config, family=found, folder=folder)


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
    trainer.pt that is not plain data or is damaged, is a ConfigError on `checkpoint`, and loads nothing)."""
    checkpoint = find_checkpoint(checkpoint, field="checkpoint")
    hf_config = read_hf_config(checkpoint)
    model = build_decoder(hf_config)
    load_checkpoint(checkpoint, model=model, restore_rng=False, field="checkpoint")
    return save_pretrained(model, hf_config, checkpoint, out)
