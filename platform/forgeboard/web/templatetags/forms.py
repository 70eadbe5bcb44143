"""Tags for the dashboard's forms."""

from __future__ import annotations

import uuid

from django import template
from django.utils.html import format_html
from django.utils.safestring import SafeString

from forgeboard.idempotency.services import FORM_FIELD

register = template.Library()


@register.simple_tag
def submission_key() -> SafeString:
    """A hidden field with a new idempotency key, for a form whose view is `idempotent_form` (web/idempotent.py):
    sent twice, the form does once what it did the first time."""
    return format_html('<input type="hidden" name="{}" value="{}">', FORM_FIELD, uuid.uuid4().hex)
