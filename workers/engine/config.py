"""The run configuration: one typed schema, one place that validates it.

Loaded from YAML with `key=value` overrides. Unknown keys are errors. Importing
this module must not import torch: the web process validates configs with it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from workers.engine.fields import ConfigError, FieldError, FieldProblems, StrictModel, field_errors
from workers.engine.operations import FaultDrillRequest
from workers.engine.yaml_safe import MAX_CONFIG_BYTES, YamlProblem, load_yaml_mapping

__all__ = ["ConfigError", "FieldError", "RunConfig", "load_config", "load_config_file", "parse_config_mapping"]


class Recipe(StrEnum):
    GRPO = "grpo"
    SFT = "sft"


_Section = StrictModel


PositiveInt = Annotated[int, Field(ge=1, le=2**31 - 1)]
NonNegativeInt = Annotated[int, Field(ge=0, le=2**31 - 1)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]


# A registered artifact: `<name>` or `<project-slug>/<name>`; a run's own files: `run:<run id>@step:<step>`.
ARTIFACT_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}"
ARTIFACT_REFERENCE = re.compile(rf"^(?:(?P<project>[a-z0-9][a-z0-9-]{{0,62}})/)?(?P<name>{ARTIFACT_NAME_PATTERN})$")
RUN_REFERENCE = re.compile(r"^run:(?P<run>[1-9][0-9]{0,18})@step:(?P<step>0|[1-9][0-9]{0,18})$")
REFERENCE_HELP = "'<name>' or '<project>/<name>' (a registered artifact) or 'run:<run id>@step:<step>'"


def _check_reference(value: str | None, *, runs: bool = True, names: bool = True) -> str | None:
    if value is None:
        return None
    if (runs and RUN_REFERENCE.match(value)) or (names and ARTIFACT_REFERENCE.match(value)):
        return value
    raise ValueError(f"{value[:60]!r} is not a reference: " + (REFERENCE_HELP if names and runs else
                                                             "'run:<run id>@step:<step>'" if runs else
                                                             "'<name>' or '<project>/<name>'"))


def is_run_reference(value: str | None) -> bool:
    return bool(value) and RUN_REFERENCE.match(value) is not None


class ModelConfig(_Section):
    family: Literal["qwen3", "llama3"] = "qwen3"
    path: str | None = Field(default=None, description="Local Hugging Face folder: config.json, *.safetensors, "
                                                       "tokenizer.json (or model.artifact)")
    artifact: str | None = Field(default=None, description="instead of path: a registered model, '<name>' or "
                                                           "'<project>/<name>', or a run's export, "
                                                           "'run:<run id>@step:<step>' (resolved by the control plane)")
    dtype: Literal["float32", "bfloat16"] = "float32"

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.path is None) == (self.artifact is None):
            raise ValueError("set exactly one of model.path and model.artifact")
        return self

    @field_validator("artifact")
    @classmethod
    def _reference(cls, value: str | None) -> str | None:
        return _check_reference(value)


RowKey = Annotated[str, Field(min_length=1, max_length=200)]


class DataFields(_Section):
    """Which key of a JSONL row holds each part of an example."""

    prompt: RowKey = Field(default="prompt", description="the prompt: a string (one user message) or a list of "
                                                         "{role, content} messages; when this is 'prompt', "
                                                         "'instruction' is read too")
    response: RowKey = Field(default="response", description="the reference reply SFT trains on (GRPO needs none); "
                                                             "when this is 'response', 'output' and 'completion' are read too")
    answer: RowKey = Field(default="answer", description="what a verifiable reward (exact_math) compares against")
    messages: RowKey = Field(default="messages", description="a whole conversation, a list of {role, content}: a "
                                                             "final assistant message is the reply, the messages "
                                                             "before it the prompt (GRPO: it may end without one)")

    @model_validator(mode="after")
    def _messages_apart(self) -> DataFields:
        same = [name for name in ("prompt", "response", "answer") if getattr(self, name) == self.messages]
        if same:
            raise FieldProblems([("messages", f"names the same key as fields.{same[0]}")])
        return self


ARITHMETIC_TRAIN_SIZE = 2000  # a generated task has no natural size


class DataConfig(_Section):
    source: Literal["arithmetic", "jsonl"] = "arithmetic"
    path: str | None = Field(default=None, description="JSONL file, required when source is jsonl (or data.artifact)")
    artifact: str | None = Field(default=None, description="instead of path: a registered JSONL dataset, '<name>' or "
                                                           "'<project>/<name>' (resolved by the control plane)")
    fields: DataFields = Field(default=DataFields(), description="jsonl: the row keys of prompt, response, answer "
                                                                 "and messages, e.g. {prompt: question}")
    answer_extractor: Literal["gsm8k"] | None = Field(
        default=None, description="jsonl: how the answer field becomes the answer; gsm8k: the text after its last "
                                  "'####', stripped, thousands commas removed; unset: the field as it is")
    max_operand: PositiveInt = Field(default=20, description="arithmetic: largest operand of a+b")
    train_size: PositiveInt | None = Field(
        default=None, description="examples to train on, after eval_size are held out; unset: every other row of a "
                                  f"JSONL file, or {ARITHMETIC_TRAIN_SIZE} arithmetic problems (at most all pairs)")
    eval_size: PositiveInt = 64
    max_prompt_tokens: PositiveInt = Field(default=64, description="GRPO: longest prompt in tokens, chat template included; "
                                                                 "preflight refuses data with a longer one")
    packing: bool = Field(default=True, description="SFT: pack several examples into one sequence")
    seq_len: PositiveInt = 256

    @model_validator(mode="after")
    def _jsonl_needs_path(self) -> DataConfig:
        if self.artifact is not None:
            if self.source != "jsonl":
                raise ValueError("artifact is a JSONL dataset: set source: jsonl")
            if self.path:
                raise ValueError("set exactly one of data.path and data.artifact")
        elif self.source == "jsonl" and not self.path:
            raise ValueError("path (or artifact) is required when source is 'jsonl'")
        if self.source != "jsonl":
            problems = [(name, "applies to source: jsonl") for name, unset in
                        (("fields", DataFields()), ("answer_extractor", None)) if getattr(self, name) != unset]
            if problems:
                raise FieldProblems(problems)
        return self

    @property
    def train_limit(self) -> int | None:
        """The most examples to train on; None: every row left after the held-out ones."""
        if self.train_size is None and self.source == "arithmetic":
            return ARITHMETIC_TRAIN_SIZE
        return self.train_size

    @field_validator("artifact")
    @classmethod
    def _reference(cls, value: str | None) -> str | None:
        return _check_reference(value, runs=False)


class GeneratorConfig(_Section):
    backend: Literal["torch", "vllm"] = "torch"
    replicas: PositiveInt = 1
    max_new_tokens: PositiveInt = 16
    temperature: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    routing: Literal["round_robin", "least_loaded", "sticky"] = "least_loaded"
    in_trainer: bool = Field(
        default=False,
        description="Monarch GRPO, sync mode: each trainer rank generates its share of the step's groups in its own "
                    "proc, from a copy of its weights refreshed in memory when the policy moved (a hybrid engine, as "
                    "verl's): no generator procs and no weight transfer. In sync mode the generators and the trainer "
                    "take turns, so this gives both the same threads or GPU")


class OptimizerConfig(_Section):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: Annotated[float, Field(ge=0.0, le=1.0)] = Field(default=1e-4, description="0: a control run whose weights never move")
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = Field(
        default=(0.9, 0.95), description="adamw: the decay rates of the gradient's running mean and of its square")
    weight_decay: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    warmup_steps: NonNegativeInt = 0
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    grad_clip: Annotated[float, Field(gt=0.0)] | None = 1.0


MAX_THREADS_PER_PROCESS = 1024  # more cores than a host has; 2**31 - 1 made OpenMP allocate 432 GiB


class TrainerConfig(_Section):
    steps: PositiveInt = 100
    batch_size: PositiveInt = Field(default=8, description="prompts per step (GRPO) or sequences per step (SFT)")
    micro_batch_size: PositiveInt = Field(default=8, description="sequences (rows) per forward/backward; gradients accumulate over a step")
    ranks: PositiveInt = Field(default=1, description="data-parallel trainer processes")
    sharding: Literal["replicate", "fsdp"] = Field(
        default="replicate",
        description="replicate: every rank holds the whole model and optimizer, gradients are all-reduced; "
                    "fsdp: parameters, gradients and optimizer state are sharded over the ranks (FSDP2, one unit per "
                    "transformer block; Monarch GRPO recipe)",
    )
    mixed_precision: Literal["off", "bf16"] = Field(
        default="off", description="bf16: compute every trainer forward and backward in bfloat16 on float32 weights, "
                                   "gradients and optimizer state (autocast; FSDP's policy when sharded, which also "
                                   "reduces gradients in float32); the generator and the reference hold bfloat16 "
                                   "weights. Needs model.dtype float32")
    threads_per_process: Annotated[int, Field(ge=1, le=MAX_THREADS_PER_PROCESS)] = Field(
        default=1, description="torch's CPU threads in each process (OpenMP allocates for each when it starts)")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto: cuda when available, else cpu")
    recover_failures: NonNegativeInt = Field(
        default=0,
        description="monarch backend: respawn a failed trainer mesh and resume from the last checkpoint, up to this many times",
    )
    optimizer: OptimizerConfig = OptimizerConfig()
    max_skipped_updates: PositiveInt = Field(
        default=3,
        description="end the run as diverged when this many steps in a row had NaN or infinite gradients (each such "
                    "update is skipped: the weights do not take it)",
    )
    seed: NonNegativeInt = 0
    peak_flops_per_second: Annotated[float, Field(gt=0.0, le=1e18)] = Field(
        default=1e12,
        description="peak FLOP/s of one trainer device, for the MFU estimate (6 * params * tokens / time / peak)",
    )


LossName = Literal["grpo", "dapo", "dr_grpo", "gspo", "cispo"]
LossAggregation = Literal["token", "sequence", "sequence_sum", "constant"]


@dataclass(frozen=True)
class LossDefaults:
    """What a policy loss sets when the config leaves it unset (workers/engine/losses.py names each paper)."""
    aggregation: LossAggregation
    clip_epsilon_low: float | None  # None: grpo.clip_epsilon
    clip_epsilon_high: float | None  # None: grpo.clip_epsilon
    std_normalised_advantages: bool


LOSS_DEFAULTS: dict[str, LossDefaults] = {
    "grpo": LossDefaults("token", None, None, std_normalised_advantages=True),
    "dapo": LossDefaults("token", 0.2, 0.28, std_normalised_advantages=True),
    "dr_grpo": LossDefaults("constant", None, None, std_normalised_advantages=False),
    "gspo": LossDefaults("sequence", 3e-4, 4e-4, std_normalised_advantages=True),
    "cispo": LossDefaults("token", 1.0, 5.0, std_normalised_advantages=True),
}


class RolloutCorrection(_Section):
    """Importance sampling between the generator's log-probs (mu) and the trainer's under the same weights (pi_old),
    for the numeric mismatch of two implementations (vLLM in bf16 against the trainer): the PPO ratio becomes
    pi_theta / pi_old and each token's policy loss is weighted by w = pi_old / mu (Yao et al. 2025, "Your Efficient RL
    Framework Secretly Brings You Off-Policy RL Training": truncated importance sampling; masked IS as in IcePop and
    verl's rollout correction)."""
    level: Literal["token", "sequence"] = Field(
        default="token", description="token: w per token; sequence: one w per response, exp(sum of its log-ratios)")
    mode: Literal["truncate", "mask"] = Field(
        default="truncate", description="truncate: w = min(w, threshold); mask: tokens (or whole responses at the "
                                        "sequence level) with w outside [threshold_low, threshold] leave the loss")
    threshold: Annotated[float, Field(gt=1.0, le=1000.0)] = Field(default=2.0, description="the upper bound C on w")
    threshold_low: Annotated[float, Field(gt=0.0, lt=1.0)] | None = Field(
        default=None, description="mask mode: the lower bound on w; unset: 1 / threshold")

    @property
    def low(self) -> float:
        return self.threshold_low if self.threshold_low is not None else 1.0 / self.threshold


