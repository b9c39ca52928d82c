"""Socket.IO namespaces and event names: GPU clients on ``/gpu``, dashboards on ``/ui``.

A GPU client connects to ``/gpu`` with its room's donor token, a dashboard to ``/ui`` with a
submitter token (``zwdx.protocol.tokens``); any other connection is refused. The payload of
each event is a declared type (see ``docs/architecture.md`` for the table).
"""
from __future__ import annotations

# Socket.IO events, GPU client namespace "/gpu".
GPU_NAMESPACE = "/gpu"
EV_REGISTER = "register"            # client -> server {client_id, hostname, host_id, slots, versions, modules,
                                    #                   advertise_addr, reach_port, link, running, client_secret}
EV_HEARTBEAT = "heartbeat"          # client -> server {slots, running}
EV_RESERVE_PORT = "reserve_port"    # server -> rank-0 client (call) {job_id} -> {addr, port}
EV_JOB_ASSIGN = "job_assign"        # server -> client {job_id, ranks (each with its rank key), master_addr, ...}
EV_RANKS_EXITED = "ranks_exited"    # client -> server {job_id, exits: {rank: returncode}}
EV_JOB_CANCEL = "job_cancel"        # server -> client {job_id, reason}
EV_UNREACHABLE = "unreachable"      # client -> server {job_id, attempt, peers: {client_id: error}}
EV_REFRESH = "refresh"              # server -> client {modules, reason}: look again at what is importable

# Socket.IO events, dashboard namespace "/ui" (connect with auth {token: a submitter token}; server -> browser).
UI_NAMESPACE = "/ui"
EV_JOB_UPDATE = "job_update"        # server -> browser: a job document
EV_JOB_EVENTS = "job_events"        # server -> browser {job_id, events: [...]}
EV_CLIENTS_UPDATE = "clients_update"  # server -> browser {clients: [...]}

__all__ = ['GPU_NAMESPACE', 'EV_REGISTER', 'EV_HEARTBEAT', 'EV_RESERVE_PORT', 'EV_JOB_ASSIGN', 'EV_RANKS_EXITED', 'EV_JOB_CANCEL', 'EV_UNREACHABLE', 'EV_REFRESH', 'UI_NAMESPACE', 'EV_JOB_UPDATE', 'EV_JOB_EVENTS', 'EV_CLIENTS_UPDATE']
