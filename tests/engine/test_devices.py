"""The GPU ledger of a run's hosts, and a proc's binding to its GPUs (one process, no Monarch)."""

from __future__ import annotations

import os

import pytest

from workers.engine.actors.devices import DeviceLedger, NoRoomForGpus, bind_proc_gpus, gpus_per_host_from_env
from workers.engine.env import GPUS_PER_HOST_ENV, PROC_GPUS_ENV


def test_procs_take_the_lowest_free_gpus_of_their_host_until_released() -> None:
    ledger = DeviceLedger(gpus_per_host=4)
    assert ledger.take(host="a", owner="trainer", procs=2, gpus_per_proc=1) == [[0], [1]]
    assert ledger.take(host="b", owner="trainer", procs=2, gpus_per_proc=1) == [[0], [1]]  # each host its own
    assert ledger.take(host="a", owner="generator_0_1", procs=1, gpus_per_proc=1) == [[2]]
    assert (ledger.free("a"), ledger.free("b")) == (1, 2)
    ledger.release("trainer")
    assert (ledger.free("a"), ledger.free("b")) == (3, 4)
    assert ledger.take(host="a", owner="generator_1_2", procs=1, gpus_per_proc=2) == [[0, 1]]
    assert ledger.holdings() == {"generator_0_1": {"a": [2]}, "generator_1_2": {"a": [0, 1]}}


def test_a_host_without_room_names_who_holds_its_gpus() -> None:
    ledger = DeviceLedger(gpus_per_host=2)
    ledger.take(host="a", owner="trainer", procs=2, gpus_per_proc=1)
    with pytest.raises(NoRoomForGpus, match=r"generator_0_1 needs 1 GPU\(s\) on host a, which has 2 and 0 free "
                                            r"\(held by trainer: 0,1\)"):
        ledger.take(host="a", owner="generator_0_1", procs=1, gpus_per_proc=1)
    assert ledger.holdings() == {"trainer": {"a": [0, 1]}}  # the refused take holds nothing
    with pytest.raises(ValueError, match="already holds"):
        ledger.take(host="a", owner="trainer", procs=1, gpus_per_proc=0)


def test_without_a_known_count_indices_are_handed_out_without_a_ceiling() -> None:
    ledger = DeviceLedger()
    assert ledger.free("a") is None
    assert ledger.take(host="a", owner="x", procs=3, gpus_per_proc=1) == [[0], [1], [2]]
    assert ledger.take(host="a", owner="y", procs=1, gpus_per_proc=1) == [[3]]
    ledger.release("x")
    assert ledger.take(host="a", owner="z", procs=2, gpus_per_proc=1) == [[0], [1]]


def test_gpus_per_host_comes_from_the_environment() -> None:
    assert gpus_per_host_from_env({}) is None
    assert gpus_per_host_from_env({GPUS_PER_HOST_ENV: "8"}) == 8
    with pytest.raises(ValueError, match="FORGEBOARD_GPUS_PER_HOST: expected a number of GPUs, got 'eight'"):
        gpus_per_host_from_env({GPUS_PER_HOST_ENV: "eight"})


def test_a_proc_given_a_gpu_cuda_does_not_show_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.delenv(PROC_GPUS_ENV, raising=False)
    assert bind_proc_gpus() is None  # given none: CUDA is left as it is
    monkeypatch.setenv(PROC_GPUS_ENV, "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a host with fewer GPUs than the plan, or none
    with pytest.raises(RuntimeError, match="given GPU 3 of its host .* but CUDA shows it 0"):
        bind_proc_gpus()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"  # CUDA would have shown the proc its own GPU only


def test_a_host_count_given_as_a_callable_is_asked_once_and_only_when_needed() -> None:
    asked = []
    ledger = DeviceLedger(gpus_per_host=lambda: asked.append(1) or 2)
    assert asked == []  # a run without GPU roles never counts them (no CUDA in the controller)
    assert ledger.take(host="a", owner="x", procs=2, gpus_per_proc=1) == [[0], [1]]
    assert ledger.free("a") == 0 and ledger.free("b") == 2 and asked == [1]
