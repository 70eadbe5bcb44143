"""The CI client (clients/python, forgeboard-client) installs and runs without the server's dependencies."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

REPO_DIR = Path(__file__).resolve().parents[2]
CLIENT_DIR = REPO_DIR / "clients" / "python"
SERVER_ONLY = {"django", "celery", "kubernetes", "channels", "psycopg", "redis", "forgeboard"}
HTTPX_AND_ITS_DEPENDENCIES = ["httpx", "httpcore", "anyio", "certifi", "idna", "h11", "sniffio", "typing_extensions.py"]


def test_client_modules_import_nothing_of_the_server():
    probe = ("import json, sys; import forgeboard_client.ci, forgeboard_client.client; "
             "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", probe], env={"PYTHONPATH": str(REPO_DIR / "platform")},
                         capture_output=True, text=True, check=True, timeout=60)
    loaded = set(json.loads(out.stdout))
    assert "httpx" in loaded and "forgeboard_client" in loaded
    assert not loaded & SERVER_ONLY, loaded & SERVER_ONLY


def test_client_distribution_declares_only_httpx():
    project = tomllib.loads((CLIENT_DIR / "pyproject.toml").read_text())["project"]
    assert project["name"] == "forgeboard-client"
    assert [dep.split(">")[0].split("=")[0].strip() for dep in project["dependencies"]] == ["httpx"]
    assert project["scripts"] == {"forgeboard-ci": "forgeboard_client.ci:main"}


@pytest.mark.slow
def test_client_wheel_installs_alone_and_runs(tmp_path):
    """Built from a copy of its sources, installed with --no-deps into a bare venv given only httpx: it runs."""
    tree = tmp_path / "src"
    shutil.copytree(CLIENT_DIR, tree / "clients" / "python", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    shutil.copytree(REPO_DIR / "platform" / "forgeboard_client", tree / "platform" / "forgeboard_client",
                    ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
                    str(tree / "clients" / "python")], check=True, capture_output=True, timeout=240)
    (wheel,) = (tmp_path / "dist").glob("forgeboard_client-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"forgeboard_client"}
    assert [line for line in metadata.splitlines() if line.startswith("Requires-Dist")] == \
        ["Requires-Dist: httpx<1,>=0.27"]

    fresh = tmp_path / "venv"
    venv.create(fresh, with_pip=False)
    python = fresh / "bin" / "python"
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", str(wheel)], check=True,
                   capture_output=True, timeout=240)
    only_httpx = tmp_path / "httpx-only"
    only_httpx.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for name in HTTPX_AND_ITS_DEPENDENCIES:
        (only_httpx / name).symlink_to(site / name)
    fresh_site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     capture_output=True, text=True, check=True).stdout.strip())
    (fresh_site / "httpx-only.pth").write_text(f"{only_httpx}\n")

    assert subprocess.run([str(python), "-c", "import django"], capture_output=True).returncode != 0
    helped = subprocess.run([str(fresh / "bin" / "forgeboard-ci"), "run", "--help"], capture_output=True,
                            text=True, timeout=60)
    assert helped.returncode == 0 and "--junit" in helped.stdout, helped.stderr
    unreachable = subprocess.run([str(fresh / "bin" / "forgeboard-ci"), "run", "smoke", "--project", "alpha"],
                                 capture_output=True, text=True, timeout=60,
                                 env={"FORGEBOARD_URL": "http://127.0.0.1:9", "FORGEBOARD_TOKEN": "fb_x_y"})
    assert unreachable.returncode == 2 and "cannot reach http://127.0.0.1:9" in unreachable.stderr, \
        unreachable.stderr
