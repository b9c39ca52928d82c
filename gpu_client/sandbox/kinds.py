"""Which isolation a GPU client's rank processes get: ``zwdx gpu-client --isolation``, or the
strongest this machine allows (``build``): a container per rank where Docker can
(``container.DockerIsolation``), else a per-job user when the agent is root
(``isolation.UserIsolation``), else the agent's own user (``isolation.ProcessIsolation``)."""
from __future__ import annotations

import logging
import os

from zwdx.protocol.vocab import Isolation

from .isolation import DEFAULT_UIDS, SYSTEM_RANK_DIR, ProcessIsolation, UserIsolation

log = logging.getLogger("gpu_client.sandbox.kinds")


def build(kind: str | Isolation | None, work_dir: str, rank_dir: str | None = None,
          uids: range | None = None, **docker) -> ProcessIsolation:
    """The isolation asked for; None: a container per rank where Docker can (``container.usable``),
    else a per-job user when this process is root, else the same user. ``docker``: the docker
    kind's options (``container.DockerIsolation``: confinement, server, slots)."""
    if not kind:
        from .container import usable
        why_not = usable(docker["confinement"].images if docker.get("confinement") else None)
        kind = Isolation.DOCKER if why_not is None else Isolation.USER if os.geteuid() == 0 else Isolation.PROCESS
        if why_not is not None:
            log.info("isolation %s: not docker, as %s", kind.value, why_not)
    kind = Isolation(kind)
    if kind == Isolation.DOCKER:
        from .container import DockerIsolation
        return DockerIsolation(work_dir, rank_dir=rank_dir, **docker)
    if kind == Isolation.USER:
        return UserIsolation(rank_dir or SYSTEM_RANK_DIR, uids or DEFAULT_UIDS, work_dir)
    return ProcessIsolation(rank_dir or os.path.join(work_dir, "ranks"), work_dir)