class DynamicSampling(_Section):
    """DAPO's dynamic sampling (Yu et al. 2025): groups whose rewards are all equal have zero advantage and teach
    nothing; they are dropped and more prompts generated until the step has trainer.batch_size groups."""
    max_rounds: Annotated[int, Field(ge=1, le=32)] = Field(
        default=4, description="generation rounds per step at most; a step still short after them trains on the "
                               "informative groups it has (if none, on its last round's groups)")


class OverlongConfig(_Section):
    """DAPO's handling of responses cut off at generator.max_new_tokens."""
    filter: bool = Field(default=False, description="cut-off responses leave the loss (their tokens are masked)")
    penalty_tokens: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="soft overlong punishment: a response longer than max_new_tokens - penalty_tokens "
                                  "loses reward linearly, up to penalty_factor at max_new_tokens; unset: off")
    penalty_factor: Annotated[float, Field(gt=0.0, le=10.0)] = Field(
        default=1.0, description="the most reward the soft overlong punishment takes")


class GrpoConfig(_Section):
    group_size: Annotated[int, Field(ge=2, le=1024)] = 8
    epochs: Annotated[int, Field(ge=1, le=16)] = Field(default=1, description="passes over each rollout batch")
    mini_batches: Annotated[int, Field(ge=1, le=64)] = Field(
        default=1, description="optimizer steps per pass: the batch's sequences, shuffled when more than one update, "
                               "in this many parts (trainer.micro_batch_size still splits each part)")
    loss: LossName = Field(
        default="grpo", description="grpo: PPO-clipped ratio; dapo: clip-higher; dr_grpo: no std normalisation, constant "
                                    "length normaliser; gspo: sequence-level ratio; cispo: clipped stop-gradient importance "
                                    "weight. Unset aggregation and epsilons take the loss's defaults (config.LOSS_DEFAULTS)")
    clip_epsilon: Annotated[float, Field(gt=0.0, le=1.0)] = 0.2
    clip_epsilon_low: Annotated[float, Field(gt=0.0, le=1.0)] | None = Field(
        default=None, description="the ratio's lower bound 1 - eps; unset: the loss's default, else clip_epsilon")
    clip_epsilon_high: Annotated[float, Field(gt=0.0, le=10.0)] | None = Field(
        default=None, description="the ratio's upper bound 1 + eps; unset: the loss's default, else clip_epsilon")
    dual_clip: Annotated[float, Field(gt=1.0, le=100.0)] | None = Field(
        default=3.0, description="dual-clip PPO's c (Ye et al. 2020): a token with a negative advantage loses at most "
                                 "c * |A| however large its ratio; null: no bound")
    kl_coef: Annotated[float, Field(ge=0.0, le=10.0)] = 0.0
    kl_in: Literal["loss", "reward"] = Field(
        default="loss", description="loss: kl_coef x the per-token estimate is added to the loss; reward: kl_coef x the "
                                    "response's summed estimate (generator's log-probs against the reference's) is "
                                    "taken from its reward before the group's advantages")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        default="k3", description="Schulman's estimators of KL(policy || reference) per token: k1 log-ratio, k2 half its "
                                  "square, k3 exp(-log-ratio) + log-ratio - 1")
    entropy_coef: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        default=0.0, description="an entropy bonus: the loss subtracts this x each response token's entropy")
    loss_aggregation: LossAggregation | None = Field(
        default=None, description="token: mean over the batch's response tokens; sequence: mean over sequences of each "
                                  "one's token mean; sequence_sum: mean over sequences of each one's token sum; constant: "
                                  "token sum / (sequences x generator.max_new_tokens). Unset: the loss's default")
    mode: Literal["sync", "async", "pipelined"] = Field(
        default="sync",
        description="sync: generate a batch, then train on it; async: generators run up to max_policy_age batches "
                    "ahead of the trainer; pipelined (Monarch): on-policy, the batch is generated in pipeline_chunks "
                    "requests and the trainer takes in each chunk while later ones are generated")
    max_policy_age: NonNegativeInt = Field(default=0, description="0: fully on-policy")
    pipeline_chunks: Annotated[int, Field(ge=2, le=64)] = Field(
        default=4, description="pipelined mode: generation requests per step (whole groups each); each is scored and "
                               "trained on as soon as it returns")

    rollout_correction: RolloutCorrection | None = Field(
        default=None, description="importance sampling against the generator's log-probs; null: off (a mismatch between "
                                  "generator and trainer counts as policy movement)")
    dynamic_sampling: DynamicSampling | None = Field(
        default=None, description="drop zero-spread groups and refill the batch (single-process recipe); null: off")
    overlong: OverlongConfig = OverlongConfig()
    packing: bool = Field(
        default=True, description="trainer and reference forwards: each group's prompt once with its responses after "
                                  "it (each seeing the prompt and itself), units packed into padding-free rows, instead "
                                  "of one right-padded row per sample; the same log-probs, losses and gradients over "
                                  "fewer positions (data/padding_share, data/shared_prompt_share); false: padded rows")

    @property
    def updates_per_step(self) -> int:
        return self.epochs * self.mini_batches

    @property
    def aggregation(self) -> LossAggregation:
        return self.loss_aggregation or LOSS_DEFAULTS[self.loss].aggregation

    @property
    def clip_low(self) -> float:
        return _first_set(self.clip_epsilon_low, LOSS_DEFAULTS[self.loss].clip_epsilon_low, self.clip_epsilon)

    @property
    def clip_high(self) -> float:
        return _first_set(self.clip_epsilon_high, LOSS_DEFAULTS[self.loss].clip_epsilon_high, self.clip_epsilon)

    @property
    def std_normalised_advantages(self) -> bool:
        return LOSS_DEFAULTS[self.loss].std_normalised_advantages


