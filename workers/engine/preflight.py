"""Checks that a valid config can run here, before anything is loaded or spawned.

Field-level, like schema errors: the model folder exists and holds the family the config
names, its sequences fit the model's positions, a CPU run's processes could fit in this host's
memory, every row of the data file can be used (else its line and why not), its prompts counted
in the model's tokens fit data.max_prompt_tokens (GRPO) or leave the held-out eval room and some
example a response token within data.seq_len (SFT, for training and for the held-out eval/nll), the
run can make and write in its checkpoint folder and write its telemetry file and resume from a
checkpoint (one whose checkpoint.json says its own recipe wrote it), a single-process run's GPU exists,
and the config asks only for what this runner implements. A path the filesystem will not look at (a NUL
byte, a folder this process may not enter, a name too long, a symlink loop) is an error of its field,
never a traceback. Warnings (`PreflightReport.warnings`: some SFT examples cut off before their
response) stop nothing.
Importing this module does not import torch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from workers.engine.checkpoint_folders import check_resume_recipe, latest_checkpoint
from workers.engine.config import ConfigError, FieldError, RunConfig, check_model_folder
from workers.engine.env import ALLOWED_PATHS_ENV, WORKERS_ENV, read_env
from workers.engine.models.hf_config import HF_MODEL_TYPES, model_dims, read_hf_config
from workers.engine.planning.shapes import BYTES_PER_VALUE, ModelShape
from workers.engine.planning.whatif import TRAINER_STATE_BYTES_PER_PARAM, Placement, Workload, generate_requests
from workers.engine.tasks import Problem, build_task, check_data, prompts_to_check

if TYPE_CHECKING:
    from workers.engine.models.tokenizer import ChatTokenizer

NUL = "\x00"
NUL_PROBLEM = "contains a NUL byte, which no file's name can hold"
PATH_FIELDS = ("model.path", "data.path", "checkpoint.resume_from", "checkpoint.folder", "telemetry.jsonl_path")


def allowed_paths() -> list[Path] | None:
    """The allowed folders and files from FORGEBOARD_ALLOWED_PATHS, resolved; None when it is unset."""
    raw = read_env(ALLOWED_PATHS_ENV)
    if raw is None:
        return None
    try:
        entries = json.loads(raw)
    except ValueError:
        entries = None
    if not isinstance(entries, list) or not all(isinstance(e, str) and e and NUL not in e for e in entries):
        raise ConfigError([FieldError("", f"{ALLOWED_PATHS_ENV} must be a JSON list of paths")])
    return [Path(os.path.realpath(entry)) for entry in entries]


def confinement_errors(config: RunConfig, allowed: list[Path]) -> list[FieldError]:
    """A FieldError for each path field that does not resolve (symlinks, `..`, relative to here) inside `allowed`."""
    errors = []
    if config.model.artifact is not None or config.data.artifact is not None:
        field = "model.artifact" if config.model.artifact is not None else "data.artifact"
        errors.append(FieldError(field, "artifact references are resolved by the control plane before launch"))
    for field in PATH_FIELDS:
        section, key = field.split(".")
        value = getattr(getattr(config, section), key)
        if value is None:
            continue
        if NUL in value:
            errors.append(FieldError(field, NUL_PROBLEM))
            continue
        real = Path(os.path.realpath(value))
        if not any(real == root or root in real.parents for root in allowed):
            errors.append(FieldError(field, f"{real} is outside the paths this run may use "
                                            f"({', '.join(str(root) for root in allowed) or 'none'})"))
    return errors


def _unsupported(config: RunConfig) -> list[FieldError]:
    """Options this build does not implement yet: refused, never silently ignored."""
    errors = []
    monarch = config.placement.runs_on_monarch  # backend monarch, or a SLURM / Kubernetes job's Monarch workers
    monarch_grpo = monarch and config.recipe == "grpo"
    # hosts to place roles on: simulated ones, a cluster job's workers, or workers a launcher named
    named_hosts = monarch and (config.placement.local_hosts > 0 or config.placement.backend in ("slurm", "kubernetes")
                               or bool(read_env(WORKERS_ENV)))
    if config.trainer.ranks != 1 and not monarch:
        errors.append(FieldError("trainer.ranks", "data parallelism needs placement.backend: monarch"))
    if config.trainer.recover_failures and not monarch:
        errors.append(FieldError("trainer.recover_failures", "in-run trainer recovery needs placement.backend: monarch"))
    if config.generator.replicas != 1 and not monarch_grpo:
        errors.append(FieldError("generator.replicas", "generator replicas need the Monarch GRPO recipe: recipe: grpo, "
                                                       "placement.backend: monarch"))
    if config.generator.backend == "vllm" and not monarch_grpo:
        errors.append(FieldError("generator.backend", "vLLM generators run in their own procs: recipe: grpo, "
                                                      "placement.backend: monarch"))
    if config.generator.backend == "vllm" and config.generator.top_p < 1.0:
        errors.append(FieldError("generator.top_p", "with vLLM, top_p must be 1: its recorded log-probs would be of the "
                                                    "truncated distribution, which the trainer does not recompute"))
    if config.reference.replicas != 1:
        errors.append(FieldError("reference.replicas", "one reference model is supported"))
    if config.max_restarts != 0:
        errors.append(FieldError("max_restarts", "restarts are the control plane's job; the engine runs once"))
    per_host = config.placement.trainer.procs_per_host
    if monarch and per_host is not None and config.trainer.ranks % per_host:
        errors.append(FieldError("placement.trainer.procs_per_host", f"trainer.ranks {config.trainer.ranks} do not fill "
                                                                     f"hosts of {per_host}: every trainer host takes "
                                                                     "as many ranks (use a divisor)"))
    for role in ("trainer", "generator", "reference", "reward", "replay_buffer"):
        placement = getattr(config.placement, role)
        if not placement.hosts:
            continue
        if role != "trainer" and config.recipe != "grpo":
            errors.append(FieldError(f"placement.{role}.hosts", f"an SFT run has no {role}: it places only its trainer"))
        elif not (named_hosts or (monarch_grpo and role == "generator")):
            errors.append(FieldError(f"placement.{role}.hosts", "no hosts to place it on: set placement.local_hosts (simulated "
                                                                "hosts) or a slurm/kubernetes backend; with monarch alone, "
                                                                "host names only label local generator procs"))
    return errors


@dataclass(frozen=True)
class PreflightReport:
    errors: list[FieldError]  # what stops the run before anything loads
    warnings: list[FieldError]  # what the run would do that its config may not mean: printed, never a refusal


def path_problem(path: str) -> str | None:
    """Why no check can look at `path` at all: a NUL byte in it, or the filesystem refusing to say what is there (a
    folder on the way this process may not look into, a name too long, a symlink loop). None when it exists or
    simply does not (yet): the field's own check says what is missing."""
    if NUL in path:
        return NUL_PROBLEM
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        return _unreachable(exc, path=path)
    return None


