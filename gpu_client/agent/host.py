"""The machine a GPU client runs on: who it is, and which modules its Python can import.

Both are sent at registration. The host identity tells the scheduler which GPU clients share
one machine's RAM (their CPU slots do); the module names let it keep a job off a GPU client
that could not load its bundle (a package the submitter's code uses is missing). The names are
read again, and sent with a new register if they changed, when the server says a waiting job
needs one this client lacks (a package installed since it started), on SIGHUP and on ``zwdx
gpu-client --refresh`` (``agent.py``).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import pkgutil
import socket
import sys

from zwdx import defaults

log = logging.getLogger(__name__)

#: Where the identity comes from, first found first: the kernel's boot id is the same for every
#: process, container and network namespace of one machine (they share its RAM) and new at
#: each boot; the machine id survives reboots; the hostname is the last resort.
_IDENTITY_FILES = ("/proc/sys/kernel/random/boot_id", "/etc/machine-id", "/var/lib/dbus/machine-id")


def host_id() -> str:
    """A short, stable id shared by every GPU client on this machine (``ZWDX_HOST_ID`` overrides
    it: give each container its own when each has its own memory limit)."""
    if os.environ.get("ZWDX_HOST_ID"):
        return os.environ["ZWDX_HOST_ID"][:64]
    for path in _IDENTITY_FILES:
        try:
            with open(path) as fh:
                value = fh.read().strip()
        except OSError:
            continue
        if value:
            break
    else:
        value = socket.gethostname()
    return hashlib.sha256(value.encode()).hexdigest()[:16]


def importable_modules() -> list[str] | None:
    """Top-level module names this Python can import: what its path holds (packages, modules,
    namespace-package folders), what installed distributions declare in ``top_level.txt``
    (editable installs served by a finder), builtins and what is loaded already. Tens of
    milliseconds. A name missing here may still import through an unusual finder; the
    scheduler only ever uses the list to keep jobs off clients that lack a name. None (not
    checked) past the server's limit on the list's length."""
    names = set(sys.builtin_module_names) | {name.split(".")[0] for name in sys.modules}
    names.update(m.name for m in pkgutil.iter_modules())
    for entry in sys.path:
        try:
            names.update(e.name for e in os.scandir(entry or ".") if e.is_dir() and e.name.isidentifier())
        except OSError:
            continue
    for dist in importlib.metadata.distributions():
        try:
            names.update((dist.read_text("top_level.txt") or "").split())
        except Exception:  # a broken distribution's metadata must not stop a GPU client
            continue
    names = sorted(n for n in names if n.isidentifier() and len(n) <= defaults.MAX_MODULE_NAME)
    if len(names) > defaults.MAX_CLIENT_MODULES:
        log.warning("gpu-client: %d importable modules, more than the %d a server takes: jobs will not be "
                    "checked for packages missing here", len(names), defaults.MAX_CLIENT_MODULES)
        return None
    return names
