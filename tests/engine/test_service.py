"""Routing of requests over service replicas (pure Python, no monarch)."""

from __future__ import annotations

import pytest

from workers.engine.actors.service import NoReplica, Service


def test_round_robin_cycles() -> None:
    service = Service(["a", "b", "c"], routing="round_robin")
    picked = [service.submit(lambda r: r)[1] for _ in range(5)]
    assert picked == ["a", "b", "c", "a", "b"]
    assert service.served == [2, 2, 1]


def test_least_loaded_prefers_idle_replicas() -> None:
    service = Service(["a", "b", "c"], routing="least_loaded")
    first, _ = service.submit(lambda r: r)
    second, _ = service.submit(lambda r: r)
    assert (first, second) == (0, 1)
    service.done(first)  # a is idle again, b still busy
    assert service.submit(lambda r: r)[1] == "a"
    assert service.submit(lambda r: r)[1] == "c"
    assert service.in_flight == [1, 1, 1]


def test_sticky_keeps_a_key_on_one_replica() -> None:
    service = Service(["a", "b", "c", "d"], routing="sticky")
    homes = {key: service.submit(lambda r: r, key=key)[1] for key in ("1+2=", "3+4=", "5+6=", "7+8=", "9+9=")}
    assert all(service.submit(lambda r: r, key=key)[1] == home for key, home in homes.items())
    assert len(set(homes.values())) > 1
    with pytest.raises(ValueError, match="key"):
        service.submit(lambda r: r)


def test_least_loaded_routes_away_from_a_slow_replica_and_probes_it_again() -> None:
    service = Service(["a", "b"], routing="least_loaded", probe_after=3)
    for index, seconds in ((0, 1.0), (1, 0.1)):
        service.in_flight[index] += 1
        service.done(index, seconds)
    picked = [service.submit(lambda r: r)[1] for _ in range(4)]
    # b is 10x faster: it takes requests until a has been passed over probe_after times
    assert picked == ["b", "b", "b", "a"]


def test_unavailable_replicas_get_no_requests_until_replaced() -> None:
    service = Service(["a", "b"], routing="round_robin")
    service.set_available(0, False)
    assert [service.submit(lambda r: r)[1] for _ in range(3)] == ["b", "b", "b"]
    service.replace(0, "a2")
    assert {service.submit(lambda r: r)[1] for _ in range(2)} == {"a2", "b"}
    assert service.add("c") == 2 and service.served[2] == 0
    for index in range(3):
        service.set_available(index, False)
    with pytest.raises(NoReplica):
        service.pick()


def test_typical_seconds_is_the_median_over_routable_replicas() -> None:
    service = Service(["a", "b", "c", "d"], routing="least_loaded")
    assert service.typical_seconds() is None
    for index, seconds in enumerate([0.2, 0.4, 9.0]):  # replica 3 has not answered yet
        service.in_flight[index] = 1
        service.done(index, seconds)
    assert service.typical_seconds() == 0.4
    service.set_available(1, False)
    assert service.typical_seconds() == 9.0, "the upper median of the routable replicas' 0.2 and 9.0"
