"""Checking single config values: sizes with units, scalar kinds and constraints, "did you mean".

Used by :mod:`corekv.config` for its own fields and for the options plugins declare
(:class:`corekv.plugin.Option`), so both are validated, and worded, the same way; and by any
module whose errors quote a received value (:func:`describe_value`) or suggest a name
(:func:`did_you_mean`). It imports nothing of corekv.
"""
from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
SIZE_EXAMPLES = "512MiB, 20GiB, 1.5GB or a whole number of bytes"


def parse_size(value: Any) -> int | None:
    """Bytes in ``value`` (``512MiB``, ``20GiB``, ``1.5GB``, ``4096``), or ``None`` if it is not
    a size. ``KB/MB/GB/TB`` are powers of 1000, ``KiB/MiB/GiB/TiB`` powers of 1024 (units are
    case-insensitive); fractional results are rounded down to whole bytes."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value >= 0 and value == int(value) else None
    if not isinstance(value, str):
        return None
    match = _SIZE_RE.match(value)
    if match is None or match.group(2).lower() not in SIZE_UNITS:
        return None
    try:
        # NOTE: Decimal, not float, so "1.1GB" is exactly 1_100_000_000 bytes.
        return int(Decimal(match.group(1)) * SIZE_UNITS[match.group(2).lower()])
    except InvalidOperation:  # pragma: no cover - the regex only admits decimal numbers
        return None


def format_size(num_bytes: int) -> str | int:
    """The shortest exact spelling of ``num_bytes`` (``"256MiB"``, ``"20GB"``), or the plain
    integer when no unit divides it (so dumping and loading again gives the same bytes)."""
    best: str | int = num_bytes
    for unit in ("TiB", "TB", "GiB", "GB", "MiB", "MB", "KiB", "kB"):
        multiple = SIZE_UNITS[unit.lower()]
        if num_bytes >= multiple and num_bytes % multiple == 0:
            text = f"{num_bytes // multiple}{unit}"
            if isinstance(best, int) or len(text) < len(best):
                best = text
    return best


def did_you_mean(word: Any, candidates: Iterable[str]) -> str:
    """``"; did you mean 'radix'?"`` for the closest candidate, or ``""`` when none is close."""
    if not isinstance(word, str):
        return ""
    candidates = list(candidates)
    lowered = {c.lower(): c for c in candidates}
    if word.lower() in lowered:
        return f"; did you mean {lowered[word.lower()]!r}?"
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def describe_value(value: Any, limit: int = 80) -> str:
    """``repr`` of a received value, at most ``limit`` characters, so an error stays one readable
    line (every corekv error message that quotes a value uses this)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(frozen=True)
class Check:
    """What one value must be: a kind (``int``, ``float``, ``str``, ``bool``, ``size``,
    ``mapping``) and optional constraints. :meth:`expected` words them once, for errors and the
    reference."""

    kind: str
    choices: tuple[Any, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    power_of_two: bool = False
    #: a regular expression a string must match, and how to say so
    pattern: str | None = None
    pattern_text: str = ""
    #: spellings to suggest for a rejected string when there are no ``choices``
    suggestions: tuple[str, ...] = ()
    #: a string may be empty (e.g. kv_events.topic, where "" is a meaningful value)
    allow_empty: bool = False

    @classmethod
    def for_option(cls, option: Any) -> Check:
        """The check a plugin's :class:`corekv.plugin.Option` declares (its kind, choices,
        minimum, pattern and whether ``""`` is a value)."""
        return cls(option.kind, choices=tuple(option.choices), minimum=option.minimum,
                   pattern=option.pattern, pattern_text=option.pattern_text,
                   allow_empty=option.allow_empty)

    def expected(self) -> str:
        if self.choices:
            return "one of " + ", ".join(str(c) for c in self.choices)
        if self.pattern_text:
            return self.pattern_text
        text = {
            "int": "an integer", "float": "a number",
            "str": "a string" if self.allow_empty else "a non-empty string",
            "bool": "true or false", "size": f"a size such as {SIZE_EXAMPLES}",
            "mapping": "a mapping of names to values (YAML `key: value` lines)",
            "eviction": "the name of a registered eviction policy (lru, lfu, priority, or a "
                        "plugin's; see `corekv plugins`)",
        }[self.kind]
        if self.power_of_two:
            text = "a power of two (1, 2, 4, 8, 16, ...)"
        low, high = self.minimum, self.maximum
        if self.kind == "size":
            if low is not None and low > 1:
                return f"a size of at least {_num(low)} bytes, such as {SIZE_EXAMPLES}"
            return f"a {'non-zero ' if low == 1 else ''}size such as {SIZE_EXAMPLES}"
        if low is not None and high is not None:
            text += f" between {_num(low)} and {_num(high)}"
        elif low is not None and not (self.power_of_two and low <= 1):
            text += f" >= {_num(low)}"
        return text

    def convert(self, value: Any) -> tuple[bool, Any]:
        """``(True, value converted)`` if ``value`` passes, else ``(False, None)``."""
        kind = self.kind
        if kind == "size":
            value = parse_size(value)
            if value is None:
                return False, None
        elif kind == "bool" and not isinstance(value, bool):
            return False, None
        elif kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            return False, None
        elif kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                return False, None
            value = float(value)
        elif kind in ("str", "eviction") and (not isinstance(value, str) or not (value or self.allow_empty)):
            return False, None
        elif kind == "mapping":
            if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
                return False, None
            value = dict(value)
        if self.choices and value not in self.choices:
            return False, None
        if self.minimum is not None and value < self.minimum:
            return False, None
        if self.maximum is not None and value > self.maximum:
            return False, None
        if self.power_of_two and (value < 1 or value & (value - 1)):
            return False, None
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            return False, None
        return True, value

    def hint(self, value: Any) -> str:
        """A suggestion for a rejected value: the closest choice, or quoting advice for YAML."""
        if self.choices or self.suggestions:
            return did_you_mean(value, [str(c) for c in self.choices or self.suggestions])
        if self.kind == "str" and isinstance(value, (int, float, bool)):
            return "; quote it in YAML to make it a string"
        return ""


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
