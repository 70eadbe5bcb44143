"""Turning rollouts and SFT examples into tensors the trainer consumes.

Rollout batches: one sequence per row, prompt + response, right-padded, positions 0..L-1,
plain causal attention (padding sits after every real token, so it never leaks in). With
grpo.packing, each micro-batch's samples are packed for the forward (`pack_rollouts`): a group's
prompt once, its responses after it, each seeing the prompt and itself (a mask), units of them
packed into fewer rows; the response tokens' outputs are put back in this padded layout, which
the loss reads.

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
    prompt_lengths: torch.Tensor  # [B] the prompt's tokens: the response's targets start at prompt_length - 1
    ref_logprobs: torch.Tensor | None = None  # [B, L-1] the frozen reference's, when there is one
    old_logprobs: torch.Tensor | None = None  # [B, L-1] the trainer's under the behaviour weights, when computed

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def _map(self, change: Callable[[torch.Tensor], torch.Tensor]) -> RolloutBatch:
        return RolloutBatch(*(None if t is None else change(t) for t in (
            self.inputs, self.targets, self.response_mask, self.behaviour_logprobs, self.advantages, self.lengths,
            self.prompt_lengths, self.ref_logprobs, self.old_logprobs)))

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
    tokens = torch.tensor([p + r + [pad_id] * (length - len(p) - len(r)) for p, r in zip(prompts, responses)],
                          dtype=torch.long).view(batch, length)
    # target index t predicts token t+1: a response occupies targets len(p)-1 .. len(p)+len(r)-2
    prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    response_lengths = torch.tensor([len(r) for r in responses], dtype=torch.long)
    target = torch.arange(length - 1)
    start = (prompt_lengths - 1).unsqueeze(1)
    mask = (target >= start) & (target < start + response_lengths.unsqueeze(1))
    behaviour = torch.zeros(batch, length - 1)
    behaviour[mask] = torch.tensor([lp for lps in logprobs for lp in lps], dtype=torch.float32)  # row by row, in order
    lengths = prompt_lengths + response_lengths - 1
    return RolloutBatch(tokens[:, :-1], tokens[:, 1:], mask, behaviour, torch.tensor(advantages, dtype=torch.float32),
                        lengths, prompt_lengths)


def collate_record(record: RolloutBatchRecord, *, pad_id: int, mask_truncated: bool = False) -> RolloutBatch:
    """A scored batch as tensors; `mask_truncated` (grpo.overlong.filter): cut-off responses leave the loss."""
    batch = collate_rollouts(record.prompts, record.responses, record.logprobs, record.advantages, pad_id=pad_id)
    if mask_truncated and any(record.truncated):
        batch.response_mask[torch.tensor(record.truncated, dtype=torch.bool)] = False
    return batch


SHARED_PROMPT_POSITIONS = 2048  # the widest a packed unit of one prompt and several responses grows


@dataclass
class PackedRows:
    """A micro-batch's samples packed into rows for one forward. Samples with the same prompt (a GRPO group) hold it
    once: a unit is the prompt's positions, then each response's, and a response sees the prompt and its own earlier
    positions only (positions continue from the prompt's end, as in its own row). Units are packed first-fit into
    rows, which padding (token 0, a unit of its own) ends. Only the response's targets are read: the target at flat
    index `source[k]` of the padded [B, T] layout is `targets[k]`, predicted at flat position `read[k]` of the packed
    rows (a prompt's last position predicts every response's first token)."""
    inputs: torch.Tensor  # [R, W]
    positions: torch.Tensor  # [R, W]
    attention_mask: torch.Tensor | None  # [R, 1, W, W]; None when every row is one sample and padding
    read: torch.Tensor  # [N] flat indices into the packed rows
    targets: torch.Tensor  # [N]
    source: torch.Tensor  # [N] flat indices into the padded layout
    padded_shape: tuple[int, int]  # (B, T)
    padding_positions: int  # positions of the rows that hold no token

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Values [N] of the read positions in the padded layout [B, T], 0 everywhere else (prompt and padding)."""
        rows, width = self.padded_shape
        return values.new_zeros(rows * width).index_copy(0, self.source, values.reshape(-1)).view(rows, width)


@dataclass
class _Unit:
    prompt_length: int
    samples: list[int]
    width: int  # the prompt's positions and each sample's response positions


def _prompt_units(batch: RolloutBatch) -> list[_Unit]:
    """The samples grouped by their prompt's tokens, in order of first appearance; a group wider than
    max(T, SHARED_PROMPT_POSITIONS) is split into several units, each with the prompt."""
    padded_width = batch.inputs.shape[1]
    cap = max(padded_width, SHARED_PROMPT_POSITIONS)
    lengths, prompt_lengths, inputs = batch.lengths.tolist(), batch.prompt_lengths.tolist(), batch.inputs.tolist()
    groups: dict[tuple[int, ...], list[int]] = {}
    for sample, prompt_length in enumerate(prompt_lengths):
        groups.setdefault(tuple(inputs[sample][:prompt_length]), []).append(sample)
    units: list[_Unit] = []
    for prompt, samples in groups.items():
        unit = _Unit(prompt_length=len(prompt), samples=[], width=len(prompt))
        for sample in samples:
            extra = max(0, lengths[sample] - len(prompt))  # its response's tokens but the last (only a target)
            if unit.samples and unit.width + extra > cap:
                units.append(unit)
                unit = _Unit(prompt_length=len(prompt), samples=[], width=len(prompt))
            unit.samples.append(sample)
            unit.width += extra
        units.append(unit)
    return units


def pack_rollouts(batch: RolloutBatch) -> PackedRows:
    """`batch`'s samples packed, each prompt once (PackedRows), units first-fit, widest first, into rows as wide as
    the widest unit or the padded width T, whichever is more. Samples of distinct prompts pack as they would alone:
    rows never wider, nor more of them, than the padded layout's."""
    padded_rows, padded_width = batch.inputs.shape
    units = _prompt_units(batch)
    width = max(padded_width, max(unit.width for unit in units))
    rows: list[list[_Unit]] = []
    used: list[int] = []
    for unit in sorted(units, key=lambda u: -u.width):
        row = next((r for r, n in enumerate(used) if n + unit.width <= width), len(rows))
        if row == len(rows):
            rows.append([])
            used.append(0)
        rows[row].append(unit)
        used[row] += unit.width
    width = max(used)

    lengths = batch.lengths.tolist()
    # per packed position, row by row: the padded layout's flat index of its token (-1: padding), its position, unit
    # and segment (0: the prompt); per target read: where the packed rows predict it and where it sits in the padded
    take: list[int] = []
    positions: list[int] = []
    unit_ids: list[int] = []
    segments: list[int] = []
    read: list[int] = []
    source: list[int] = []
    units_seen = 0
    for row_units in rows:
        for unit in row_units:
            p, unit_id = unit.prompt_length, units_seen
            units_seen += 1
            first = unit.samples[0] * padded_width
            prompt_end = len(take) + p
            take.extend(range(first, first + p))
            positions.extend(range(p))
            unit_ids.extend([unit_id] * p)
            segments.extend([0] * p)
            for segment, sample in enumerate(unit.samples, start=1):
                extra, at = max(0, lengths[sample] - p), len(take)
                offset = sample * padded_width
                take.extend(range(offset + p, offset + p + extra))
                positions.extend(range(p, p + extra))
                unit_ids.extend([unit_id] * extra)
                segments.extend([segment] * extra)
                if lengths[sample] >= p:  # targets p-1 .. length-1; an empty response has none
                    source.extend(range(offset + p - 1, offset + lengths[sample]))
                    read.append(prompt_end - 1)  # the prompt's last position predicts the response's first token
                    read.extend(range(at, at + extra))
        pad = width - len(take) % width if len(take) % width else 0
        if pad:  # padding: a unit of its own, so every position sees at least itself
            unit_id, units_seen = units_seen, units_seen + 1
            take.extend([-1] * pad)
            # a packed row may be wider than the model's positions: padding's stop at the padded layout's last
            positions.extend(min(i, padded_width - 1) for i in range(pad))
            unit_ids.extend([unit_id] * pad)
            segments.extend([0] * pad)
    shape = (len(rows), width)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=batch.inputs.device)  # noqa: E731
    take_index = as_tensor(take)
    real = take_index >= 0
    inputs = torch.zeros_like(take_index)
    inputs[real] = batch.inputs.reshape(-1)[take_index[real]]
    source_index, read_index = as_tensor(source), as_tensor(read)
    single = all(len(row_units) == 1 and len(row_units[0].samples) == 1 for row_units in rows)
    mask = None if single else shared_prompt_mask(as_tensor(unit_ids).view(shape), as_tensor(segments).view(shape))
    return PackedRows(inputs.view(shape), as_tensor(positions).view(shape), mask, read_index,
                      batch.targets.reshape(-1)[source_index], source_index, (padded_rows, padded_width),
                      len(take) - int(real.sum()))


