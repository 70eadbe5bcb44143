# An export's state moves from its status file (<run folder>/exports/step_N.status.json, no longer read) to a
# CheckpointExport row. The exports that runs were waiting for (PendingChildRun) are recorded as queued, as attempt 0,
# which the task messages queued before this take: the run reconciler queues one again if its message was lost.

import django.db.models.deletion
from django.db import migrations, models

ATTEMPT_BEFORE_UPGRADE = 0  # runs/checkpoints.py


def record_the_exports_runs_wait_for(apps, schema_editor):
    PendingChildRun = apps.get_model("runs", "PendingChildRun")
    CheckpointExport = apps.get_model("runs", "CheckpointExport")
    User = apps.get_model("accounts", "User")
    ApiToken = apps.get_model("accounts", "ApiToken")
    first_asked: dict[tuple[int, int], object] = {}
    for pending in PendingChildRun.objects.order_by("id"):
        first_asked.setdefault((pending.parent_id, pending.step), pending)
    for (run_id, step), pending in first_asked.items():
        if pending.actor_kind == "token":
            prefix = ApiToken.objects.filter(pk=pending.actor_id).values_list("prefix", flat=True).first()
            requested_by = f"token:{prefix}" if prefix else f"token {pending.actor_id} (deleted)"
        else:
            username = User.objects.filter(pk=pending.actor_id).values_list("username", flat=True).first()
            requested_by = f"user:{username}" if username else f"user {pending.actor_id} (deleted)"
        CheckpointExport.objects.create(run_id=run_id, step=step, state="queued", attempt=ATTEMPT_BEFORE_UPGRADE,
                                        requested_by=requested_by, updated_at=pending.created_at)


class Migration(migrations.Migration):

    dependencies = [
        ('accounts', '0002_project_quotas'),
        ('runs', '0006_pending_child_run'),
    ]

    operations = [
        migrations.CreateModel(
            name='CheckpointExport',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('step', models.BigIntegerField()),
                ('state', models.CharField(choices=[('queued', 'Queued'), ('running', 'Running'), ('failed', 'Failed')], max_length=8)),
                ('error', models.TextField(blank=True, default='', help_text='Why it failed, when it did')),
                ('attempt', models.PositiveIntegerField(default=1, help_text='Which sending of its task runs it: a task message of another attempt does nothing')),
                ('requeues', models.PositiveSmallIntegerField(default=0, help_text='How often it was lost and queued again since it was asked for')),
                ('requested_by', models.CharField(help_text='Who asked first (user:NAME or token:PREFIX)', max_length=200)),
                ('worker', models.CharField(blank=True, default='', help_text='The host and process running it', max_length=200)),
                ('updated_at', models.DateTimeField(help_text='When its state was last written: queued or running longer than FORGEBOARD_EXPORT_LOST_AFTER_S means lost')),
                ('run', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='exports', to='runs.run')),
            ],
            options={
                'indexes': [models.Index(fields=['state', 'updated_at'], name='checkpoint_export_lost_idx')],
                'constraints': [models.UniqueConstraint(fields=('run', 'step'), name='checkpoint_export_once'), models.CheckConstraint(condition=models.Q(('state__in', ['queued', 'running', 'failed'])), name='checkpoint_export_state_valid')],
            },
        ),
        migrations.RunPython(record_the_exports_runs_wait_for, migrations.RunPython.noop),
    ]
