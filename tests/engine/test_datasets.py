"""Datasets as users have them: {prompt, answer} rows for GRPO, mapped field names (GSM8K), chat prompts,
a field error with its line before anything loads, every row used unless asked otherwise, and SFT that
teaches a model to stop when its template ends turns with ordinary text."""

from __future__ import annotations

import io
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from workers.engine.config import ARITHMETIC_TRAIN_SIZE, ConfigError, load_config
from workers.engine.metrics import ConsoleSink, MemorySink, Recorder
from workers.engine.models.hf_folder import export_hf, load_pretrained
from workers.engine.models.tokenizer import ChatTokenizer
from workers.engine.preflight import preflight_errors
from workers.engine.recipes.grpo import train_grpo
from workers.engine.recipes.sft import train_sft
from workers.engine.rewards import exact_math
from workers.engine.sampler import SamplingParams, TorchSampler
from workers.engine.tasks import DataError, build_task

ROOT = Path(__file__).resolve().parents[2]
# Turns end with "<|end|>\n" spelled as ordinary bytes: eight tokens, none of them the EOS.
END_OF_TURN = "<|end|>\n"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}" + END_OF_TURN + "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def byte_eot_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 whose byte-level tokenizer's only special tokens are <pad> and the EOS </s>."""
    from workers.engine.models.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path_factory.mktemp("byte-eot"), family="qwen3")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    inner = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    inner.add_special_tokens(["<pad>", "</s>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="</s>", pad_token="<pad>", bos_token=None,
                                        chat_template=CHAT_TEMPLATE)
    tokenizer.save_pretrained(str(folder))
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.is_file():
            config = json.loads(path.read_text())
            config.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            path.write_text(json.dumps(config))
    return folder


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def _sums(count: int, *, start: int = 0) -> list[dict]:
    return [{"prompt": f"{a % 10}+{a // 10}=", "answer": str(a % 10 + a // 10)} for a in range(start, start + count)]


def _config(tmp_path: Path, recipe: str, model: Path | str, *overrides: str):
    return load_config(f"recipe: {recipe}\nmodel: {{path: '{model}'}}\n", overrides=[
        f"checkpoint.folder={tmp_path / 'checkpoints'}", "telemetry.console=false", "trainer.threads_per_process=1",
        *overrides])


def test_the_template_end_of_turn_is_ordinary_bytes_and_sft_appends_eos(byte_eot_model: Path, tiny_qwen3: Path) -> None:
    tokenizer = ChatTokenizer(byte_eot_model)
    end_ids = tokenizer.encode(END_OF_TURN)
    assert len(end_ids) == len(END_OF_TURN) and not set(end_ids) & set(tokenizer.eos_token_ids)
    _, response = tokenizer.encode_exchange([{"role": "user", "content": "2+2="}], "4")
    assert response == [*tokenizer.encode("4" + END_OF_TURN), tokenizer.eos_token_ids[0]]
    # ChatML ends turns with its EOS special token: nothing is added
    chatml = ChatTokenizer(tiny_qwen3)
    _, response = chatml.encode_exchange([{"role": "user", "content": "2+2="}], "4")
    assert response == chatml.encode("4<|im_end|>\n") and response.count(chatml.eos_token_ids[0]) == 1


def test_after_a_short_sft_the_model_emits_eos_and_stops(byte_eot_model: Path, tmp_path: Path) -> None:
    data = _write_jsonl(tmp_path / "sums.jsonl", [{**row, "response": row["answer"]} for row in _sums(100)])
    sink = MemorySink()
    config = _config(tmp_path, "sft", byte_eot_model, "data.source=jsonl", f"data.path={data}", "data.eval_size=8",
                     "trainer.steps=40", "trainer.batch_size=16", "trainer.micro_batch_size=16",
                     "trainer.optimizer.lr=3e-3", "eval.every_steps=0", "data.seq_len=128")
    result = train_sft(config, Recorder([sink]))
    [event] = [r for r in sink.records if r["kind"] == "event" and r["name"] == "dataset"]
    assert (event["rows"], event["train"], event["held_out"]) == (100, 92, 8)

    loaded = load_pretrained(export_hf(result.checkpoint, tmp_path / "hf"))
    tokenizer = loaded.tokenizer
    sampler = TorchSampler(loaded.model.eval(), eos_token_ids=tokenizer.eos_token_ids, pad_id=tokenizer.pad_id)
    max_new_tokens = 24
    prompts = [tokenizer.encode_prompt([{"role": "user", "content": f"{a}+{b}="}]) for a, b in [(1, 2), (7, 5), (3, 9)]]
    completions = sampler.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, greedy=True), seed=0)
    for completion in completions:
        assert completion.finished and completion.token_ids[-1] == tokenizer.eos_token_ids[0]
        assert len(completion.token_ids) < max_new_tokens
        assert tokenizer.decode(completion.token_ids).endswith(END_OF_TURN)
        reply = tokenizer.decode_reply(completion.token_ids)  # what rewards and the rollouts table see
        assert "<|end|>" not in reply and tokenizer.decode(completion.token_ids) == reply + END_OF_TURN


def test_a_reply_is_decoded_without_the_templates_end_of_turn(byte_eot_model: Path, tiny_qwen3: Path) -> None:
    from workers.engine.rewards import answer_format

    spelled = ChatTokenizer(byte_eot_model)
    assert spelled.turn_end_text == "<|end|>"
    ids = spelled.encode("42" + END_OF_TURN)
    assert spelled.decode_reply(ids) == "42"
    assert answer_format(None, spelled.decode_reply(ids), True) == 1.0  # a bare number, as the format reward wants
    assert answer_format(None, spelled.decode(ids), True) == 0.0
    assert spelled.decode_reply(spelled.encode("42")) == "42", "an unfinished reply is left as it is"
    assert spelled.decode_reply(spelled.encode("a <|end|> b")) == "a <|end|> b", "only at the end"
    chatml = ChatTokenizer(tiny_qwen3)  # ends turns with a special token, which decoding drops anyway
    assert chatml.turn_end_text == ""
    assert chatml.decode_reply(chatml.encode("42<|im_end|>\n")) == chatml.decode(chatml.encode("42<|im_end|>\n"))


def test_grpo_trains_on_prompt_answer_rows_and_chat_prompts(tiny_trainable_qwen3: Path, tmp_path: Path) -> None:
    chat = [
        {"prompt": [{"role": "system", "content": "answer with a number"}, {"role": "user", "content": "4+4="}],
         "answer": 8},
        {"messages": [{"role": "user", "content": "5+1="}], "answer": "6"},
        {"messages": [{"role": "user", "content": "2+7="}, {"role": "assistant", "content": "9"}], "answer": "9"},
    ]
    data = _write_jsonl(tmp_path / "grpo.jsonl", [*_sums(21), *chat])
    sink, console = MemorySink(), io.StringIO()
    config = _config(tmp_path, "grpo", tiny_trainable_qwen3, "data.source=jsonl", f"data.path={data}",
                     "data.eval_size=4", "trainer.steps=3", "trainer.batch_size=4", "trainer.micro_batch_size=32",
                     "grpo.group_size=4", "generator.max_new_tokens=6", "eval.every_steps=3")
    result = train_grpo(config, Recorder([sink, ConsoleSink(total_steps=3, stream=console)]))
    assert len(result.losses) == 3 and all(math.isfinite(loss) for loss in result.losses)
    [event] = [r for r in sink.records if r["kind"] == "event" and r["name"] == "dataset"]
    assert (event["source"], event["rows"], event["train"], event["held_out"], event["unused"]) == ("jsonl", 24, 20, 4, 0)
    assert "[dataset]" in console.getvalue() and "'train': 20" in console.getvalue()

    problems = {p.messages[-1]["content"]: p for p in build_task(config).train + build_task(config).held_out}
    assert problems["4+4="].messages[0] == {"role": "system", "content": "answer with a number"}
    assert problems["4+4="].answer == "8" and problems["4+4="].response is None
    assert problems["2+7="].messages == [{"role": "user", "content": "2+7="}] and problems["2+7="].response == "9"


def test_gsm8k_fields_and_extractor(tmp_path: Path) -> None:
    rows = [{"question": "Natalia sold 40 clips and then 2 more. How many?", "answer": "40 + 2 = 42\n#### 42"},
            {"question": "A farm has 1,000 hens and 42 more. How many?", "answer": "1000+42 = 1042\n####  1,042 "},
            {"question": "q", "answer": "#### 7"}]
    data = _write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    config = _config(tmp_path, "grpo", "/nowhere", "data.source=jsonl", f"data.path={data}", "data.eval_size=1",
                     "data.fields.prompt=question", "data.answer_extractor=gsm8k")
    task = build_task(config)
    answers = {p.messages[0]["content"]: p.answer for p in task.train + task.held_out}
    assert answers[rows[0]["question"]] == "42" and answers[rows[1]["question"]] == "1042"
    natalia = next(p for p in task.train + task.held_out if p.answer == "42")
    assert exact_math(natalia, "40 + 2 = 42", True) == 1.0 and exact_math(natalia, "41", True) == 0.0
    # the same file without the extractor would compare against the whole worked solution
    plain = build_task(_config(tmp_path, "grpo", "/nowhere", "data.source=jsonl", f"data.path={data}",
                               "data.eval_size=1", "data.fields.prompt=question"))
    assert {p.answer for p in plain.train + plain.held_out} == {row["answer"] for row in rows}


@pytest.mark.parametrize("rows, overrides, field, message", [
    ([*_sums(6), {"prompt": "1+1="}, *_sums(3)], ("recipe=grpo",), "data.path",
     "line 7: 'answer' is missing (GRPO needs an answer for its reward)"),
    ([*_sums(4), {"question": "1+1=", "answer": "2"}], ("recipe=grpo",), "data.path",
     "line 5: 'prompt' is missing (the prompt; or give 'messages')"),
    ([*_sums(4), {"question": "1+1=", "answer": "2"}], ("recipe=grpo", "data.fields.prompt=question"), "data.path",
     "line 1: 'question' is missing (the prompt; or give 'messages')"),
    (_sums(3), ("recipe=sft",), "data.path", "line 1: 'response' is missing (SFT trains on the reply)"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], ("recipe=sft",), "data.path",
     "line 1: 'response' is missing (SFT trains on the reply; or end 'messages' with the assistant's reply)"),
    ([*_sums(2), "{not json"], ("recipe=grpo",), "data.path", "line 3: not JSON"),
    ([*_sums(2), [1, 2]], ("recipe=grpo",), "data.path", "line 3: expected a JSON object"),
    ([{"prompt": [{"role": "wizard", "content": "x"}], "answer": 1}], ("recipe=grpo",), "data.path",
     "line 1: 'prompt' message 0 needs a role"),
    ([{"prompt": "x", "answer": True}], ("recipe=grpo",), "data.path", "line 1: 'answer' must be a string or a number"),
    ([{"prompt": "x", "answer": "42"}], ("recipe=grpo", "data.answer_extractor=gsm8k"), "data.path",
     "line 1: 'answer' has no '#### <answer>' (data.answer_extractor: gsm8k)"),
    ([{"prompt": "x", "response": 4}], ("recipe=sft",), "data.path", "line 1: 'response' must be a string, not int"),
    ([{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "response": "z"}],
     ("recipe=sft",), "data.path", "line 1: both 'messages' ending with the assistant's reply and 'response'"),
    (_sums(5), ("recipe=grpo", "data.eval_size=5"), "data.eval_size", "5 examples cannot leave any for training"),
    (_sums(10), ("recipe=grpo", "data.eval_size=2", "data.train_size=9"), "data.train_size",
     "9 asked, but"),
    ([], ("recipe=grpo",), "data.path", "no rows: every line is blank"),
    ([*_sums(2), '{"prompt": "x", "answer": ' + "9" * 5000 + "}"], ("recipe=grpo",), "data.path",
     "line 3: a number of more than 4300 digits"),
    (['{"prompt": "x", "answer": NaN}'], ("recipe=grpo",), "data.path", "line 1: 'answer' must be a finite number, not "
                                                                         "nan"),
    (['{"prompt": "x", "answer": 1e400}'], ("recipe=grpo",), "data.path", "line 1: 'answer' must be a finite number, "
                                                                           "not inf"),
])
def test_a_row_it_cannot_use_is_a_field_error_with_its_line(tmp_path: Path, tiny_qwen3: Path, rows: list,
                                                             overrides: tuple[str, ...], field: str, message: str) -> None:
    data = _write_jsonl(tmp_path / "data.jsonl", rows)
    config = _config(tmp_path, "grpo", tiny_qwen3, "data.source=jsonl", f"data.path={data}", "data.eval_size=1",
                     *overrides)
    errors = {e.field: e.message for e in preflight_errors(config)}
    assert list(errors) == [field] and errors[field].startswith(message), errors


def test_bytes_that_are_not_utf8_name_their_line(tmp_path: Path, tiny_qwen3: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "\xff", "answer": "2"}\n')
    config = _config(tmp_path, "grpo", tiny_qwen3, "data.source=jsonl", f"data.path={data}", "data.eval_size=1")
    assert [str(e) for e in preflight_errors(config)] == ["data.path: line 3: not UTF-8 text"]


def _model_that_cannot_load(tiny: Path, out: Path) -> Path:
    """Passes preflight's folder checks (config, tokenizer, a *.safetensors), but its weights are not weights."""
    shutil.copytree(tiny, out, ignore=shutil.ignore_patterns("*.safetensors"))
    (out / "model.safetensors").write_bytes(b"not safetensors")
    return out


def test_a_bad_row_stops_the_run_before_the_model_loads(tiny_qwen3: Path, tmp_path: Path) -> None:
    broken = _model_that_cannot_load(tiny_qwen3, tmp_path / "broken-model")
    good = _write_jsonl(tmp_path / "good.jsonl", _sums(10))
    bad = _write_jsonl(tmp_path / "bad.jsonl", [*_sums(6), {"prompt": "1+1="}, *_sums(3)])
    run = ("data.source=jsonl", "data.eval_size=2", "trainer.steps=1", "trainer.batch_size=2", "grpo.group_size=2")
    with pytest.raises(Exception) as loading:  # the control: with usable rows, the run gets to the model and fails there
        train_grpo(_config(tmp_path, "grpo", broken, *run, f"data.path={good}"), Recorder())
    assert not isinstance(loading.value, DataError)
    with pytest.raises(DataError, match=r"^line 7: 'answer' is missing \(GRPO needs an answer for its reward\)$"):
        train_grpo(_config(tmp_path, "grpo", broken, *run, f"data.path={bad}"), Recorder())

    # the CLI: one field line, exit 2, no traceback
    config_file = tmp_path / "run.yaml"
    config_file.write_text(f"recipe: grpo\nmodel: {{path: '{broken}'}}\n"
                           f"data: {{source: jsonl, path: '{bad}', eval_size: 2}}\n"
                           f"checkpoint: {{folder: '{tmp_path / 'ckpt'}'}}\n")
    cli = subprocess.run([sys.executable, "-m", "workers.engine", "train", "--config", str(config_file)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2, cli.stderr
    assert cli.stderr.splitlines() == ["invalid config:",
                                       "  data.path: line 7: 'answer' is missing (GRPO needs an answer for its reward)"]


def test_every_row_is_used_unless_train_size_says_otherwise(tmp_path: Path) -> None:
    data = _write_jsonl(tmp_path / "big.jsonl", [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(2500)])
    jsonl = ("data.source=jsonl", f"data.path={data}", "data.eval_size=10")
    assert build_task(_config(tmp_path, "grpo", "/nowhere", *jsonl)).summary() == {
        "source": "jsonl", "task": "big", "rows": 2500, "train": 2490, "held_out": 10, "unused": 0}
    assert build_task(_config(tmp_path, "grpo", "/nowhere", *jsonl, "data.train_size=100")).summary()["unused"] == 2390
    # the generated task keeps its explicit size
    arithmetic = build_task(_config(tmp_path, "grpo", "/nowhere", "data.max_operand=60")).summary()
    assert (arithmetic["rows"], arithmetic["train"], arithmetic["held_out"]) == (61 * 61, ARITHMETIC_TRAIN_SIZE, 64)


def test_data_options_that_do_not_apply_are_refused() -> None:
    for overrides, field in ((["data.fields.prompt=question"], "data.fields"),
                             (["data.answer_extractor=gsm8k"], "data.answer_extractor"),
                             (["data.source=jsonl", "data.path=x", "data.fields.prompt=messages"], "data.fields.messages"),
                             (["data.source=jsonl", "data.path=x", "data.train_size=0"], "data.train_size")):
        with pytest.raises(ConfigError) as exc:
            load_config("recipe: grpo\nmodel: {path: /nowhere}\n", overrides=overrides)
        assert [e.field for e in exc.value.errors] == [field], exc.value.errors
    config = load_config("recipe: grpo\nmodel: {path: /nowhere}\n", overrides=[
        "data.source=jsonl", "data.path=x", "data.fields.prompt=question", "data.answer_extractor=gsm8k"])
    from workers.engine.config import config_to_yaml

    assert load_config(config_to_yaml(config)) == config  # a snapshot round trip validates the same
    assert load_config(config_to_yaml(load_config("recipe: sft\nmodel: {path: /m}\n"))).data.train_size is None

