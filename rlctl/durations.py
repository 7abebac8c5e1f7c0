"""Durations as people write them in a config ("3h50m", "90m", "45s", "3600"), and back."""

from __future__ import annotations

import re

_PART = re.compile(r"(\d+(?:\.\d+)?)([hms])")
_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration(text: str) -> float | None:
    """Seconds of `text` ("3h50m", "1h30m15s", "90m", "45s", or plain seconds), or None when it is
    not a duration. Each unit once, largest first."""
    text = text.strip()
    if re.fullmatch(r"\d+(?:\.\d+)?", text):
        return float(text)
    parts = _PART.findall(text)
    units = [unit for _, unit in parts]
    if not parts or "".join(f"{n}{u}" for n, u in parts) != text or units != sorted(set(units), key="hms".index):
        return None
    return sum(float(n) * _UNIT[u] for n, u in parts)


def describe_duration(seconds: float) -> str:
    """`seconds` the way parse_duration reads it, to the second: 13_260 → "3h41m"."""
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    text = (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "") + (f"{secs}s" if secs else "")
    return text or "0s"