def _unreachable(exc: OSError, *, path: str | Path) -> str:
    shown = str(exc.filename or path)
    if len(shown) > 200:  # a path too long for the system would fill the error: its start and end say which
        shown = f"{shown[:120]}...{shown[-60:]} ({len(shown)} characters)"
    return f"cannot reach {shown} ({exc.strerror or exc})"


def path_errors(config: RunConfig) -> list[FieldError]:
    """A FieldError for each path field that `path_problem` finds no check could look at."""
    errors = []
    for field in PATH_FIELDS:
        section, key = field.split(".")
        value = getattr(getattr(config, section), key)
        if value is not None and (problem := path_problem(value)):
            errors.append(FieldError(field, problem))
    return errors


def preflight_report(config: RunConfig) -> PreflightReport:
    try:
        allowed = allowed_paths()
    except ConfigError as exc:
        return PreflightReport(exc.errors, [])
    if allowed is not None:
        confined = confinement_errors(config, allowed)
        if confined:
            return PreflightReport(confined, [])  # nothing outside is opened, not even to check it
    unreachable = path_errors(config)
    if unreachable:
        return PreflightReport(unreachable, [])  # the checks below would stop on them with a traceback
    errors: list[FieldError] = []
    rows = None  # a JSONL file's rows, read once by the data check and handed on
    context = None  # the model's positions, when its config.json gives them
    try:
        check_model_folder(config)
    except ConfigError as exc:
        errors.extend(exc.errors)
    except OSError as exc:  # inside a folder that exists (one it may not read, say)
        errors.append(FieldError("model.path", _unreachable(exc, path=config.model.path or "")))
    else:
        try:
            hf_config = read_hf_config(config.model.path)
        except ConfigError as exc:
            errors.extend(exc.errors)
        else:
            model_type = hf_config.get("model_type")
            family = HF_MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
            if family is None:
                errors.append(FieldError("model.path", f"model_type {model_type!r} is not supported (qwen3, llama)"))
            elif family != config.model.family:
                errors.append(FieldError("model.family", f"the folder holds a {family} model, not {config.model.family}"))
            else:
                errors.extend(_model_errors(config, hf_config))
            context = hf_config.get("max_position_embeddings")
            errors.extend(_context_errors(config, context))
            errors.extend(memory_errors(config, hf_config, host_bytes=host_memory_bytes()))
    if config.data.source == "jsonl" and config.data.path and Path(config.data.path).is_dir():
        errors.append(FieldError("data.path", f"{config.data.path} is a folder: name a JSONL file"))
    elif config.data.source == "jsonl" and config.data.path and not Path(config.data.path).is_file():
        errors.append(FieldError("data.path", f"file {config.data.path} does not exist"))
    elif config.data.source == "arithmetic" or config.data.path:
        checked = check_data(config)  # every row read and checked (a file it cannot read is a data.path error)
        errors.extend(checked.errors)
        rows = checked.rows
    try:
        errors.extend(_resume_errors(config))
    except OSError as exc:  # inside a folder that exists (one it may not read, say)
        errors.append(FieldError("checkpoint.resume_from", _unreachable(exc, path=config.checkpoint.resume_from or "")))
    errors.extend(_output_path_errors(config))
    errors.extend(_unsupported(config))
    errors.extend(_device_errors(config))
    if errors:
        return PreflightReport(errors, [])
    # a usable model folder and data: their prompts in the model's tokens
    return prompt_length_checks(config, context=context if _positions(context) else None, rows=rows)


