"""Script jobs from the SDK: ``ZWDX.submit_script`` (what ``zwdx run`` calls), ``push_workdir``
and ``download_outputs`` (``zwdx.protocol.script`` says what travels).

    zwdx = ZWDX("http://server:4461", room_token=SUBMITTER_TOKEN)
    result = zwdx.submit_script("train.py", ["--lr", "3e-4"], nproc=2)   # prints each rank's lines as they come
    zwdx.download_outputs(result["job_id"], "zwdx-output")                # what rank 0 wrote in $ZWDX_OUTPUT_DIR

What a ``.gitignore`` ignores does not travel unless ``include`` names it (git's patterns):
what was left out is said before the upload, and named to the job, so that a script that fails
opening one of those files fails saying so. ``outputs_from``: folders of the working dir whose
files come back with the outputs (as ``$ZWDX_OUTPUT_DIR``'s do); when none come back, rank 0
says where its script wrote (in the job's log; ``result["outputs_note"]`` when followed with
``progress``).

Everything that can be checked here is, before a byte is uploaded: the script's arguments and
environment (as the server checks them), the script (a file of the working dir that travels),
the working dir's size (``zwdx.workdir``). The working dir is then asked for by its sha256
and uploaded only if the room does not have it. A job's outputs come back as a tar, unpacked
with tarfile's ``data`` filter: nothing lands outside the folder asked for, no link leads out
of it, no device is made; they are plain files, never unpickled.
"""
from __future__ import annotations

import hashlib
import os
import sys
import tarfile
import tempfile

from . import defaults
from .errors import BadRequest, JobFailed, NotFound, ZwdxError
from .protocol import JobKind, runtime_versions
from .protocol.base import parse
from .protocol.rest import SubmitJob
from .protocol.script import MAX_LEFT_OUT, VARIABLE, ScriptSpec
from .archives import data_filter_missing
from .datasets import check_datasets
from .sizes import human
from .workdir import Packed, pack


def print_line(event: dict) -> None:
    """A rank's line as ``zwdx run`` prints it, on stdout, prefixed as torchrun's ``--tee`` does."""
    print(f"[rank{event.get('rank')}]:{event['data'].get('text', '')}", flush=True)


def extract_outputs(archive: str, dest: str) -> list[str]:
    """The outputs' tar unpacked into ``dest`` (made if need be): the files it wrote, relative.
    An entry that would land outside ``dest``, link out of it or be a device is refused, naming it."""
    missing = data_filter_missing()
    if missing:
        raise ZwdxError(f"{missing}: zwdx does not unpack a job's outputs without it")
    os.makedirs(dest, exist_ok=True)
    try:
        with tarfile.open(archive, "r:") as tar:
            members = [tarfile.data_filter(m, dest) for m in tar.getmembers()]  # as written: "/a" lands as "a"
            tar.extractall(dest, members=members, filter="data")
    except tarfile.FilterError as exc:
        raise ZwdxError(f"the job's outputs are refused: {exc}") from None
    except tarfile.TarError as exc:
        raise ZwdxError(f"the job's outputs are not a tar: {exc}") from None
    return sorted(m.name for m in members if m.isfile())


def _check_arguments(args, include, outputs_from, datasets) -> None:
    """``BadRequest`` for a list that is not of strings, or args naming $ZWDX_DATA_DIR without datasets."""
    for field, value in (("args", args), ("include", include), ("outputs_from", outputs_from)):
        if isinstance(value, str) or not all(isinstance(a, str) for a in value):
            raise BadRequest(f"{field} must be a list of strings", field=field)
    if not datasets and any((m.group(1) or m.group(2)) == "ZWDX_DATA_DIR" for a in args
                            for m in VARIABLE.finditer(a)):
        raise BadRequest("args name $ZWDX_DATA_DIR, the job's datasets, but the job has none: name them with "
                         "datasets=[...] (zwdx run --dataset NAME)", field="args")