def _first_set(*values: float | None) -> float:
    return next(v for v in values if v is not None)


class ReferenceConfig(_Section):
    enabled: bool = False
    replicas: PositiveInt = 1


MAX_REWARD_WEIGHT = 1000.0  # finite: a nan, inf or 1e308 weight made the advantages, then the model, nan


class RewardConfig(_Section):
    functions: list[Literal["exact_math", "format"]] = Field(default_factory=lambda: ["exact_math"], min_length=1)
    weights: list[Annotated[float, Field(ge=-MAX_REWARD_WEIGHT, le=MAX_REWARD_WEIGHT)]] | None = Field(
        default=None, description="one per function, the combined reward their weighted sum; unset: 1 each")

    @model_validator(mode="after")
    def _weights_match(self) -> RewardConfig:
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise ValueError(f"weights has {len(self.weights)} entries for {len(self.functions)} functions")
        return self

    @property
    def needs_answer(self) -> bool:
        """exact_math compares against each problem's answer."""
        return "exact_math" in self.functions


class ReplayBufferConfig(_Section):
    capacity: PositiveInt = 1024


class RolePlacement(_Section):
    hosts: list[str] = Field(
        default_factory=list,
        description="host names, the same to the control plane's scheduler and the engine; empty: any host. With "
                    "placement.local_hosts: N, host0..host{N-1}: the run's simulated hosts, all on the one inventory "
                    "host the run is given. backend slurm / kubernetes: the job's node / pod names. backend monarch: an "
                    "inventory host's name pins the role there (a Monarch worker of that name, FORGEBOARD_MONARCH_WORKERS); "
                    "a generator's other names label its procs on the run's own host. backend local: inventory hosts")
    procs_per_host: PositiveInt | None = Field(
        default=None, description="Monarch GRPO: the most procs of this role on one host. Trainer: its ranks go this many "
                                  "to a host, over trainer.ranks / procs_per_host hosts; replicas: a host takes at most "
                                  "this many (warm spares included). Unset: the trainer's ranks share one host, replicas "
                                  "go round the role's hosts")
    gpus_per_proc: NonNegativeInt = Field(
        default=0, description="Monarch GRPO: GPUs of its host each proc of this role holds alone (0 or 1); 0: the "
                               "role runs on trainer.device, sharing it")
    colocate_with: Literal["trainer", "generator", "reference"] | None = Field(
        default=None, description="Monarch GRPO: start this role's procs on the host of that role (the trainer's host, or "
                                  "the hosts of the live generator replicas), also when they are replaced; where that "
                                  "host is gone, on any host")


