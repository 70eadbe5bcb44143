"""The engine's command channel against the real control plane (its WSGI app, in process), behind a network that
fails where a test says: a command runs only once the control plane accepts its acknowledgement, at most once across
a killed controller, and nothing the network, the ledger file or a handler's result does raises out of `poll` (the
training loop calls it between steps: an exception there ends the run as failed)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from forgeboard.runs.models import Command, CommandState
from forgeboard.runs.services import command_acknowledge, command_create, run_transition
from forgeboard.runs.states import RunState
from forgeboard.telemetry.models import RunEvent
from workers.engine import command_channel
from workers.engine.command_channel import CommandChannel
from workers.engine.control_plane import ControlPlaneTarget
from workers.engine.run_control import RunControl

DRILL = {"kind": "kill", "role": "generator"}


class Network(httpx.BaseTransport):
    """The control plane's WSGI app behind a network a test breaks: before a request whose path ends with a given
    suffix it runs `before` (the world changes meanwhile), then `fail` answers for the control plane (an exception
    to raise, or a response a proxy gives), or the answer is lost on its way back (`lose_answer`)."""

    def __init__(self) -> None:
        from forgeboard.wsgi import application

        self.server = httpx.WSGITransport(app=application)
        self.before: dict[str, Callable[[], None]] = {}
        self.fail: dict[str, list[Exception | httpx.Response]] = {}
        self.lose_answer: dict[str, int] = {}
        self.sent: list[tuple[str, str]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.sent.append((request.method, path))
        suffix = next((s for s in (*self.before, *self.fail, *self.lose_answer) if path.endswith(s)), None)
        if suffix in self.before:
            self.before.pop(suffix)()
        if self.fail.get(suffix):
            fault = self.fail[suffix].pop(0)
            if isinstance(fault, Exception):
                raise fault
            return fault
        response = self.server.handle_request(request)
        if self.lose_answer.get(suffix):
            self.lose_answer[suffix] -= 1
            response.read()
            raise httpx.ReadError("connection reset by peer", request=request)
        return response

    def count(self, method: str, suffix: str) -> int:
        return sum(1 for m, p in self.sent if m == method and p.endswith(suffix))


class Engine:
    """What the engine does with a command: counts each run and answers with `answer(kind, payload)`."""

    def __init__(self, answer: Callable[[str, dict], object] | None = None) -> None:
        self.ran: list[tuple[str, dict]] = []
        self.answer = answer or (lambda kind, payload: {"step": 7})

    def __call__(self, kind: str, payload: dict) -> object:
        self.ran.append((kind, payload))
        return self.answer(kind, payload)


@pytest.fixture
def network(wsgi_in_process) -> Network:
    return Network()


def _channel(run, token: str, network: Network, ledger: Path) -> CommandChannel:
    target = ControlPlaneTarget(url="http://testserver", run_id=run.pk, token=token)
    return CommandChannel(target, ledger=ledger, transport=network)


def _ledger(path: Path) -> dict[str, dict]:
    return json.loads(path.read_text())


def _state(command: Command) -> str:
    command.refresh_from_db()
    return command.state


# --- the acknowledgement decides ----------------------------------------------------------------------------------

def test_a_command_that_expired_before_its_ack_is_skipped_and_recorded(team, monarch_running_run, network, tmp_path):
    """The run is lost between the pull and the acknowledgement: the drill is not fired, the ledger says why, and
    the next polls neither run it nor ask about it again."""
    run, token = monarch_running_run
    drill = command_create(actor=team.member, run=run, kind="fault_drill", payload=DRILL)
    network.before["/ack"] = lambda: run_transition(run_id=run.pk, from_state=RunState.RUNNING,
                                                    to_state=RunState.LOST, reason="no heartbeat")
    engine = Engine()
    channel = _channel(run, token, network, tmp_path / "commands.json")

    assert channel.poll(engine) == 0
    assert engine.ran == [], "a drill of a lost controller is a fault nobody asked for"
    assert _state(drill) == CommandState.EXPIRED and "late" not in _finished_events(run)[-1]
    skipped = _ledger(tmp_path / "commands.json")[str(drill.pk)]
    assert skipped["skipped"].startswith("expired: the run was lost before its controller took this command")
    assert channel.poll(engine) == 0 and engine.ran == []
    assert network.count("POST", "/ack") == 1 and network.count("POST", "/result") == 0


def test_a_command_finished_meanwhile_is_not_run_again(team, running_run, network, tmp_path):
    run, token = running_run
    checkpoint = command_create(actor=team.member, run=run, kind="checkpoint")

    def finished_elsewhere() -> None:
        Command.objects.filter(pk=checkpoint.pk).update(state=CommandState.SUCCEEDED, result={"step": 3})

    network.before["/ack"] = finished_elsewhere
    engine = Engine()
    assert _channel(run, token, network, tmp_path / "c.json").poll(engine) == 0
    assert engine.ran == [] and _state(checkpoint) == CommandState.SUCCEEDED
    assert _ledger(tmp_path / "c.json")[str(checkpoint.pk)]["skipped"].startswith("succeeded")


def test_a_command_gone_before_its_ack_is_skipped(team, running_run, network, tmp_path):
    run, token = running_run
    checkpoint = command_create(actor=team.member, run=run, kind="checkpoint")
    network.before["/ack"] = lambda: Command.objects.filter(pk=checkpoint.pk).delete()
    engine = Engine()
    assert _channel(run, token, network, tmp_path / "c.json").poll(engine) == 0
    assert engine.ran == []
    assert f"has no command {checkpoint.pk}" in _ledger(tmp_path / "c.json")[str(checkpoint.pk)]["skipped"]


def test_a_run_that_ended_before_the_ack_runs_nothing(team, running_run, network, tmp_path):
    """Once the run has ended its token is refused (401): nothing is run, and nothing is written off either."""
    run, token = running_run
    command_create(actor=team.member, run=run, kind="checkpoint")
    network.before["/ack"] = lambda: run_transition(run_id=run.pk, from_state=RunState.RUNNING,
                                                    to_state=RunState.SUCCEEDED, reason="finished")
    engine = Engine()
    assert _channel(run, token, network, tmp_path / "c.json").poll(engine) == 0
    assert engine.ran == [] and not (tmp_path / "c.json").exists()


@pytest.mark.parametrize("fault", [
    httpx.ConnectError("connection refused"),  # the web server is restarting
    httpx.ReadTimeout("timed out"),
    httpx.Response(503, text="<html>upstream unavailable</html>"),  # a proxy in front of it
    httpx.Response(502, text="bad gateway"),
    httpx.Response(429, json={"code": "rate_limited", "message": "slow down", "errors": []}),
    httpx.Response(200, text="<html>a captive portal</html>"),
], ids=["connect", "timeout", "503", "502", "429", "200-not-json"])
def test_a_transient_failure_of_the_ack_leaves_the_command_for_the_next_poll(team, running_run, network, tmp_path,
                                                                             fault):
    """Not run now, not written off, no exception into the training loop; the next poll runs it, once."""
    run, token = running_run
    checkpoint = command_create(actor=team.member, run=run, kind="checkpoint")
    network.fail["/ack"] = [fault]
    engine = Engine()
    control = RunControl(_channel(run, token, network, tmp_path / "c.json"), poll_seconds=0.0)

    assert control.between_steps(step=1, checkpoint=lambda: Path("/ckpt/1")) is True
    assert engine.ran == [] and control.channel.poll(engine) == 1 and engine.ran == [("checkpoint", {})]
    assert _state(checkpoint) == CommandState.SUCCEEDED
    assert control.channel.poll(engine) == 0 and len(engine.ran) == 1


def test_a_training_run_goes_on_through_a_web_server_restart_during_an_ack(team, running_run, network, tmp_path):
    """The SFT recipe asks for commands after each step (StepEnd -> RunControl.between_steps -> poll): the web server
    is restarting as the checkpoint command is acknowledged. The run trains every step, and the checkpoint is taken
    at the next step's poll, once. (An exception out of poll ended the run: the engine exits 1, the run fails.)"""
    import torch

    from workers.engine.config import load_config
    from workers.engine.metrics import Recorder
    from workers.engine.models.tiny import make_tiny_model
    from workers.engine.recipes.sft import train_sft

    torch.set_num_threads(1)
    run, token = running_run
    checkpoint = command_create(actor=team.member, run=run, kind="checkpoint")
    network.fail["/ack"] = [httpx.ConnectError("connection refused")]
    model = make_tiny_model(tmp_path / "tiny-qwen3", family="qwen3")
    config = load_config(f"recipe: sft\nmodel: {{path: '{model}'}}\ncheckpoint: {{folder: '{tmp_path / 'ckpt'}'}}\n"
                         "telemetry: {console: false}\ntrainer: {threads_per_process: 1}\n",
                         overrides=["trainer.steps=3", "trainer.batch_size=2", "eval.every_steps=0"])
    control = RunControl(_channel(run, token, network, tmp_path / "commands.json"), poll_seconds=0.0)

    result = train_sft(config, Recorder([]), control=control)

    assert result.step == 3
    checkpoint.refresh_from_db()
    assert checkpoint.state == CommandState.SUCCEEDED and checkpoint.result["step"] == 2, checkpoint.result
    assert network.count("POST", "/ack") == 2 and network.count("POST", "/result") == 1


