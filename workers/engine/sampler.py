"""A pure-torch batched generator with a KV cache.

Prompts are left-padded to a common length so every row decodes its next token at the
same cache slot; each row keeps its own positions (0 at its first real token), so a
prompt gets the same logits here as alone in an unpadded forward. A prompt that several
rows share (a GRPO group) is prefilled once and its cache copied to each of its rows.

Each sampled token's log-prob is recorded under softmax(logits / temperature), the full
tempered distribution: exactly what the trainer recomputes from its own logits, so the
GRPO ratio's denominator matches the trainer's numerator at equal weights. With top_p < 1
the token is drawn from the truncated distribution but the recorded log-prob is still
the untruncated tempered one (what the trainer can recompute).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from workers.engine.models.kv_cache import KVCache


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finished: bool  # ended with an end-of-sequence token (kept as the last token)
    policy_version: int = 0


NO_TOKEN_TO_DRAW = "no token to draw: a row's probabilities hold inf or nan, or no mass (the model's logits?)"
NUCLEUS_CANDIDATES = 256  # a trained model's top_p nucleus is mostly far smaller than its vocabulary


def draw_in_nucleus(probs: torch.Tensor, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """One token a row, drawn in proportion from the row's nucleus: the smallest set of most likely tokens whose mass
    reaches top_p. A row whose nucleus lies within its `NUCLEUS_CANDIDATES` most likely tokens is drawn from those
    (a top-k: 36-53 ms for 128 rows of 152k on one CPU thread); only the other rows sort the whole vocabulary
    (1.4-2.6 s). Which way a row goes does not change its token: both draw it with the same uniform number."""
    uniform = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=probs.dtype)
    top, order = probs.topk(min(NUCLEUS_CANDIDATES, probs.shape[-1]), dim=-1)
    covered = top.sum(dim=-1) >= top_p  # every token past the candidates has at least top_p of mass before it
    if bool(covered.all()):
        return _draw_sorted(top, order, top_p, uniform)
    tokens = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    tokens[covered] = _draw_sorted(top[covered], order[covered], top_p, uniform[covered])
    wide = ~covered
    tokens[wide] = _draw_sorted(*probs[wide].sort(dim=-1, descending=True), top_p, uniform[wide])
    return tokens


def _draw_sorted(sorted_probs: torch.Tensor, order: torch.Tensor, top_p: float, uniform: torch.Tensor) -> torch.Tensor:
    """`draw_tokens` over each row's nucleus, its probabilities in descending order (`order`: their token ids)."""
    cumulative = sorted_probs.cumsum(dim=-1)
    outside = (cumulative - sorted_probs) >= top_p
    kept = cumulative.masked_fill(outside, 0.0).amax(dim=-1, keepdim=True)
    if not bool(((kept > 0) & torch.isfinite(kept)).all()):
        raise ValueError(NO_TOKEN_TO_DRAW)
    return order.gather(1, token_at(torch.minimum(cumulative, kept), uniform)[:, None]).squeeze(1)


def draw_tokens(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token a row, drawn in proportion to the row's `probs` (rows need not sum to 1). One uniform number a row
    against the row's cumulative mass (torch.multinomial and the exponential race draw one a token: 8-16x slower on
    CPU, from a vocabulary of 320 to one of 152k)."""
    cumulative = probs.cumsum(dim=-1)
    total = cumulative[:, -1]
    if not bool(((total > 0) & torch.isfinite(total)).all()):
        raise ValueError(NO_TOKEN_TO_DRAW)
    uniform = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=probs.dtype)
    return token_at(cumulative, uniform)


def token_at(cumulative: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The first token of each row whose cumulative mass exceeds `uniform` (in [0, 1], a column) of the row's total:
    one with mass of its own, also where the scaled draw rounds up to the total."""
    total = cumulative[:, -1:]
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, target, right=True).squeeze(1)


def check_weights_fit(expected: Mapping[str, torch.Size], state_dict: Mapping[str, torch.Tensor]) -> None:
    """ValueError naming every missing, unexpected and mis-shaped weight of a synced state dict, so a broken sync
    fails before any weight changes instead of serving the old ones under a new policy version."""
    missing = sorted(expected.keys() - state_dict.keys())
    unexpected = sorted(state_dict.keys() - expected.keys())
    shapes = [f"{name} {tuple(state_dict[name].shape)} (the model's: {tuple(expected[name])})"
              for name in sorted(expected.keys() & state_dict.keys()) if state_dict[name].shape != expected[name]]
    problems = [f"{what}: {', '.join(names)}" for what, names in
                (("missing", missing), ("unexpected", unexpected), ("mis-shaped", shapes)) if names]
    if problems:
        raise ValueError("the weights do not fit the model; " + "; ".join(problems))