MAX_LOCAL_HOSTS = 8


def local_host_names(count: int) -> list[str]:
    """The names of `placement.local_hosts` simulated hosts."""
    return [f"host{i}" for i in range(count)]


class PlacementConfig(_Section):
    backend: Literal["local", "monarch", "slurm", "kubernetes"] = "local"
    local_hosts: Annotated[int, Field(ge=0, le=MAX_LOCAL_HOSTS)] = Field(
        default=0, description="Monarch GRPO: simulate this many hosts (host0, host1, ...) as Monarch worker "
                                "processes on the run's host (one inventory host holds the whole run); 0: none "
                                "(see placement.<role>.hosts)")
    trainer: RolePlacement = RolePlacement()
    generator: RolePlacement = RolePlacement()
    reference: RolePlacement = RolePlacement()
    reward: RolePlacement = RolePlacement()
    replay_buffer: RolePlacement = RolePlacement()

    @property
    def runs_on_monarch(self) -> bool:
        """The GRPO controller spawns its actors on Monarch (on this machine's procs or a cluster job's workers)."""
        return self.backend != "local"


class FailoverConfig(_Section):
    call_timeout_s: Annotated[float, Field(gt=0.0, le=86_400.0)] = Field(
        default=300.0, description="a generator, reference or reward call, a train step, or the trainer's load of a checkpoint "
                                   "(resuming, or recovering a failure), not answered in this long counts as hung; a generator's "
                                   "read of the trainer's weights gets half of it (then the trainer counts as hung or lost), so "
                                   "a large model over a slow network or disk needs a longer one")
    setup_timeout_s: Annotated[float, Field(gt=0.0, le=86_400.0)] = Field(
        default=1800.0, description="every role's set-up: the trainer's ranks not started (spawned, joined their process "
                                    "group and loaded the model), or a generator, reference or reward replica or spare "
                                    "not started (its model loaded), within this long of their launch count as hung: at "
                                    "the run's start the run fails, later it is one more failure of that role (the trainer: "
                                    "trainer.recover_failures; a replica: failover.max_replacements; a spare is started "
                                    "again). "
                                    "Separate from call_timeout_s, since loading a large model can take far longer than "
                                    "any call or step; it bounds a set-up that never ends (a stuck shared filesystem, a "
                                    "deadlocked rendezvous), which would hold the run's GPUs")
    poll_seconds: Annotated[float, Field(gt=0.0, le=60.0)] = Field(default=1.0, description="how often waits check for failures and drills")
    max_retries: NonNegativeInt = Field(default=3, description="retries of one request on a healthy replica before the run fails")
    retry_backoff_s: Annotated[float, Field(ge=0.0, le=600.0)] = Field(default=0.2, description="wait before a retry; doubles each time")
    max_replacements: NonNegativeInt = Field(
        default=3, description="replacement procs per role (generator, reference, reward) before the run fails; trainer: trainer.recover_failures")
    straggler_factor: Annotated[float, Field(ge=0.0, le=1000.0)] = Field(
        default=0.0, description="a generator, reference or reward request not answered within this many times its role's "
                                 "typical seconds per request (at least straggler_min_s) counts as hung and is retried "
                                 "elsewhere; 0: only failover.call_timeout_s")
    straggler_min_s: Annotated[float, Field(gt=0.0, le=86_400.0)] = Field(
        default=2.0, description="the shortest deadline straggler_factor may set")
    warm_spares: Annotated[int, Field(ge=0, le=8)] = Field(
        default=0, description="started replicas per role (generator, reference, reward) kept out of routing, so a failed "
                               "one is replaced without waiting for a process to start; a used spare is started again in the background")

    @property
    def weight_read_s(self) -> float:
        """How long a generator's inbox reads one weight publication from the trainer ranks before it gives up (the
        trainer then counts as stopped or dead): within call_timeout_s, so the read ends before the request waiting for
        its weights counts as hung."""
        return self.call_timeout_s / 2

    @property
    def weight_wait_s(self) -> float:
        """How long a generate request waits on its replica for the publication it names: longer than the read, within
        call_timeout_s (only an inbox that never got the publication is waited for this long)."""
        return self.call_timeout_s * 3 / 4


