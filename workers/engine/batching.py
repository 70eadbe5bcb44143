"""Turning rollouts and SFT examples into tensors the trainer consumes.

Rollout batches: one sequence per row, prompt + response, right-padded, positions 0..L-1,
plain causal attention (padding sits after every real token, so it never leaks in). With
grpo.packing, each micro-batch's samples are packed into fewer rows for the forward
(`pack_rollouts`) and its per-token outputs put back in this padded layout, which the loss reads.

SFT batches: with packing, examples are laid end to end in rows of seq_len; positions
restart at 0 for each example and a document-causal mask stops attention across
examples, so a packed example gets the same logits as alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.engine.replay_buffer import RolloutBatchRecord


def rank_span(rows: int, *, rank: int, world: int) -> tuple[int, int, int]:
    """(first row, end, rows per rank) of a data-parallel rank's contiguous share of `rows`."""
    per_rank = math.ceil(rows / world)
    return min(rows, rank * per_rank), min(rows, (rank + 1) * per_rank), per_rank


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """[B, 1, L, L] bool mask for rows packed with several documents.

    A document starts wherever `positions` is 0; a token sees earlier tokens of its own
    document only.
    """
    doc_ids = torch.cumsum((positions == 0).int(), dim=1)
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    length = positions.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()
    return (same_doc & causal)[:, None]


@dataclass
class RolloutBatch:
    inputs: torch.Tensor  # [B, L-1] token ids fed to the model
    targets: torch.Tensor  # [B, L-1] next tokens
    response_mask: torch.Tensor  # [B, L-1] True where the target is a generated token
    behaviour_logprobs: torch.Tensor  # [B, L-1] generator's log-prob of each target (0 off-response)
    advantages: torch.Tensor  # [B]
    lengths: torch.Tensor  # [B] real positions of each row (prompt + response - 1); the rest is padding
    ref_logprobs: torch.Tensor | None = None  # [B, L-1] the frozen reference's, when there is one
    old_logprobs: torch.Tensor | None = None  # [B, L-1] the trainer's under the behaviour weights, when computed

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def _map(self, change: Callable[[torch.Tensor], torch.Tensor]) -> RolloutBatch:
        return RolloutBatch(*(None if t is None else change(t) for t in (
            self.inputs, self.targets, self.response_mask, self.behaviour_logprobs, self.advantages, self.lengths,
            self.ref_logprobs, self.old_logprobs)))

    def to(self, device: torch.device) -> RolloutBatch:
        return self._map(lambda t: t.to(device))

    def rows(self, start: int, stop: int) -> RolloutBatch:
        return self._map(lambda t: t[start:stop])

    def select(self, rows: torch.Tensor) -> RolloutBatch:
        """The rows at these indices, in their order."""
        return self._map(lambda t: t[rows.to(t.device)])

    def rank_rows(self, *, rank: int, world: int) -> tuple[RolloutBatch, int]:
        """(this data-parallel rank's contiguous rows, rows per rank): rank 0 has the most, a last rank may have none."""
        lo, hi, per_rank = rank_span(len(self), rank=rank, world=world)
        return self.rows(lo, hi), per_rank


def collate_rollouts(
    prompts: list[list[int]],
    responses: list[list[int]],
    logprobs: list[list[float]],
    advantages: list[float],
    *,
    pad_id: int,
) -> RolloutBatch:
    length = max(len(p) + len(r) for p, r in zip(prompts, responses))
    batch = len(prompts)
    tokens = torch.full((batch, length), pad_id, dtype=torch.long)
    mask = torch.zeros(batch, length - 1, dtype=torch.bool)
    behaviour = torch.zeros(batch, length - 1)
    for row, (prompt, response, lps) in enumerate(zip(prompts, responses, logprobs)):
        seq = prompt + response
        tokens[row, : len(seq)] = torch.tensor(seq)
        # target index t predicts token t+1: the response occupies targets len(p)-1 .. len(seq)-2
        start = len(prompt) - 1
        mask[row, start: start + len(response)] = True
        behaviour[row, start: start + len(response)] = torch.tensor(lps, dtype=torch.float32)
    lengths = torch.tensor([len(p) + len(r) - 1 for p, r in zip(prompts, responses)], dtype=torch.long)
    return RolloutBatch(tokens[:, :-1], tokens[:, 1:], mask, behaviour, torch.tensor(advantages, dtype=torch.float32),
                        lengths)


def collate_record(record: RolloutBatchRecord, *, pad_id: int, mask_truncated: bool = False) -> RolloutBatch:
    """A scored batch as tensors; `mask_truncated` (grpo.overlong.filter): cut-off responses leave the loss."""
    batch = collate_rollouts(record.prompts, record.responses, record.logprobs, record.advantages, pad_id=pad_id)
    if mask_truncated and any(record.truncated):
        batch.response_mask[torch.tensor(record.truncated, dtype=torch.bool)] = False
    return batch


