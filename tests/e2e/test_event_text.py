"""Every event on a run page's timeline reads in words (frontend/static/js/event_text.js).

A lost run's story is told through the real code: the reconciler on its attempts (an engine stopped on this host, one
on a host no worker here reaches, then down, one never confirmed stopped), the engine's telemetry client with an item
the control plane refuses, the controller's supervisor over fake hosts, start-up phases and an operator command; each
event's description on the page says its facts, not its JSON. A static check finds every event kind and message name
the code emits (event_append on the platform, the engine's recorder.event and its telemetry client) and fails on one
without a describer; hostile payloads give a description or the JSON, never an exception or "undefined".
"""

from __future__ import annotations

import ast
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import typing
from datetime import timedelta
from pathlib import Path

from django.db import transaction
from django.utils import timezone

from forgeboard.accounts.models import User
from forgeboard.cluster.models import Host, HostLiveness
from forgeboard.runs.models import Run
from forgeboard.runs.reconcile import STOP_TIMEOUT_S, runs_reconcile
from forgeboard.runs.services import command_create, run_launch, run_transition
from forgeboard.runs.states import RunState
from forgeboard.runs.tokens import run_token_issue
from forgeboard.telemetry.models import EventKind, RunEvent
from tests.e2e.conftest import login, outside_the_browser_loop, screenshot
from tests.engine.fake_fleet import FakeHosts, controller_parts, fake_group, grpo_config
from tests.platform.conftest import TINY_GRPO_YAML, Team
from tests.support.processes import REPO_DIR
from workers.engine.command_channel import CommandChannel
from workers.engine.control_plane import ControlPlaneSink, ControlPlaneTarget
from workers.engine.env import RUN_ID_ENV
from workers.engine.metrics import Recorder
from workers.engine.startup import StartupPhases
from workers.engine.telemetry_wire import STEP_TIMELINE, EventKindName
from workers.launch import local
from workers.launch.backends import stop_attempt

EVENT_TEXT_JS = REPO_DIR / "frontend" / "static" / "js" / "event_text.js"
SOURCE_ROOTS = {"forgeboard": REPO_DIR / "platform" / "forgeboard", "workers": REPO_DIR / "workers"}
NOT_ON_THE_TIMELINE = {STEP_TIMELINE}  # stored as the step's timeline (telemetry/ingest.py), not as a run event
NOT_WORDS = re.compile(r"\b(undefined|null|NaN|Infinity)\b|\[object |function ")
HOSTILE_VALUES = [None, "", "12", "x" * 10_000, {"a": {"b": [1, {"c": None}]}}, [1, "two", None], True, 0, -1, 1e308]


def _stop_asked(asks: list[dict], run: Run) -> dict:
    [ask] = [a for a in asks if a["name"] == "runs.stop_attempt" and a["kwargs"]["run_id"] == run.pk]
    asks.clear()
    return ask["kwargs"]


def _engine(run_id: int) -> subprocess.Popen:
    """A sleeping process in a process group of its own with the run's id in its environment, as an engine has."""
    code = "import time\nprint('ready', flush=True)\ntime.sleep(600)"
    engine = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, RUN_ID_ENV: str(run_id)},
                              start_new_session=True, stdout=subprocess.PIPE)
    assert engine.stdout.readline() == b"ready\n"
    threading.Thread(target=engine.wait, daemon=True).start()  # reaped as its supervisor would
    return engine


def _running(run: Run, *, pid: int, host: str) -> None:
    """The run's next attempt launched and running: its engine is `pid` on `host`."""
    run_transition(run_id=run.pk, from_state=RunState.QUEUED, to_state=RunState.LAUNCHING)
    run_transition(run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING, pid=pid, host=host)


def _silent(run: Run) -> None:
    Run.objects.filter(pk=run.pk).update(last_heartbeat_at=timezone.now() - timedelta(seconds=120))


