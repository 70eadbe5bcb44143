# A host's one `state` (up, draining, cordoned, down) becomes what the operator wants of it (`intent`) and whether it
# is alive (`liveness`). A host that was down had lost its drain or cordon to the reconcile: it is schedulable and down.

from django.db import migrations, models

INTENT_OF_STATE = {"up": "schedulable", "draining": "draining", "cordoned": "cordoned", "down": "schedulable"}


def split_state(apps, schema_editor):
    Host = apps.get_model("cluster", "Host")
    for state, intent in INTENT_OF_STATE.items():
        Host.objects.filter(state=state).update(intent=intent, liveness="down" if state == "down" else "up")


def join_state(apps, schema_editor):
    Host = apps.get_model("cluster", "Host")
    Host.objects.filter(intent="schedulable").update(state="up")
    Host.objects.filter(intent__in=["draining", "cordoned"]).update(state=models.F("intent"))
    Host.objects.filter(liveness="down").update(state="down")


class Migration(migrations.Migration):

    dependencies = [
        ('cluster', '0004_host_agent_token'),
    ]

    operations = [
        migrations.AddField(
            model_name='host',
            name='intent',
            field=models.CharField(choices=[('schedulable', 'Schedulable'), ('draining', 'Draining'), ('cordoned', 'Cordoned')], default='schedulable', max_length=16),
        ),
        migrations.AddField(
            model_name='host',
            name='liveness',
            field=models.CharField(choices=[('up', 'Up'), ('down', 'Down')], default='up', max_length=8),
        ),
        migrations.RunPython(split_state, join_state),
        migrations.RemoveConstraint(
            model_name='host',
            name='host_state_valid',
        ),
        migrations.RemoveField(
            model_name='host',
            name='state',
        ),
        migrations.AddConstraint(
            model_name='host',
            constraint=models.CheckConstraint(condition=models.Q(('intent__in', ['schedulable', 'draining', 'cordoned'])), name='host_intent_valid'),
        ),
        migrations.AddConstraint(
            model_name='host',
            constraint=models.CheckConstraint(condition=models.Q(('liveness__in', ['up', 'down'])), name='host_liveness_valid'),
        ),
    ]
