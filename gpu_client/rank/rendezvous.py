"""How a rank joins its job's process group: meet at rank 0's store, then make the group.

``join`` is the runner's first step with the job (it runs while the bundle loads, in another
thread). Two stages, each a mark of the rank's startup line (``runner.Startup``):

- **met**: every rank connected to rank 0's TCPStore (rank 0 listens on the rendezvous port its
  GPU client offered and waits for the others there). torch's client, finding the port not yet
  listening, tries again only after a backoff with jitter (500 ms +-50 %, then x1.5), so a rank
  whose spec arrived a few milliseconds before rank 0's waited 0.25-0.75 s, and a job of N ranks
  the longest of N-1 such waits: the near-constant "join process group" of the GPU runs. Here
  every other rank first waits for the port to accept, trying every ``POLL`` seconds, and then
  connects at once. The store is the one ``init_process_group(init_method="tcp://...")`` makes
  (same keys, same prefix), so ranks of older GPU clients meet these.
- **joined**: ``init_process_group`` over that store. NCCL makes its communicator at the first
  collective (DDP's first gradient all-reduce, FSDP's first all-gather): measured on 2 x H100,
  that beat making it here (``device_id``) on both submit -> first step (cnn 0.43 s against
  1.00 s) and first step done (5.9 s against 6.4 s), one run each.

Switches a GPU client sets for its ranks (``tuning.Tuning``: ``zwdx gpu-client`` flags or these
variables; the bench compares them in one run); each defaults to what is expected to be fastest,
and none changes what a CPU (gloo) rank does:

- ``ZWDX_EAGER_NCCL=1``: ``device_id`` to ``init_process_group``: NCCL's communicator is made in
  the join (overlapping the bundle's load) instead of at the first collective.
- ``ZWDX_NCCL_CONNECT=init``: sets ``NCCL_RUNTIME_CONNECT=0`` for the rank (unless the donor
  set it), so that NCCL connects its peers in the eager join, while the bundle loads, rather than
  at the first collective. The default, ``runtime``, leaves NCCL's own (lazy since 2.22): eager
  connections are every algorithm's (NVLS's buffers too where NVLink multicast is on), which costs
  GPU memory and lengthens a join that nothing overlaps (a small bundle); measure first.
- ``ZWDX_WARM_CUDA=1``: while the rank joins, a thread makes the cuBLAS and cuDNN handles
  (a tiny bf16 matmul and convolution), which the first step would otherwise make. Off by
  default: the same warm-up in the standby process (``standby.warm_up``, ``kernels``) cost
  2.6 % of steady-state throughput on 2 x H200 for reasons not known; measure before turning it on.
- ``ZWDX_DDP_INIT_SYNC=1`` (``parallel.py``, CPU ranks too): DDP checks the ranks' shapes and
  broadcasts rank 0's weights as it wraps, which the same sha256-checked bundle on every rank
  makes needless (off by default).
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from urllib.parse import urlparse

from .tuning import DEFAULT_TUNING, Tuning

log = logging.getLogger("gpu_client.rank.rendezvous")

#: How often a rank tries rank 0's port until it listens (seconds).
POLL = 0.005


def join(arguments: dict, backend: str, device, timeout: float, mark, tuning: Tuning = DEFAULT_TUNING) -> None:
    """``init_process_group`` with the strategy's ``arguments`` (``rendezvous()``), marking
    ``met`` and ``joined``. ``device``: the rank's torch.device; ``timeout``: the job's
    collective timeout in seconds; ``mark(name)``: the startup's; ``tuning``: the GPU client's switches."""
    import torch.distributed as dist
    cuda = device.type == "cuda"
    if cuda and tuning.nccl_connect == "init":
        os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
    warm = warm_cuda(device) if cuda and tuning.warm_cuda else None
    wait = datetime.timedelta(seconds=timeout)
    init_method = arguments.get("init_method", "")
    if init_method.startswith("tcp://"):
        rank, world_size = arguments["rank"], arguments["world_size"]
        store = meet(init_method, rank, world_size, timeout)
        arguments = {"store": dist.PrefixStore("default_pg", store), "rank": rank, "world_size": world_size}
    mark("met")
    eager = cuda and tuning.eager_nccl
    dist.init_process_group(backend, **arguments, timeout=wait, **({"device_id": device} if eager else {}))
    if warm is not None:
        warm.join()
    mark("joined")


#: Listening sockets this rank was handed (``take_listeners``), by port: its stores serve on them.
_held: dict[int, int] = {}


def take_listeners(count: int) -> None:
    """Receive the ``count`` listening sockets the GPU client sends on this process's channel
    (``CHANNEL_ENV``), for ``tcp_store`` to serve on; the channel is closed either way."""
    from zwdx.protocol.rank import CHANNEL_ENV
    fd = os.environ.pop(CHANNEL_ENV, None)
    if fd is None:
        if count:
            raise RuntimeError(f"the GPU client said it sends {count} listening socket(s), but gave no channel")
        return
    with socket.socket(fileno=int(fd)) as channel:
        if not count:
            return
        _, fds, _, _ = socket.recv_fds(channel, 16, count)
    if len(fds) != count:
        raise RuntimeError(f"the GPU client sent {len(fds)} of the {count} listening socket(s) it said it sends")
    for received in fds:
        hold(socket.socket(fileno=received))


def hold(sock: socket.socket) -> int:
    """Keep the listening ``sock`` for the store this process serves on its port; the port."""
    port = sock.getsockname()[1]
    _held[port] = sock.detach()
    return port


def tcp_store(host: str, port: int, world_size: int, is_master: bool, **options):
    """A TCPStore at ``host:port``; its server, where this rank is the master, serves on the
    socket the GPU client handed over for that port (bound since it was offered), else binds it."""
    import torch.distributed as dist
    fd = _held.pop(port, None) if is_master else None
    if fd is not None:
        options["master_listen_fd"] = fd  # libuv's store (the default) takes the socket over
    return dist.TCPStore(host, port, world_size, is_master, **options)


def meet(init_method: str, rank: int, world_size: int, timeout: float):
    """Rank 0's TCPStore at ``init_method`` (``tcp://host:port``): rank 0 makes it and waits
    for the others; each other rank waits for it to listen, then connects."""
    url = urlparse(init_method)
    host, port = url.hostname, url.port
    deadline = time.monotonic() + timeout
    if rank != 0:
        listening(host, port, deadline)
    left = max(deadline - time.monotonic(), 1.0)
    store = tcp_store(host, port, world_size, rank == 0, timeout=datetime.timedelta(seconds=left),
                      multi_tenant=True)  # as torch's tcp:// rendezvous makes it
    store.set_timeout(datetime.timedelta(seconds=timeout))
    return store


def listening(host: str, port: int, deadline: float) -> bool:
    """Wait until ``host:port`` accepts a connection (closed at once) or ``deadline``
    (``time.monotonic``) passes; whether it did. A store that never comes is then torch's to
    report, with its own error."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL)


def warm_cuda(device) -> threading.Thread:
    """Make the cuBLAS and cuDNN handles of ``device`` in a thread (PyTorch hands a finished
    thread's handles to the next thread that asks), so the first step finds them made."""
    def run():
        import torch
        try:
            with torch.cuda.device(device):
                a = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
                (a @ a).sum().item()
                conv = torch.nn.functional.conv2d
                conv(torch.ones(1, 3, 8, 8, device=device, dtype=torch.bfloat16),
                     torch.ones(4, 3, 3, 3, device=device, dtype=torch.bfloat16)).sum().item()
        except Exception:  # a warm-up that fails costs the first step only
            log.warning("warming %s failed", device, exc_info=True)
    thread = threading.Thread(target=run, name="zwdx-warm-cuda", daemon=True)
    thread.start()
    return thread
