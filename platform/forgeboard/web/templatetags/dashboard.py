"""Small formatting filters for the dashboard."""

from __future__ import annotations

import json
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
def json_text(value: object, limit: int) -> str:
    """A JSON value as one line of compact JSON, as a browser's JSON.stringify writes it, cut at `limit` characters."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return text if len(text) <= limit else text[:limit - 1] + "…"


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


@register.filter
def signed_percent(value: object) -> str:
    """+4.2%, -13.0%; an em dash for missing or non-finite values."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "—"
    return f"{100 * value:+.1f}%"


ERROR_BAR_FULL = 0.5  # an error of 50% (or more) fills the bar


@register.filter
def error_bar_px(value: object, full_px: int = 80) -> int:
    """The width of a bar drawing |value| (a relative error) against ERROR_BAR_FULL."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return 0
    return round(min(1.0, abs(value) / ERROR_BAR_FULL) * int(full_px))