def _model_errors(config: RunConfig, hf_config: dict) -> list[FieldError]:
    """A config.json that describes no model the engine builds (`hf_config.model_dims`: its sizes, heads, norm and
    RoPE), refused with the words of the model's load, before any proc starts."""
    try:
        model_dims(hf_config)
    except ValueError as exc:
        return [FieldError("model.path", f"{Path(config.model.path)}: {exc}")]
    return []


def preflight_errors(config: RunConfig) -> list[FieldError]:
    return preflight_report(config).errors


def _resume_errors(config: RunConfig) -> list[FieldError]:
    """A checkpoint.resume_from that does not exist, is a file, holds no checkpoint (what `resolve_checkpoint` finds: a
    step folder itself, or a complete step_N folder inside), or one whose checkpoint.json does not say its own recipe
    wrote it (the other recipe's, or one written before there was one: `check_resume_recipe`). With
    checkpoint.resume_latest, the newest checkpoint in checkpoint.folder when it holds one (the same checks, as that
    field's errors), else resume_from as given; a folder that holds none, or does not exist yet, starts the run."""
    latest = latest_checkpoint(config)
    if latest is not None:
        try:
            check_resume_recipe(latest, recipe=config.recipe, field="checkpoint.folder")
        except ConfigError as exc:
            return exc.errors
        return []
    path = config.checkpoint.resume_from
    if not path:
        return []
    if not Path(path).exists():
        return [FieldError("checkpoint.resume_from", f"{path} does not exist")]
    if not Path(path).is_dir():
        return [FieldError("checkpoint.resume_from", f"{path} is a file: name a checkpoint folder (a step_N folder, or "
                                                     "a folder of them)")]
    try:
        check_resume_recipe(path, recipe=config.recipe)
    except FileNotFoundError:
        return [FieldError("checkpoint.resume_from",
                           f"{path} holds no checkpoint (a step_N folder, or a folder of them)")]
    except ConfigError as exc:
        return exc.errors
    return []


