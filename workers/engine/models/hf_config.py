"""A Hugging Face model folder's config.json, read without torch (preflight reads it as the model's load does)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workers.engine.fields import ConfigError, FieldError

HF_CONFIG_MAX_BYTES = 1 << 20  # a model's config.json is a few KB


def read_hf_config(folder: str | Path, *, field: str = "model.path") -> dict[str, Any]:
    """The folder's config.json, a JSON object; a ConfigError on `field` (the one that named the folder) when it is
    missing, not a file, or not a JSON object (read no further than HF_CONFIG_MAX_BYTES)."""
    path = Path(folder) / "config.json"
    try:
        if not path.is_file():
            raise _refused(field, f"{folder} has no config.json file (the model's description)")
        with open(path, "rb") as file:
            raw = file.read(HF_CONFIG_MAX_BYTES + 1)
    except OSError as exc:
        raise _refused(field, f"cannot read {path} ({exc.strerror or exc})") from None
    if len(raw) > HF_CONFIG_MAX_BYTES:
        raise _refused(field, f"{path} is longer than {HF_CONFIG_MAX_BYTES} bytes: not a model's config.json")
    try:
        hf_config = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise _refused(field, f"{path} is not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise _refused(field, f"{path} is not JSON ({exc.msg}, line {exc.lineno} column {exc.colno})") from None
    except (ValueError, RecursionError):  # a number of over 4300 digits, arrays nested a thousand deep
        raise _refused(field, f"{path} is not JSON this engine can read") from None
    if not isinstance(hf_config, dict):
        raise _refused(field, f"{path} is a JSON {type(hf_config).__name__}, not an object")
    return hf_config


def _refused(field: str, message: str) -> ConfigError:
    return ConfigError([FieldError(field, message)])
