"""The tokenizer of a local HF folder, with its chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from workers.engine.fields import ConfigError
from workers.engine.models.hf_config import read_json_object, too_long

Message = dict[str, str]

FIELD = "model.path"  # the field that names the folder
TOKENIZER_MAX_BYTES = 64 << 20  # Qwen3's tokenizer.json is 11 MB; tokenizer_config.json a few KB
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class ChatTokenizer:
    """A ConfigError on model.path, naming the file and why, for tokenizer files it cannot use."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.hf = self._load()
        if self.hf.chat_template is None:
            raise ConfigError.on(FIELD, f"{self.folder}: its tokenizer has no chat template (chat_template.jinja, or "
                                        "chat_template in tokenizer_config.json)")
        self.eos_token_ids = self._eos_token_ids()
        pad = self.hf.pad_token_id
        self.pad_id: int = self._checked_ids(pad, where="the tokenizer's pad_token")[0] if pad is not None \
            else self.eos_token_ids[0]
        self.turn_end_text = self._turn_end_text()

    def _load(self) -> PreTrainedTokenizerFast:
        if not (self.folder / "tokenizer.json").is_file():
            raise ConfigError.on(FIELD, f"{self.folder} has no tokenizer.json file (the model's tokenizer)")
        for name in TOKENIZER_FILES:  # transformers reads them whole
            path = self.folder / name
            if path.is_file() and path.stat().st_size > TOKENIZER_MAX_BYTES:
                raise too_long(path, field=FIELD, max_bytes=TOKENIZER_MAX_BYTES)
        try:
            return PreTrainedTokenizerFast.from_pretrained(str(self.folder))
        except Exception as exc:  # noqa: BLE001 - whatever transformers raises of the files it read
            raise self._unreadable(exc) from None

    def _unreadable(self, exc: Exception) -> ConfigError:
        """The refusal of a folder transformers could not load a tokenizer from: the file at fault when one is found,
        with the reason (the JSON file's, as config.json's, or the tokenizers library's), else transformers' reason."""
        tokenizer_json = self.folder / "tokenizer.json"
        for name in TOKENIZER_FILES:
            if (self.folder / name).is_file():
                read_json_object(self.folder / name, field=FIELD, max_bytes=TOKENIZER_MAX_BYTES)  # raises its refusal
        try:
            Tokenizer.from_file(str(tokenizer_json))
        except Exception as bad:  # noqa: BLE001 - the tokenizers library's error, of this file
            return ConfigError.on(FIELD, f"cannot load its tokenizer ({tokenizer_json}: {_short(bad)})")
        return ConfigError.on(FIELD, f"cannot load its tokenizer ({self.folder}: {_short(exc)})")

    def _eos_token_ids(self) -> list[int]:
        ids: list[int] = []
        if self.hf.eos_token_id is not None:
            ids.extend(self._checked_ids(self.hf.eos_token_id, where="the tokenizer's eos_token"))
        for name in ("generation_config.json", "config.json"):
            path = self.folder / name
            if path.is_file():
                eos = read_json_object(path, field=FIELD).get("eos_token_id")
                if eos is not None:
                    ids.extend(i for i in self._checked_ids(eos, where=f"{name} eos_token_id") if i not in ids)
        if not ids:
            raise ConfigError.on(FIELD, f"{self.folder}: its tokenizer has no end-of-sequence token (eos_token in "
                                        "tokenizer_config.json, or eos_token_id in generation_config.json or "
                                        "config.json)")
        return ids

    def _checked_ids(self, value: Any, *, where: str) -> list[int]:
        """`value`, a token id or a list of them, as a list; a ConfigError naming `where` unless each is a whole number
        from 0 to the vocabulary's last id."""
        ids = value if isinstance(value, list) else [value]
        if not all(_token_id(i, vocab=len(self.hf)) for i in ids):
            raise ConfigError.on(FIELD, f"{self.folder}: {where}: a token id from 0 to {len(self.hf) - 1}, or a list "
                                        f"of them, got {json.dumps(value)[:40]}")
        return list(dict.fromkeys(ids))

    def _turn_end_text(self) -> str:
        """What the chat template writes after an assistant's reply, as text a decoded reply keeps (special tokens
        dropped): "" for templates that end turns with a special token, "<|end|>" for one that spells it out."""
        marker = "\u2063reply\u2063"
        try:
            rendered = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}],
                                   add_generation_prompt=False)
            after = rendered[rendered.find(marker) + len(marker):] if marker in rendered else ""
            return self.decode(self.encode(after)).strip()
        except Exception as exc:  # noqa: BLE001 - a template, or a tokenizer_config.json value taken unchecked
            raise ConfigError.on(FIELD, f"{self.folder}: its tokenizer cannot render a conversation ({_short(exc)})") \
                from None

    def __len__(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_reply(self, ids: list[int]) -> str:
        """A generated reply as text, without the template's end of turn (what a reward and a reader should see)."""
        text = self.decode(ids)
        if self.turn_end_text and text.rstrip().endswith(self.turn_end_text):
            return text.rstrip()[: -len(self.turn_end_text)]
        return text

    def render(self, messages: list[Message], *, add_generation_prompt: bool) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode_prompt(self, messages: list[Message]) -> list[int]:
        """Token ids of a conversation that ends where the assistant should start answering."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def encode_exchange(self, messages: list[Message], response: str) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids) for supervised training on the assistant's reply only.

        The response ids run to the end of the rendered conversation, so they include the
        template's end of turn; when that holds no end-of-sequence token (a template that ends
        turns with ordinary text), the EOS follows it. Either way the model learns to stop
        where the sampler stops.
        """
        prompt_text = self.render(messages, add_generation_prompt=True)
        full_text = self.render([*messages, {"role": "assistant", "content": response}], add_generation_prompt=False)
        if not full_text.startswith(prompt_text):
            raise ValueError("chat template does not render the prompt as a prefix of the full conversation")
        prompt_ids = self.encode(prompt_text)
        response_ids = self.encode(full_text[len(prompt_text):])
        if not set(response_ids) & set(self.eos_token_ids):
            response_ids.append(self.eos_token_ids[0])
        return prompt_ids, response_ids


def _token_id(value: Any, *, vocab: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab


def _short(exc: Exception) -> str:
    """An exception's type and the first line of its message, at most 200 characters (no traceback)."""
    lines = str(exc).strip().splitlines()
    kind = "" if type(exc) is Exception else type(exc).__name__  # the tokenizers library raises plain Exception
    text = ": ".join(part for part in (kind, lines[0] if lines else "") if part) or "Exception"
    return text if len(text) <= 200 else text[:199] + "…"
