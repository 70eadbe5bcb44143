"""A SLURM run end to end through monarch.job, on this machine: only the SLURM commands are fakes.

The fakes stand in for a one-node cluster: `sbatch` runs the script it is given in the background (in
the submitting directory, with SLURM_JOB_ID and the node list set, as slurmd would), `srun` runs its
command on "the node" (this machine, SLURM_NODEID=0), `squeue` reports the job running on this host
until the script has exited (then sacct-like, with its exit code); the test polls them as beat would. Everything else is real: the backend applies the run's SlurmJob, monarch's
batch runner starts the worker with its service identity and then the engine as its client, the engine
attaches to that worker through the pickled job (`job.state()`), trains, and reports to the web server.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.utils import timezone

from forgeboard.experiments.services import experiment_create
from forgeboard.runs.models import Run
from forgeboard.runs.scheduling import runs_schedule
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import RunState
from forgeboard.telemetry.models import MetricPoint, RunEvent
from tests.support.processes import free_port, kill_processes_in, wait_for, web_server
from workers.launch.backends import start_run
from workers.launch.slurm_backend import poll_slurm_runs

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=list(settings.DATABASES))]

JOB_ID = "7001"
NODES = ("127.0.0.2", "127.0.0.3")  # two "nodes" of this machine, each named by a loopback address of its own
FAKE_SLURM = """#!{python}
import json, os, signal, subprocess, sys
from pathlib import Path

here = Path(__file__).resolve().parent.parent
job = here / "job"
name = Path(sys.argv[0]).name
nodes = {nodes!r}


def on_node(index):
    # what slurmd gives a task on node `index`; sitecustomize makes the node's name its hostname
    return dict(os.environ, SLURM_NODEID=str(index), SLURM_PROCID=str(index), SLURM_LOCALID="0",
                FAKE_SLURM_HOSTNAME=nodes[index], PYTHONPATH=os.pathsep.join(filter(None, [
                    str(here / "site"), os.environ.get("PYTHONPATH")])))