def _output_path_errors(config: RunConfig) -> list[FieldError]:
    """What the run would write where it cannot (found when the first checkpoint is saved, at the end of a run without
    checkpoint.every_steps): a checkpoint folder that is a file or cannot be made or written in, a telemetry file that
    is a folder or cannot be written."""
    errors = []
    if problem := _cannot_make(Path(config.checkpoint.folder), folder=True):
        errors.append(FieldError("checkpoint.folder", problem))
    if config.telemetry.jsonl_path and (problem := _cannot_make(Path(config.telemetry.jsonl_path), folder=False)):
        errors.append(FieldError("telemetry.jsonl_path", problem))
    return errors


def _cannot_make(path: Path, *, folder: bool) -> str | None:
    """Why the run could not use or make `path` (a folder, or a file): the kinds of the paths, then a trial, since
    neither mode bits (root passes them) nor os.access (it tells root yes for /proc) can say. Nothing is left behind:
    a file that exists is opened to append and closed, else a folder is made and removed at once where the run would
    first create something (in the folder itself, or in the nearest existing folder above what it would create)."""
    try:
        if path.exists():
            if path.is_dir() != folder:
                return f"{path} is a {'file' if folder else 'folder'}: name a {'folder' if folder else 'file'}"
            if folder:
                return _cannot_create_in(path, why=f"cannot write in {path}")
            return _cannot_append_to(path)
        ancestor = next((parent for parent in path.parents if parent.exists()), None)
        if ancestor is None:
            return None
        if not ancestor.is_dir():
            return f"{ancestor} is a file: {path} cannot be made inside it"
        return _cannot_create_in(ancestor, why=f"{path} cannot be made: nothing can be created in {ancestor}")
    except OSError as exc:  # a folder on the way that this process may not look into
        return f"cannot reach {path} ({exc.strerror or exc})"


def _cannot_create_in(folder: Path, *, why: str) -> str | None:
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".preflight-", dir=folder))
    except OSError as exc:
        return f"{why} ({exc.strerror or exc})"
    return None


def _cannot_append_to(file: Path) -> str | None:
    try:
        open(file, "ab").close()  # noqa: SIM115 - only to learn whether it opens
    except OSError as exc:
        return f"cannot write to {file} ({exc.strerror or exc})"
    return None


def prompt_length_checks(config: RunConfig, *, context: int | None,
                         rows: list[tuple[int, Problem]] | None) -> PreflightReport:
    """Prompts counted in the model's tokens, chat template included, before anything loads (`rows`: a JSONL file's,
    as the data check read them). GRPO: a prompt longer than data.max_prompt_tokens stops the step that draws it (or
    the held-out eval), so every prompt the data can give is counted and the first one too long refused. SFT: see
    `_sft_length_checks`."""
    if importlib.util.find_spec("transformers") is None:  # torch-free
        return PreflightReport([], [])
    from workers.engine.models.tokenizer import ChatTokenizer  # noqa: PLC0415 - transformers, only once all else passed

    try:
        tokenizer = ChatTokenizer(config.model.path)
    except ConfigError as exc:  # tokenizer files it cannot use, with the words of the model's load
        return PreflightReport(exc.errors, [])
    except Exception as exc:  # noqa: BLE001 - whatever the folder's tokenizer files hold, the run could not load them
        problem = f"cannot load its tokenizer ({type(exc).__name__}: {exc})"
        return PreflightReport([FieldError("model.path", problem)], [])
    if config.recipe == "sft":
        return _sft_length_checks(config, tokenizer=tokenizer, context=context, rows=rows)
    limit = config.data.max_prompt_tokens
    for where, problem in prompts_to_check(config, rows=rows):
        tokens = len(tokenizer.encode_prompt(problem.messages))
        if tokens > limit:
            problem = f"{limit} is shorter than a prompt of {tokens} tokens ({where}, in the chat template)"
            return PreflightReport([FieldError("data.max_prompt_tokens", problem)], [])
    return PreflightReport([], [])


