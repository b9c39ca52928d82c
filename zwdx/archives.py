"""Unpacking a tar that crossed the wire (a script job's working dir on a GPU client, a job's
outputs on the submitter's machine) is done with tarfile's data filter only (PEP 706): it refuses
an entry that would land outside the folder, link out of it, or be a device. Pythons before
3.10.12 and 3.11.4 lack it, and zwdx then unpacks nothing rather than unpack without it."""
from __future__ import annotations

import sys
import tarfile


def data_filter_missing() -> str | None:
    """None where this Python's tarfile has the data filter; else what is missing, as a refusal
    says it: "Python 3.11.2 lacks tarfile's data filter (3.10.12, 3.11.4 and later have it)"."""
    if hasattr(tarfile, "data_filter"):
        return None
    return f"Python {sys.version.split()[0]} lacks tarfile's data filter (3.10.12, 3.11.4 and later have it)"