def _say_left_out(packed) -> None:
    """What the packing left out of the working dir, and --include patterns that matched nothing."""
    for pattern in packed.unmatched:
        _say(f"zwdx: --include {pattern!r} names none of the files a .gitignore left out")
    if packed.left_out_line():
        _say(f"zwdx: {packed.left_out_line()}")


class ScriptJobs:
    """The script-job calls of one ``ZWDX`` (which exposes them as its own methods)."""

    def __init__(self, sdk):
        self.sdk = sdk

    def push_workdir(self, packed: Packed, token: str, ask: bool = True) -> dict:
        """The room's working dir of these bytes: asked for by sha256 (``ask``) and uploaded only
        if it is not there. ``{"id", "sha256", "size", "files", "uploaded"}``."""
        found = None
        if ask:
            try:
                found = self.sdk._json("GET", f"/workdirs/{packed.sha256}", token)
            except NotFound:
                pass
        uploaded = found is None
        if uploaded:
            with open(packed.path, "rb") as fh:
                found = self.sdk._json("PUT", f"/workdirs/{packed.sha256}", token, data=fh,
                                       headers={defaults.SHA256_HEADER: packed.sha256,
                                                "Content-Type": "application/octet-stream"},
                                       timeout=max(self.sdk.timeout, 600))
        return {"id": found["id"], "sha256": packed.sha256, "size": packed.size, "files": packed.files,
                "uploaded": uploaded, "left_out": len(packed.left_out)}

    def push(self, working_dir: str = ".", script: str | None = None, room_token: str | None = None,
             max_workdir_bytes: int | None = None, include=()) -> dict:
        """Pack a working dir (``script``: a file it must hold) and upload it unless the room has
        it, as ``submit`` does: ``{"id", "sha256", "size", "files", "uploaded"}``."""
        packed = pack(working_dir, script, max_workdir_bytes, include)
        try:
            return self.push_workdir(packed, self.sdk._token(room_token))
        finally:
            packed.discard()

    def submit(self, script: str, args=(), *, nproc: int, working_dir: str = ".", gpus_per_client: int | None = None,
               memory_required: int = 0, name: str = "", env: dict | None = None, room_token: str | None = None,
               wait: bool = True, progress: bool = True, raise_on_failure: bool = True, timeout: float | None = None,
               max_restarts: int = defaults.MAX_RESTARTS, fail_if_unschedulable: bool = False,
               cancel_on_interrupt: bool = True, max_workdir_bytes: int | None = None, datasets=None,
               include=(), outputs_from=()):
        sdk = self.sdk
        token = sdk._token(room_token)
        _check_arguments(args, include, outputs_from, datasets)
        run = parse(ScriptSpec, {"path": "pending", "args": list(args), "env": dict(env or {}),
                                 "outputs_from": list(outputs_from)}, "script")
        packed = pack(working_dir, script, max_workdir_bytes, include)
        try:
            if progress:
                _say_left_out(packed)
            run.path = packed.script
            run.left_out = packed.left_out_entries[:MAX_LEFT_OUT]
            fields = {"kind": JobKind.SCRIPT.value, "script": run.model_dump(), "world_size": nproc,
                      "gpus_per_client": gpus_per_client, "memory_required": memory_required,
                      "name": name or os.path.basename(packed.script), "versions": runtime_versions(),
                      "max_restarts": max_restarts, "fail_if_unschedulable": fail_if_unschedulable,
                      "datasets": check_datasets(sdk, token, datasets)}
            submit = parse(SubmitJob, {**fields, "bundle_artifact": "pending"}).model_dump(mode="json")  # the server's
            # own check, before the upload; the body is the one spec tree, as submit_job's

            job, workdir = self._post(submit, packed, token)
        finally:
            packed.discard()
        try:  # from here on, Ctrl-C has a job to cancel
            sdk._job_tokens[job["id"]] = token
            sdk._remember("remember_job", job["id"], job["room_id"], token)
            if progress:
                said = "uploaded" if workdir["uploaded"] else "unchanged, not uploaded again"
                _say(f"zwdx: job {job['id']}: {packed.script} on {nproc} rank(s); working dir {working_dir} "
                     f"({workdir['files']} files, {human(workdir['size'])}, sha256 {workdir['sha256'][:12]}) {said}")
            if job.get("unschedulable"):
                _say(f"zwdx: job {job['id']} cannot run in this room as it is now: {job['unschedulable']}; it waits "
                     f"for GPU clients that fit")
            if not wait:
                return job["id"]
            return self._wait(job["id"], token, workdir, progress, timeout, raise_on_failure)
        except KeyboardInterrupt:
            if wait:
                sdk._interrupted(job["id"], token, cancel_on_interrupt)
            raise

    def _post(self, submit: dict, packed, token: str) -> tuple[dict, dict]:
        """The working dir pushed (unless the room has it) and the job posted with it; pushed again
        if it was swept between the question and the submit (unused for UNATTACHED_GRACE)."""
        def body(artifact_id: str) -> dict:
            code = {**submit["spec"]["code"], "bundle_artifact": artifact_id}
            return {**submit, "spec": {**submit["spec"], "code": code}}

        workdir = self.push_workdir(packed, token)
        try:
            return self.sdk._json("POST", "/jobs", token, json=body(workdir["id"])), workdir
        except BadRequest as err:
            if err.context.get("field") != "bundle_artifact" or workdir["uploaded"]:
                raise
            workdir = self.push_workdir(packed, token, ask=False)
            return self.sdk._json("POST", "/jobs", token, json=body(workdir["id"])), workdir

    def _wait(self, job_id: str, token: str, workdir: dict, progress: bool, timeout: float | None,
              raise_on_failure: bool):
        """The job followed to its end (its log printed), its result with the working dir and what
        rank 0 said of its outputs."""
        notes = []

        def on_log(event: dict) -> None:
            text = event["data"].get("text", "")
            if event.get("rank") == 0 and text.startswith("zwdx: no outputs"):
                notes.append(text[len("zwdx: "):])
            print_line(event)
        done = self.sdk._follow(job_id, token, progress, timeout, on_log=on_log if progress else None)
        try:
            result = self.sdk._result(done, raise_on_failure)
        except JobFailed as err:
            err.result.update(workdir=workdir, outputs_note=notes[-1] if notes else None)
            raise
        result.update(workdir=workdir, outputs_note=notes[-1] if notes else None)
        return result

    def download_outputs(self, job_id: str, dest: str | None = None, room_token: str | None = None) -> str | None:
        """What the job's rank 0 wrote under ``$ZWDX_OUTPUT_DIR``, unpacked into ``dest``
        (default ``zwdx-output/<job id>``); its path, or None when the job has no outputs."""
        sdk = self.sdk
        token = sdk._token(room_token, job_id)
        dest = dest or os.path.join("zwdx-output", job_id)
        try:
            resp = sdk._request("GET", f"{defaults.API_PREFIX}/jobs/{job_id}/outputs", token, stream=True,
                                timeout=max(sdk.timeout, 600))
        except NotFound as err:
            if err.context.get("job_id") == job_id and "status" in err.context:
                return None  # the job exists and has no outputs
            raise
        fd, archive = tempfile.mkstemp(suffix=".tar")
        try:
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as fh:
                for block in resp.iter_content(defaults.CHUNK_BYTES):
                    digest.update(block)
                    fh.write(block)
            expected = resp.headers.get(defaults.SHA256_HEADER)
            if expected and digest.hexdigest() != expected:
                raise ZwdxError(f"outputs of job {job_id} arrived corrupted (sha256 mismatch)", job_id=job_id)
            extract_outputs(archive, dest)
        finally:
            os.unlink(archive)
        return dest


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