def _sft_length_checks(config: RunConfig, *, tokenizer: ChatTokenizer, context: int | None,
                       rows: list[tuple[int, Problem]] | None) -> PreflightReport:
    """An SFT example whose prompt is longer than data.seq_len is cut off before its response starts: it trains no
    token and the held-out eval has none of it to score (`batching.collate_sft`). When every training example is, the
    run would train on nothing with loss 0; when every held-out example is (and the run evaluates), eval/nll would be
    0 over nothing: each refused. When some are, a warning counts them (and each step reports
    `data/no_response_share`, each eval `eval/nll_dropped`). The held-out eval (when its problems carry answers)
    generates generator.max_new_tokens after each held-out prompt, past the model's positions if the longest does not
    leave room."""
    task = build_task(config, rows=rows)
    seq_len, errors, warnings = config.data.seq_len, [], []
    lines = {id(problem): line for line, problem in rows or []}  # the split keeps the rows' objects
    lengths = [len(tokenizer.encode_prompt(problem.messages)) for problem in task.train]
    cut = [i for i, tokens in enumerate(lengths) if tokens > seq_len]
    if len(cut) == len(lengths):
        errors.append(FieldError("data.seq_len", f"{seq_len} cuts off every training example's whole response: their "
                                                 f"prompts are {_span(lengths)} (in the chat template), so the run "
                                                 "would train on nothing, with loss 0"))
    elif cut:
        longest = _longest(cut, lengths=lengths, problems=task.train, lines=lines)
        warnings.append(FieldError("data.seq_len", f"{len(cut)} of {len(lengths)} training examples have prompts "
                                                   f"longer than {seq_len} tokens ({longest}): their responses are cut "
                                                   "off whole and train nothing"))
    if config.eval.every_steps == 0:
        return PreflightReport(errors, warnings)
    held_out = [len(tokenizer.encode_prompt(problem.messages)) for problem in task.held_out]
    dropped = [i for i, tokens in enumerate(held_out) if tokens > seq_len]
    if len(dropped) == len(held_out):
        errors.append(FieldError("data.seq_len", f"{seq_len} cuts off every held-out example's whole response: their "
                                                 f"prompts are {_span(held_out)} (in the chat template), so eval/nll "
                                                 "would score nothing (or set eval.every_steps: 0)"))
    elif dropped:
        longest = _longest(dropped, lengths=held_out, problems=task.held_out, lines=lines)
        warnings.append(FieldError("data.seq_len", f"{len(dropped)} of {len(held_out)} held-out examples have prompts "
                                                   f"longer than {seq_len} tokens ({longest}): eval/nll leaves them "
                                                   "out, with none of their responses to score"))
    if context is not None and task.verifiable:
        longest_held_out = max(held_out)
        new = config.generator.max_new_tokens
        if longest_held_out + new > context:
            errors.append(FieldError("generator.max_new_tokens", f"the held-out eval generates {new} tokens after "
                                                                 f"prompts of up to {longest_held_out}: "
                                                                 f"{longest_held_out + new} is longer than the model's "
                                                                 f"{context} positions"))
    return PreflightReport(errors, warnings)


def _span(lengths: list[int]) -> str:
    low, high = min(lengths), max(lengths)
    return f"{low} tokens" if low == high else f"{low} to {high} tokens"


def _longest(cut: list[int], *, lengths: list[int], problems: list[Problem], lines: dict[int, int]) -> str:
    """The longest of the `cut` examples, in tokens, and where it comes from (its line of data.path, or its text)."""
    at = max(cut, key=lengths.__getitem__)
    longest = problems[at]
    where = f"data.path line {lines[id(longest)]}" if id(longest) in lines else repr(longest.messages[-1]["content"])
    return f"the longest: {lengths[at]} tokens, {where}"


def _device_errors(config: RunConfig) -> list[FieldError]:
    """A single-process run asked for a GPU this host does not have (a Monarch run's procs may be on other hosts: the
    trainer rank that finds none says so)."""
    if config.placement.runs_on_monarch:
        return []
    wants = [(field, fix) for field, asked, fix in (
        ("trainer.device", config.trainer.device == "cuda", "set it to cpu or auto"),
        ("placement.trainer.gpus_per_proc", config.placement.trainer.gpus_per_proc > 0, "set it to 0")) if asked]
    if not wants or _cuda_here():
        return []
    return [FieldError(field, f"this host has no CUDA device: {fix}") for field, fix in wants]


def _positions(context: object) -> bool:
    """A config.json's max_position_embeddings that says how many positions the model has."""
    return isinstance(context, int) and not isinstance(context, bool) and context >= 1