class CheckpointConfig(_Section):
    folder: str = Field(default="checkpoints", description="where step_NNNNNN checkpoint folders are written")
    every_steps: NonNegativeInt = Field(default=0, description="0: only at the end")
    keep_last: PositiveInt = 3
    resume_from: str | None = Field(default=None, description="a checkpoint folder (or a folder of step_N ones), or "
                                                              "a run's checkpoint: 'run:<run id>@step:<step>'")
    resume_latest: bool = Field(default=False, description=(
        "at start, resume from the newest complete checkpoint in checkpoint.folder when it holds one (a restarted or "
        "requeued run goes on where it stopped); resume_from is then the warm start of a folder that holds none"))


class EvalConfig(_Section):
    every_steps: NonNegativeInt = 10
    rollout_samples: NonNegativeInt = Field(default=4, description="rollouts recorded per step for the dashboard")


class TelemetryConfig(_Section):
    console: bool = True
    jsonl_path: str | None = None
    flush_seconds: Annotated[float, Field(gt=0.0, le=60.0)] = 1.0


class RunConfig(_Section):
    recipe: Recipe
    model: ModelConfig
    data: DataConfig = DataConfig()
    generator: GeneratorConfig = GeneratorConfig()
    trainer: TrainerConfig = TrainerConfig()
    grpo: GrpoConfig = GrpoConfig()
    reference: ReferenceConfig = ReferenceConfig()
    reward: RewardConfig = RewardConfig()
    replay_buffer: ReplayBufferConfig = ReplayBufferConfig()
    placement: PlacementConfig = PlacementConfig()
    failover: FailoverConfig = FailoverConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    max_restarts: NonNegativeInt = 0
    drills: list[FaultDrillRequest] = Field(
        default_factory=list, max_length=64,
        description="fault drills scheduled from the start (Monarch GRPO); the same shape as a fault_drill command",
    )

    @property
    def rollout_dtype(self) -> str:
        """The dtype the generator and the reference hold their weights in: what the trainer computes in."""
        return "bfloat16" if self.trainer.mixed_precision == "bf16" else self.model.dtype

    def role_processes(self) -> dict[str, int]:
        """The processes this run starts for each role of its recipe, in PLACED_ROLES order (0: a reference not
        enabled)."""
        counts = {"trainer": self.trainer.ranks, "generator": 0 if self.generator.in_trainer else self.generator.replicas,
                  "reference": self.reference.replicas if self.reference.enabled else 0, "reward": 1,
                  "replay_buffer": 1}
        return {role: counts[role] for role in RECIPE_ROLES[self.recipe]}


def _apply_override(data: dict, override: str) -> None:
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError([FieldError(override, "override must look like section.key=value")])
    path = key.strip().split(".")
    node = data
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError([FieldError(key, f"{part!r} is not a section")])
        node = child
    try:
        node[path[-1]] = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        node[path[-1]] = raw


