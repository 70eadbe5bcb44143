"""Supervision and failover of a Monarch GRPO run's replicas: what failed (Monarch's failure reports, hosts that stop
accepting connections, procs gone from /proc), where a replacement goes, and warm spares. The detection and
replacement bookkeeping of one replica is `actors.failover.Failover`'s; the trainer's and the control proc's failures
end in a restore (`recovery.py`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from workers.engine.actors.calls import CallFailed, exited, refusal_ends_run
from workers.engine.actors.failover import Failover
from workers.engine.actors.hosts import Hosts, HostsUnreachable
from workers.engine.actors.replica_group import Replica, ReplicaGroup
from workers.engine.controller.control_procs import ControlLost, ControlProcs
from workers.engine.controller.placement import Placer
from workers.engine.controller.state import RunState
from workers.engine.controller.trainer import TrainerHandle
from workers.engine.controller.waits import Waits
from workers.engine.fields import ConfigError
from workers.engine.metrics import Recorder

HOST_SETTLE_S = 2.0  # a killed worker's port can accept connections a moment longer than its procs live


class Supervisor:
    def __init__(self, *, recorder: Recorder, hosts: Hosts, groups: Mapping[str, ReplicaGroup], failover: Failover,
                 placer: Placer, trainer: TrainerHandle, control: ControlProcs | None, waits: Waits, state: RunState,
                 reports: list[Any]):
        self.recorder, self.hosts, self.groups, self.failover = recorder, hosts, groups, failover
        self.placer, self.trainer, self.waits, self.state = placer, trainer, waits, state
        self.control = control  # None: the run has no control proc (SFT keeps its data in the controller)
        self.reports = reports  # Monarch's failure reports (monarch.actor.unhandled_fault_hook), not yet read
        self.unexplained: list[str] = []  # reports no replica explains
        # what a new replica needs before it serves, per role
        self.prepare_new: dict[str, Callable[[Replica], int]] = {"generator": self.prepare_generator}

    def tick(self) -> None:
        """While waiting: notice dead replicas and loaded spares."""
        self.scan()
        self.poll_spares()

    # --- detection ----------------------------------------------------------------------
    def scan(self) -> None:
        self.check_hosts()
        while self.reports:
            report = self.reports.pop(0)
            name = str(getattr(report, "mesh_name", ""))
            for group in self.groups.values():
                replica = group.find(name)
                if replica is not None and replica in group.spare_replicas():
                    group.drop_spare(replica)
                    self.recorder.event("message", step=self.state.step,
                                        text=f"a {group.role} spare failed; another is started: {str(report)[:200]}")
                    break
                if replica is not None:
                    current = group.replicas[replica.index] is replica and replica not in group.retiring
                    if current and not replica.failed:
                        self.failover.detect(group, replica, str(report), hung=False,
                                             request_failed=replica.outstanding > 0)
                    break
            else:
                if self.trainer.owns(name):  # noticed now; restored once the controller next needs the trainer
                    self.trainer.report_failed(str(report))
                elif not name.startswith(("logger", "trainer")):  # a stopped trainer mesh's late reports: its own
                    self.unexplained.append(str(report)[:500])
        for group in self.groups.values():  # local procs: a killed one shows in /proc before Monarch reports it
            for spare in group.ready_spares:
                if spare.pids_visible and any(exited(pid) for pid in spare.pids):
                    group.drop_spare(spare)
            for replica in group.live():
                gone = [pid for pid in replica.pids if replica.pids_visible and exited(pid)]
                if gone and not replica.failed:
                    self.failover.detect(group, replica, f"process {gone[0]} exited", hung=False,
                                         request_failed=replica.outstanding > 0)

    def check_hosts(self, *, now: bool = False) -> None:
        for name in self.hosts.check(now=now):
            self.host_lost(name)

    def host_lost(self, name: str) -> None:
        """Every proc on the host is gone: detect its replicas (their replacements go elsewhere)."""
        reason = f"host {self.hosts.describe(name)} is unreachable"
        self.recorder.event("message", step=self.state.step, text=f"{reason}: its procs are lost")
        if self.control is not None and name == self.control.host:  # noticed now; restored from the last checkpoint on the next dataset or buffer call
            self.control.detect(f"{reason}: the dataset and replay buffer ran there")
        # noticed now; restored once the controller next needs the trainer (a stopped mesh, or one not spawned yet, is
        # no failure: a relaunch goes elsewhere)
        if self.trainer.running and name in self.placer.trainer_hosts:
            self.trainer.detect(CallFailed(f"host {self.hosts.describe(name)} of the trainer was lost", hung=False))
        for group in self.groups.values():
            live = group.live()
            for replica in [*group.replicas, *group.retiring]:
                if replica.host != name:
                    continue
                replica.lost_with_host = reason
                if replica in live and not replica.failed:
                    self.failover.detect(group, replica, reason, hung=False, request_failed=replica.outstanding > 0)

    def settle(self, host: str) -> None:
        """A proc on `host` died: if the whole host did, its port is closed a moment later; look then."""
        self.check_hosts(now=True)
        if host in self.hosts.workers and host not in self.hosts.lost:
            time.sleep(HOST_SETTLE_S)
            self.check_hosts(now=True)

    def check_control_procs(self) -> None:
        """A failure report no replica explains: the run goes on only if dataset and buffer still answer."""
        if not self.unexplained:
            return
        if self.control is None:  # nothing but the trainer runs, whose failures surface in its calls
            self.unexplained.clear()
            return
        reason = f"a process of the run failed: {self.unexplained[0]}"
        answers = self.control.answers()
        self.unexplained.clear()
        if not answers:
            self.control.detect(reason)
            raise ControlLost(reason)

    # --- replacement --------------------------------------------------------------------
    def replacement_host(self, replica: Replica) -> str:
        if replica.failed:
            self.settle(replica.host)
        self.check_hosts(now=True)  # a proc spawned on a lost host would wait for it
        return self.placer.replacement_host(replica)

    def prepare_generator(self, replica: Replica) -> int:
        """Give a new generator replica the trainer's current weights, read by its inbox from the ranks; the policy
        version it then holds. Unless the trainer moved since the generators' last publication, the replica gets
        that publication (the same weights); else a new one, for this replica only until the next sync. TrainerLost
        when the ranks fail or stop while it reads them (the replacement is tried again after the trainer's restore)."""
        state = self.state
        if state.generator_version != state.policy_version:
            state.publications += 1
        if state.publications:  # publication 0: the model folder's weights, which the replica loaded
            self.trainer.publish_weights([replica], state.publications)
            self.trainer.await_read(replica, state.publications)
        return int(self.waits.wait(replica.actor.take_weights.call_one(state.publications)))

    def prepare(self, replica: Replica) -> int:
        """Bring a new replica to serving state; its policy version (0 for roles without weights to sync)."""
        return self.prepare_new[replica.role](replica) if replica.role in self.prepare_new else 0

    def repair(self) -> None:
        """Replace the failed replicas queued for it; spares used up start again."""
        if not self.failover.pending_repairs():
            return
        self.poll_spares()
        self.failover.repair(self.prepare_new, host=self.replacement_host)
        self.warm_spares()  # their models load while training goes on

    def warm_spares(self) -> None:
        """Start each role's missing spares on its spare host. A spare is optional capacity: a host that dies as one is
        spawned there is told on the run page and probed (found lost, its replicas fail over), and the spares go to the
        role's next host; a host the probe still finds up is tried again at the next warm."""
        for group in self.groups.values():
            while (host := self.placer.spare_host(group.role)) is not None:
                try:
                    started = group.warm(host)
                except HostsUnreachable as unreachable:
                    self.check_hosts(now=True)
                    elsewhere = host in self.hosts.lost  # the next spare host differs: it is not lost
                    self.recorder.event("message", step=self.state.step, text=(
                        f"a {group.role} spare did not start: {unreachable}; another is started"
                        f"{' elsewhere' if elsewhere else ''}"))
                    if elsewhere:
                        continue
                    break
                if started:
                    self.recorder.event("spares_started", step=self.state.step, role=group.role, host=host,
                                        count=started)
                break

    def poll_spares(self, wait_s: float = 0.001) -> None:
        """Record the spares that are ready and those that failed to start; the ConfigError of a model folder a spare
        refused ends the run (`ReplicaGroup.poll_spares`), said on the run page."""
        for group in self.groups.values():
            try:
                ready, failed = group.poll_spares(wait_s=wait_s)
            except ConfigError as refused:
                raise refusal_ends_run(refused, recorder=self.recorder, step=self.state.step,
                                       what=f"a {group.role} spare did not start") from None
            for spare in ready:
                self.recorder.event("spare_ready", step=self.state.step, role=group.role, host=spare.host,
                                    pids=spare.pids)
            for why in failed:
                self.recorder.event("message", step=self.state.step,
                                    text=f"a {group.role} spare {why}; another is started")
