"""One rank container, from both ends of the stream that joins it to the agent.

Outside (the agent, ``RankContainer``): a container as the launcher sees a rank process
(``pid``, ``stdin``, ``poll()``, ``wait()``), attached and waited for before it starts so that
neither its first output nor its end is missed. A standby's container is made at once; a fresh
rank's when its ``RankSpec`` line is written (the spec says which GPUs it gets). After the spec,
``ready`` (or closing stdin) sends the files shared into the job's sandbox (``file NAME SIZE``,
then the bytes: its bundle, the CA file), then ``ready``. The container's output goes to the
rank's log. A container that ends before its rank started (a broken image, no such module)
fails the rank with its last output, so that the submitter reads why.

Inside (``python -m gpu_client.sandbox.rank_container [--standby DEVICE]``, what the container runs):
prepare as a standby process does, read the spec, take the files in while the rank joins its
peers (runner.BundleLoader waits for "ready"), enter the sandbox (its path on the host, in the tmpfs),
run the rank as ``runner`` would; and when the stream ends while the rank runs, the agent is
gone: end at once (PR_SET_PDEATHSIG's part for a rank process).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from zwdx import defaults
from zwdx.protocol.rank import RankSpec
from zwdx.protocol.vocab import RankStatus

log = logging.getLogger("gpu_client.sandbox.rank_container")

#: What the container prints once it holds its spec: it started (before it, an exit is a failure to start).
STARTED = b"zwdx-container: rank started"


class _Stdin:
    """What the launcher writes to a rank's stdin, turned into the container's stream."""

    def __init__(self, handle: "RankContainer"):
        self.handle = handle

    def write(self, data: bytes) -> int:
        h = self.handle
        if h.spec is None:
            spec = RankSpec.model_validate_json(data)
            if h.id is None:
                h.spec = spec
                h.create(spec=spec)
            else:  # a standby takes the rank
                h.isolation.let_out(h, spec)
                h.spec = spec
                h.log_to(str(spec.log_path))
            h.send(data)
        elif data.strip() == b"ready":
            h.deliver()
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.handle.spec is not None:
            self.handle.deliver()


class RankContainer:
    """One rank's container as the launcher sees a rank process (see the module)."""

    def __init__(self, isolation, env: dict[str, str], out):
        self.isolation, self.env = isolation, env
        self.id: str | None = None
        self.uid: int | None = None
        self.image: str = isolation.confinement.image
        self.spec: RankSpec | None = None
        self.stdin = _Stdin(self)
        self.returncode: int | None = None
        self.started = False
        self.pid = 0
        self._delivered = False
        self._tail = b""
        self._out = open(os.dup(out.fileno()), "ab")
        self._done = threading.Event()
        self._sock = None

    def create(self, device: str | None = None, spec: RankSpec | None = None) -> None:
        """Create, attach and start the container (a standby's with ``device``, a rank's with ``spec``)."""
        if spec is None:
            gpus = [device.split(":")[1]] if device and device.startswith("cuda") else []
        elif spec.script is not None:
            gpus = [str(g) for g in spec.local_gpus]
        else:
            gpus = [spec.device.split(":")[1]] if spec.device.startswith("cuda") else []
        try:
            self.id = self.isolation.create(self, gpus, spec)
            api = self.isolation.docker.api
            self._waiting = api._post(api._url("/containers/{0}/wait", self.id), params={"condition": "removed"},
                                      stream=True, timeout=None)  # answers its headers at once: the waiter is set
            self._waiting.raise_for_status()
            self._sock = api.attach_socket(self.id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
            threading.Thread(target=self._pump, name=f"out-{self.id[:12]}", daemon=True).start()
            threading.Thread(target=self._wait, name=f"wait-{self.id[:12]}", daemon=True).start()
            api.start(self.id)
        except Exception as exc:
            if self.id is not None:
                try:  # created, never started: not auto-removed
                    self.isolation.docker.api.remove_container(self.id, force=True)
                except Exception:
                    pass
            self.isolation.ended(self)
            self.returncode = 125
            self._done.set()
            if spec is not None:  # the submitter reads why
                report_unstarted(spec, f"its container could not start: {exc}")
            raise OSError(f"the rank's container could not start: {exc}") from exc
        try:
            self.pid = self.isolation.docker.api.inspect_container(self.id)["State"]["Pid"]
        except Exception:
            pass  # it ended already

    def log_to(self, path: str) -> None:
        old, self._out = self._out, open(path, "ab")
        old.close()

    def send(self, data: bytes) -> None:
        self._sock._sock.sendall(data)

    def deliver(self) -> None:
        """The files shared into the sandbox, then ``ready``: once."""
        if self._delivered or self.spec is None or self.spec.sandbox is None:
            return
        self._delivered = True
        try:
            for name, path in self.isolation.files(str(self.spec.sandbox.dir)):
                if "\n" in name:
                    continue  # no such name in a bundle, a CA file or a dataset of zwdx's
                with open(path, "rb") as fh:
                    self.send(f"file {name} {os.fstat(fh.fileno()).st_size}\n".encode())
                    while block := fh.read(1 << 20):
                        self.send(block)
            self.send(b"ready\n")
        except OSError:
            pass  # the container is gone; its exit code says so

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
        if code != 0 and not self.started and self.spec is not None:
            tail = self._tail.decode(errors="replace").strip()[-1500:]
            report_unstarted(self.spec, f"its container (image {self.image}) exited with "
                                        f"code {code} before the rank started" + (f": {tail}" if tail else ""))
        self.isolation.ended(self)
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if self.id is None and not self._done.is_set():
            return 125  # never made: no spec came
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"container {self.id[:12]}", timeout)
        self.close()
        return self.returncode

    def kill(self, signum: int = signal.SIGKILL) -> None:
        if self.id is None:
            return
        try:
            self.isolation.docker.api.kill(self.id, signal=int(signum))
        except Exception:
            pass  # gone already

    def stop(self, grace: float) -> None:
        """SIGTERM, SIGKILL after ``grace`` seconds (Docker's stop); gone already is fine."""
        if self.id is None:
            return
        try:
            self.isolation.docker.api.stop(self.id, timeout=max(1, int(grace)))
        except Exception:
            pass

    def close(self) -> None:
        for closing in (self._sock, self._out):
            try:
                if closing is not None:
                    closing.close()
            except Exception:
                pass


