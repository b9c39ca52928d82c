"""Tests of ``submit_job``'s earlier keywords (``world_size=``, ``diloco=``, ``tp_plan=``, ...).

Everywhere else the suite submits with the settings objects, and pyproject's filterwarnings turns
the earlier form's FutureWarning into an error, so that no test drifts back to it unseen. A test
whose point is the earlier form (its errors name the flat fields, as they always did) says so::

    with earlier_form():
        sdk.submit_job(model, loaders, train, parallelism="TP", tp_plan=plan)
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from zwdx.sdk import submission


@contextlib.contextmanager
def earlier_form() -> Iterator[None]:
    """Expects the earlier form's FutureWarning inside; the SDK warns once per keyword and process,
    so each keyword is warned of again here, whatever ran before."""
    saved = set(submission._warned)
    submission._warned.clear()
    try:
        with pytest.warns(FutureWarning, match=r"submit_job\(\w+=\.\.\.\) is the earlier form"):
            yield
    finally:
        submission._warned.clear()
        submission._warned.update(saved)