def test_an_ack_whose_answer_is_lost_is_run_once_after_the_next_ack(team, running_run, network, tmp_path):
    """The control plane took the ack but its answer never came: the command waits for the next poll, whose ack
    (repeated, harmless) says it is this controller's."""
    run, token = running_run
    checkpoint = command_create(actor=team.member, run=run, kind="checkpoint")
    network.lose_answer["/ack"] = 1
    engine = Engine()
    channel = _channel(run, token, network, tmp_path / "c.json")
    assert channel.poll(engine) == 0 and _state(checkpoint) == CommandState.DELIVERED
    assert channel.poll(engine) == 1 and engine.ran == [("checkpoint", {})]
    checkpoint.refresh_from_db()
    assert checkpoint.state == CommandState.SUCCEEDED and checkpoint.delivery_count == 2


def test_a_broken_pull_raises_nothing(team, running_run, network, tmp_path):
    run, token = running_run
    command_create(actor=team.member, run=run, kind="checkpoint")
    network.fail["/commands"] = [httpx.Response(200, text="<html>login</html>"),
                                 httpx.Response(200, json={"not": "a list"}),
                                 httpx.Response(200, json=[{"id": "x"}, 7, {"id": 10**30, "kind": "pause"}]),
                                 httpx.RemoteProtocolError("server disconnected")]
    engine = Engine()
    channel = _channel(run, token, network, tmp_path / "c.json")
    assert [channel.poll(engine) for _ in range(4)] == [0, 0, 0, 0] and engine.ran == []
    assert channel.poll(engine) == 1