if name == "sbatch":
    job.mkdir(exist_ok=True)
    (job / "script").write_text(sys.stdin.read())
    env = dict(on_node(0), SLURM_JOB_ID="{job_id}", SLURM_JOB_NODELIST=",".join(nodes), SLURM_NNODES=str(len(nodes)))
    with open(job / "out", "wb") as out:
        run = subprocess.Popen(["bash", "-c", 'bash "$0/script"; echo $? > "$0/rc"', str(job)], env=env,
                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    (job / "pid").write_text(str(run.pid))
    print("Submitted batch job {job_id}")
elif name == "srun":  # one task per node (all that monarch's batch runner asks for)
    args = sys.argv[1:]
    while args and args[0].startswith("-"):
        args.pop(0)
    tasks = [subprocess.Popen(args, env=on_node(i)) for i in range(len(nodes))]
    signal.signal(signal.SIGTERM, lambda *_: [t.terminate() for t in tasks])
    sys.exit(max(t.wait() for t in tasks))
elif name in ("squeue", "sacct"):
    code = int((job / "rc").read_text()) if (job / "rc").exists() else None
    state = "RUNNING" if code is None else "COMPLETED" if code == 0 else "FAILED"
    record = {{"job_id": {job_id}, "job_state": [state], "nodes": ",".join(nodes), "exit_code": {{"return_code": code}},
              "job_resources": {{"nodes": {{"allocation": [{{"name": node}} for node in nodes]}}}}}}
    print(json.dumps({{"jobs": [record], "errors": []}}))
elif name == "scancel":
    os.killpg(int((job / "pid").read_text()), signal.SIGTERM)
"""
SITECUSTOMIZE = """import os, socket
if os.environ.get("FAKE_SLURM_HOSTNAME"):
    socket.gethostname = lambda: os.environ["FAKE_SLURM_HOSTNAME"]
"""

SLURM_GRPO_YAML = """\
recipe: grpo
model:
  family: qwen3
  path: {model}
placement:
  backend: slurm
  trainer:
    procs_per_host: 1
trainer:
  ranks: 2
  steps: 2
  batch_size: 2
  threads_per_process: 1
grpo:
  group_size: 4
"""
SLURM_SFT_YAML = SLURM_GRPO_YAML.replace("recipe: grpo", "recipe: sft").replace("grpo:\n  group_size: 4\n", "")


def _polled_state(run: Run) -> str:
    """The run's state after beat's SLURM poll has looked at its job."""
    poll_slurm_runs()
    return Run.objects.get(pk=run.pk).state


@pytest.fixture
def fake_slurm(tmp_path, settings) -> Path:
    bin_dir = tmp_path / "slurm" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("sbatch", "srun", "squeue", "sacct", "scancel"):
        program = bin_dir / name
        program.write_text(FAKE_SLURM.format(python=sys.executable, job_id=JOB_ID, nodes=NODES))
        program.chmod(0o755)
    (bin_dir.parent / "site").mkdir()
    (bin_dir.parent / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    settings.SLURM_PARTITION = "debug"
    settings.SLURM_VENV = sys.prefix
    settings.SLURM_IMAGE = None
    settings.SLURM_BIN_DIR = str(bin_dir)
    settings.SLURM_MONARCH_PORT = free_port()
    return bin_dir.parent / "job"


@pytest.mark.parametrize("recipe", ["grpo", "sft"])
def test_a_slurm_run_trains_on_the_worker_its_monarch_job_started(team, tiny_model, fake_slurm, settings, tmp_path,
                                                                  recipe):
    """GRPO, and SFT on two trainer ranks: each recipe's trainer spans the job's two nodes."""
    port = free_port()
    settings.PUBLIC_URL = f"http://127.0.0.1:{port}"
    experiment = team.experiment if recipe == "grpo" else \
        experiment_create(actor=team.owner, project=team.project, name="warm-start", recipe="sft")
    yaml_text = SLURM_GRPO_YAML if recipe == "grpo" else SLURM_SFT_YAML
    try:
        with web_server(tmp_path / "web.log", port=port):
            run = run_launch(actor=team.member, experiment=experiment, config_yaml=yaml_text.format(model=tiny_model))
            assert run.pk in runs_schedule(now=timezone.now()), "SLURM queues it: no inventory host is needed"
            start_run(run_id=run.pk)  # what the launch.slurm worker does
            assert Run.objects.get(pk=run.pk).job_id == JOB_ID
            ended = wait_for(lambda: _polled_state(run) in (RunState.SUCCEEDED, RunState.FAILED), timeout=240,
                             interval=1, what="the SLURM run to end")
            out = (fake_slurm / "out").read_text() if (fake_slurm / "out").exists() else ""
            run.refresh_from_db()
            assert ended and run.state == RunState.SUCCEEDED, f"{run.exit_reason}\n{out[-4000:]}"
            wait_for(lambda: (fake_slurm / "rc").exists(), timeout=60, what="the batch script to exit")
            assert (fake_slurm / "rc").read_text().strip() == "0", out[-4000:]
    finally:
        kill_processes_in(Path(settings.DATA_DIR) / "runs")

    script = (fake_slurm / "script").read_text()
    assert "#SBATCH --nodes=2" in script, "trainer ranks one to a host: two nodes"
    [identities] = [line for line in script.splitlines() if line.startswith("export MONARCH_SERVICE_PROC_IDS=")]
    assert len(json.loads(identities.split("=", 1)[1].strip("'"))) == 2, "a service identity per node"
    port = settings.SLURM_MONARCH_PORT
    attached = RunEvent.objects.filter(run=run, kind="message", payload__text__startswith="attached to").get()
    assert attached.payload["text"].startswith(
        f"attached to 2 Monarch workers of the slurm job ({NODES[0]} (tcp://{NODES[0]}:{port}), "
        f"{NODES[1]} (tcp://{NODES[1]}:{port}))")
    ready = RunEvent.objects.filter(run=run, kind="message", payload__name="meshes_ready").get().payload
    assert ready["trainer_hosts"] == list(NODES) and ready["trainer_master_addr"] == NODES[0]
    assert MetricPoint.objects.filter(series__run=run, series__key="loss").count() == 2