def _report_as_an_engine(*, run: Run, operator: User, url: str, spool: Path) -> None:
    """What an engine's controller sends: its start-up phases, a lost host its supervisor replaces a generator for
    (over fake hosts), a metric the control plane refuses (dropped, and said so), and an operator's command taken."""
    target = ControlPlaneTarget(url=url, run_id=run.pk, token=run_token_issue(run=run))
    sink = ControlPlaneSink(target, spool_dir=spool / "spool", flush_seconds=0.05, max_backoff_s=0.2)
    recorder = Recorder([sink])
    phases = StartupPhases(recorder)
    phases.enter("placing", "placing the actors")
    phases.enter("loading_model", "loading the model")
    phases.ready()

    hosts = FakeHosts(["a", "b", "c"])
    groups = {"generator": fake_group("generator", hosts, ["a", "b"], spares=1, take_weights=3),
              "reward": fake_group("reward", hosts, ["c"])}
    fleet = controller_parts(grpo_config(), hosts, groups, trainer_hosts=["a"], control_host="c")
    fleet.recorder.sinks.append(sink)
    fleet.state.step, fleet.state.policy_version = 4, 3
    fleet.supervisor.warm_spares()
    fleet.supervisor.poll_spares()
    hosts.fail("b")
    fleet.supervisor.scan()
    fleet.supervisor.repair()

    recorder.log("loss", 0.5, step=4)
    recorder.log("bad\x07key", 1.0, step=4)  # a control character: the control plane refuses this point
    assert sink.close(timeout_s=30) is True
    assert sink.dropped == 1

    command_create(actor=operator, run=run, kind="checkpoint")
    channel = CommandChannel(target, ledger=spool / "commands.json")
    assert channel.poll(lambda kind, payload: {"path": "/ckpt/step-4"}) == 1


def _lost_runs_story(*, team: Team, url: str, spool: Path, asks: list[dict]) -> Run:
    """A run of two restarts, lost three times; what its timeline holds then. (Its relaunches are not run.)"""
    with transaction.atomic():
        run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=TINY_GRPO_YAML)
        Run.objects.filter(pk=run.pk).update(max_restarts=2)
    here = socket.gethostname()
    # Attempt 1, its engine on this host, goes silent: lost; its engine is stopped here, and the run restarts.
    engine = _engine(run.pk)
    try:
        _running(run, pid=engine.pid, host=here)
        _silent(run)
        assert runs_reconcile(now=timezone.now()).stopping == [run.pk]
        assert stop_attempt(**_stop_asked(asks, run)).endswith("; restarted")  # what the worker on `here` runs
    finally:
        if engine.poll() is None:
            os.killpg(engine.pid, signal.SIGKILL)
    # Attempt 2, on gpu-node-7, reports, then goes silent: no worker here reaches its engine; then its host is down.
    _running(run, pid=4242, host="gpu-node-7")
    _report_as_an_engine(run=run, operator=team.member, url=url, spool=spool)
    _silent(run)
    assert runs_reconcile(now=timezone.now()).stopping == [run.pk]
    assert stop_attempt(**_stop_asked(asks, run)).startswith("not stopped: the engine runs on gpu-node-7")
    Host.objects.create(hostname="gpu-node-7", liveness=HostLiveness.DOWN)
    assert runs_reconcile(now=timezone.now()).restarted == [run.pk]
    # Attempt 3, on gpu-node-8, is lost out of restarts: the run fails, and its engine is never confirmed stopped.
    _running(run, pid=4343, host="gpu-node-8")
    _silent(run)
    failed_at = timezone.now()
    assert runs_reconcile(now=failed_at).failed == [run.pk]
    late = runs_reconcile(now=failed_at + timedelta(seconds=STOP_TIMEOUT_S))
    assert late.leftover_unconfirmed == [run.pk]
    return run