def shared_prompt_mask(units: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """[R, 1, W, W] bool: a position sees the earlier positions of its own unit that are its prompt (segment 0) or
    its own segment."""
    same_unit = units[:, :, None] == units[:, None, :]
    visible = (segments[:, None, :] == 0) | (segments[:, :, None] == segments[:, None, :])
    length = units.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=units.device).tril()
    return (same_unit & visible & causal)[:, None]


@dataclass
class SftBatch:
    inputs: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L]
    loss_mask: torch.Tensor  # [B, L] True where the target is a response token
    positions: torch.Tensor  # [B, L], restarting at 0 for each packed example
    attention_mask: torch.Tensor | None  # [B, 1, L, L] document-causal, None for one example per row
    examples: int = 0  # of the collated batch (a slice of its rows says 0)
    examples_cut: int = 0  # of those, the ones whose prompt left no room in seq_len for a response token

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def to(self, device: torch.device) -> SftBatch:
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        return SftBatch(self.inputs.to(device), self.targets.to(device), self.loss_mask.to(device),
                        self.positions.to(device), mask, self.examples, self.examples_cut)

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
    cut = sum(not any(piece_loss) for row in rows for _, _, piece_loss in row)
    return SftBatch(inputs, targets, loss_mask, positions, attention_mask, examples=len(examples), examples_cut=cut)