def report_unstarted(spec: RankSpec, message: str) -> None:
    """A rank whose container ended before it started: its failure, with the container's last words."""
    from gpu_client.outage import http_session
    session = http_session(spec.rank_key.get_secret_value(), spec.ca_file or True, spec.outage_tolerance)
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
    """Prepare (a standby), read the spec, take the files in while the rank joins its peers,
    run the rank; end at once if the agent goes (its stream ends)."""
    stdin = sys.stdin.buffer
    from . import folder as sandbox
    from gpu_client.rank.runner import rank_for
    from gpu_client.rank.standby import prepare
    from gpu_client.rank.tuning import Tuning

    from .rank_process import enter
    tuning = Tuning.from_environ()
    if argv[:1] == ["--standby"] and len(argv) == 2:
        prepare(argv[1], tuning.standby_warmup)
    line = stdin.readline()
    if not line.strip():
        return 0  # let go before it got a rank
    spec = RankSpec.model_validate_json(line)
    update = {"bundle_pending": True, "log_path": None}
    if spec.device.startswith("cuda"):  # its GPUs are 0.. inside, whatever their indexes outside
        update["device"] = f"cuda:{spec.local_gpus.index(int(spec.device[5:])) if spec.script else 0}"
    if spec.local_gpus:
        update["local_gpus"] = list(range(len(spec.local_gpus)))
    spec = spec.model_copy(update=update)
    box = str(spec.sandbox.dir)
    for name in (sandbox.HOME, sandbox.TMP):  # the job's own folders, as a sandbox on the host has them
        os.makedirs(os.path.join(box, name), mode=0o700, exist_ok=True)
    sys.stdout.buffer.write(STARTED + b"\n")
    sys.stdout.flush()
    ready_r, ready_w = os.pipe()
    sys.stdin = os.fdopen(ready_r, "r")  # what runner.BundleLoader waits on: "ready" once the bundle is in
    threading.Thread(target=_take_files, args=(stdin, box, ready_w), daemon=True).start()
    enter(spec.sandbox)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {spec.rank} %(name)s: %(message)s")
    return rank_for(spec, tuning).run()


def _take_files(stdin, box: str, ready_w: int) -> None:
    """``file PATH SIZE`` and SIZE bytes, each into the sandbox, then ``ready``; then wait for the
    stream's end (the agent gone), and end the container."""
    try:
        while True:
            line = stdin.readline().rstrip(b"\n")
            if not line.startswith(b"file "):
                break
            name, size = line[5:].rsplit(b" ", 1)
            left, path = int(size), os.path.normpath(os.path.join(box, name.decode()))
            if not path.startswith(box + os.sep):
                break  # not the agent's: it sends paths inside the sandbox only
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            with open(path, "wb") as fh:
                while left and (block := stdin.read(min(left, 1 << 20))):
                    fh.write(block)
                    left -= len(block)
            os.chmod(path, 0o444)
        if line == b"ready":
            os.write(ready_w, b"ready\n")
        os.close(ready_w)  # no "ready" before it closes: the bundle did not come
        while stdin.read(1 << 16):
            pass
    except (OSError, ValueError):
        pass
    os._exit(137)  # the agent's stream ended while the rank ran: the agent is gone


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
