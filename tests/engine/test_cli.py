"""The CLI: field-level errors and exit code 2 before anything is loaded; a tiny run end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from workers.engine.cli import main

REPO = Path(__file__).resolve().parents[2]


def _run_cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "workers.engine", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=240, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_bad_config_lists_every_field_and_exits_2(tmp_path: Path) -> None:
    config = _write(tmp_path / "bad.yaml", "recipe: grpo\nmodel: {path: /nowhere}\ntrainer: {steps: 0, bogus: 1}\n")
    result = _run_cli("train", "--config", str(config), "grpo.group_size=1", "generator.temperature=hot")
    assert result.returncode == 2
    for line in ("trainer.steps: Input should be greater than or equal to 1", "trainer.bogus: unknown key",
                 "grpo.group_size:", "generator.temperature:"):
        assert line in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_model_folder_is_a_field_error(tmp_path: Path) -> None:
    config = _write(tmp_path / "run.yaml", f"recipe: sft\nmodel: {{path: '{tmp_path / 'missing'}'}}\n")
    result = _run_cli("train", "--config", str(config))
    assert result.returncode == 2
    assert f"model.path: folder {tmp_path / 'missing'} does not exist" in result.stderr


def test_config_file_that_does_not_exist(tmp_path: Path) -> None:
    result = _run_cli("train", "--config", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_config_file_that_cannot_be_read_is_a_clean_refusal(tmp_path: Path) -> None:
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("recipe: sft\n# caf\u00e9\n".encode("latin-1"))
    result = _run_cli("train", "--config", str(latin1))
    assert result.returncode == 2 and "is not UTF-8 text" in result.stderr and "Traceback" not in result.stderr
    too_long = tmp_path / ("x" * 300) / "run.yaml"  # a name over the filesystem's 255 bytes
    result = _run_cli("train", "--config", str(too_long))
    assert result.returncode == 2 and "cannot be read (File name too long)" in result.stderr
    assert "Traceback" not in result.stderr


def test_preflight_refuses_what_it_cannot_run(tiny_llama3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _write(tmp_path / "run.yaml", f"recipe: grpo\nmodel: {{family: qwen3, path: '{tiny_llama3}'}}\n")
    code = main(["train", "--config", str(config), "generator.backend=vllm", "trainer.ranks=2",
                 "grpo.kl_coef=0.1", f"checkpoint.resume_from={tmp_path / 'none'}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "grpo.kl_coef: a KL penalty needs a reference model" in err  # schema-level cross check first
    code = main(["train", "--config", str(config), "generator.backend=vllm", "trainer.ranks=2",
                 "trainer.recover_failures=1", f"checkpoint.resume_from={tmp_path / 'none'}"])
    assert code == 2
    err = capsys.readouterr().err
    for field in ("model.family: the folder holds a llama3 model", "generator.backend:", "trainer.ranks:",
                  "trainer.recover_failures:", "checkpoint.resume_from:"):
        assert field in err
    sft = _write(tmp_path / "sft.yaml", f"recipe: sft\nmodel: {{family: llama3, path: '{tiny_llama3}'}}\n")
    assert main(["train", "--config", str(sft), "placement.backend=monarch", "placement.generator.hosts=[a]"]) == 2
    assert "placement.generator.hosts: an SFT run has no generator" in capsys.readouterr().err
    grpo = _write(tmp_path / "grpo.yaml", f"recipe: grpo\nmodel: {{family: llama3, path: '{tiny_llama3}'}}\n")
    assert main(["train", "--config", str(grpo), "placement.backend=monarch", "trainer.ranks=3",
                 "placement.trainer.procs_per_host=2"]) == 2
    assert "placement.trainer.procs_per_host: trainer.ranks 3 do not fill hosts of 2" in capsys.readouterr().err
    assert main(["train", "--config", str(grpo), "placement.backend=monarch", "placement.trainer.hosts=[a, b]"]) == 2
    assert "placement.trainer.hosts: no hosts to place it on: set placement.local_hosts" in capsys.readouterr().err
    # The tiny model has 1024 positions: a prompt and its completion, or an SFT sequence, must fit in them.
    assert main(["train", "--config", str(grpo), "generator.max_new_tokens=2000000000"]) == 2
    assert ("generator.max_new_tokens: data.max_prompt_tokens 64 + generator.max_new_tokens 2000000000 = 2000000064 "
            "is longer than the model's 1024 positions") in capsys.readouterr().err
    assert main(["train", "--config", str(sft), "data.seq_len=1025"]) == 2
    assert "data.seq_len: 1025 is longer than the model's 1024 positions" in capsys.readouterr().err


def test_hosts_for_every_role_pass_preflight_where_there_are_hosts(tiny_llama3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulated hosts, a SLURM or Kubernetes job's workers, or workers a launcher named: every role may be placed."""
    from workers.engine.config import load_config
    from workers.engine.preflight import preflight_errors

    example = (REPO / "examples/configs/cpu_demo_grpo_two_hosts.yaml").read_text()
    two_hosts = load_config(example, overrides=[f"model.path={tiny_llama3}", "model.family=llama3"])
    assert preflight_errors(two_hosts) == []
    for backend in ("slurm", "kubernetes"):
        on_cluster = load_config(f"recipe: grpo\nmodel: {{family: llama3, path: '{tiny_llama3}'}}\n", overrides=[
            f"placement.backend={backend}", "trainer.ranks=2", "trainer.sharding=fsdp", "placement.trainer.hosts=[node0]"])
        assert on_cluster.placement.runs_on_monarch and preflight_errors(on_cluster) == []
    attached = load_config(f"recipe: grpo\nmodel: {{family: llama3, path: '{tiny_llama3}'}}\n", overrides=[
        "placement.backend=monarch", "placement.reward.hosts=[h1]"])
    assert [e.field for e in preflight_errors(attached)] == ["placement.reward.hosts"]
    monkeypatch.setenv("FORGEBOARD_MONARCH_WORKERS", "h1=tcp://127.0.0.1:26600")
    assert preflight_errors(attached) == []


