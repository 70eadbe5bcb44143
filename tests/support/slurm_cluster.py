"""A real SLURM cluster on this machine for the suite: munged, slurmdbd, slurmctld and one slurmd per node.

Each node is a slurmd in a UTS namespace of its own, so that the node's hostname is its node name (as on
a real cluster, and as monarch's batch runner expects: a worker listens on `socket.gethostname()`), and
each node name resolves to a loopback address of its own (127.0.0.2, 127.0.0.3, ...; written to
/etc/hosts). Every daemon's files are in the cluster's folder (config, state, spool, logs, munge's key and
socket); accounting goes to a database of its own on the local MariaDB, so `sacct` answers. `stop()`
ends only the processes `start()` started, and the jobs they ran.

`scripts/slurm.sh` installs Debian's slurm-wlm, slurmdbd and munge where they are missing.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.processes import free_port

HOSTS_FILE = Path("/etc/hosts")
HOSTS_MARK = "# forgeboard test slurm cluster"
MARIADB = ("127.0.0.1", 3306)
DAEMONS = ("munged", "slurmdbd", "slurmctld", "slurmd")


class SlurmClusterError(RuntimeError):
    """The test cluster could not be started; the message says which daemon and shows its log."""


def slurm_installed() -> bool:
    return all(shutil.which(name) or Path("/usr/sbin", name).exists() for name in (*DAEMONS, "sbatch", "sacctmgr"))


def mariadb_answers() -> bool:
    try:
        with socket.create_connection(MARIADB, timeout=2):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class SlurmNode:
    name: str
    address: str
    port: int


@dataclass
class SlurmTestCluster:
    """`nodes` nodes of `cpus` CPUs each in one partition, `debug` (the default), and a second, `short`."""

    folder: Path
    nodes: int = 2
    cpus: int = 2
    memory_mb: int = 8000
    name_prefix: str = "fbslurm"
    cluster_name: str = "fbtest"
    accounting: bool = True
    node_list: list[SlurmNode] = field(default_factory=list)
    _pids: dict[str, int] = field(default_factory=dict)
    _database: str = ""

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.folder / "munge" / "munge.socket"

    @property
    def env(self) -> dict[str, str]:
        """What SLURM's commands need to find this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    @property
    def prolog_slurmctld(self) -> Path:
        return self.folder / "prolog_slurmctld.sh"

    def hold_configuring(self, job_name: str) -> Path:
        """The jobs named `job_name` that start from now on stay CONFIGURING (slurmctld's prolog for them waits, as
        while SLURM boots a job's nodes) until the returned file is removed."""
        hold = self.folder / "configuring" / job_name
        hold.parent.mkdir(exist_ok=True)
        hold.touch()
        return hold

    def log(self, daemon: str) -> str:
        path = self.folder / "log" / f"{daemon}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else f"(no {path})"

    # --- start -----------------------------------------------------------------------------------------

    def start(self) -> SlurmTestCluster:
        if not slurm_installed():
            raise SlurmClusterError("slurm-wlm, slurmdbd or munge is missing: run scripts/slurm.sh")
        for sub in ("state", "spool", "log", "munge"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        self.node_list = [SlurmNode(name=f"{self.name_prefix}{i + 1}", address=f"127.0.0.{i + 2}", port=free_port())
                          for i in range(self.nodes)]
        self._write_hosts()
        ctld_port, dbd_port = free_port(), free_port()
        if self.accounting and not mariadb_answers():
            raise SlurmClusterError(f"MariaDB does not answer at {MARIADB[0]}:{MARIADB[1]} (slurmdbd's database): "
                                    "run scripts/slurm.sh")
        self._write_conf(ctld_port=ctld_port, dbd_port=dbd_port)
        self.prolog_slurmctld.write_text(
            f'#!/bin/sh\nwhile [ -e "{self.folder}/configuring/$SLURM_JOB_NAME" ]; do sleep 0.2; done\n')
        self.prolog_slurmctld.chmod(0o755)
        try:
            self._start_munge()
            if self.accounting:
                self._start_slurmdbd()
            self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            for node in self.node_list:
                self._start_slurmd(node)
            self.wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_slurmd(self, node: SlurmNode) -> None:
        # A UTS namespace whose hostname is the node's name: what a job's processes on that node see.
        self._spawn(f"slurmd.{node.name}", ["unshare", "--uts", "sh", "-c",
                                            f"hostname {node.name} && exec slurmd -D -N {node.name}"])

    def restart_node(self, name: str) -> None:
        """A killed node's slurmd started again; SLURM returns the node to service when it registers."""
        self._start_slurmd(next(n for n in self.node_list if n.name == name))
        self._wait(lambda: self.node_states().get(name, "down").rstrip("*") in ("idle", "mix", "alloc"),
                   what=f"{name} back in service", daemon="slurmctld", timeout=60)

    def _write_hosts(self) -> None:
        lines = HOSTS_FILE.read_text().splitlines()
        kept = [line for line in lines if not line.endswith(HOSTS_MARK)]
        ours = [f"{node.address} {node.name} {HOSTS_MARK}" for node in self.node_list]
        HOSTS_FILE.write_text("\n".join(kept + ours) + "\n")

    def _write_conf(self, *, ctld_port: int, dbd_port: int) -> None:
        d = self.folder
        host = socket.gethostname()
        names = ",".join(node.name for node in self.node_list)
        lines = [
            f"ClusterName={self.cluster_name}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd.%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd.%n.log",
            "SlurmUser=root",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            # Node loss is noticed within seconds here (defaults: minutes), and the time limit is checked often.
            "SlurmdTimeout=10",
            "InactiveLimit=0",
            "KillWait=5",
            "MinJobAge=300",
            "MessageTimeout=10",
            # Run before each job's processes start, the job CONFIGURING meanwhile: see hold_configuring.
            f"PrologSlurmctld={self.prolog_slurmctld}",
        ]
        if self.accounting:
            lines += ["AccountingStorageType=accounting_storage/slurmdbd", "AccountingStorageHost=127.0.0.1",
                      f"AccountingStoragePort={dbd_port}", "AccountingStoreFlags=job_comment,job_script",
                      # the munge socket for connections to slurmdbd (AuthInfo is not read for them)
                      f"AccountingStoragePass={self.munge_socket}",
                      "JobAcctGatherType=jobacct_gather/none"]
            self._database = f"fb_slurm_{secrets.token_hex(4)}"
            dbd = self.folder / "slurmdbd.conf"  # slurmdbd reads it beside SLURM_CONF
            dbd.write_text("\n".join([
                "AuthType=auth/munge", f"AuthInfo=socket={self.munge_socket}", "DbdHost=localhost",
                "DbdAddr=127.0.0.1", f"DbdPort={dbd_port}", "SlurmUser=root", f"PidFile={d}/slurmdbd.pid",
                f"LogFile={d}/log/slurmdbd.log", "StorageType=accounting_storage/mysql",
                f"StorageHost={MARIADB[0]}", f"StoragePort={MARIADB[1]}", "StorageUser=root",
                f"StorageLoc={self._database}"]) + "\n")
            dbd.chmod(0o600)
        lines += [f"NodeName={node.name} NodeHostname={node.name} NodeAddr={node.address} Port={node.port} "
                  f"CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN" for node in self.node_list]
        lines += [f"PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP",
                  f"PartitionName=short Nodes={names} MaxTime=1 State=UP"]
        self.conf.write_text("\n".join(lines) + "\n")

    def _start_munge(self) -> None:
        key = self.folder / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        self._spawn("munged", ["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--pid-file={self.folder / 'munge' / 'munged.pid'}",
                               f"--seed-file={self.folder / 'munge' / 'munged.seed'}",
                               f"--log-file={self.folder / 'log' / 'munged.log'}"])
        self._wait(lambda: self.munge_socket.exists(), what="munged's socket", daemon="munged")

    def _start_slurmdbd(self) -> None:
        self._spawn("slurmdbd", ["slurmdbd", "-D"])
        self._wait(lambda: "started" in self.log("slurmdbd"), what="slurmdbd", daemon="slurmdbd")
        added = self.command("sacctmgr", "-i", "add", "cluster", self.cluster_name, timeout=30)
        if added.returncode != 0:
            raise SlurmClusterError(f"sacctmgr add cluster: {added.stderr or added.stdout}")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.folder / "log" / f"{name}.stdout", "ab")  # noqa: SIM115 - the daemon owns it
        process = subprocess.Popen(argv, env=dict(os.environ, **self.env), stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, cwd=self.folder)
        log.close()
        self._pids[name] = process.pid

    def _wait(self, predicate, *, what: str, daemon: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise SlurmClusterError(f"timed out waiting for {what}:\n{self.log(daemon)}")
            time.sleep(0.2)

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo prints it (idle, alloc, down*, ...)."""
        done = self.command("sinfo", "-N", "-h", "-o", "%N %t")
        return dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)

    def wait_idle(self, timeout: float = 60) -> None:
        self._wait(lambda: set(self.node_states().values()) == {"idle"} and len(self.node_states()) == self.nodes,
                   what="every node idle in sinfo", daemon="slurmctld", timeout=timeout)

    def command(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """One of SLURM's commands against this cluster."""
        return subprocess.run(list(argv), env=dict(os.environ, **self.env), capture_output=True, text=True,
                              timeout=timeout, check=False)

    # --- faults and stop --------------------------------------------------------------------------------

    def node_processes(self, node: SlurmNode) -> list[int]:
        """The processes on `node`: its slurmd and everything in its UTS namespace (its jobs' steps)."""
        slurmd = self._pids.get(f"slurmd.{node.name}")
        if slurmd is None:
            return []
        try:
            namespace = os.readlink(f"/proc/{slurmd}/ns/uts")
        except OSError:
            return []
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if os.readlink(entry / "ns" / "uts") == namespace:
                        found.append(int(entry.name))
                except OSError:
                    continue
        return found

    def job_processes(self, node: SlurmNode) -> list[int]:
        """The processes of jobs on `node`: those of its UTS namespace but its slurmd."""
        return [pid for pid in self.node_processes(node) if pid != self._pids.get(f"slurmd.{node.name}")]

    @contextmanager
    def node_frozen(self, name: str) -> Iterator[None]:
        """The node's slurmd stopped (SIGSTOP) meanwhile: it takes no message from slurmctld, as a hung node's, while
        its jobs' processes run on. Keep it short: past SlurmdTimeout (10 s) SLURM takes the node for down."""
        pid = self._pids[f"slurmd.{name}"]
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def kill_node(self, name: str) -> list[int]:
        """The node goes away at once: its slurmd and every process on it SIGKILLed; the pids killed."""
        node = next(n for n in self.node_list if n.name == name)
        killed = self.node_processes(node)
        for pid in killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._pids.pop(f"slurmd.{name}", None)
        return killed

    def stop(self) -> None:
        if "slurmctld" in self._pids:
            self.command("scancel", "--full", "--user=root", timeout=15)
        for node in self.node_list:
            self.kill_node(node.name)
        for name in ("slurmctld", "slurmdbd", "munged"):
            pid = self._pids.pop(name, None)
            if pid is None:
                continue
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            for _ in range(50):
                try:
                    os.waitpid(pid, os.WNOHANG)
                    os.kill(pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    break
                time.sleep(0.1)
            else:
                os.killpg(pid, signal.SIGKILL)
        if self._database:
            subprocess.run(["mysql", "-h", MARIADB[0], "-u", "root", "-e", f"DROP DATABASE IF EXISTS {self._database}"],
                           capture_output=True, timeout=30, check=False)
            self._database = ""
