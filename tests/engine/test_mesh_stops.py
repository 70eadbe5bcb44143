"""The stopping of proc meshes (actors/mesh_stops.py), with real processes to signal."""

from __future__ import annotations

from typing import Any

from tests.engine.fake_fleet import FakeMesh
from workers.engine.actors.calls import exited
from workers.engine.actors.mesh_stops import MeshStops


class RefusingMesh:
    def stop(self) -> Any:
        raise RuntimeError("the mesh is damaged")


class StopFails(RefusingMesh):
    def stop(self) -> Any:
        return self

    def get(self, timeout: float | None = None) -> None:
        raise TimeoutError("the mesh did not stop in time")


def test_mesh_stops_signal_the_given_pids_then_wait_for_every_stop_started() -> None:
    import subprocess

    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    ended = subprocess.Popen(["true"])
    ended.wait()
    meshes = [FakeMesh(), FakeMesh(), FakeMesh()]
    stops = MeshStops()
    stops.add(meshes[0], pids=[procs[0].pid])
    stops.add(meshes[1], pids=[procs[1].pid, ended.pid])  # a pid that is gone already is passed over
    stops.add(meshes[2])
    stops.add(RefusingMesh())  # a damaged mesh that refuses to stop is passed over
    stops.add(StopFails())  # and so is one whose stop fails while waited for
    assert all(mesh.stopped for mesh in meshes)  # started at add, before any wait
    assert [p.wait(timeout=5) for p in procs] == [-15, -15]  # SIGTERM
    assert all(exited(p.pid) for p in procs)
    stops.wait()
    assert stops.stopping == []
