"""Byte sizes as people write them (``8GiB``, ``512MB``, ``2G``, ``1000000``) and as a person
reads them back (``3.2 MiB``): the CLI's size flags, their ``ZWDX_*`` variables, and what
``zwdx room show`` prints."""
from __future__ import annotations

import argparse
import re

#: Units taken: powers of 1024 for the short ones and the *iB ones (as torch prints), of 1000 for kB/MB/GB/TB.
UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
         "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4, "tb": 1000**4, "tib": 1024**4}


def parse(text: str | int) -> int:
    """``8GiB`` -> 8589934592; ValueError naming what it expected."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in UNITS:
        raise ValueError(f"{text!r} is not a size (8GiB, 512MB, 1000000)")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def argument(text: str) -> int:
    """``8GiB`` -> 8589934592: argparse's ``type`` for a size flag (its error says what it expected)."""
    try:
        return parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def human(n: int | float) -> str:
    """``3355443`` -> ``3.2 MiB``; ``0`` -> ``0 B``."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