# --- at most once, whatever the ledger holds ----------------------------------------------------------------------

class Killed(BaseException):
    """The controller dies while it runs a command (an OOM kill, a SIGKILL): nothing after this line runs."""


def test_a_command_a_killed_controller_was_running_is_not_run_again(team, running_run, network, tmp_path):
    run, token = running_run
    checkpoint = command_create(actor=team.member, run=run, kind="checkpoint")

    def dies(kind: str, payload: dict) -> dict:
        raise Killed

    with pytest.raises(Killed):
        _channel(run, token, network, tmp_path / "c.json").poll(Engine(dies))
    engine = Engine()
    assert _channel(run, token, network, tmp_path / "c.json").poll(engine) == 0
    assert engine.ran == [], "it may have run in part: a second drill or checkpoint is not what was asked"
    checkpoint.refresh_from_db()
    assert checkpoint.state == CommandState.FAILED
    assert "stopped while it was running this command" in checkpoint.result["error"]


@pytest.mark.parametrize("ledger_text", ["", "{\"1", "\x00\x00\x00", "[1, 2]", "{\"x\": {}}", "{\"1\": 5}",
                                         "[" * 100_000],
                         ids=["empty", "cut-short", "zeros", "a-list", "a-bad-key", "a-bad-entry", "too-deep"])