def _facts(kind: str, p: dict) -> list[str]:
    """What an event's description must say: the facts its payload holds that an operator needs."""
    match p.get("name") if kind == EventKind.MESSAGE else kind:
        case "previous_attempt_stopped":
            return ["previous attempt confirmed stopped", p["detail"]]
        case "previous_attempt_not_stopped":
            return ["previous attempt not confirmed stopped", p["attempt"], p["problem"]]
        case "previous_attempt_not_confirmed":
            return ["previous attempt given up on", p["left"], "stopping it is left to an operator"]
        case "telemetry_dropped":
            return [f"telemetry dropped: 1 metric point of batch {p['seq']} ({p['reasons'][0][:60]}",
                    f"; {p['total']} item dropped so far"]
        case "restarted":
            previous = f"after stopping {p['stopped']}" if "stopped" in p else f"without stopping {p['not_stopped']}"
            return [f"attempt {p['attempt']} queued (restart {p['restart']} of {p['of']}) {previous}"]
        case "state_changed":
            return [f"{p['from'] or '—'} → {p['to']}", *([p["reason"]] if p.get("reason") else [])]
        case "command_issued":
            return [f"command {p['command']}: checkpoint from mateo"]
        case "command_acknowledged":
            return [f"command {p['command']} taken by the run's controller"]
        case "command_finished":
            return [f"command {p['command']} (checkpoint) done"]
        case "startup_phase":
            return ["ready: started in " if p["phase"] == "ready" else f"{p['label']} (at "]
        case "spares_started" | "spare_ready":
            return ["warm spare", f"for {p['role']}", f" on {p['host']}"]
        case "failure_detected":
            return [f"{p['role']} {p['replica']} failed", p["reason"]]
        case "replica_replaced":
            return [f"{p['role']} {p['replica']} replaced by a warm spare on {p['host']}", str(p["policy_version"])]
        case "recovered":
            return [f"recovered {p['role']} {p['replica']} in "]
        case None if kind == EventKind.MESSAGE and "text" in p:
            return [p["text"]]
    raise AssertionError(f"the story has a {kind} event {p} no facts are listed for: add what its description says")


def test_a_lost_runs_timeline_reads_in_words(page, server, team, asks, tmp_path, monkeypatch):
    monkeypatch.setattr(local, "STOP_GRACE_SECONDS", 2.0)
    run = outside_the_browser_loop(_lost_runs_story, team=team, url=server["url"], spool=tmp_path, asks=asks)
    events = list(RunEvent.objects.filter(run=run).order_by("seq").values("seq", "kind", "payload"))
    told = {e["payload"].get("name") if e["kind"] == EventKind.MESSAGE else e["kind"] for e in events}
    assert {"previous_attempt_stopped", "previous_attempt_not_stopped", "previous_attempt_not_confirmed",
            "telemetry_dropped", "restarted", "command_acknowledged", "spares_started", "replica_replaced"} <= told

    login(page, server, "mateo")
    page.goto(f"{server['url']}/runs/{run.pk}/")
    page.wait_for_function("document.getElementById('conn').textContent === 'live'", timeout=30_000)
    page.locator("#timeline-all").check()
    page.wait_for_function(f"document.querySelectorAll('#timeline li').length >= {len(events)}", timeout=15_000)
    shown = {line["seq"]: line["text"] for line in page.eval_on_selector_all(
        "#timeline li", "items => items.map((li) => ({seq: Number(li.dataset.seq), text: li.lastChild.textContent}))")}
    for event in events:
        text = shown[event["seq"]]
        assert not text.startswith(("{", "[")) and not NOT_WORDS.search(text), (event, text)
        for fact in _facts(event["kind"], event["payload"]):
            assert fact in text, (fact, text)
    # A restart reads once: the state change to queued says why, the restarted event after it only what is new.
    restarts = [e for e in events if e["kind"] == EventKind.RESTARTED]
    [stopped_here, host_down] = [e["payload"] for e in restarts]
    assert stopped_here["attempt"] == 2 and re.fullmatch(rf"its engine \(pid \d+ on {re.escape(socket.gethostname())}\)",
                                                          stopped_here["stopped"]), stopped_here
    assert host_down["attempt"] == 3 and host_down["not_stopped"] == "its engine (pid 4242 on gpu-node-7)", host_down
    for restart in restarts:
        why, said = shown[restart["seq"] - 1], shown[restart["seq"]]
        assert why.startswith("lost → queued: restart ") and "no heartbeat for" in why, why
        assert "no heartbeat" not in said and "lost" not in said, said
    page.locator("#timeline").evaluate("list => { list.style.maxHeight = 'none'; }")  # the whole list in the picture
    page.locator("#timeline").scroll_into_view_if_needed()
    screenshot(page, "run_page_timeline_lost_run_in_words")


