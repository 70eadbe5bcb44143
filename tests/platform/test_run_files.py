"""The files a launch writes in a run's folder for its engine (workers/launch/local.py `write_run_files`): the
config.yaml and the run token, each a new file readable by its owner only, written whole or not at all."""

from __future__ import annotations

import os
import stat

import pytest

from forgeboard.runs.services import run_launch
from forgeboard.runs.tokens import run_token_authenticate
from workers.launch import local
from workers.launch.local import write_run_files


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_restarted_attempt_replaces_a_world_readable_token_with_a_new_owner_only_file(team, grpo_yaml, tmp_path):
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    folder = tmp_path / "run"
    folder.mkdir()
    for name, text in (("run_token", "fbr_old_token"), ("config.yaml", "old: config\n")):
        (folder / name).write_text(text)
        os.chmod(folder / name, 0o644)
    with open(folder / "run_token") as old_reader:  # an engine still reading the first attempt's token
        token_file = write_run_files(run=run, folder=folder)
        assert old_reader.read() == "fbr_old_token", "the old token was rewritten in place, not replaced"
        assert os.stat(token_file).st_ino != os.fstat(old_reader.fileno()).st_ino
    assert token_file == folder / "run_token"
    assert _mode(token_file) == 0o600 and _mode(folder / "config.yaml") == 0o600
    assert os.stat(token_file).st_uid == os.geteuid()
    assert run_token_authenticate(raw=token_file.read_text()).run_id == run.pk
    assert "resume_latest: true" in (folder / "config.yaml").read_text()
    assert sorted(p.name for p in folder.iterdir()) == ["config.yaml", "run_token"]


def test_a_write_that_fails_before_its_rename_leaves_the_old_files_whole(team, grpo_yaml, tmp_path, monkeypatch):
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    folder = tmp_path / "run"
    write_run_files(run=run, folder=folder)
    before = {name: (folder / name).read_text() for name in ("config.yaml", "run_token")}

    def refused(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(local.os, "replace", refused)
    with pytest.raises(OSError, match="No space left"):
        write_run_files(run=run, folder=folder)
    assert {name: (folder / name).read_text() for name in before} == before
    assert sorted(p.name for p in folder.iterdir()) == ["config.yaml", "run_token"], "a half-written file was left"