def _cross_field_errors(config: RunConfig) -> list[FieldError]:
    """Rules that involve two sections, reported against the field a user would change."""
    errors = []
    if config.grpo.kl_coef > 0.0 and not config.reference.enabled:
        errors.append(FieldError("grpo.kl_coef", "a KL penalty needs a reference model: set reference.enabled: true"))
    monarch = config.placement.runs_on_monarch  # either recipe's trainer on Monarch procs
    monarch_grpo = config.recipe == Recipe.GRPO and monarch
    errors.extend(unused_option_errors(config, monarch_grpo=monarch_grpo))
    errors.extend(replay_buffer_errors(config))
    if config.drills and not monarch:
        errors.append(FieldError("drills", "fault drills need a Monarch run: placement.backend: monarch"))
    errors.extend(grpo_update_errors(config, monarch_grpo=monarch_grpo))
    if config.grpo.mode == "pipelined":
        if not monarch_grpo:
            errors.append(FieldError("grpo.mode", "pipelined needs the Monarch GRPO recipe: placement.backend: monarch"))
        if config.grpo.max_policy_age:
            errors.append(FieldError("grpo.max_policy_age", "pipelined mode trains on-policy: set 0, or grpo.mode: async"))
        if config.grpo.pipeline_chunks > config.trainer.batch_size:
            errors.append(FieldError("grpo.pipeline_chunks", f"more chunks than the step's {config.trainer.batch_size} "
                                                             "groups (trainer.batch_size)"))
    if config.trainer.sharding == "fsdp" and not monarch:
        errors.append(FieldError("trainer.sharding", "fsdp shards the Monarch trainer's ranks: placement.backend: monarch"))
    if config.trainer.mixed_precision != "off" and config.model.dtype != "float32":
        errors.append(FieldError("trainer.mixed_precision", f"mixed precision computes in bfloat16 from float32 weights; "
                                                            f"model.dtype is {config.model.dtype}: set it to float32, "
                                                            "or mixed_precision off to train in it throughout"))
    if config.placement.local_hosts:
        if config.placement.backend != "monarch":
            errors.append(FieldError("placement.local_hosts", "simulated hosts are Monarch workers on this machine: "
                                                              "placement.backend: monarch"))
        errors.extend(unknown_host_errors(config.placement, known=local_host_names(config.placement.local_hosts)))
    errors.extend(colocation_errors(config.placement, monarch_grpo=monarch_grpo))
    errors.extend(in_trainer_errors(config, monarch_grpo=monarch_grpo))
    errors.extend(proc_layout_errors(config, monarch_grpo=monarch_grpo))
    for i, drill in enumerate(config.drills):
        errors.extend(FieldError(f"drills.{i}.{field}", message) for field, message in drill_target_problems(config, drill))
    return errors


def unused_option_errors(config: RunConfig, *, monarch_grpo: bool) -> list[FieldError]:
    """Options changed from their defaults where nothing reads them. A value equal to its default is accepted: a
    snapshot's full dump writes every field."""
    errors = []
    if config.grpo.mode == "sync" and config.grpo.max_policy_age:
        errors.append(FieldError("grpo.max_policy_age", "sync mode trains on-policy (age 0): set grpo.mode: async to "
                                                         "train on older rollouts, or max_policy_age to 0"))
    changed_failover = changed_fields(config.failover)
    if not config.placement.runs_on_monarch:
        errors.extend(FieldError(f"failover.{name}", "failover applies to a Monarch run's procs: placement.backend: monarch")
                      for name in changed_failover)
    elif not monarch_grpo:  # an SFT run's waits time out and poll, but it has no replicas to retry or replace
        errors.extend(FieldError(f"failover.{name}", "applies to GRPO's generator, reference and reward replicas; an "
                                                     "SFT run has only trainer ranks (trainer.recover_failures)")
                      for name in changed_failover if name not in SFT_FAILOVER_FIELDS)
    grpo, changed_grpo = config.grpo, changed_fields(config.grpo)
    defaults = LOSS_DEFAULTS[grpo.loss]
    clip_epsilon_read = ((grpo.clip_epsilon_low is None and defaults.clip_epsilon_low is None)
                         or (grpo.clip_epsilon_high is None and defaults.clip_epsilon_high is None))
    if "clip_epsilon" in changed_grpo and not clip_epsilon_read:
        errors.append(FieldError("grpo.clip_epsilon", f"both bounds come from grpo.clip_epsilon_low / _high or {grpo.loss}'s "
                                                      "own epsilons: set those instead"))
    if grpo.loss == "cispo" and "dual_clip" in changed_grpo:
        errors.append(FieldError("grpo.dual_clip", "cispo caps its importance weight itself: dual_clip does not apply"))
    if not config.reference.enabled and "kl_estimator" in changed_grpo:
        errors.append(FieldError("grpo.kl_estimator", "a KL estimate needs a reference model: set reference.enabled: true"))
    optimizer = config.trainer.optimizer
    if optimizer.name != "adamw" and "betas" in changed_fields(optimizer):
        errors.append(FieldError("trainer.optimizer.betas", f"betas are AdamW's; {optimizer.name} has none"))
    if config.recipe == Recipe.SFT:
        errors.extend(sft_unused_errors(config))
    elif not monarch_grpo and "routing" in changed_fields(config.generator):
        errors.append(FieldError("generator.routing", "picks among generator replicas, and the local recipe generates "
                                                      "in its one process: placement.backend: monarch"))
    return errors


# What of GRPO's sections an SFT run reads: its held-out eval generates greedily up to max_new_tokens and scores
# with the reward functions. replicas, backend and in_trainer have rules of their own.
SFT_READS = {"generator": ("max_new_tokens", "replicas", "backend", "in_trainer")}
GRPO_ONLY_SECTIONS = ("grpo", "generator", "reference", "replay_buffer")


def sft_unused_errors(config: RunConfig) -> list[FieldError]:
    """GRPO's options set on an SFT run, each named down to the nested field that was changed."""
    return [FieldError(path, "a GRPO option: this is an SFT run (recipe: sft), which does not read it")
            for section in GRPO_ONLY_SECTIONS
            for path in changed_paths(getattr(config, section), prefix=section)
            if path.split(".")[1] not in SFT_READS.get(section, ())]


def changed_paths(section: _Section, *, prefix: str) -> list[str]:
    """Dotted paths of the fields that differ from their defaults, descending into nested sections."""
    paths = []
    for name in changed_fields(section):
        value, default = getattr(section, name), type(section).model_fields[name].get_default(call_default_factory=True)
        if isinstance(value, _Section) and isinstance(default, _Section):
            paths.extend(changed_paths(value, prefix=f"{prefix}.{name}"))
        else:
            paths.append(f"{prefix}.{name}")
    return paths