class TorchSampler:
    def __init__(self, model: nn.Module, *, eos_token_ids: list[int], pad_id: int, policy_version: int = 0):
        self.model = model
        self.eos_token_ids = list(eos_token_ids)
        self.pad_id = pad_id
        self.policy_version = policy_version

    @classmethod
    def copy_of(cls, model: nn.Module, *, dtype: torch.dtype, eos_token_ids: list[int], pad_id: int) -> "TorchSampler":
        """A generator on a frozen copy of a trainer's model in `dtype` (the rollout dtype), refreshed by
        `load_weights`; made before the model is sharded or wrapped for mixed precision."""
        copied = copy.deepcopy(model).to(dtype).eval().requires_grad_(False)
        return cls(copied, eos_token_ids=eos_token_ids, pad_id=pad_id)

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Weight sync: take the trainer's (torchtitan) state dict, every weight of the model, and its policy version."""
        check_weights_fit({name: tensor.shape for name, tensor in self.model.state_dict().items()}, state_dict)
        self.model.load_state_dict(state_dict)
        self.policy_version = version

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, *, seed: int) -> list[Completion]:
        model = self.model
        device = next(model.parameters()).device
        batch, prompt_len = len(prompts), max(len(p) for p in prompts)
        total = prompt_len + params.max_new_tokens
        generator = torch.Generator(device=device).manual_seed(seed)

        # each distinct prompt (a GRPO group's) is prefilled once, then its cache and logits fanned out to its rows
        distinct: dict[tuple[int, ...], int] = {}
        row_of = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prompts], device=device)
        tokens = torch.full((len(distinct), prompt_len), self.pad_id, dtype=torch.long, device=device)
        prompt_valid = torch.zeros(len(distinct), prompt_len, dtype=torch.bool, device=device)
        for row, prompt in enumerate(distinct):
            tokens[row, prompt_len - len(prompt):] = torch.tensor(prompt, device=device)
            prompt_valid[row, prompt_len - len(prompt):] = True
        positions = (prompt_valid.long().cumsum(dim=1) - 1).clamp(min=0)

        cache = KVCache(total)
        causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=device).tril()
        eye = torch.eye(prompt_len, dtype=torch.bool, device=device)
        # A left-pad query sees only itself: SDPA needs one visible key per row.
        cache.mask = ((causal & prompt_valid[:, None, :]) | eye)[:, None]
        logits = model(tokens, positions=positions, attention_masks=cache)[:, -1]
        cache.advance(prompt_len)
        if len(distinct) < batch:
            cache.select_rows(row_of)
        logits = logits.index_select(0, row_of)
        key_valid = torch.zeros(batch, total, dtype=torch.bool, device=device)
        key_valid[:, :prompt_len] = prompt_valid.index_select(0, row_of)
        next_position = positions[:, -1].index_select(0, row_of) + 1

        eos = torch.tensor(self.eos_token_ids, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        out_tokens: list[torch.Tensor] = []
        out_logprobs: list[torch.Tensor] = []
        out_alive: list[torch.Tensor] = []
        for step in range(params.max_new_tokens):
            logprobs = torch.log_softmax(logits.float() / params.temperature, dim=-1)
            if params.greedy:
                token = logits.argmax(dim=-1)
            else:
                probs = logprobs.exp()
                token = (draw_in_nucleus(probs, params.top_p, generator) if params.top_p < 1.0
                         else draw_tokens(probs, generator))
            token = token.masked_fill(done, self.pad_id)
            out_tokens.append(token)
            out_logprobs.append(logprobs.gather(1, token[:, None]).squeeze(1))
            out_alive.append(~done)
            done = done | torch.isin(token, eos)
            if bool(done.all()) or step == params.max_new_tokens - 1:
                break
            key_valid[:, prompt_len + step] = True
            cache.mask = key_valid[:, None, None, : prompt_len + step + 1]
            logits = model(token[:, None], positions=next_position[:, None], attention_masks=cache)[:, -1]
            cache.advance(1)
            next_position = next_position + 1

        tokens_bt = torch.stack(out_tokens, dim=1).tolist()
        logprobs_bt = torch.stack(out_logprobs, dim=1).tolist()
        alive_bt = torch.stack(out_alive, dim=1).tolist()
        eos_set = set(self.eos_token_ids)
        completions = []
        for row in range(batch):
            length = sum(alive_bt[row])
            ids = tokens_bt[row][:length]
            completions.append(Completion(
                prompt_ids=list(prompts[row]), token_ids=ids, logprobs=logprobs_bt[row][:length],
                finished=bool(ids) and ids[-1] in eos_set, policy_version=self.policy_version,
            ))
        return completions
