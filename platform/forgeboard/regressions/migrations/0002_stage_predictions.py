from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("regressions", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="stageresult",
            name="predicted_step_s",
            field=models.FloatField(blank=True, help_text="the what-if model's step seconds for the stage's config, "
                                    "calibrated on the suite run's first stage (runs/planning.py)", null=True),
        ),
        migrations.AddField(
            model_name="stageresult",
            name="measured_step_s",
            field=models.FloatField(blank=True, help_text="the median step of the stage's run", null=True),
        ),
        migrations.AddField(
            model_name="stageresult",
            name="prediction_note",
            field=models.CharField(blank=True, max_length=300),
        ),
    ]
