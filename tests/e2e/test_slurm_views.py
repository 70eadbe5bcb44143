"""SLURM's view in Chromium: a node SLURM has down shows on its host card on the cluster page (in the alarm colour,
with SLURM's reason), and a SLURM run's timeline says what its job is doing and which of its nodes is down, live
after the page has loaded. The views are written by the functions the SLURM poll calls
(tests/system/test_slurm_cluster_live.py drives that poll on a real cluster)."""

from __future__ import annotations

from django.utils import timezone

from forgeboard.cluster.models import Host
from forgeboard.cluster.services import hosts_record_scheduler_view
from forgeboard.runs.services import run_launch
from tests.e2e.conftest import login, outside_the_browser_loop, screenshot
from workers.launch.jobs import last_job_status, record_job_status
from workers.launch.slurm import SchedulerStatus

SLURM_YAML = """\
recipe: grpo
model: {{family: qwen3, path: {model}}}
placement: {{backend: slurm, trainer: {{procs_per_host: 1}}}}
trainer: {{ranks: 2, steps: 2}}
"""
ALARM = "rgb(251, 224, 222)"  # .host-liveness-down's background


def _hosts() -> None:
    for name in ("fbslurm1", "fbslurm2"):
        Host.objects.create(hostname=name, cpu_count=2, memory_bytes=8 << 30, last_heartbeat_at=timezone.now())
    hosts_record_scheduler_view(nodes={"fbslurm1": ("allocated", ""),
                                       "fbslurm2": ("down (not responding)", "Not responding")}, now=timezone.now())


def test_the_cluster_page_shows_a_node_slurm_has_down(page, server, team):
    outside_the_browser_loop(_hosts)
    login(page, server, "opal")
    page.goto(f"{server['url']}/cluster/")
    down = page.locator("#host-fbslurm2 .scheduler-state")
    assert down.inner_text() == "SLURM: down (not responding)" and down.is_visible()
    assert down.evaluate("e => getComputedStyle(e).backgroundColor") == ALARM
    assert page.locator("#host-fbslurm2 .scheduler-view dd").inner_text().startswith(
        "down (not responding): Not responding as of ")
    busy = page.locator("#host-fbslurm1 .scheduler-state")
    assert busy.inner_text() == "SLURM: allocated"
    assert busy.evaluate("e => getComputedStyle(e).backgroundColor") != ALARM
    header = page.locator("#host-fbslurm2 .header-line").bounding_box()
    box = down.bounding_box()
    assert header["x"] <= box["x"] and box["x"] + box["width"] <= header["x"] + header["width"], "inside its card"
    screenshot(page, "cluster_slurm_node_down")


def test_a_slurm_runs_timeline_says_what_its_job_does_and_which_node_is_down(page, server, team, demo_model):
    run = outside_the_browser_loop(run_launch, actor=team.member, experiment=team.experiment,
                                   config_yaml=SLURM_YAML.format(model=demo_model))
    running = SchedulerStatus("running", "running on fbslurm[1-2]", "77", nodes="fbslurm[1-2]")
    outside_the_browser_loop(record_job_status, run=run, status=running, backend="slurm", nodes_down={}, last=None)
    login(page, server, "mateo")
    page.goto(f"{server['url']}/runs/{run.pk}/")
    first = page.locator("#timeline li", has_text="SLURM job 77: running on fbslurm[1-2]")
    first.wait_for()
    assert "node down" not in first.inner_text()

    lost = SchedulerStatus("running", "running on fbslurm1", "77", nodes="fbslurm1")
    down = {"fbslurm2": "down (not responding): Not responding"}
    added = outside_the_browser_loop(record_job_status, run=run, status=lost, backend="slurm", nodes_down=down,
                                     last=outside_the_browser_loop(last_job_status, run=run))
    again = outside_the_browser_loop(record_job_status, run=run, status=lost, backend="slurm", nodes_down=down,
                                     last=outside_the_browser_loop(last_job_status, run=run))
    assert added and not again, "an unchanged view is not recorded twice"
    live = page.locator("#timeline li", has_text="node down: fbslurm2")
    live.wait_for(timeout=15_000)  # pushed over the websocket, no reload
    assert live.inner_text().endswith(
        "SLURM job 77: running on fbslurm1; node down: fbslurm2 (down (not responding): Not responding)")
    assert live.is_visible() and page.locator("#timeline li").first.inner_text() == live.inner_text(), "newest first"
    assert page.locator("#timeline li", has_text="SLURM job 77").count() == 2
    screenshot(page, "run_page_slurm_node_down")