def _context_errors(config: RunConfig, context: object) -> list[FieldError]:
    """Sequences longer than the model's positions: its position embeddings end there (and a sampler asked for a
    billion new tokens would allocate their cache before it failed)."""
    if not _positions(context):
        return []
    if config.recipe == "sft":
        if config.data.seq_len > context:
            return [FieldError("data.seq_len", f"{config.data.seq_len} is longer than the model's {context} positions")]
        return []
    longest = config.data.max_prompt_tokens + config.generator.max_new_tokens
    if longest > context:
        return [FieldError("generator.max_new_tokens", f"data.max_prompt_tokens {config.data.max_prompt_tokens} + "
                           f"generator.max_new_tokens {config.generator.max_new_tokens} = {longest} is longer than "
                           f"the model's {context} positions")]
    return []


GIB = 1 << 30


def host_memory_bytes() -> int:
    """This host's memory, or the cgroup's limit where that is lower (what the kernel's OOM killer enforces)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return physical
    return min(physical, int(limit)) if limit.isdigit() else physical


def memory_errors(config: RunConfig, hf_config: dict, *, host_bytes: int) -> list[FieldError]:
    """A run whose processes compute on this host's CPU and could never fit in its memory: each count is a floor of
    what the engine allocates (no activations, no allocator slack), so a refusal is certain. Without it, a typo'd
    trainer.batch_size ran until the kernel killed the largest process on a shared host, which need not be the run's.
    On a GPU the allocator fails cleanly in the run's own device, so only the CPU is checked here."""
    try:
        shape = ModelShape.from_hf_config(hf_config)
    except ValueError:
        return []  # the model's loader says what is wrong with its config.json
    if not _computes_on_cpu(config):
        return []
    errors = []
    dtype_bytes = BYTES_PER_VALUE[config.model.dtype]
    state = shape.params() * TRAINER_STATE_BYTES_PER_PARAM[config.trainer.optimizer.name] * dtype_bytes // 4
    sharded = config.trainer.sharding == "fsdp"
    state //= config.trainer.ranks if sharded else 1
    if state > host_bytes:
        errors.append(FieldError("model.path", f"a trainer rank holds at least {state / GIB:.1f} GiB (the model's "
                                 f"{shape.params():,} parameters: weights, gradients and optimizer state"
                                 f"{'' if sharded else '; trainer.sharding: fsdp shards them over the ranks'}), "
                                 f"more than this host's {host_bytes / GIB:.1f} GiB"))
    if config.recipe != "grpo" or config.generator.backend != "torch":
        return errors  # vLLM schedules its sequences into the cache it has
    _, prompts = generate_requests(Workload.from_config(config), Placement.from_config(config))
    sequences = prompts * config.grpo.group_size
    # The sampler allocates every sequence's KV cache for its whole length up front, and one step's log-probs over
    # the vocabulary (float32) beside it.
    cache = sequences * (1 + config.generator.max_new_tokens) * shape.kv_bytes_per_token(config.rollout_dtype)
    request = cache + sequences * shape.vocab * 4
    in_trainer = config.generator.in_trainer  # the rank also holds its training state
    if request + (state if in_trainer else 0) > host_bytes:
        beside = " beside its training state" if in_trainer else ""
        errors.append(FieldError("trainer.batch_size", f"a generate request of {sequences:,} sequences (its share of "
                                 f"trainer.batch_size x grpo.group_size) needs at least {request / GIB:.1f} GiB for "
                                 f"their KV cache and log-probs{beside}, more than this host's {host_bytes / GIB:.1f} "
                                 f"GiB: fewer prompts a step, or more "
                                 f"{'trainer.ranks' if in_trainer else 'generator.replicas'}"))
    return errors


def _computes_on_cpu(config: RunConfig) -> bool:
    if config.trainer.device != "auto":
        return config.trainer.device == "cpu"
    return not _cuda_here()


def _cuda_here() -> bool:
    try:
        import torch  # noqa: PLC0415 - the rest of preflight runs without torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def preflight(config: RunConfig) -> list[FieldError]:
    """ConfigError on what stops the run; else its warnings."""
    report = preflight_report(config)
    if report.errors:
        raise ConfigError(report.errors)
    return report.warnings