# --- every event the code emits has a describer ----------------------------------------------------------------


def _module_path(module: str) -> Path | None:
    root, _, rest = module.partition(".")
    if root not in SOURCE_ROOTS:
        return None
    path = SOURCE_ROOTS[root].joinpath(*rest.split(".")) if rest else SOURCE_ROOTS[root]
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"


class _Source:
    """One module's syntax tree, and the text constants its names stand for (its own, or imported)."""

    def __init__(self, path: Path):
        self.path, self.tree = path, ast.parse(path.read_text(), filename=str(path))

    def where(self, node: ast.AST) -> str:
        return f"{self.path.relative_to(REPO_DIR)}:{node.lineno}"

    def text(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if not isinstance(node, ast.Name):
            return None
        for statement in self.tree.body:
            if isinstance(statement, ast.Assign) and [getattr(t, "id", None) for t in statement.targets] == [node.id]:
                return self.text(statement.value)
            if isinstance(statement, ast.ImportFrom) and any(a.name == node.id and not a.asname for a in statement.names):
                path = _module_path(statement.module or "")
                return _Source(path).text(node) if path and path.is_file() else None
        return None

    def payload(self, node: ast.AST, *, before: int) -> ast.Dict | None:
        """The dict literal an event's payload is: written there, or the last one assigned to its name before."""
        if isinstance(node, ast.Dict) or not isinstance(node, ast.Name):
            return node if isinstance(node, ast.Dict) else None
        assigned = [n.value for n in ast.walk(self.tree) if isinstance(n, ast.Assign) and n.lineno < before
                    and [getattr(t, "id", None) for t in n.targets] == [node.id] and isinstance(n.value, ast.Dict)]
        return max(assigned, key=lambda d: d.lineno, default=None)


def _entry(node: ast.Dict, key: str) -> ast.AST | None:
    return next((v for k, v in zip(node.keys, node.values, strict=True)
                 if isinstance(k, ast.Constant) and k.value == key), None)


def _emitted() -> tuple[dict[str, list[str]], dict[str, list[str]], list[str]]:
    """The event kinds and message names the code emits, each with where; and the emitters whose kind or name this
    cannot read (a name computed at run time), which the test refuses: each must be one a describer can know."""
    kinds: dict[str, list[str]] = {}
    names: dict[str, list[str]] = {}
    unread: list[str] = []

    def message(source: _Source, node: ast.AST, payload: ast.AST | None) -> None:
        name_node = _entry(payload, "name") if isinstance(payload, ast.Dict) else None
        name = source.text(name_node) if name_node is not None else None
        if name is None:
            unread.append(f"{source.where(node)}: a message whose name is not a constant")
        else:
            names.setdefault(name, []).append(source.where(node))

    for root in SOURCE_ROOTS.values():
        for path in sorted(root.rglob("*.py")):
            if "migrations" in path.parts:
                continue
            source = _Source(path)
            for node in ast.walk(source.tree):
                if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "event_append":
                    arguments = {k.arg: k.value for k in node.keywords}
                    kind_node = arguments.get("kind")
                    kind = (EventKind[kind_node.attr].value if isinstance(kind_node, ast.Attribute)
                            and getattr(kind_node.value, "id", "") == "EventKind" else source.text(kind_node))
                    if kind is None:
                        unread.append(f"{source.where(node)}: event_append of a kind that is not a constant")
                        continue
                    kinds.setdefault(kind, []).append(source.where(node))
                    if kind == EventKind.MESSAGE:
                        message(source, node, source.payload(arguments.get("payload"), before=node.lineno))
                elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "event" and node.args:
                    name = source.text(node.args[0])  # the engine's recorder.event(name, ...): see record_to_wire
                    if name is None:
                        unread.append(f"{source.where(node)}: recorder.event of a name that is not a constant")
                    elif name == "message" or name in typing.get_args(EventKindName):
                        kinds.setdefault(name, []).append(source.where(node))
                    else:
                        kinds.setdefault("message", []).append(source.where(node))
                        names.setdefault(name, []).append(source.where(node))
                elif isinstance(node, ast.Dict) and source.text(_entry(node, "kind") or ast.Pass()) == "message" \
                        and _entry(node, "payload") is not None:  # a wire event built by hand (the telemetry client)
                    payload = next((d for d in ast.walk(_entry(node, "payload")) if isinstance(d, ast.Dict)), None)
                    message(source, node, payload)
    return kinds, names, unread


def _described(page) -> dict[str, list[str]]:
    page.add_script_tag(path=str(EVENT_TEXT_JS))
    return page.evaluate("({kinds: FBEventText.kinds, names: FBEventText.messageNames})")


def test_every_event_kind_and_message_name_the_code_emits_has_a_describer(page):
    kinds, names, unread = _emitted()
    assert not unread, unread
    assert {"previous_attempt_stopped", "previous_attempt_not_stopped", "previous_attempt_not_confirmed",
            "telemetry_dropped", "job_status", "job_submitted", "checkpoint_export", "startup_phase",
            "spares_started"} <= set(names), "the source is read: these are known to be emitted"
    assert {"state_changed", "command_acknowledged", "restarted", "failure_detected", "message"} <= set(kinds)
    described = _described(page)
    possible = set(EventKind.values) | set(typing.get_args(EventKindName))  # what can be stored, whoever sends it
    missing = {kind: kinds.get(kind, ["a kind the control plane stores"])
               for kind in (set(kinds) | possible) - NOT_ON_THE_TIMELINE if kind not in described["kinds"]}
    assert not missing, f"event kinds with no describer in event_text.js: {missing}"
    missing = {name: where for name, where in names.items() if name not in described["names"]}
    assert not missing, f"message names with no describer in event_text.js: {missing}"


# --- hostile payloads ----------------------------------------------------------------------------------------------

HOSTILE_CHECK = """({kinds, names, fields, hostile, notWordsPattern}) => {
  const cut = (payload) => { const json = JSON.stringify(payload) || ""; return json.length > 160 ? json.slice(0, 157) + "…" : json; };
  const notWords = new RegExp(notWordsPattern);
  const payloads = (name) => {
    const named = (p) => (name === null ? p : {...p, name});
    const plausible = Object.fromEntries(fields.map((f) => [f, "3"]));
    const all = [named({}), named(plausible), "text", 7, null, [1, 2]];
    for (const h of hostile) {
      all.push(named(Object.fromEntries(fields.map((f) => [f, h]))));
      for (const f of fields) all.push(named({...plausible, [f]: h}));
    }
    for (const f of fields) { const p = named({...plausible}); delete p[f]; all.push(p); }
    return all;
  };
  const cases = [...kinds.map((kind) => [kind, null]), ...names.map((name) => ["message", name]), ["no_such_kind", null]];
  const bad = [];
  let count = 0;
  for (const [kind, name] of cases) {
    for (const payload of payloads(name)) {
      count += 1;
      let said;
      try { said = FBEventText.describe({kind, payload}); } catch (error) { bad.push([kind, name, payload, "threw " + error]); continue; }
      const json = said === cut(payload) || said === cut(payload || {});
      if (typeof said !== "string" || !said || (!json && (/^[{\\[]/.test(said) || notWords.test(said) || said.length > 600)))
        bad.push([kind, name, JSON.stringify(payload).slice(0, 300), said && said.slice(0, 300)]);
    }
  }
  return {count, bad: bad.slice(0, 20), badCount: bad.length};
}"""


def test_hostile_payloads_read_as_words_or_as_their_json_never_as_an_exception_or_undefined(page):
    described = _described(page)
    fields = sorted(set(re.findall(r"\bp\.([A-Za-z_]\w*)", EVENT_TEXT_JS.read_text())) | {"error", "reason"})
    assert {"detail", "attempt", "problem", "left", "by_section", "reasons", "total"} <= set(fields)
    result = page.evaluate(HOSTILE_CHECK, {"kinds": described["kinds"], "names": described["names"], "fields": fields,
                                           "hostile": HOSTILE_VALUES, "notWordsPattern": NOT_WORDS.pattern})
    assert result["count"] > 10_000 and result["badCount"] == 0, result

    describe = "([kind, payload]) => FBEventText.describe({kind, payload})"
    numbers_as_text = {"name": "telemetry_dropped", "items": "3", "seq": "7", "total": "12", "reasons": ["refused"]}
    assert page.evaluate(describe, ["message", numbers_as_text]) == \
        "telemetry dropped: 3 items of batch 7 (refused); 12 items dropped so far"
    assert page.evaluate(describe, ["eval", {"accuracy": 0.5}]) == "evaluation: accuracy 0.5"
    assert page.evaluate(describe, ["eval", {"step": 40, "accuracy": 0.40625, "reward_mean": 0.6566666666666666}]) == \
        "evaluation at step 40: accuracy 0.4063, reward_mean 0.6567"
    long = page.evaluate(describe, ["message", {"name": "previous_attempt_stopped", "detail": "x" * 10_000}])
    assert long.startswith("previous attempt confirmed stopped: xxx") and long.endswith("…") and len(long) < 300
    nested = {"name": "previous_attempt_not_stopped", "attempt": {"job": 12}, "problem": "scancel failed"}
    assert page.evaluate(describe, ["message", nested]).startswith('{"name":"previous_attempt_not_stopped"')
    assert page.evaluate("FBEventText.describe(null)") == "null"


def test_a_redirect_and_a_failure_say_what_moved_and_where(page):
    """The operator's drain (controller/operator.py) says which replicas or ranks move and where they went; a
    failure says the host its payload names."""
    _described(page)  # the page with event_text.js
    describe = "([kind, payload]) => FBEventText.describe({kind, payload})"
    started = {"action": "drain", "host": "gpu-b", "replicas": [0, 2]}
    assert page.evaluate(describe, ["redirect_started", started]) == \
        "drain host gpu-b: moving generator replica 0, generator replica 2"
    trainer = {"action": "drain", "host": "gpu-a", "replicas": [], "trainer_ranks": [1], "moves_at": "the next checkpoint"}
    assert page.evaluate(describe, ["redirect_started", trainer]) == \
        "drain host gpu-a: moving trainer rank 1 at the next checkpoint"
    finished = {"action": "drain", "host": "gpu-b", "moved": {"0": "gpu-c", "2": "gpu-d"}, "plan": {}, "seconds": 3.21}
    assert page.evaluate(describe, ["redirect_finished", finished]) == \
        "drain host gpu-b done in 3.2 s: generator replica 0 → gpu-c, generator replica 2 → gpu-d"
    assert page.evaluate(describe, ["redirect_finished", {"action": "undrain", "host": "gpu-b", "moved": {}}]) == \
        "undrain host gpu-b done"
    moved_in_recovery = {"action": "drain", "host": "gpu-a", "moved": {}, "plan": {}, "seconds": 2.14,
                         "moved_roles": {"trainer": {"0": "gpu-b"}}, "in_recovery": True}
    assert page.evaluate(describe, ["redirect_finished", moved_in_recovery]) == \
        "drain host gpu-a done in 2.1 s as the trainer recovered"
    assert page.evaluate(describe, ["redirect_finished", {**moved_in_recovery, "in_recovery": False}]) == \
        "drain host gpu-a done in 2.1 s"
    failed = {"role": "generator", "replica": 1, "host": "gpu-b", "reason": "killed", "time_to_detect_s": 0.25}
    assert page.evaluate(describe, ["failure_detected", failed]) == \
        "generator 1 failed on gpu-b (detected in 0.25 s): killed"


def test_a_kubernetes_submission_says_where_the_runs_checkpoints_are(page):
    """workers/launch/kubernetes_backend.py: without a run volume claim a restart starts from step 0, and says so."""
    _described(page)
    describe = "([kind, payload]) => FBEventText.describe({kind, payload})"
    submitted = {"name": "job_submitted", "backend": "kubernetes", "job_id": "forgeboard-run-7", "namespace": "research",
                 "checkpoints": "its checkpoints are in the pod's emptyDir: a restart starts from step 0 "
                                "(set FORGEBOARD_K8S_RUN_VOLUME_CLAIM)"}
    assert page.evaluate(describe, ["message", submitted]) == (
        "submitted as kubernetes job forgeboard-run-7; its checkpoints are in the pod's emptyDir: a restart starts "
        "from step 0 (set FORGEBOARD_K8S_RUN_VOLUME_CLAIM)")
    assert page.evaluate(describe, ["message", {"name": "job_submitted", "backend": "slurm", "job_id": "18004"}]) == \
        "submitted as slurm job 18004"


def test_a_restart_says_the_attempt_it_queues_and_what_it_stopped_not_why(page):
    """runs/reconcile.py: the reason a run restarts is its state change's (lost → queued), said once; a restart from
    before that (its payload has the reason as `after`) reads as its count only."""
    _described(page)
    describe = "([kind, payload]) => FBEventText.describe({kind, payload})"
    stopped = {"restart": 1, "of": 2, "attempt": 2, "stopped": "SLURM job 18004"}
    assert page.evaluate(describe, ["restarted", stopped]) == "attempt 2 queued (restart 1 of 2) after stopping SLURM job 18004"
    host_down = {"restart": 2, "of": 2, "attempt": 3, "not_stopped": "its engine (pid 4242 on gpu-node-7)"}
    assert page.evaluate(describe, ["restarted", host_down]) == \
        "attempt 3 queued (restart 2 of 2) without stopping its engine (pid 4242 on gpu-node-7)"
    nothing_left = {"restart": 1, "of": 3, "attempt": 2}
    assert page.evaluate(describe, ["restarted", nothing_left]) == "attempt 2 queued (restart 1 of 3)"
    older = {"restart": 1, "of": 2, "after": "no heartbeat for 75 s (timeout 60 s)"}
    assert page.evaluate(describe, ["restarted", older]) == "restart 1 of 2"


def test_a_resume_says_the_optimizer_settings_it_took_from_the_checkpoint_over_the_config(page):
    """workers/engine/startup.py's record_resumed: a resumed run goes on with its checkpoint's optimizer settings;
    the ones its config gave otherwise are in the `resumed` event, said in words."""
    _described(page)
    describe = "([kind, payload]) => FBEventText.describe({kind, payload})"
    resumed = {"name": "resumed", "step": 2, "path": "/ckpt/step_000002", "policy_version": 2,
               "optimizer_from_checkpoint": [{"setting": "lr", "checkpoint": 1e-05, "config": 2e-05},
                                             {"setting": "betas", "checkpoint": [0.9, 0.95], "config": [0.8, 0.99]},
                                             {"setting": "weight_decay", "checkpoint": 0.0, "config": 0.1}]}
    assert page.evaluate(describe, ["message", resumed]) == (
        "resumed from /ckpt/step_000002 at step 2, policy version 2; the checkpoint's optimizer settings: lr 0.00001 "
        "(the config says 0.00002), betas [0.9, 0.95] (the config says [0.8, 0.99]), weight_decay 0 (the config says 0.1)")
    assert page.evaluate(describe, ["message", {**resumed, "optimizer_from_checkpoint": []}]) == \
        "resumed from /ckpt/step_000002 at step 2, policy version 2"
