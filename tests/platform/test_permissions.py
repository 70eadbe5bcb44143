"""The permission matrix: owner, member, viewer and outsider (and tokens) against every write."""

from __future__ import annotations

import pytest

from forgeboard.accounts.models import Role, TokenScope, User
from forgeboard.accounts.services import (
    api_token_create,
    api_token_revoke,
    membership_remove,
    membership_set,
    project_create,
    user_set_operator,
)
from forgeboard.audit.models import AuditEvent
from forgeboard.cluster.models import Host, HostIntent
from forgeboard.cluster.services import host_register, host_set_intent
from forgeboard.errors import Conflict, PermissionDenied
from forgeboard.experiments.services import experiment_create, experiment_update
from forgeboard.runs.models import Command, Run
from forgeboard.runs.services import command_create, run_cancel, run_launch
from forgeboard.runs.states import RunState

ROLES = ["owner", "member", "viewer", "outsider"]


def _expect(allowed: bool, action):
    audits_before = AuditEvent.objects.count()
    if allowed:
        result = action()
        assert AuditEvent.objects.count() > audits_before, "an allowed write must leave an audit entry"
        return result
    with pytest.raises(PermissionDenied):
        action()
    assert AuditEvent.objects.count() == audits_before, "a refused write must change nothing"
    return None


@pytest.mark.parametrize("role", ROLES)
def test_create_experiment(team, role):
    allowed = role in {"owner", "member"}
    _expect(allowed, lambda: experiment_create(actor=team.by_role(role), project=team.project,
                                               name=f"exp-{role}", recipe="sft"))


@pytest.mark.parametrize("role", ROLES)
def test_edit_experiment(team, role):
    _expect(role in {"owner", "member"},
            lambda: experiment_update(actor=team.by_role(role), experiment=team.experiment, tags=["x"]))


@pytest.mark.parametrize("role", ROLES)
def test_launch_run(team, grpo_yaml, role):
    runs_before = Run.objects.count()
    run = _expect(role in {"owner", "member"},
                  lambda: run_launch(actor=team.by_role(role), experiment=team.experiment, config_yaml=grpo_yaml))
    assert Run.objects.count() == runs_before + (1 if run else 0)


@pytest.mark.parametrize("role", ROLES)
def test_cancel_run(team, grpo_yaml, role):
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    result = _expect(role in {"owner", "member"}, lambda: run_cancel(actor=team.by_role(role), run=run))
    assert Run.objects.get(pk=run.pk).state == (RunState.CANCELLED if result else RunState.QUEUED)


@pytest.mark.parametrize("role", ROLES)
def test_send_command(team, grpo_yaml, role):
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING)
    _expect(role in {"owner", "member"},
            lambda: command_create(actor=team.by_role(role), run=run, kind="pause"))


@pytest.mark.parametrize("role", ROLES)
def test_manage_members(team, role):
    newcomer = User.objects.create_user("nina")
    _expect(role == "owner",
            lambda: membership_set(actor=team.by_role(role), project=team.project, user=newcomer, role="viewer"))


@pytest.mark.parametrize("role", ROLES)
def test_remove_member(team, role):
    _expect(role == "owner",
            lambda: membership_remove(actor=team.by_role(role), project=team.project, user=team.viewer))


@pytest.mark.parametrize("role", ROLES)
def test_create_token(team, role):
    _expect(role in {"owner", "member"},
            lambda: api_token_create(actor=team.by_role(role), project=team.project, name=f"ci-{role}", scope="read"))


def test_only_owner_or_creator_revokes_a_token(team):
    token, _ = api_token_create(actor=team.member, project=team.project, name="ci", scope="write")
    other_member = User.objects.create_user("milo")
    membership_set(actor=team.owner, project=team.project, user=other_member, role="member")
    _expect(False, lambda: api_token_revoke(actor=other_member, token=token))
    _expect(False, lambda: api_token_revoke(actor=team.viewer, token=token))
    _expect(True, lambda: api_token_revoke(actor=team.owner, token=token))


@pytest.mark.parametrize(("scope", "allowed"), [(TokenScope.WRITE, True), (TokenScope.READ, False)])
def test_tokens_act_as_member_or_viewer_of_their_own_project(team, grpo_yaml, scope, allowed):
    token, _ = api_token_create(actor=team.owner, project=team.project, name="bot", scope=scope)
    _expect(allowed, lambda: run_launch(actor=token, experiment=team.experiment, config_yaml=grpo_yaml))


def test_token_of_another_project_cannot_act(team, grpo_yaml):
    other = project_create(actor=team.outsider, slug="beta", name="Beta")
    token, _ = api_token_create(actor=team.outsider, project=other, name="bot", scope="write")
    _expect(False, lambda: run_launch(actor=token, experiment=team.experiment, config_yaml=grpo_yaml))
    _expect(False, lambda: experiment_create(actor=token, project=team.project, name="x", recipe="sft"))


@pytest.mark.parametrize("role", [*ROLES, "operator"])
def test_cluster_actions_need_the_operator_role(team, role):
    allowed = role == "operator"
    _expect(allowed, lambda: host_register(actor=team.by_role(role), hostname=f"gpu-{role}", cpu_count=8))
    host = Host.objects.create(hostname=f"spare-{role}")
    _expect(allowed, lambda: host_set_intent(actor=team.by_role(role), host=host, intent=HostIntent.DRAINING))
    assert Host.objects.get(pk=host.pk).intent == (HostIntent.DRAINING if allowed else HostIntent.SCHEDULABLE)


def test_operator_role_is_granted_by_an_administrator_only(team):
    admin = User.objects.create_superuser("root-admin", password="pw-admin-1")
    _expect(False, lambda: user_set_operator(actor=team.owner, user=team.member, is_operator=True))
    _expect(True, lambda: user_set_operator(actor=admin, user=team.member, is_operator=True))
    assert User.objects.get(pk=team.member.pk).is_operator


def test_last_owner_cannot_be_demoted_or_removed(team):
    with pytest.raises(Conflict, match="at least one owner"):
        membership_set(actor=team.owner, project=team.project, user=team.owner, role=Role.MEMBER)
    with pytest.raises(Conflict, match="at least one owner"):
        membership_remove(actor=team.owner, project=team.project, user=team.owner)


def test_inactive_user_loses_every_right(team):
    team.member.is_active = False
    team.member.save()
    _expect(False, lambda: experiment_create(actor=team.member, project=team.project, name="x", recipe="sft"))


def test_commands_audit_their_payload(team, monarch_running_run):
    run, _ = monarch_running_run
    command = command_create(actor=team.member, run=run, kind="fault_drill", payload={"kind": "kill", "role": "generator"})
    entry = AuditEvent.objects.get(action="command.fault_drill")
    assert entry.actor == team.member and entry.target_id == str(command.pk)
    assert entry.payload == {"kind": "kill", "role": "generator"}
    assert Command.objects.get(pk=command.pk).state == "pending"
