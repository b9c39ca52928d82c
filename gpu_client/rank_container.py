"""One rank container, from both ends of the stream that joins it to the agent.

Outside (the agent, ``RankContainer``): a container as the agent sees a rank process (``pid``,
``poll()``, ``wait()``), attached and waited for before it starts so that neither its first
output nor its end is missed. The agent writes the rank's ``RankSpec`` line, then the job's
bundle (``bundle N``, then N bytes); the container's output goes to the rank's log file. A
container that ends before its rank started (a broken image, no such module) fails the rank
with its last output, so that the submitter reads why.

Inside (``python -m gpu_client.rank_container [--standby DEVICE]``, what the container runs):
prepare as a standby process does, read the spec, take the bundle in while the rank joins its
peers (runner.BundleLoader waits for its "ready"), run the rank; and when the stream ends while
the rank runs, the agent is gone: end at once (PR_SET_PDEATHSIG's part for a rank process).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

from zwdx import defaults
from zwdx.protocol.rank import RankSpec
from zwdx.protocol.vocab import RankStatus

log = logging.getLogger("gpu_client.rank_container")

#: Inside the container: the work dir (a tmpfs) and the bundle's place in it.
WORK, BUNDLE = "/work", "/work/bundle.zwdx"
#: What the container prints once it holds its spec: it started (before it, an exit is a failure to start).
STARTED = b"zwdx-container: rank started"


class RankContainer:
    """One rank's container as the agent sees a rank process: ``pid``, ``poll()``, ``wait()``.
    Attached and waited for before it starts, so neither its first output nor its end is missed."""

    def __init__(self, api, container_id: str, log_path: str, report=None, on_end=None):
        self.api, self.id = api, container_id
        self.spec: RankSpec | None = None
        self.report = report            # called with (spec, message) when it exits before its rank started
        self.on_end = on_end            # called once it is gone
        self.returncode: int | None = None
        self.started = False
        self.pid = 0
        self._tail = b""
        self._out = open(log_path, "ab")
        self._done = threading.Event()
        self._waiting = api._post(api._url("/containers/{0}/wait", container_id), params={"condition": "removed"},
                                  stream=True, timeout=None)  # answers its headers at once: the waiter is set
        self._waiting.raise_for_status()
        self._sock = api.attach_socket(container_id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
        threading.Thread(target=self._pump, name=f"out-{container_id[:12]}", daemon=True).start()
        threading.Thread(target=self._wait, name=f"wait-{container_id[:12]}", daemon=True).start()

    def start(self) -> None:
        self.api.start(self.id)
        try:
            self.pid = self.api.inspect_container(self.id)["State"]["Pid"]
        except Exception:
            pass  # it ended already

    def log_to(self, path: str) -> None:
        old, self._out = self._out, open(path, "ab")
        old.close()

    def send(self, data: bytes) -> None:
        self._sock._sock.sendall(data)

    def send_bundle(self, path: str) -> None:
        with open(path, "rb") as fh:
            self.send(f"bundle {os.fstat(fh.fileno()).st_size}\n".encode())
            while block := fh.read(1 << 20):
                self.send(block)

    def _pump(self) -> None:
        from docker.utils.socket import frames_iter
        try:
            for _, data in frames_iter(self._sock, tty=False):
                if not self.started and STARTED in self._tail[-len(STARTED):] + data:
                    self.started = True
                self._tail = (self._tail + data)[-4096:]
                try:
                    self._out.write(data)
                    self._out.flush()
                except ValueError:
                    pass  # log_to swapped the file meanwhile
        except Exception:
            pass  # the stream ended with the container

    def _wait(self) -> None:
        try:
            code = int(json.loads(self._waiting.content or b"{}").get("StatusCode", 125))
        except Exception:
            code = 125
        self.returncode = code
        time.sleep(0.2)  # its last output, still in the stream
        if code != 0 and not self.started and self.spec is not None and self.report is not None:
            tail = self._tail.decode(errors="replace").strip()[-1500:]
            self.report(self.spec, f"its container exited with code {code} before the rank started"
                                   + (f": {tail}" if tail else ""))
        if self.on_end is not None:
            self.on_end(self)
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"container {self.id[:12]}", timeout)
        self.close()
        return self.returncode

    def stop(self, grace: float) -> None:
        """SIGTERM, SIGKILL after ``grace`` seconds (Docker's stop); gone already is fine."""
        try:
            self.api.stop(self.id, timeout=max(1, int(grace)))
        except Exception:
            pass

    def close(self) -> None:
        for closing in (self._sock, self._out):
            try:
                closing.close()
            except Exception:
                pass


def report_unstarted(spec: RankSpec, message: str) -> None:
    """A rank whose container ended before it started: its failure, with the container's last words."""
    from .reporter import http_session
    session = http_session(spec.rank_key.get_secret_value(), retries=2)
    try:
        session.post(f"{spec.server.rstrip('/')}{defaults.API_PREFIX}/jobs/{spec.job_id}/ranks/{spec.rank}",
                     json={"status": RankStatus.FAILED.value, "error": f"{spec.where}: {message}",
                           "traceback": message}, timeout=15)
    except Exception as exc:
        log.warning("job %s rank %d: could not report its container's failure: %s", spec.job_id, spec.rank, exc)
    finally:
        session.close()


# -- inside the container ----------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    """Prepare (a standby), read the spec, take the bundle in while the rank joins its peers,
    run the rank; end at once if the agent goes (its stream ends)."""
    stdin = sys.stdin.buffer
    from .runner import Trainer  # ahead of the spec, as a rank process has it
    if argv[:1] == ["--standby"] and len(argv) == 2:
        from .standby import prepare
        prepare(argv[1])
    line = stdin.readline()
    if not line.strip():
        return 0  # let go before it got a rank
    spec = RankSpec.model_validate_json(line)
    device = "cuda:0" if spec.device.startswith("cuda") else "cpu"  # its one GPU, whatever its index outside
    spec = spec.model_copy(update={"device": device, "bundle_path": BUNDLE, "bundle_pending": True, "log_path": None})
    sys.stdout.buffer.write(STARTED + b"\n")
    sys.stdout.flush()
    ready_r, ready_w = os.pipe()
    sys.stdin = os.fdopen(ready_r, "r")  # what runner.BundleLoader waits on: "ready" once the bundle is in
    threading.Thread(target=_take_bundle, args=(stdin, ready_w), daemon=True).start()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {spec.rank} %(name)s: %(message)s")
    return Trainer(spec).run()


def _take_bundle(stdin, ready_w: int) -> None:
    try:
        header = stdin.readline().split()
        if header[:1] == [b"bundle"] and len(header) == 2:
            left = int(header[1])
            with open(BUNDLE, "wb") as fh:
                while left and (block := stdin.read(min(left, 1 << 20))):
                    fh.write(block)
                    left -= len(block)
            if not left:
                os.write(ready_w, b"ready\n")
        os.close(ready_w)  # no "ready" before it closes: the bundle did not come
        while stdin.read(1 << 16):
            pass
    except (OSError, ValueError):
        pass
    os._exit(137)  # the agent's stream ended while the rank ran: the agent is gone


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
