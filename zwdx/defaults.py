"""Documented constants. Every one can be overridden by the server's config or the CLI."""

#: Port the server listens on.
PORT = 4461
#: Prefix of the REST API.
API_PREFIX = "/api/v1"
#: Largest artifact (bundle, checkpoint, weights) the server accepts, in bytes.
MAX_ARTIFACT_BYTES = 8 * 1024**3
#: Largest request body other than an artifact's bytes (every JSON body), in bytes.
MAX_REQUEST_BYTES = 8 * 1024**2
#: Jobs a room may have waiting or running at once (0: no limit).
ROOM_MAX_JOBS = 100
#: Bytes of artifacts (bundles, checkpoints, weights) and of metric and log events (their JSON) a
#: room may keep (0: no limit).
ROOM_MAX_ARTIFACT_BYTES = 100 * 1024**3
#: Metric and log events a room may keep, all its jobs together (0: no limit).
ROOM_MAX_EVENTS = 10_000_000
#: Event posts one rank of a job may make (a rate, as the `limits` library parses it); a rank's
#: reporter posts at most every 0.2 s and retries a refused (429) batch later.
RATE_LIMIT_EVENTS = "20 per second; 600 per minute"
#: Points a metric series of a job shows at most (``GET /jobs/<id>/metrics``): past it, the series
#: is thinned to the first and last point of each of MAX_SERIES_POINTS / 2 spans of the job's events.
MAX_SERIES_POINTS = 10_000
#: Free bytes the server keeps on its data dir's disk: below it, uploads, events and new jobs
#: are refused (507) rather than fill the disk (0: no floor).
MIN_FREE_BYTES = 1024**3
#: Rooms one address may create (a rate, as the `limits` library parses it: "10 per minute").
RATE_LIMIT_ROOMS = "20 per minute; 200 per day"
#: Requests with a wrong room token or rank key one address may make before it is refused (429)
#: for the rest of the window.
RATE_LIMIT_AUTH_FAILURES = "60 per minute"
#: Seconds between two sweeps of unreferenced artifacts (0: never).
SWEEP_INTERVAL = 300.0
#: Seconds an uploaded bundle may wait for its job (and a half-written upload lie) before it is deleted.
UNATTACHED_GRACE = 3600.0
#: Seconds a finished job keeps its artifacts (bundle, checkpoints, weights; 0: for ever).
ARTIFACT_RETENTION = 0.0
#: Seconds between a GPU client's heartbeats (the shortest: see HEARTBEAT_RATE).
HEARTBEAT_INTERVAL = 2.0
#: A GPU client silent for this long is declared lost (also the grace a restarted server gives
#: its GPU clients to reconnect). Stretched with the heartbeat interval (HEARTBEAT_RATE).
CLIENT_TIMEOUT = 8.0
#: Heartbeats per second one server process aims at, all its GPU clients together: past
#: HEARTBEAT_RATE x HEARTBEAT_INTERVAL clients, it asks them for a longer interval (in 0.5 s
#: steps, at most HEARTBEAT_MAX_STRETCH x HEARTBEAT_INTERVAL) and stretches CLIENT_TIMEOUT alike.
#: 0: the interval stays HEARTBEAT_INTERVAL.
HEARTBEAT_RATE = 250.0
HEARTBEAT_MAX_STRETCH = 3.0
#: A GPU client whose connection dropped is declared lost if it is not back within this time.
DISCONNECT_GRACE = 3.0
#: Checkpoints kept per job (older ones are deleted).
KEEP_CHECKPOINTS = 2
#: Bounded timeout of torch.distributed collectives, in seconds: a dead peer fails a job in minutes.
COLLECTIVE_TIMEOUT = 300
#: Seconds the rank-0 GPU client gets to answer a port reservation.
RESERVE_TIMEOUT = 10.0
#: Seconds a placed job's ranks get to report running (bundle, datasets and image fetched) before
#: the job is placed again on other GPU clients (0: never).
START_TIMEOUT = 600.0
#: Placements that did not start (START_TIMEOUT, or no rendezvous address) after which the job fails.
START_TRIES = 3
#: GPU clients one donor token may have online at once, slots one GPU client may offer, and
#: registers one donor token may make (a rate, as the `limits` library parses it).
DONOR_MAX_CLIENTS = 64
CLIENT_MAX_SLOTS = 16
RATE_LIMIT_REGISTERS = "120 per minute"
#: Seconds a GPU client may stay offline before its record is dropped from its room (a room may
#: set its own, ``PATCH /room``; 0: never). A client that comes back registers again.
CLIENT_RETENTION = 86400.0
#: Least seconds between two looks of a GPU client at what its Python can import, when the
#: server says a waiting job needs a package it lacks (``gpu_client/agent/host.py``).
MODULES_REFRESH = 30.0
#: The most memory a slot may claim: a GPU's (the largest made has 288 GB), a CPU slot's (its
#: machine's RAM). A register past these is refused, not believed.
MAX_GPU_MEMORY = 512 * 1024**3
MAX_HOST_MEMORY = 64 * 1024**4
#: Shortest time between the SDK's polls of a job it waits on: after an answer that brought
#: news at once, it waits out the rest before asking again, so that more news gathers.
POLL_INTERVAL = 1.0
#: Longest a poll of a job may be held on the server until the job has news (``?wait=``).
LONG_POLL_MAX = 25.0
#: Seconds the SDK asks a poll to be held for (below its request timeout, and the balancer's).
LONG_POLL = 10.0
#: Seconds between a held poll's looks at the store, for news a wake-up did not bring (from
#: another server process).
LONG_POLL_RECHECK = 1.0
#: Chunk size for streaming artifacts.
CHUNK_BYTES = 1024 * 1024
#: Header that carries a room token (a submitter token on REST; see zwdx.protocol.tokens).
TOKEN_HEADER = "X-Zwdx-Room-Token"
#: Header that carries a rank key (held by one rank process of a running job).
RANK_KEY_HEADER = "X-Zwdx-Rank-Key"
#: Seconds a server process trusts what it read of a token before it asks the store again: a
#: token revoked or rotated on another server process stops working within this time (at once
#: on the process that did it).
CREDENTIAL_CACHE_S = 2.0
#: Seconds after a job failed during which its ranks may still report their own failure and
#: their last log lines (the traceback of a rank that lost its peers as the job failed).
FAILURE_REPORT_GRACE = 60.0
#: Header that carries an artifact's sha256 on upload.
SHA256_HEADER = "X-Zwdx-Sha256"
#: Seconds between reports of throughput and GPU utilisation by rank 0.
SYSTEM_METRICS_INTERVAL = 2.0
#: How many restarts a job gets before it fails for good (see the failure issue).
MAX_RESTARTS = 3
#: Seconds a rank or the SDK keeps retrying while the server is unreachable (a server restart or
#: upgrade): a rank's uploads, events and status wait this long before its job fails
#: (``zwdx gpu-client --outage-tolerance``).
OUTAGE_TOLERANCE = 900.0
#: Most top-level module names a job may require (``required_modules``) and a GPU client may
#: report it can import (at registration), and the longest such name.
MAX_REQUIRED_MODULES = 1000
#: The most bytes a LoRA job's adapter config (peft's JSON) may take in its spec.
MAX_LORA_CONFIG_BYTES = 64 * 1024
MAX_CLIENT_MODULES = 50000
MAX_MODULE_NAME = 200
#: Bytes each way of a GPU client's link measurement at register (``gpu_client/agent/link.py``), and
#: the most the server sends or reads for one (``GET``/``POST /api/v1/link``).
LINK_PROBE_BYTES = 1024**2
LINK_PROBE_MAX_BYTES = 4 * 1024**2
#: Seconds a GPU client keeps its link figures before it measures again at a register.
LINK_REFRESH = 3600.0
#: Link measurement requests one address may make (a rate, as the `limits` library parses it: "10 per minute").
RATE_LIMIT_LINK = "30 per minute; 300 per day"
#: Seconds a GPU client waits for a TCP connection to a peer of a DDP/FSDP job before it calls
#: the peer unreachable (``gpu_client/agent/reach.py``).
REACH_TIMEOUT = 3.0
#: Seconds the server remembers that two GPU clients could not reach each other.
UNREACHABLE_TTL = 3600.0
#: Datasets (``zwdx data push``, ``zwdx.datasets``): the size files are cut into chunks at, the
#: largest chunk the server takes, the most files one version holds, the most chunks one
#: question may ask about, and the most datasets one job may name.
DATASET_CHUNK_BYTES = 8 * 1024**2
MAX_DATASET_CHUNK_BYTES = 256 * 1024**2
MAX_DATASET_FILES = 20000
MAX_DATASET_CHUNK_QUERY = 10000
MAX_JOB_DATASETS = 16
#: Bytes a GPU client's dataset cache may hold (``zwdx gpu-client --dataset-cache-bytes``): the
#: least recently used datasets go to make room; it also never fills the disk past what is free.
DATASET_CACHE_BYTES = 50 * 1024**3
#: Seconds the scheduler's lease lasts unless renewed, when several server processes share a
#: store (``ZWDX_MESSAGE_QUEUE`` set): another process takes it over this long after its
#: holder died. Renewed every third of it.
SCHEDULER_LEASE_TTL = 6.0
#: The server's connections (``zwdx/server/connections.py``): seconds a connection has to send a
#: request's line and headers, seconds a kept-alive one may wait before its next request, and
#: connections one address may hold at once (0: no cap; not applied behind PROXY_HOPS proxies).
HEADER_TIMEOUT = 10.0
IDLE_TIMEOUT = 60.0
#: Seconds a JSON body (at most MAX_REQUEST_BYTES) has to arrive once its headers are in (0: no limit).
BODY_TIMEOUT = 30.0
MAX_CONNECTIONS_PER_ADDRESS = 1000
#: Engine.IO sessions one address may have open (0: no cap), and seconds a session has to connect
#: to /gpu or /ui with its token before it is closed (``zwdx/server/socket_edge.py``).
SOCKET_SESSIONS_PER_ADDRESS = 256
SOCKET_AUTH_TIMEOUT = 10.0
#: ``parallelism="AUTO"`` (``zwdx.server.auto``): the slowest link to the server (bytes/s) at which a
#: job spanning hosts still runs DDP/FSDP/PIPELINE rather than DILOCO (1 Gbit/s: a guess until the
#: device bench measures where DDP's all-reduce stops paying, docs/modes/auto.md); the share of a
#: slot's free memory held back; one rank's activations as a multiple of the parameters' bytes
#: when the submitter neither measured nor stated them.
AUTO_MIN_LINK = 125_000_000.0
AUTO_MARGIN = 0.2
AUTO_ACTIVATION_FACTOR = 1.0
