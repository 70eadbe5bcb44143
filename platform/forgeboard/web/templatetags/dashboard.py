"""Small formatting filters for the dashboard."""

from __future__ import annotations

import math

from django import template

register = template.Library()


@register.filter
def duration(seconds: float | None) -> str:
    """1h 02m, 3m 05s, 12s; an em dash when unknown."""
    if seconds is None:
        return "—"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


@register.filter
def metric(value: object) -> str:
    """Four significant digits; an em dash for missing, non-numeric or non-finite values."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "—"
    return f"{value:.4g}"


@register.filter
def filesize(size: int | None) -> str:
    if size is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(size)
