"""Hosts of a multi-host run: FORGEBOARD_MONARCH_WORKERS, unknown host names, `placement.local_hosts`."""

from __future__ import annotations

import socket

import pytest

from workers.engine.actors.hosts import (LOCAL, Hosts, HostsUnreachable, WorkerListError, check_placement, parse_workers,
                                         reachable, workers_from_env)
from workers.engine.actors.worker import Worker
from workers.engine.config import ConfigError, load_config

BASE = "recipe: grpo\nmodel: {path: /models/tiny}\n"


def test_bare_and_named_entries() -> None:
    workers = parse_workers(" tcp://node-a:26600 , gpu1=tcp://10.0.0.7:26600,,tcp://[::1]:9 ")
    assert workers == [Worker("node-a", "tcp://node-a:26600", "node-a", 26600),
                       Worker("gpu1", "tcp://10.0.0.7:26600", "10.0.0.7", 26600),
                       Worker("::1", "tcp://[::1]:9", "::1", 9)]


def test_bare_entries_on_one_machine_are_named_by_host_and_port() -> None:
    workers = parse_workers("tcp://127.0.0.1:5001,tcp://127.0.0.1:5002,tcp://other:5001")
    assert [w.name for w in workers] == ["127.0.0.1:5001", "127.0.0.1:5002", "other"]


def test_empty_or_unset_means_no_workers() -> None:
    assert parse_workers("") == [] and parse_workers(" , ") == []
    assert workers_from_env({}) == []
    assert [w.name for w in workers_from_env({"FORGEBOARD_MONARCH_WORKERS": "a=tcp://h:1"})] == ["a"]


@pytest.mark.parametrize(("text", "problem"), [
    ("node-a:26600", "'node-a:26600' is neither tcp://host:port nor name=tcp://host:port"),
    ("tcp://node-a", "is neither"),
    ("tcp://node-a:70000", "is neither"),
    ("udp://node-a:1", "is neither"),
    ("a b=tcp://h:1", "'a b' in 'a b=tcp://h:1' is not a host name"),
    ("=tcp://h:1", "'' in '=tcp://h:1' is not a host name"),
    ("a=tcp://h:1,a=tcp://g:1", "host name 'a' appears more than once"),
    ("tcp://h:1,h=tcp://g:1", "host name 'h' appears more than once"),
    ("a=tcp://h:1,b=tcp://h:1", "address 'tcp://h:1' appears more than once"),
])
def test_bad_worker_lists_name_the_entry(text: str, problem: str) -> None:
    with pytest.raises(WorkerListError, match="FORGEBOARD_MONARCH_WORKERS") as caught:
        parse_workers(text)
    assert problem in str(caught.value)


def test_a_placement_host_that_is_not_a_worker_is_a_field_error() -> None:
    config = load_config(BASE, overrides=["placement.backend=monarch", "placement.generator.hosts=[a, b]",
                                          "placement.trainer.hosts=[b]"])
    workers = parse_workers("a=tcp://h:1,b=tcp://h:2")
    check_placement(config.placement, workers=workers)  # no error for a and b
    config = load_config(BASE, overrides=["placement.backend=monarch", "placement.generator.hosts=[a, gpu9]"])
    with pytest.raises(ConfigError) as caught:
        check_placement(config.placement, workers=workers)
    assert [(e.field, e.message) for e in caught.value.errors] == [
        ("placement.generator.hosts", "unknown host 'gpu9'; hosts: a, b")]
    check_placement(config.placement, workers=[])  # without workers a host name labels local procs