def test_an_unreadable_ledger_runs_no_taken_command_again(team, running_run, network, tmp_path, ledger_text):
    """A ledger lost to a crash (empty, cut short, zeros) or garbled: a command this run's controller already took
    (delivered) may have run, so it is reported failed, not run again; a command nobody took runs; the unreadable
    file is kept beside the new one."""
    run, token = running_run
    taken = command_create(actor=team.member, run=run, kind="checkpoint")
    command_acknowledge(run=run, command_id=taken.pk)
    waiting = command_create(actor=team.member, run=run, kind="pause")
    ledger = tmp_path / "commands.json"
    ledger.write_text(ledger_text)
    engine = Engine()

    assert _channel(run, token, network, ledger).poll(engine) == 1
    assert engine.ran == [("pause", {})]
    taken.refresh_from_db()
    assert taken.state == CommandState.FAILED and "ledger" in taken.result["error"]
    assert _state(waiting) == CommandState.SUCCEEDED
    assert set(_ledger(ledger)) == {str(taken.pk), str(waiting.pk)}
    [kept] = tmp_path.glob("commands.json.unreadable-*")
    assert kept.read_text() == ledger_text


def test_a_ledger_that_cannot_be_written_runs_nothing(team, running_run, network, tmp_path):
    """No room to write down that a command is running (a full disk): it is not run, and waits."""
    run, token = running_run
    command_create(actor=team.member, run=run, kind="checkpoint")
    ledger = tmp_path / "commands.json"
    channel = _channel(run, token, network, ledger)
    ledger.mkdir()  # os.replace onto a folder fails as a full disk would
    engine = Engine()
    assert channel.poll(engine) == 0 and engine.ran == []
    ledger.rmdir()
    assert channel.poll(engine) == 1 and engine.ran == [("checkpoint", {})]


# --- results the control plane cannot take ------------------------------------------------------------------------

@pytest.mark.parametrize(("answer", "stored"), [
    (lambda k, p: {"recovered_s": float("nan"), "at": float("inf")}, {"recovered_s": None, "at": None}),
    (lambda k, p: {"path": Path("/ckpt/step-7")}, {"path": "/ckpt/step-7"}),
    (lambda k, p: {"note": "half a pair \ud800"}, {"note": "half a pair ?"}),
    (lambda k, p: ["not", "an", "object"], {"value": ["not", "an", "object"]}),
    (lambda k, p: {1: "a key that is no text"}, {"1": "a key that is no text"}),
    (lambda k, p: {"huge": 10**400}, None),
    (lambda k, p: {"blob": "x" * 70_000}, None),
], ids=["nan", "path", "surrogate", "list", "int-key", "huge-int", "too-large"])
def test_a_result_the_control_plane_cannot_take_is_reported_once_in_a_form_it_takes(
        team, running_run, network, tmp_path, answer, stored):
    """What a handler returns is made storable; what is still refused (too large) is replaced by why, so the
    command finishes and is not reported again at every poll."""
    run, token = running_run
    checkpoint = command_create(actor=team.member, run=run, kind="checkpoint")
    channel = _channel(run, token, network, tmp_path / "c.json")
    assert channel.poll(Engine(answer)) == 1
    checkpoint.refresh_from_db()
    assert checkpoint.state == CommandState.SUCCEEDED
    if stored is not None:
        assert checkpoint.result == stored
    else:
        assert set(checkpoint.result) == {"result_refused"}, checkpoint.result
    reports = network.count("POST", "/result")
    assert channel.poll(Engine()) == 0 and network.count("POST", "/result") == reports


def test_an_error_no_one_can_print_fails_the_command_with_what_is_known(team, running_run, network, tmp_path):
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    def raises(kind: str, payload: dict) -> dict:
        raise Unprintable

    run, token = running_run
    checkpoint = command_create(actor=team.member, run=run, kind="checkpoint")
    assert _channel(run, token, network, tmp_path / "c.json").poll(Engine(raises)) == 1
    checkpoint.refresh_from_db()
    assert checkpoint.state == CommandState.FAILED and "Unprintable" in checkpoint.result["error"]


