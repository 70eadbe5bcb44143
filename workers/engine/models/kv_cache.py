"""The decoding KV cache, kept free of torchtitan so the sampler imports with torch alone."""

from __future__ import annotations

from collections.abc import Callable

import torch


class KVCache:
    """Per-layer key/value buffers for batched decoding, preallocated on first use."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0  # positions already written by previous forwards
        self.mask: torch.Tensor | None = None  # [B, 1, Lq, length + Lq], set before each forward
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        # called with select_rows' rows by whoever keeps per-row cache state of its own (the GPU script's adapter)
        self.on_select_rows: list[Callable[[torch.Tensor], None]] = []

    def append(self, layer: object, k_BNLH: torch.Tensor, v_BNLH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = id(layer)  # one buffer pair per attention module
        if key not in self._keys:
            b, n, _, h = k_BNLH.shape
            self._keys[key] = k_BNLH.new_zeros(b, n, self.max_len, h)
            self._values[key] = v_BNLH.new_zeros(b, n, self.max_len, v_BNLH.shape[-1])
        end = self.length + k_BNLH.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} positions is full")
        self._keys[key][:, :, self.length:end] = k_BNLH
        self._values[key][:, :, self.length:end] = v_BNLH
        return self._keys[key][:, :, :end], self._values[key][:, :, :end]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Make row i of the cache a copy of row rows[i] (a prompt prefilled once, fanned out to its samples)."""
        for key in self._keys:
            self._keys[key] = self._keys[key].index_select(0, rows)
            self._values[key] = self._values[key].index_select(0, rows)
        for select in self.on_select_rows:
            select(rows)

    def advance(self, n: int) -> None:
        self.length += n