def test_local_hosts_field() -> None:
    config = load_config(BASE, overrides=["placement.backend=monarch", "placement.local_hosts=2",
                                          "placement.generator.hosts=[host0, host1]"])
    assert config.placement.local_hosts == 2
    with pytest.raises(ConfigError) as caught:
        load_config(BASE, overrides=["placement.local_hosts=2"])
    assert [e.field for e in caught.value.errors] == ["placement.local_hosts"]
    with pytest.raises(ConfigError) as caught:
        load_config(BASE, overrides=["placement.backend=monarch", "placement.local_hosts=2",
                                     "placement.reward.hosts=[host2]"])
    assert [(e.field, e.message) for e in caught.value.errors] == [
        ("placement.reward.hosts", "unknown host 'host2'; hosts: host0, host1")]
    with pytest.raises(ConfigError) as caught:
        load_config(BASE, overrides=["placement.backend=monarch", "placement.local_hosts=9"])
    assert [e.field for e in caught.value.errors] == ["placement.local_hosts"]


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_unreachable_workers_are_named_before_attaching() -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        up = Worker("up", f"tcp://127.0.0.1:{listening.getsockname()[1]}", "127.0.0.1", listening.getsockname()[1])
        port = _closed_port()
        down = Worker("down", f"tcp://127.0.0.1:{port}", "127.0.0.1", port)
        assert reachable(up) and not reachable(down)
        with pytest.raises(HostsUnreachable) as caught:
            Hosts.attach(workers=[up, down], timeout_s=5)
    assert str(caught.value) == (f"Monarch workers not accepting connections: down (tcp://127.0.0.1:{port}) "
                                 "(from FORGEBOARD_MONARCH_WORKERS)")


def test_a_lost_host_is_reported_once() -> None:
    port = _closed_port()
    hosts = Hosts(workers=[Worker("gone", f"tcp://127.0.0.1:{port}", "127.0.0.1", port)])
    assert hosts.check(now=True) == ["gone"] and hosts.lost == {"gone"}
    assert hosts.check(now=True) == [] and hosts.alive(["gone"]) == []
    with pytest.raises(HostsUnreachable, match="host gone"):
        hosts.spawn_procs(host="gone", count=1, threads=1)
    with pytest.raises(HostsUnreachable, match=f"^host gone \\(tcp://127.0.0.1:{port}\\) is lost$"):
        hosts.signals("gone")  # a drill there is refused with this reason; nothing is spawned on it
    hosts._signals["gone"] = object()  # an agent started there before the host was lost went with it
    with pytest.raises(HostsUnreachable, match="is lost"):
        hosts.signals("gone")
    asked: list[str] = []
    hosts.signals = asked.append  # type: ignore[method-assign]
    hosts.kill("gone", [4242])
    assert asked == [], "nothing to kill on a lost host, and nothing asked of it"


def test_without_workers_every_name_is_this_machine() -> None:
    hosts = Hosts()
    assert hosts.names == [LOCAL] and hosts.pids_visible("anything") and hosts.check(now=True) == []
    remote = Hosts(workers=parse_workers("a=tcp://10.1.2.3:1,b=tcp://localhost:2"))
    assert not remote.pids_visible("a") and remote.pids_visible("b")


def test_hosts_that_are_not_neighbours_and_cannot_be_attached_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Procs over host0 and host2 need a mesh of their own (a slice takes neighbours only): when its attach fails,
    the error names the worker that did not answer, not only Monarch's timeout."""
    import monarch.actor

    from workers.engine.actors import hosts as hosts_module

    class NeverAttached:
        class initialized:  # noqa: N801 - Monarch's attribute
            @staticmethod
            def get(timeout: float) -> None:
                raise TimeoutError(f"not initialized within {timeout} s")

    attached: list[list[str]] = []
    monkeypatch.setattr(monarch.actor, "attach_to_workers",
                        lambda *, ca, workers, name: attached.append(workers) or NeverAttached())
    monkeypatch.setattr(hosts_module, "SPAWN_TIMEOUT_S", 0.5)
    with socket.socket() as first, socket.socket() as second:
        for listening in (first, second):
            listening.bind(("127.0.0.1", 0))
            listening.listen()
        up0, up1, down = first.getsockname()[1], second.getsockname()[1], _closed_port()
        hosts = Hosts(workers=parse_workers(f"host0=tcp://127.0.0.1:{up0},host1=tcp://127.0.0.1:{up1},"
                                            f"host2=tcp://127.0.0.1:{down}"))
        with pytest.raises(HostsUnreachable) as caught:
            hosts._host_mesh(["host0", "host2"])
        assert attached == [[f"tcp://127.0.0.1:{up0}", f"tcp://127.0.0.1:{down}"]]
        assert str(caught.value) == ("Monarch workers not attached within 0.5 s: "
                                     f"host2 (tcp://127.0.0.1:{down}) (from the run's hosts)")
        with socket.socket() as third:  # every worker answers, the attach still fails: Monarch's reason
            third.bind(("127.0.0.1", down))
            third.listen()
            with pytest.raises(HostsUnreachable, match="could not attach to Monarch workers host0 .* not initialized"):
                hosts._host_mesh(["host0", "host2"])