def test_make_tiny_model_and_train_end_to_end(tmp_path: Path) -> None:
    assert main(["make-tiny-model", "--family", "llama3", "--out", str(tmp_path / "tiny")]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "tiny").iterdir()}
    config = _write(tmp_path / "run.yaml", (
        "recipe: grpo\n"
        f"model: {{family: llama3, path: '{tmp_path / 'tiny'}'}}\n"
        "data: {max_operand: 5, eval_size: 4}\n"
        "generator: {max_new_tokens: 4}\n"
        "trainer: {steps: 2, batch_size: 2, micro_batch_size: 8, threads_per_process: 1}\n"
        "grpo: {group_size: 2}\n"
        "eval: {every_steps: 2}\n"
        f"checkpoint: {{folder: '{tmp_path / 'ckpt'}'}}\n"
        f"telemetry: {{console: true, jsonl_path: '{tmp_path / 'metrics.jsonl'}'}}\n"
    ))
    result = _run_cli("train", "--config", str(config), "trainer.optimizer.lr=1e-3")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["recipe"] == "grpo" and summary["steps"] == 2 and summary["checkpoint"].endswith("step_000002")
    assert summary["steps_per_s"] > 0 and 0.0 <= summary["eval_reward_mean_start"] <= 1.0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    keys = {r["key"] for r in records if r["kind"] == "metric"}
    assert {"loss", "reward/mean", "time/generate_s", "time/train_s", "eval/accuracy", "mfu"} <= keys
    assert "2/2" in result.stderr  # the console progress bar

    assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "model.safetensors").is_file()


