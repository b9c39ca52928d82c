"""A job's result, and the calls that read a job and what it made: its document, logs,
metrics, trained weights.

``Result`` is typed and still reads as the dict it was: ``result.status`` and ``result["status"]``.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Any

from .. import defaults, lora as _lora, trackers as _trackers
from ..errors import BadRequest, JobFailed, ZwdxError
from ..protocol import JobStatus
from ..protocol.flat import nest
from ..protocol.job import suspect_rank
from ..protocol.report import from_wire


class ResultStatus(str):
    """The status in a job's result: a plain string ("completed", "failed", "cancelled") that
    also equals "complete", the earlier project's word for "completed", so code written for
    either works. It serialises, prints and hashes as the string itself."""

    _EARLIER = {"completed": "complete"}

    def __eq__(self, other):
        if isinstance(other, str) and self._EARLIER.get(str.__str__(self)) == str.__str__(other):
            return True
        return str.__eq__(self, other)

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = str.__hash__


def numbers(job: dict) -> dict:
    """A job as the API answers it, with the non-finite numbers it reported (its final loss, its
    results) as floats again: JSON carries them as "NaN", "Infinity", "-Infinity"."""
    out = dict(job)
    for name in ("final_loss", "results"):
        if out.get(name) is not None:
            out[name] = from_wire(out[name])
    return out


class Result(dict):
    """What ``submit_job`` and ``wait`` return: a dict (``result["status"]``, as before) whose
    keys are also typed attributes (``result.status``)."""

    @property
    def job_id(self) -> str:
        return self["job_id"]

    @property
    def status(self) -> ResultStatus:
        return self["status"]

    @property
    def complete(self) -> bool:
        return self["complete"]

    @property
    def results(self) -> dict[str, Any]:
        """What ``train_func`` and ``eval_func`` returned, by name."""
        return self["results"]

    @property
    def final_loss(self) -> float | None:
        return self["final_loss"]

    @property
    def world_size(self) -> int | None:
        return self["world_size"]

    @property
    def placement(self) -> list[dict] | None:
        return self["placement"]

    @property
    def failures(self) -> dict[str, str]:
        """rank -> traceback"""
        return self["failures"]

    @property
    def failure_order(self) -> list[str]:
        return self["failure_order"]

    @property
    def reason(self) -> str | None:
        return self["reason"]

    @property
    def warnings(self) -> list[str]:
        return self["warnings"]

    @property
    def suspects(self) -> list[dict]:
        """The ranks named dishonest, every attempt's (``{rank, attempt, client_id, rounds, reason, ...}``)."""
        return self["suspects"]

    @property
    def auto(self) -> dict | None:
        """``parallelism="AUTO"``: the mode chosen as it was placed and why (``{"parallelism", "reason",
        "at"}``); None for a job of another mode."""
        return self["auto"]

    @property
    def job(self) -> dict:
        """The job's last document."""
        return self["job"]


def result_of(job: dict, raise_on_failure: bool) -> Result:
    """The ``Result`` of a job that ended (``JobFailed`` for a failed one, unless not asked)."""
    job = numbers(job)
    status = ResultStatus(job["status"])
    suspects = sorted(({**v, "rank": suspect_rank(k, v), "attempt": v.get("attempt", 0)}
                       for k, v in (job.get("suspects") or {}).items()), key=lambda s: (s["attempt"], s["rank"]))
    result = Result({"job_id": job["id"], "status": status, "complete": status == JobStatus.COMPLETED.value,
                     "results": job.get("results") or {}, "final_loss": job.get("final_loss"),
                     "world_size": job.get("world_size"), "placement": job.get("placement"),
                     "failures": job.get("failures") or {}, "failure_order": job.get("failure_order") or [],
                     "reason": job.get("reason"), "job": job, "warnings": job.get("warnings") or [],
                     "suspects": suspects, "auto": job.get("auto")})
    if job["status"] == JobStatus.FAILED.value and raise_on_failure:
        raise JobFailed(f"job {job['id']} failed: {job.get('reason')}", job_id=job["id"],
                        failures=job.get("failures"), reason=job.get("reason") or "", result=result,
                        failure_order=job.get("failure_order"))
    return result


