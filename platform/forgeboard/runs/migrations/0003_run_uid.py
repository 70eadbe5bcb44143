import uuid

from django.db import migrations, models


def give_each_run_a_uid(apps, schema_editor):
    Run = apps.get_model("runs", "Run")
    for run in Run.objects.filter(uid__isnull=True).only("pk"):
        run.uid = uuid.uuid4()
        run.save(update_fields=["uid"])


class Migration(migrations.Migration):
    dependencies = [("runs", "0002_run_tokens")]

    operations = [
        migrations.AddField(model_name="run", name="uid", field=models.UUIDField(null=True, editable=False)),
        migrations.RunPython(give_each_run_a_uid, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="run",
            name="uid",
            field=models.UUIDField(default=uuid.uuid4, editable=False, help_text="Names its files and jobs",
                                   unique=True),
        ),
    ]