@dataclass
class PackedRows:
    """A micro-batch's samples packed into rows for one forward, positions restarting at 0 for each sample. The
    real position at flat index `source[k]` of the padded [B, T] layout sits at flat index `dest[k]` of the packed
    [R, W] rows; packed padding holds token 0 and its outputs are never read."""
    inputs: torch.Tensor  # [R, W]
    targets: torch.Tensor  # [R, W]
    positions: torch.Tensor  # [R, W]
    attention_mask: torch.Tensor | None  # [R, 1, W, W] document-causal; None when no row holds two samples
    source: torch.Tensor  # [N] flat indices into the padded layout
    dest: torch.Tensor  # [N] flat indices into the packed rows
    padded_shape: tuple[int, int]  # (B, T)

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position values [R, W] of the packed rows in the padded layout [B, T], 0 at its padding."""
        rows, width = self.padded_shape
        flat = values.new_zeros(rows * width).index_copy(0, self.source, values.reshape(-1)[self.dest])
        return flat.view(rows, width)


def pack_rollouts(batch: RolloutBatch) -> PackedRows:
    """`batch`'s samples packed first-fit, longest first, into rows of at most its padded width T (the step batch's
    longest sample): a packed forward is never wider, and never has more rows, than the padded one."""
    padded_rows, padded_width = batch.inputs.shape
    lengths = batch.lengths.tolist()
    rows: list[list[int]] = []  # the samples of each row
    used: list[int] = []  # the positions each row holds
    for sample in sorted(range(padded_rows), key=lambda i: -lengths[i]):
        row = next((r for r, n in enumerate(used) if n + lengths[sample] <= padded_width), len(rows))
        if row == len(rows):
            rows.append([])
            used.append(0)
        rows[row].append(sample)
        used[row] += lengths[sample]
    width = max(used)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    source, dest = [], []
    for r, samples in enumerate(rows):
        at = 0
        for sample in samples:
            n = lengths[sample]
            source.append(torch.arange(n) + sample * padded_width)
            dest.append(torch.arange(n) + r * width + at)
            positions[r, at: at + n] = torch.arange(n)
            at += n
        if at < width:  # trailing padding continues the last sample's positions: the mask starts no sample there
            positions[r, at:] = torch.arange(positions[r, at - 1] + 1, positions[r, at - 1] + 1 + width - at)
    device = batch.inputs.device
    source_index, dest_index = torch.cat(source).to(device), torch.cat(dest).to(device)
    inputs = torch.zeros(len(rows) * width, dtype=torch.long, device=device)
    targets = torch.zeros(len(rows) * width, dtype=torch.long, device=device)
    inputs[dest_index] = batch.inputs.reshape(-1)[source_index]
    targets[dest_index] = batch.targets.reshape(-1)[source_index]
    positions = positions.to(device)
    shared = any(len(samples) > 1 for samples in rows)
    return PackedRows(inputs.view(len(rows), width), targets.view(len(rows), width), positions,
                      document_causal_mask(positions) if shared else None, source_index, dest_index,
                      (padded_rows, padded_width))


@dataclass
class SftBatch:
    inputs: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L]
    loss_mask: torch.Tensor  # [B, L] True where the target is a response token
    positions: torch.Tensor  # [B, L], restarting at 0 for each packed example
    attention_mask: torch.Tensor | None  # [B, 1, L, L] document-causal, None for one example per row

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def to(self, device: torch.device) -> SftBatch:
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        return SftBatch(self.inputs.to(device), self.targets.to(device), self.loss_mask.to(device), self.positions.to(device), mask)

    def rows(self, start: int, stop: int) -> SftBatch:
        mask = None if self.attention_mask is None else self.attention_mask[start:stop]
        return SftBatch(self.inputs[start:stop], self.targets[start:stop], self.loss_mask[start:stop], self.positions[start:stop], mask)

    def rank_rows(self, *, rank: int, world: int) -> tuple[SftBatch, int]:
        """(this data-parallel rank's contiguous rows, rows per rank): rank 0 has the most, a last rank may have none."""
        lo, hi, per_rank = rank_span(len(self), rank=rank, world=world)
        return self.rows(lo, hi), per_rank


def _example_tensors(prompt: list[int], response: list[int], seq_len: int) -> tuple[list[int], list[int], list[bool]]:
    """(inputs, targets, loss mask) of one example, truncated to seq_len predictions."""
    seq = (prompt + response)[: seq_len + 1]
    inputs, targets = seq[:-1], seq[1:]
    loss = [i >= len(prompt) - 1 for i in range(len(targets))]
    return inputs, targets, loss


def collate_sft(examples: list[tuple[list[int], list[int]]], *, seq_len: int, pad_id: int, packing: bool) -> SftBatch:
    """Rows of at most seq_len tokens. packing=True fills rows greedily with whole examples."""
    rows: list[list[tuple[list[int], list[int], list[bool]]]] = []
    for prompt, response in examples:
        piece = _example_tensors(prompt, response, seq_len)
        if packing and rows and sum(len(p[0]) for p in rows[-1]) + len(piece[0]) <= seq_len:
            rows[-1].append(piece)
        else:
            rows.append([piece])
    length = max(sum(len(p[0]) for p in row) for row in rows)
    inputs = torch.full((len(rows), length), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), length), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), length, dtype=torch.bool)
    positions = torch.zeros(len(rows), length, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for piece_inputs, piece_targets, piece_loss in row:
            n = len(piece_inputs)
            inputs[r, at: at + n] = torch.tensor(piece_inputs)
            targets[r, at: at + n] = torch.tensor(piece_targets)
            loss_mask[r, at: at + n] = torch.tensor(piece_loss)
            positions[r, at: at + n] = torch.arange(n)
            at += n
        # trailing padding continues the last document's positions: it is never a target
        if at < length:
            positions[r, at:] = torch.arange(positions[r, at - 1] + 1, positions[r, at - 1] + 1 + length - at)
    attention_mask = document_causal_mask(positions) if packing else None
    return SftBatch(inputs, targets, loss_mask, positions, attention_mask)