def grpo_update_errors(config: RunConfig, *, monarch_grpo: bool) -> list[FieldError]:
    """Several updates per batch, the KL's place, the rollout correction, dynamic sampling and overlong handling."""
    grpo, errors = config.grpo, []
    if grpo.mode == "pipelined":
        errors.extend(FieldError(f"grpo.{name}", "pipelined mode takes one optimizer step as the chunks come in: set 1, "
                                                 "or grpo.mode: sync")
                      for name in ("epochs", "mini_batches") if getattr(grpo, name) > 1)
    rollouts = config.trainer.batch_size * grpo.group_size
    if grpo.mini_batches > rollouts:
        errors.append(FieldError("grpo.mini_batches", f"more parts than the step's {rollouts} sequences "
                                                      "(trainer.batch_size x grpo.group_size)"))
    if grpo.kl_in != "loss" and grpo.kl_coef == 0.0:
        errors.append(FieldError("grpo.kl_in", "places the KL penalty, and grpo.kl_coef is 0: set kl_coef > 0"))
    correction = grpo.rollout_correction
    if correction is not None and correction.mode == "truncate" and correction.threshold_low is not None:
        errors.append(FieldError("grpo.rollout_correction.threshold_low", "truncation has no lower bound: set mode: mask"))
    if grpo.dynamic_sampling is not None and monarch_grpo:
        errors.append(FieldError("grpo.dynamic_sampling", "the Monarch recipe does not refill batches: use "
                                                          "placement.backend: local, or null"))
    overlong = grpo.overlong
    if overlong.penalty_tokens is None and "penalty_factor" in changed_fields(overlong):
        errors.append(FieldError("grpo.overlong.penalty_factor", "the soft overlong punishment is off: set "
                                                                 "grpo.overlong.penalty_tokens"))
    if overlong.penalty_tokens is not None and overlong.penalty_tokens > config.generator.max_new_tokens:
        errors.append(FieldError("grpo.overlong.penalty_tokens", f"longer than generator.max_new_tokens "
                                                                 f"({config.generator.max_new_tokens})"))
    return errors


def changed_fields(section: _Section) -> list[str]:
    return [name for name, field in type(section).model_fields.items()
            if getattr(section, name) != field.get_default(call_default_factory=True)]


def replay_buffer_errors(config: RunConfig) -> list[FieldError]:
    """Async GRPO keeps max_policy_age + 1 batches buffered or in flight: the buffer (counted in rollouts, at least
    one batch) must hold them all, or it evicts batches the trainer is waiting for."""
    if config.recipe != Recipe.GRPO or config.grpo.mode != "async" or not config.grpo.max_policy_age:
        return []
    batch = config.trainer.batch_size * config.grpo.group_size
    batches = config.grpo.max_policy_age + 1
    if config.replay_buffer.capacity >= batches * batch:
        return []
    return [FieldError("replay_buffer.capacity", f"holds {config.replay_buffer.capacity} rollouts, but async mode keeps "
                                                 f"max_policy_age + 1 = {batches} batches of {batch} rollouts "
                                                 f"(trainer.batch_size x grpo.group_size) buffered: set at least "
                                                 f"{batches * batch}")]


PLACED_ROLES = ("trainer", "generator", "reference", "reward", "replay_buffer")
# The roles whose processes each recipe starts (SFT: its trainer ranks only).
RECIPE_ROLES: dict[str, tuple[str, ...]] = {Recipe.GRPO: PLACED_ROLES, Recipe.SFT: ("trainer",)}
SFT_FAILOVER_FIELDS = ("call_timeout_s", "setup_timeout_s", "poll_seconds")  # what of FailoverConfig an SFT run's trainer waits read


# roles start in this order (trainer, generators, reward, reference): a role follows one started before it
COLOCATION_TARGETS: dict[str, tuple[str, ...]] = {"generator": ("trainer",), "reward": ("trainer", "generator"),
                                                  "reference": ("trainer", "generator")}


def colocation_errors(placement: PlacementConfig, *, monarch_grpo: bool) -> list[FieldError]:
    errors = []
    for role in PLACED_ROLES:
        rule = getattr(placement, role)
        if rule.colocate_with is None:
            continue
        field = f"placement.{role}.colocate_with"
        targets = COLOCATION_TARGETS.get(role, ())
        if not monarch_grpo:
            errors.append(FieldError(field, "colocation needs the Monarch GRPO recipe: recipe: grpo, placement.backend: monarch"))
        elif rule.colocate_with not in targets:
            errors.append(FieldError(field, f"the {role} can follow {' or '.join(targets)}" if targets else
                                     f"the {role} does not follow another role; use placement.{role}.hosts"))
        elif rule.hosts:
            errors.append(FieldError(f"placement.{role}.hosts", f"the {role} follows the {rule.colocate_with}'s host "
                                                                f"(colocate_with): leave hosts empty"))
    return errors


IN_TRAINER = "the generator runs in the trainer's procs (generator.in_trainer)"  # why generator options do not apply


def in_trainer_errors(config: RunConfig, *, monarch_grpo: bool) -> list[FieldError]:
    """generator.in_trainer: the trainer's ranks generate, so what configures generator procs does not apply."""
    generator = config.generator
    if not generator.in_trainer:
        return []
    if not monarch_grpo:
        return [FieldError("generator.in_trainer", "the local recipe always generates in its one process; in_trainer is "
                                                   "for the Monarch GRPO recipe: placement.backend: monarch")]
    errors = []
    if config.grpo.mode != "sync":
        errors.append(FieldError("generator.in_trainer", f"{config.grpo.mode} mode generates while the trainer trains, "
                                                         "which needs generator procs of their own: grpo.mode: sync"))
    if generator.backend != "torch":
        errors.append(FieldError("generator.in_trainer", "vLLM runs in generator procs of its own: generator.backend: torch"))
    if config.trainer.sharding != "replicate":
        errors.append(FieldError("generator.in_trainer", "an FSDP rank holds a shard of the weights, not a model to "
                                                         "generate from: trainer.sharding: replicate"))
    errors.extend(FieldError(f"generator.{name}", "the trainer's ranks generate, one share each (generator.in_trainer): "
                                                  "leave it unset")
                  for name in ("replicas", "routing") if name in changed_fields(generator))
    errors.extend(FieldError(f"placement.generator.{name}", f"{IN_TRAINER}: place the trainer")
                  for name in changed_fields(config.placement.generator))
    errors.extend(FieldError(f"placement.{role}.colocate_with", f"{IN_TRAINER}: colocate_with: trainer")
                  for role in ("reward", "reference") if getattr(config.placement, role).colocate_with == "generator")
    return errors