def test_resuming_the_other_recipes_checkpoint_exits_2_naming_resume_from(tiny_trainable_qwen3: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    # a GRPO run resuming an SFT checkpoint loaded the model, then stopped on KeyError: 'generations' (a traceback)
    from workers.engine.config import load_config
    from workers.engine.metrics import Recorder
    from workers.engine.recipes.sft import train_sft

    short = ("data.max_operand=5", "data.eval_size=4", "trainer.steps=1", "trainer.batch_size=2", "eval.every_steps=0",
             "trainer.threads_per_process=1", "telemetry.console=false")
    sft = train_sft(load_config(f"recipe: sft\nmodel: {{path: '{tiny_trainable_qwen3}'}}\n",
                                overrides=[*short, f"checkpoint.folder={tmp_path / 'sft'}"]), Recorder()).checkpoint
    assert sft is not None
    grpo = _write(tmp_path / "grpo.yaml", f"recipe: grpo\nmodel: {{path: '{tiny_trainable_qwen3}'}}\n")
    resume = [*short, "grpo.group_size=2", "generator.max_new_tokens=4", f"checkpoint.folder={tmp_path / 'grpo'}",
              f"checkpoint.resume_from={sft}"]
    refusal = (f"checkpoint.resume_from: {sft} holds an SFT run's checkpoint, and a GRPO run resumes only its own "
               "recipe's; to start it from these weights, export them (python -m workers.engine export --checkpoint "
               f"{sft} --out DIR) and set model.path to DIR")

    result = _run_cli("train", "--config", str(grpo), *resume)  # refused by preflight, from its checkpoint.json
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[1:] == [f"  {refusal} (on the platform: model.artifact=run:<id>@step:<step>)"]

    (sft / "checkpoint.json").unlink()  # written before there was one: refused by preflight too, saying what it lacks
    assert main(["train", "--config", str(grpo), *resume]) == 2
    assert (f"checkpoint.resume_from: {sft} has no checkpoint.json, which says which recipe wrote a checkpoint (it was "
            f"written before checkpoints had one): if a GRPO run wrote it, write {sft / 'checkpoint.json'} as "
            '{"recipe": "grpo", "step": 1} and resume again; otherwise start from its weights: export them (python -m '
            f"workers.engine export --checkpoint {sft} --out DIR) and set model.path to DIR") in capsys.readouterr().err
    assert not (tmp_path / "grpo").exists()


def test_an_sft_run_that_cuts_some_responses_off_warns_and_reports_their_share(
        tiny_trainable_qwen3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # examples whose prompt filled data.seq_len trained nothing, and nothing said so
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"prompt": "x" * 60 if i % 2 else f"{i}+1=", "response": str(i + 1)})
                              for i in range(12)))
    config = _write(tmp_path / "sft.yaml", f"recipe: sft\nmodel: {{path: '{tiny_trainable_qwen3}'}}\n")
    assert main(["train", "--config", str(config), "data.source=jsonl", f"data.path={rows}", "data.eval_size=2",
                 "data.seq_len=40", "trainer.steps=2", "trainer.batch_size=10", "eval.every_steps=0",
                 "trainer.threads_per_process=1", "telemetry.console=false", f"checkpoint.folder={tmp_path / 'ckpt'}",
                 f"telemetry.jsonl_path={tmp_path / 'metrics.jsonl'}"]) == 0
    warning = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert len(warning) == 1 and warning[0].startswith("warning: data.seq_len: ")
    assert "training examples have prompts longer than 40 tokens (the longest: 79 tokens, data.path line" in warning[0]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    shares = [r["value"] for r in records if r["kind"] == "metric" and r["key"] == "data/no_response_share"]
    assert len(shares) == 2 and all(0.0 < share < 1.0 for share in shares)


def test_schema_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "trainer" in schema["properties"] and schema["additionalProperties"] is False


def _config_errors(text: str, *overrides: str) -> dict[str, str]:
    from workers.engine.config import ConfigError, load_config

    with pytest.raises(ConfigError) as caught:
        load_config(text, overrides=list(overrides))
    return {e.field: e.message for e in caught.value.errors}


def test_sharding_rules_are_field_errors() -> None:
    from workers.engine.config import load_config

    def fields(*overrides: str) -> dict[str, str]:
        return _config_errors("recipe: grpo\nmodel: {path: /x}\n", *overrides)

    assert "fsdp shards the Monarch trainer's ranks" in fields("trainer.sharding=fsdp")["trainer.sharding"]
    assert "model.dtype is bfloat16" in fields("model.dtype=bfloat16", "trainer.mixed_precision=bf16")["trainer.mixed_precision"]
    for backend in ("local", "monarch"):  # autocast on a replicated or single-process trainer
        assert load_config("recipe: grpo\nmodel: {path: /x}\n", overrides=[
            f"placement.backend={backend}", "trainer.mixed_precision=bf16"]).rollout_dtype == "bfloat16"
    assert "trainer.sharding" in fields("trainer.sharding=zero3")
    config = load_config("recipe: grpo\nmodel: {path: /x}\n", overrides=[
        "placement.backend=monarch", "trainer.sharding=fsdp", "trainer.mixed_precision=bf16", "trainer.ranks=4"])
    assert (config.trainer.sharding, config.trainer.mixed_precision, config.rollout_dtype) == ("fsdp", "bf16", "bfloat16")