class Reads:
    """``ZWDX``'s calls that read a job and what it made."""

    def get_job(self, job_id: str, room_token: str | None = None) -> dict:
        return numbers(self._json("GET", f"/jobs/{job_id}", self._token(room_token, job_id)))

    def list_jobs(self, room_token: str | None = None, status: str | None = None) -> list[dict]:
        params = {"status": status} if status else None
        return [numbers(j) for j in self._json("GET", "/jobs", self._token(room_token), params=params)["jobs"]]

    def cancel_job(self, job_id: str, room_token: str | None = None) -> dict:
        return self._json("POST", f"/jobs/{job_id}/cancel", self._token(room_token, job_id))

    def get_job_logs(self, job_id: str, room_token: str | None = None) -> list[dict]:
        """Log lines ``{"rank", "text", "ts"}``: what the ranks printed or passed to reporter.log."""
        token, events, after = self._token(room_token, job_id), [], 0
        while after is not None:  # a page at a time, as the server answers them
            page = self._json("GET", f"/jobs/{job_id}/events", token, params={"kind": "log", "after": after})
            events += page["events"]
            after = page.get("next") if page["events"] else None
        return [{"rank": e.get("rank"), "text": e["data"].get("text", ""), "ts": e.get("ts")} for e in events]

    def export_metrics(self, job_id: str, trackers, room_token: str | None = None) -> int:
        """Send every metric the job reported so far to ``trackers`` (as in ``submit_job``), in
        the order the server stored them, but those a tracker holds already: exported again into
        the same TensorBoard log dir, only the points reported since are added. Returns how many
        events were read."""
        token = self._token(room_token, job_id)
        feed = _trackers.Feed(_trackers.make(trackers), self._json("GET", f"/jobs/{job_id}", token))
        after, sent = feed.after, 0  # what an earlier export left in a tracker is not sent again
        try:
            while True:
                events = self._json("GET", f"/jobs/{job_id}/events", token,
                                    params={"kind": "metric", "after": after})["events"]
                if not events:
                    return sent
                for ev in events:
                    feed.event(ev.get("rank"), ev.get("step"), from_wire(ev["data"]), ev["seq"])
                    after, sent = ev["seq"], sent + 1
        finally:
            feed.close()

    def get_job_metrics(self, job_id: str, room_token: str | None = None) -> dict[str, list[dict]]:
        """Every metric series of the job: name -> ``[{"step", "value", "rank", "ts"}, ...]``, at
        most the server's ``MAX_SERIES_POINTS`` points each (a longer series keeps its first and
        last points and those at the edges of its spans, ``zwdx.server.series``);
        "throughput" (samples/s) and, on GPUs, "gpu_utilization" come from the platform. A value
        that was NaN or infinite is that float again (it travels as "NaN", "Infinity", "-Infinity")."""
        token, series, params = self._token(room_token, job_id), {}, {"after": 0}
        while True:  # a page at a time; a series longer than the server's MAX_SERIES_POINTS comes thinned
            page = self._json("GET", f"/jobs/{job_id}/metrics", token, params=params)
            for name, points in page["series"].items():
                series.setdefault(name, []).extend({**p, "value": from_wire(p.get("value"))} for p in points)
            if page.get("next") is None:
                return series
            params = {"after": page["next"], "stride": page["stride"]}

    def get_trained_model(self, job_id: str, model, room_token: str | None = None):
        """Load the job's trained weights into ``model`` and return it. The weights arrive as
        safetensors: nothing the GPU clients sent is unpickled. A LoRA job's are its adapter:
        ``model`` (the base model, or a peft model of the same config) comes back as the peft
        model with the trained adapter loaded."""
        config = _lora_config(self.get_job(job_id, room_token))
        state = self._weights(job_id, room_token)
        if config is not None:
            return _lora.load_adapter(model, config, state)
        model.load_state_dict(state)
        return model

    def get_adapter(self, job_id: str, room_token: str | None = None) -> dict:
        """A LoRA job's trained adapter: its tensors by name, as ``peft.get_peft_model_state_dict``
        names them (``set_peft_model_state_dict`` loads them)."""
        if _lora_config(self.get_job(job_id, room_token)) is None:
            raise BadRequest(f"job {job_id} is not a LoRA job: its weights are the whole model "
                             f"(get_trained_model)", field="job_id")
        return self._weights(job_id, room_token)

    def _weights(self, job_id: str, room_token: str | None) -> dict:
        from safetensors.torch import load_file
        fd, path = tempfile.mkstemp(suffix=".safetensors")
        os.close(fd)
        try:
            self.download_weights(job_id, path, room_token)
            return load_file(path)
        finally:
            os.unlink(path)

    def download_weights(self, job_id: str, path: str, room_token: str | None = None) -> dict:
        """Write the job's trained weights (a safetensors file) to ``path``, checked against the
        sha256 the server has for them. Returns ``{"path", "bytes", "sha256"}``."""
        token = self._token(room_token, job_id)
        resp = self._request("GET", f"{defaults.API_PREFIX}/jobs/{job_id}/weights", token, stream=True,
                             timeout=max(self.timeout, 600))
        digest, size = hashlib.sha256(), 0
        partial = f"{path}.part"
        try:
            with open(partial, "wb") as fh:
                for block in resp.iter_content(defaults.CHUNK_BYTES):
                    digest.update(block)
                    size += len(block)
                    fh.write(block)
            expected = resp.headers.get(defaults.SHA256_HEADER)
            if expected and digest.hexdigest() != expected:
                raise ZwdxError(f"weights of job {job_id} arrived corrupted (sha256 mismatch)", job_id=job_id)
            os.replace(partial, path)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
        return {"path": path, "bytes": size, "sha256": digest.hexdigest()}



def _lora_config(job: dict) -> dict | None:
    """A LoRA job's adapter config (a server before the spec tree kept it flat)."""
    return (nest(job.get("spec") or {}).get("strategy") or {}).get("lora")