def test_a_result_refused_for_a_passing_reason_is_reported_again(team, running_run, network, tmp_path):
    """A 5xx, a 429 or a lost connection on the result: the outcome stays in the ledger and is reported next poll."""
    run, token = running_run
    checkpoint = command_create(actor=team.member, run=run, kind="checkpoint")
    network.fail["/result"] = [httpx.ConnectError("refused"), httpx.Response(503, text="down")]
    engine = Engine()
    channel = _channel(run, token, network, tmp_path / "c.json")
    assert [channel.poll(engine), channel.poll(engine), channel.poll(engine)] == [1, 0, 0]
    assert len(engine.ran) == 1 and _state(checkpoint) == CommandState.SUCCEEDED
    assert network.count("POST", "/result") == 3


def _finished_events(run) -> list[dict]:
    return [e.payload for e in RunEvent.objects.filter(run=run, kind="command_finished").order_by("seq")]


# --- more open commands than one pull answers (100) -----------------------------------------------------------------

def _proxy_refusal() -> httpx.Response:
    return httpx.Response(413, text="<html>413 Request Entity Too Large</html>")


def _given_up(team, run, channel: CommandChannel, network: Network, count: int) -> None:
    """`count` commands run whose results a proxy refuses, the replacement too: the channel gives up reporting them
    (`unreported` in its ledger), and they stay open (delivered) on the control plane."""
    for _ in range(count):
        command_create(actor=team.member, run=run, kind="checkpoint")
    network.fail["/result"] = [_proxy_refusal() for _ in range(2 * count)]
    assert channel.poll(Engine()) == count
    assert all("unreported" in entry for entry in _ledger(channel.ledger).values())
    assert Command.objects.filter(run=run, state=CommandState.DELIVERED).count() == count


def test_commands_given_up_on_do_not_hide_a_newer_one(team, running_run, network, tmp_path):
    """A pull answers at most 100 open commands: with 100 given up on, a newer pause is still pulled and run."""
    run, token = running_run
    channel = _channel(run, token, network, tmp_path / "c.json")
    _given_up(team, run, channel, network, 100)
    pause = command_create(actor=team.member, run=run, kind="pause")
    engine = Engine()
    assert channel.poll(engine) == 1 and engine.ran == [("pause", {})]
    assert _state(pause) == CommandState.SUCCEEDED
    assert channel.poll(engine) == 0 and len(engine.ran) == 1


def test_a_poll_pulls_a_bounded_number_of_pages_and_the_next_goes_on(team, running_run, network, tmp_path,
                                                                     monkeypatch):
    run, token = running_run
    channel = _channel(run, token, network, tmp_path / "c.json")
    _given_up(team, run, channel, network, 100)
    monkeypatch.setattr(command_channel, "MAX_PAGES_PER_POLL", 1)
    pause = command_create(actor=team.member, run=run, kind="pause")
    engine = Engine()
    pulls = network.count("GET", "/commands")
    assert channel.poll(engine) == 0, "the first page holds only commands given up on"
    assert channel.poll(engine) == 1 and engine.ran == [("pause", {})] and _state(pause) == CommandState.SUCCEEDED
    assert channel.poll(engine) == 0, "from the first page again"
    assert network.count("GET", "/commands") == pulls + 3


@pytest.mark.parametrize("pages_per_poll", [None, 1], ids=["default", "one-page-a-poll"])
def test_an_unreadable_ledger_runs_no_taken_command_again_past_the_first_page(team, running_run, network, tmp_path,
                                                                             monkeypatch, pages_per_poll):
    """101 commands the killed controller took (delivered), its ledger lost: every one is failed, none run again
    (the 101st, past the first page, was run once the first 100 had finished)."""
    run, token = running_run
    if pages_per_poll is not None:
        monkeypatch.setattr(command_channel, "MAX_PAGES_PER_POLL", pages_per_poll)
    taken = [command_create(actor=team.member, run=run, kind="checkpoint") for _ in range(101)]
    for command in taken:
        command_acknowledge(run=run, command_id=command.pk)
    ledger = tmp_path / "commands.json"
    ledger.write_text("{\"1")
    engine = Engine()
    channel = _channel(run, token, network, ledger)
    assert [channel.poll(engine) for _ in range(3)] == [0, 0, 0]
    assert engine.ran == []
    assert Command.objects.filter(run=run, state=CommandState.FAILED).count() == 101