def proc_layout_errors(config: RunConfig, *, monarch_grpo: bool) -> list[FieldError]:
    """gpus_per_proc: one GPU, for roles with a model, in their own procs (Monarch GRPO) except the trainer's (its one
    process's GPU otherwise)."""
    errors = []
    for role in PLACED_ROLES:
        rule = getattr(config.placement, role)
        if rule.gpus_per_proc and role != "trainer" and not monarch_grpo:
            errors.append(FieldError(f"placement.{role}.gpus_per_proc", "without Monarch GRPO procs every role runs in "
                                                                         "the trainer's process: set it on the trainer"))
        if rule.gpus_per_proc > 1:
            errors.append(FieldError(f"placement.{role}.gpus_per_proc", "at most 1: a proc runs its model on one GPU "
                                                                         "(tensor parallelism is not implemented; "
                                                                         "trainer ranks shard with trainer.sharding: fsdp)"))
        if rule.gpus_per_proc and role in ("reward", "replay_buffer"):
            errors.append(FieldError(f"placement.{role}.gpus_per_proc", f"the {role} holds no model: 0"))
    if config.placement.trainer.gpus_per_proc and config.trainer.device == "cpu":
        errors.append(FieldError("placement.trainer.gpus_per_proc", "a GPU for a trainer on the CPU: set trainer.device "
                                                                     "to cuda or auto, or gpus_per_proc to 0"))
    return errors


def unknown_host_errors(placement: PlacementConfig, *, known: Sequence[str]) -> list[FieldError]:
    """One error per host named in `placement.<role>.hosts` that is not among the run's hosts."""
    return [FieldError(f"placement.{role}.hosts", f"unknown host {name!r}; hosts: {', '.join(known)}")
            for role in PLACED_ROLES for name in getattr(placement, role).hosts if name not in known]


def drill_target_problems(config: RunConfig, drill: FaultDrillRequest) -> list[tuple[str, str]]:
    """(field, reason) for a drill whose role or replica this config does not have."""
    if config.recipe == Recipe.SFT and drill.role != "trainer":
        return [("role", f"an SFT run has no {drill.role}: its drills target trainer ranks")]
    if drill.role == "generator" and config.generator.in_trainer:
        return [("role", f"{IN_TRAINER}: drill the trainer")]
    counts = {"generator": config.generator.replicas, "trainer": config.trainer.ranks,
              "reference": config.reference.replicas if config.reference.enabled else 0, "reward": 1}
    if counts[drill.role] == 0:
        return [("role", f"this run has no {drill.role} (reference.enabled is false)")]
    if drill.replica >= counts[drill.role]:
        return [("replica", f"{drill.role} has replicas 0..{counts[drill.role] - 1}")]
    return []


def parse_config_mapping(data: dict[str, Any]) -> RunConfig:
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(field_errors(exc)) from None
    errors = _cross_field_errors(config)
    if errors:
        raise ConfigError(errors)
    return config


def config_mapping(text: str, *, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The YAML text as written, with `section.key=value` overrides applied; not yet validated."""
    try:
        data = load_yaml_mapping(text, max_bytes=MAX_CONFIG_BYTES)
    except YamlProblem as exc:
        raise ConfigError([FieldError("", str(exc))]) from None
    for override in overrides:
        _apply_override(data, override)
    return data


def load_config(text: str, *, overrides: Sequence[str] = ()) -> RunConfig:
    """Parse YAML text plus `section.key=value` overrides into a validated RunConfig."""
    return parse_config_mapping(config_mapping(text, overrides=overrides))


def load_config_file(path: str | Path, *, overrides: Sequence[str] = ()) -> RunConfig:
    path = Path(path)
    try:
        if not path.is_file():
            raise ConfigError([FieldError("", f"config file {path} does not exist")])
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([FieldError("", f"config file {path} cannot be read ({exc.strerror or exc})")]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([FieldError("", f"config file {path} is not UTF-8 text (byte {exc.start})")]) from None
    return load_config(text, overrides=overrides)


def check_model_folder(config: RunConfig) -> None:
    """Field-level error for a model folder that is missing or incomplete, before any process starts."""
    if config.model.path is None:
        raise ConfigError([FieldError("model.artifact", "an artifact reference is resolved by the control plane; "
                                                        "run from the engine's CLI with model.path")])
    folder = Path(config.model.path)
    if not folder.is_dir():
        raise ConfigError([FieldError("model.path", f"folder {folder} does not exist")])
    missing = [name for name in ("config.json", "tokenizer.json") if not (folder / name).is_file()]
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ConfigError([FieldError("model.path", f"folder {folder} lacks {', '.join(missing)}")])


def config_json_schema() -> dict[str, Any]:
    """JSON Schema of RunConfig, for the dashboard's config editor."""
    return RunConfig.model_json_schema()


def config_to_yaml(config: RunConfig) -> str:
    return yaml.safe_dump(json.loads(config.model_dump_json()), sort_keys=False)
