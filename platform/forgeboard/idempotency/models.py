from django.db import models


class IdempotentRequest(models.Model):
    """A write sent with an Idempotency-Key: the answer its first copy got, which every later copy gets again.

    A row is created inside the first copy's transaction and committed with the answer, so no other request ever
    sees it half done: a second copy sent meanwhile waits on the unique key, then reads the answer."""

    owner = models.CharField(max_length=64, help_text="Whose keys these are: token:<id> or user:<id>")
    key = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64, help_text="sha256 of the method, path and body")
    status_code = models.PositiveSmallIntegerField(null=True, help_text="None until the answer is recorded")
    content_type = models.CharField(max_length=255, blank=True)
    location = models.CharField(max_length=2048, blank=True, help_text="Where a redirect answer pointed")
    body = models.BinaryField(blank=True, default=b"")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["owner", "key"], name="idempotency_owner_key")]

    def __str__(self) -> str:
        return f"{self.owner} {self.key!r} -> {self.status_code}"
