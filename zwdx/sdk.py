"""The submitter's client.

    from zwdx import ZWDX
    zwdx = ZWDX("http://localhost:4461")
    result = zwdx.submit_job(model=Net(), data_loader_func=..., train_func=..., room_token=token)
    model = zwdx.get_trained_model(result["job_id"], Net())
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time

import requests

from . import defaults
from .bundle import pack
from .errors import BadRequest, JobFailed, ServerUnreachable, ZwdxError, from_response
from .protocol import JobStatus, runtime_versions

log = logging.getLogger(__name__)


class ZWDX:
    """A connection to one zwdx server. Room tokens are given per call or once here."""

    def __init__(self, server_url: str = f"http://localhost:{defaults.PORT}", room_token: str | None = None,
                 timeout: float = 30.0):
        self.server_url = server_url.rstrip("/")
        self.room_token = room_token
        self.timeout = timeout
        self._session = requests.Session()
        self._job_tokens: dict[str, str] = {}

    # -- plumbing ----------------------------------------------------------------------------
    def _token(self, room_token: str | None, job_id: str | None = None) -> str:
        token = room_token or (self._job_tokens.get(job_id) if job_id else None) or self.room_token
        if not token:
            raise BadRequest("a room token is needed: pass room_token=... (from `zwdx room create`)",
                             field="room_token")
        return token

    def _request(self, method: str, path: str, token: str | None = None, **kwargs) -> requests.Response:
        headers = kwargs.pop("headers", {})
        if token:
            headers[defaults.TOKEN_HEADER] = token
        url = f"{self.server_url}{path}"
        try:
            resp = self._session.request(method, url, headers=headers, timeout=kwargs.pop("timeout", self.timeout),
                                         **kwargs)
        except requests.ConnectionError as exc:
            raise ServerUnreachable(f"cannot reach the zwdx server at {self.server_url}: {exc}",
                                    server_url=self.server_url) from None
        except requests.Timeout:
            raise ServerUnreachable(f"the zwdx server at {self.server_url} did not answer in time",
                                    server_url=self.server_url) from None
        if resp.status_code >= 400:
            try:
                body = resp.json()
            except ValueError:
                body = None
            raise from_response(resp.status_code, body)
        return resp

    def _json(self, method: str, path: str, token: str | None = None, **kwargs) -> dict:
        return self._request(method, f"{defaults.API_PREFIX}{path}", token, **kwargs).json()

    # -- rooms -------------------------------------------------------------------------------
    def health(self) -> dict:
        return self._request("GET", "/health").json()

    def create_room(self, name: str = "") -> dict:
        """A new room: ``{"id", "name", "token"}``. The token is shown only this once."""
        return self._json("POST", "/rooms", json={"name": name})

    def get_room(self, room_token: str | None = None) -> dict:
        """The room of the token, with its GPU clients and their slots."""
        return self._json("GET", "/room", self._token(room_token))

    # -- jobs --------------------------------------------------------------------------------
    def submit_job(self, model, data_loader_func, train_func, eval_func=None, optimizer=None,
                   parallelism: str = "DDP", memory_required: int = 0, room_token: str | None = None,
                   epochs: int = 1, world_size: int | None = None, wait: bool = True, progress: bool = True,
                   raise_on_failure: bool = True, name: str = "", collective_timeout: float | None = None,
                   timeout: float | None = None, min_world_size: int | None = None,
                   max_restarts: int = defaults.MAX_RESTARTS, keep_checkpoints: int = defaults.KEEP_CHECKPOINTS,
                   checkpoint_every_epoch: bool = True):
        """Send a training job to a room. Blocks with live progress until it ends and returns the
        result (``wait=False``: returns the job id at once).

        If a GPU client of the job is lost, the job goes on from its last checkpoint, on the
        remaining clients if ``min_world_size`` allows or when a replacement joins, at most
        ``max_restarts`` times. A checkpoint is saved at every epoch end unless
        ``checkpoint_every_epoch=False``; the last ``keep_checkpoints`` are kept."""
        token = self._token(room_token)
        if str(parallelism).upper() not in ("DDP", "FSDP"):
            raise BadRequest(f"parallelism must be 'DDP' or 'FSDP', got {parallelism!r}", field="parallelism")
        blob = pack(model, data_loader_func, train_func, eval_func, optimizer)
        sha = hashlib.sha256(blob).hexdigest()
        artifact = self._json("POST", "/artifacts", token, data=blob,
                              headers={defaults.SHA256_HEADER: sha, "Content-Type": "application/octet-stream"},
                              timeout=max(self.timeout, 600))
        job = self._json("POST", "/jobs", token, json={
            "bundle_artifact": artifact["id"], "parallelism": str(parallelism).upper(), "epochs": epochs,
            "world_size": world_size, "memory_required": memory_required, "versions": runtime_versions(),
            "name": name, "collective_timeout": collective_timeout, "min_world_size": min_world_size,
            "max_restarts": max_restarts, "keep_checkpoints": keep_checkpoints,
            "checkpoint_every_epoch": checkpoint_every_epoch})
        self._job_tokens[job["id"]] = token
        log.info("job %s submitted (%d bytes bundle)", job["id"], len(blob))
        if not wait:
            return job["id"]
        return self.wait(job["id"], room_token=token, progress=progress, raise_on_failure=raise_on_failure,
                         timeout=timeout)

    def wait(self, job_id: str, room_token: str | None = None, progress: bool = True,
             raise_on_failure: bool = True, timeout: float | None = None) -> dict:
        """Block until the job ends; show a progress bar with the latest metrics."""
        token = self._token(room_token, job_id)
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(desc=f"job {job_id}", unit="step", dynamic_ncols=True)
        after, latest, deadline = 0, {}, (time.time() + timeout) if timeout else None
        unreachable_since = None
        try:
            while True:
                try:
                    job = self._json("GET", f"/jobs/{job_id}", token, params={"events_after": after})
                    events = job.pop("events", [])
                    unreachable_since = None
                except ServerUnreachable:
                    # A server restart: keep waiting, within reason.
                    unreachable_since = unreachable_since or time.time()
                    if time.time() - unreachable_since > defaults.OUTAGE_TOLERANCE:
                        raise
                    if bar is not None:
                        bar.set_description(f"job {job_id} (server unreachable, waiting)")
                    time.sleep(1.0)
                    continue
                for ev in events:
                    after = ev["seq"]
                    if ev["kind"] == "metric":
                        latest.update(ev["data"])
                        if bar is not None and ev.get("step") is not None:
                            bar.n = max(bar.n, ev["step"] + 1)
                    elif ev["kind"] == "log" and bar is not None:
                        bar.write(f"[rank {ev.get('rank')}] {ev['data'].get('text', '')}")
                if bar is not None:
                    bar.set_description(f"job {job_id} {job['status']}")
                    bar.set_postfix({k: f"{v:.4g}" for k, v in list(latest.items())[:6]}, refresh=True)
                if JobStatus(job["status"]).finished:
                    break
                if deadline and time.time() > deadline:
                    raise TimeoutError(f"job {job_id} still {job['status']} after {timeout} s")
                time.sleep(defaults.POLL_INTERVAL)
        finally:
            if bar is not None:
                bar.close()
        result = {"job_id": job_id, "status": job["status"], "results": job.get("results") or {},
                  "final_loss": job.get("final_loss"), "world_size": job.get("world_size"),
                  "placement": job.get("placement"), "failures": job.get("failures") or {},
                  "failure_order": job.get("failure_order") or [], "reason": job.get("reason"), "job": job}
        if job["status"] == JobStatus.FAILED.value and raise_on_failure:
            raise JobFailed(f"job {job_id} failed: {job.get('reason')}", job_id=job_id,
                            failures=job.get("failures"), reason=job.get("reason") or "", result=result,
                            failure_order=job.get("failure_order"))
        return result

    def get_job(self, job_id: str, room_token: str | None = None) -> dict:
        return self._json("GET", f"/jobs/{job_id}", self._token(room_token, job_id))

    def list_jobs(self, room_token: str | None = None, status: str | None = None) -> list[dict]:
        params = {"status": status} if status else None
        return self._json("GET", "/jobs", self._token(room_token), params=params)["jobs"]

    def cancel_job(self, job_id: str, room_token: str | None = None) -> dict:
        return self._json("POST", f"/jobs/{job_id}/cancel", self._token(room_token, job_id))

    def get_job_logs(self, job_id: str, room_token: str | None = None) -> list[dict]:
        """Log lines ``{"rank", "text", "ts"}``: what the ranks printed or passed to reporter.log."""
        events = self._json("GET", f"/jobs/{job_id}/events", self._token(room_token, job_id),
                            params={"kind": "log"})["events"]
        return [{"rank": e.get("rank"), "text": e["data"].get("text", ""), "ts": e.get("ts")} for e in events]

    def get_job_metrics(self, job_id: str, room_token: str | None = None) -> dict[str, list[dict]]:
        """Every metric series of the job: name -> ``[{"step", "value", "rank", "ts"}, ...]``;
        "throughput" (samples/s) and, on GPUs, "gpu_utilization" come from the platform."""
        return self._json("GET", f"/jobs/{job_id}/metrics", self._token(room_token, job_id))["series"]

    def get_trained_model(self, job_id: str, model, room_token: str | None = None):
        """Load the job's trained weights into ``model`` and return it. The weights arrive as
        safetensors: nothing the GPU clients sent is unpickled."""
        from safetensors.torch import load_file
        token = self._token(room_token, job_id)
        resp = self._request("GET", f"{defaults.API_PREFIX}/jobs/{job_id}/weights", token, stream=True,
                             timeout=max(self.timeout, 600))
        fd, path = tempfile.mkstemp(suffix=".safetensors")
        try:
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as fh:
                for block in resp.iter_content(defaults.CHUNK_BYTES):
                    digest.update(block)
                    fh.write(block)
            expected = resp.headers.get(defaults.SHA256_HEADER)
            if expected and digest.hexdigest() != expected:
                raise ZwdxError(f"weights of job {job_id} arrived corrupted (sha256 mismatch)", job_id=job_id)
            state = load_file(path)
        finally:
            os.unlink(path)
        model.load_state_dict(state)
        return model