def test_sft_on_a_cluster_job_runs_on_its_workers(tiny_llama3: Path) -> None:
    from workers.engine.config import load_config
    from workers.engine.preflight import preflight_errors

    sft = f"recipe: sft\nmodel: {{family: llama3, path: '{tiny_llama3}'}}\n"
    assert preflight_errors(load_config(sft, overrides=["placement.backend=slurm"])) == []
    assert preflight_errors(load_config(sft, overrides=[
        "placement.backend=kubernetes", "trainer.ranks=2", "placement.trainer.hosts=[node0]"])) == []
    refused = {e.field: e.message for e in preflight_errors(load_config(sft, overrides=[
        "placement.backend=kubernetes", "placement.generator.hosts=[node0]"]))}
    assert refused == {"placement.generator.hosts": "an SFT run has no generator: it places only its trainer"}
    local = {e.field: e.message for e in preflight_errors(load_config(sft, overrides=["trainer.ranks=2"]))}
    assert "monarch" in local["trainer.ranks"]


def test_colocation_rules_are_field_errors() -> None:
    from workers.engine.config import load_config

    def fields(*overrides: str) -> dict[str, str]:
        return _config_errors("recipe: grpo\nmodel: {path: /x}\nreference: {enabled: true}\n", *overrides)

    assert "Monarch GRPO recipe" in fields("placement.reference.colocate_with=trainer")["placement.reference.colocate_with"]
    monarch = "placement.backend=monarch"
    assert "the trainer does not follow another role" in fields(monarch, "placement.trainer.colocate_with=generator")[
        "placement.trainer.colocate_with"]
    assert "the generator can follow trainer" in fields(monarch, "placement.generator.colocate_with=reference")[
        "placement.generator.colocate_with"]
    assert "leave hosts empty" in fields(monarch, "placement.reward.colocate_with=generator", "placement.reward.hosts=[a]")[
        "placement.reward.hosts"]
    config = load_config("recipe: grpo\nmodel: {path: /x}\n", overrides=[
        monarch, "placement.reference.colocate_with=trainer", "placement.reward.colocate_with=generator"])
    assert config.placement.reward.colocate_with == "generator"


def test_gpu_placement_rules_are_field_errors() -> None:
    from workers.engine.config import load_config

    def fields(*overrides: str) -> dict[str, str]:
        return _config_errors("recipe: grpo\nmodel: {path: /x}\n", *overrides)

    monarch = "placement.backend=monarch"
    assert "tensor parallelism is not implemented" in fields(monarch, "placement.generator.gpus_per_proc=2")[
        "placement.generator.gpus_per_proc"]
    assert "holds no model" in fields(monarch, "placement.reward.gpus_per_proc=1")["placement.reward.gpus_per_proc"]
    assert "set it on the trainer" in fields("placement.generator.gpus_per_proc=1")["placement.generator.gpus_per_proc"]
    assert "trainer.device" in fields("placement.trainer.gpus_per_proc=1", "trainer.device=cpu")[
        "placement.trainer.gpus_per_proc"]
    # one process with its GPU, or every role's procs with one each
    assert load_config("recipe: grpo\nmodel: {path: /x}\n", overrides=["placement.trainer.gpus_per_proc=1"])
    config = load_config("recipe: grpo\nmodel: {path: /x}\n", overrides=[
        monarch, "trainer.ranks=4", "placement.trainer.procs_per_host=2", "placement.trainer.gpus_per_proc=1",
        "placement.generator.gpus_per_proc=1", "placement.generator.procs_per_host=1"])
    assert (config.placement.trainer.procs_per_host, config.placement.generator.gpus_per_proc) == (2, 1)
    assert load_config("recipe: grpo\nmodel: {path: /x}\n").placement.generator.procs_per_host is None
