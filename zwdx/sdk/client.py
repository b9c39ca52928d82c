"""The submitter's client, ``ZWDX``: a connection to one server (plumbing, rooms, submitting
and waiting); what reads a job is ``results.Reads``, the earlier project's calls ``compat.Compat``."""
from __future__ import annotations

import hashlib
import logging
import threading

import requests

from .. import __version__, defaults, tls, trackers as _trackers
from .. import lora as _lora
from .. import start_weights
from . import auto as _auto
from ..bundle import HEAD_PARTS, pack_parts, required_modules
from ..checks import check_devices, check_pipeline, check_tp_plan
from ..credentials import CredentialStore, remember_by_default
from ..datasets import Datasets, check_datasets
from ..errors import BadRequest, ServerUnreachable, ZwdxError, from_response
from ..protocol import runtime_versions
from ..protocol.base import PROTOCOL, PROTOCOL_HEADER, VERSION_HEADER, parse
from ..protocol.rest import SubmitJob
from .compat import SUBMIT_POSITIONAL, Compat, positional_at_most
from .follow import Follower, interrupt, interrupted, say
from .results import Reads, Result, result_of
from .settings import Resources, Run, Training
from .submission import Submission

log = logging.getLogger("zwdx.sdk")

#: What a proxy (nginx, HAProxy) answers while the server behind it is away: without zwdx's JSON
#: error body, these are read as "server unreachable" (a wait goes on), not as the server's answer.
PROXY_AWAY = (502, 503, 504)


class ZWDX(Compat, Reads):
    """A connection to one zwdx server. Submitter tokens are given per call (``room_token=``) or
    once here; those of rooms created or submitted to are remembered (``remember=False`` or
    ``ZWDX_REMEMBER=0``: not).

    A context manager: ``with ZWDX(url) as zwdx: ...`` closes its HTTP connections at the end
    (as ``close()`` does).

    Over ``https://`` the server's certificate is verified against the system's CAs, or the
    CA file ``ca_file=`` (else ``$ZWDX_CA_FILE``) names, for a private CA; plain ``http://`` to
    another machine warns once."""

    def __init__(self, server_url: str = f"http://localhost:{defaults.PORT}", room_token: str | None = None,
                 timeout: float = 30.0, remember: bool | None = None, ca_file: str | None = None):
        self.server_url = server_url.rstrip("/")
        self.room_token = room_token
        self.timeout = timeout
        self.verify = tls.verify(ca_file)
        tls.warn_if_plain(self.server_url, "zwdx")
        self._session = self._new_session()
        self._job_tokens: dict[str, str] = {}
        remember = remember_by_default() if remember is None else remember
        self.credentials = CredentialStore() if remember else None

    def _new_session(self) -> requests.Session:
        return tls.session(self.verify)

    def close(self) -> None:
        """Close the connections to the server this object holds open. It can still be used:
        a later call opens a new one."""
        self._session.close()

    def __enter__(self) -> ZWDX:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- plumbing ----------------------------------------------------------------------------
    def _token(self, room_token: str | None, job_id: str | None = None) -> str:
        token = room_token or (self._job_tokens.get(job_id) if job_id else None)
        if not token and job_id and self.credentials is not None:
            token = self.credentials.token_for_job(self.server_url, job_id)
        token = token or self.room_token
        if not token:
            known = f" (no job {job_id} submitted to {self.server_url} is on record here)" if job_id else ""
            raise BadRequest(f"a room token is needed{known}: a submitter token of the room (zs_..., printed by "
                             f"`zwdx room create`), as room_token=..., --room-token-file FILE or $ZWDX_ROOM_TOKEN",
                             field="room_token")
        return token

    def _remember(self, what: str, *args) -> None:
        if self.credentials is None:
            return
        try:
            getattr(self.credentials, what)(self.server_url, *args)
        except OSError as exc:  # a read-only home must not fail a submit
            log.warning("zwdx: cannot write the credential store %s: %s", self.credentials.path, exc.strerror)

    def _request(self, method: str, path: str, token: str | None = None, session: requests.Session | None = None,
                 **kwargs) -> requests.Response:
        headers = kwargs.pop("headers", {})
        # a server of another protocol major refuses the call, saying which side to upgrade
        headers.update({PROTOCOL_HEADER: PROTOCOL, VERSION_HEADER: __version__})
        if token:
            headers[defaults.TOKEN_HEADER] = token
        url = f"{self.server_url}{path}"
        try:
            resp = (session or self._session).request(method, url, headers=headers,
                                                      timeout=kwargs.pop("timeout", self.timeout), **kwargs)
        except requests.ConnectionError as exc:
            why = tls.untrusted(exc)
            raise ServerUnreachable(f"cannot reach the zwdx server at {self.server_url}: {why or exc}",
                                    server_url=self.server_url, **({"tls": True} if why else {})) from None
        except requests.Timeout:
            raise ServerUnreachable(f"the zwdx server at {self.server_url} did not answer in time",
                                    server_url=self.server_url) from None
        if resp.status_code >= 400:
            try:
                body = resp.json()
            except ValueError:
                body = None
            if resp.status_code in PROXY_AWAY and not (isinstance(body, dict) and body.get("error")):
                # a proxy in front answers for a server that is away (restarting): as a refused connection
                raise ServerUnreachable(f"the zwdx server at {self.server_url} is away: HTTP {resp.status_code} "
                                        f"from {url} (a proxy in front of it?)", server_url=self.server_url,
                                        status=resp.status_code)
            raise from_response(resp.status_code, body)
        return resp

    def _json(self, method: str, path: str, token: str | None = None, **kwargs) -> dict:
        return self._request(method, f"{defaults.API_PREFIX}{path}", token, **kwargs).json()

    # -- rooms -------------------------------------------------------------------------------
    def health(self) -> dict:
        return self._request("GET", "/health").json()

    def create_room(self, name: str = "") -> dict:
        """A new room: ``{"id", "name", "created_at", "submitter_token", "donor_token", "token"}``.
        The submitter token submits jobs and reads them (``token`` is the same one, under its
        earlier name); the donor token is for GPU clients (``zwdx gpu-client``). Both are shown
        only this once; the submitter token is remembered in this user's credential store."""
        room = self._json("POST", "/rooms", json={"name": name})
        self._remember("remember_room", room["id"], room["submitter_token"])
        return room

    def get_room(self, room_token: str | None = None) -> dict:
        """The room of the token, with its GPU clients and their slots."""
        return self._json("GET", "/room", self._token(room_token))

    def set_room(self, room_token: str | None = None, **settings) -> dict:
        """Change the room's settings (``client_retention``: seconds a GPU client may stay
        offline before it is dropped, 0: never); the room after."""
        return self._json("PATCH", "/room", self._token(room_token), json=settings)

    def prune_clients(self, room_token: str | None = None, offline_for: float = 0.0) -> list[str]:
        """Drop the room's GPU clients offline for at least ``offline_for`` seconds (0: every one
        offline now) that run no ranks; their ids."""
        return self._json("POST", "/room/clients/prune", self._token(room_token),
                          json={"offline_for": offline_for})["pruned"]

    @property
    def tokens(self):
        """The room's tokens: ``zwdx.tokens.list()``, ``.create(role, name)``, ``.revoke(id)``,
        ``.rotate(id)`` (``zwdx.room_tokens.RoomTokens``)."""
        from ..room_tokens import RoomTokens
        return RoomTokens(self)

    # -- jobs --------------------------------------------------------------------------------
    @positional_at_most(SUBMIT_POSITIONAL)
    def submit_job(self, model, data_loader_func, train_func, eval_func=None, optimizer=None,
                   parallelism: str = "DDP", memory_required: int = 0, *, strategy=None,
                   resources: Resources | None = None, training: Training | None = None, run: Run | None = None,
                   wait: bool = True, **earlier):
        """Send a training job to a room. Blocks with live progress until it ends and returns its
        ``Result`` (``wait=False``: the job id at once). The first seven arguments may be given by
        position, in this order; the settings (``zwdx.sdk.settings``) only by name:

        ``strategy``: how the ranks train, ``zwdx.DDP()`` (the default, or ``parallelism``'s mode),
        ``FSDP(units=..., tp=...)``, ``TP(plan=..., size=...)``, ``Pipeline(schedule=...)``,
        ``Diloco(inner_steps=...)``, ``Mixed(global_batch=...)`` (each mode's page under Modes);
        ``resources``: ``Resources(world_size, memory_required, gpus_per_client, image)``;
        ``training``: ``Training(epochs, collective_timeout, seed)``; ``run``: ``Run(name,
        room_token, datasets, trackers, recovery=Recovery(...), progress, timeout, ...)``.

        The earlier keywords (``epochs=``, ``world_size=``, ``room_token=``, ``diloco=``, ...)
        still work; each warns once, saying which setting replaces it
        (``zwdx.sdk.submission.EARLIER``). Everything is checked here, as the server will, before
        anything is uploaded: a ``BadRequest`` names the field."""
        job = Submission.of(parallelism, memory_required, strategy, resources, training, run, earlier)
        run = job.run
        token = self._token(run.room_token)
        _trackers.make(run.trackers)  # a wrong name is refused before anything is uploaded
        checked = parse(SubmitJob, job.checked_body(runtime_versions())).spec
        model, lora_config = self._checked_model(model, data_loader_func, checked, job)
        datasets = check_datasets(self, token, list(run.datasets))  # a name the room lacks is refused
        parts = pack_parts(model, data_loader_func, train_func, eval_func, optimizer, fsdp_units=job.units)
        tree = checked.model_dump(mode="json", exclude={"code", "datasets"})
        if lora_config is not None:
            tree["strategy"]["lora"] = lora_config
        if tree["strategy"]["type"] == "auto":  # what one replica needs: the server chooses the mode with it
            tree["strategy"] = _auto.counted(tree["strategy"], model, optimizer)
        if checked.diloco is not None or tree["strategy"]["type"] == "auto":  # the start weights DILOCO steps
            tree["strategy"] = start_weights.upload(self, token, model, "DILOCO", tree["strategy"])
        artifact = self._upload_bundle(token, parts)
        code = {"bundle_artifact": artifact["id"], "versions": runtime_versions(),
                "required_modules": required_modules(b"".join(parts[:HEAD_PARTS]))}
        submit = parse(SubmitJob, {"spec": {**tree, "code": code, "datasets": datasets},
                                   "name": run.name or getattr(train_func, "__name__", ""),
                                   "fail_if_unschedulable": run.fail_if_unschedulable})
        posted = self._json("POST", "/jobs", token, json=submit.model_dump(mode="json"))
        return self._after_submit(posted, artifact, token, run, wait)

    @staticmethod
    def _checked_model(model, data_loader_func, spec, job: Submission):
        """The model (with its LoRA adapter) and the adapter's config, once the model and the
        loaders are checked against the mode, before anything is uploaded."""
        if spec.pipeline is not None:
            stages = (spec.resources.world_size or 2) * (spec.pipeline.stages_per_rank or 1)  # None: 2 at least
            check_pipeline(model, spec.pipeline.stage_plan, stages)
        if spec.tp is not None:
            check_tp_plan(model, spec.tp.plan, spec.parallelism.value)
        check_devices(spec.mixed is not None, spec.mixed.global_batch if spec.mixed else None, data_loader_func)
        if job.units is not None and spec.parallelism.value not in ("FSDP", "FSDP+TP"):
            raise BadRequest(f"fsdp_units applies to FSDP and FSDP+TP only, not {spec.parallelism.value}",
                             field="fsdp_units")
        if (job.lora is not None or _lora.is_peft_model(model)) \
                and spec.parallelism.value not in ("DDP", "FSDP"):
            raise BadRequest(f"LoRA jobs run with DDP or FSDP, not {spec.parallelism.value}", field="lora")
        return _lora.prepare(model, job.lora)

    def _after_submit(self, job: dict, artifact: dict, token: str, run: Run, wait: bool):
        try:  # from here on, Ctrl-C has a job to cancel
            self._job_tokens[job["id"]] = token
            self._remember("remember_job", job["id"], job["room_id"], token)
            log.info("job %s submitted (%d bytes bundle)", job["id"], artifact["size"])
            if job.get("unschedulable"):
                say(f"zwdx: job {job['id']} cannot run in this room as it is now: {job['unschedulable']}; it "
                    f"waits for GPU clients that fit (run=zwdx.Run(fail_if_unschedulable=True) refuses it)")
            if not wait:
                return job["id"]
            return self._result(self._follow(job["id"], token, run.progress, run.timeout, run.trackers),
                                run.raise_on_failure)
        except KeyboardInterrupt:
            if wait:
                self._interrupted(job["id"], token, run.cancel_on_interrupt)
            raise interrupt(job["id"]) from None  # not the internals (requests, sockets) it came through

    def _upload_bundle(self, token: str, parts: list) -> dict:
        """Upload a bundle's buffers as they are (no joined copy), hashing them meanwhile on
        another thread (sha256 releases the GIL): the server hashes what it received and says
        so, and the two must agree, else the upload is refused here. The artifact's record."""
        digest = hashlib.sha256()
        hasher = threading.Thread(target=lambda: [digest.update(p) for p in parts], name="zwdx-bundle-sha256",
                                  daemon=True)
        hasher.start()
        artifact = self._json("POST", "/artifacts", token, data=_Buffers(parts), timeout=max(self.timeout, 600),
                              headers={"Content-Type": "application/octet-stream"})
        hasher.join()
        if artifact.get("sha256") != digest.hexdigest():
            raise ZwdxError(f"the job bundle arrived changed (sha256 {artifact.get('sha256')} at the server, "
                            f"{digest.hexdigest()} sent); submit again")
        return artifact

    # -- datasets (zwdx.datasets) ---------------------------------------------------------------
    def push_dataset(self, path: str, name: str, room_token: str | None = None, progress: bool = True,
                     chunk_bytes: int = defaults.DATASET_CHUNK_BYTES) -> dict:
        """Upload a folder as a version of the room's dataset ``name`` (what ``zwdx data push``
        does): only the chunks the room lacks travel, so a push cut short resumes. ``{"name",
        "version", "files", "size", "chunks", "uploaded_chunks", "uploaded_bytes", "new_version"}``."""
        return Datasets(self).push(path, name, room_token, progress, chunk_bytes)

    def list_datasets(self, room_token: str | None = None) -> list[dict]:
        """The room's datasets, each with its versions (the newest first)."""
        return Datasets(self).list(room_token)

    def get_dataset(self, name: str, room_token: str | None = None) -> dict:
        """One dataset: its versions, and its newest version's files (``manifest``)."""
        return Datasets(self).get(name, room_token)

    def remove_dataset(self, name: str, room_token: str | None = None) -> dict:
        """Remove a dataset, every version (refused while a waiting or running job uses it)."""
        return Datasets(self).remove(name, room_token)

    # -- script jobs (zwdx.script_jobs) -------------------------------------------------------
    def submit_script(self, script: str, args=(), *, nproc: int, working_dir: str = ".", **options):
        """Run an existing torchrun script unchanged on ``nproc`` ranks of the room (what ``zwdx
        run`` does; ``zwdx.script_jobs``): the working dir is packed and uploaded unless the room
        has it; each rank runs ``python script args...`` in it with torchrun's environment.
        Blocks, printing the ranks' lines as they come, and returns the result as ``submit_job``
        does, with ``"workdir"`` (``sha256``, ``size``, ``uploaded``); ``wait=False``: the job id.
        Options: ``gpus_per_client``, ``memory_required``, ``name``, ``env``, ``room_token``,
        ``wait``, ``progress``, ``raise_on_failure``, ``timeout``, ``max_restarts``,
        ``fail_if_unschedulable``, ``cancel_on_interrupt``, ``max_workdir_bytes``, ``datasets`` (as
        ``submit_job``'s; the script finds them under ``$ZWDX_DATA_DIR/<name>``); ``include``:
        patterns (git's) of files a ``.gitignore`` ignores, packed anyway; ``outputs_from``: folders
        of the working dir that come back with the outputs. ``"outputs_note"``: where rank 0 wrote
        when no outputs came back. ``$ZWDX_OUTPUT_DIR`` and ``$ZWDX_DATA_DIR`` in ``args`` are the
        rank's folders on the GPU client."""
        from ..script_jobs import ScriptJobs
        return ScriptJobs(self).submit(script, args, nproc=nproc, working_dir=working_dir, **options)

    def download_outputs(self, job_id: str, dest: str | None = None, room_token: str | None = None) -> str | None:
        """A script job's outputs (what its rank 0 wrote under ``$ZWDX_OUTPUT_DIR``) unpacked into
        ``dest`` (default ``zwdx-output/<job id>``): that folder, or None when it has none."""
        from ..script_jobs import ScriptJobs
        return ScriptJobs(self).download_outputs(job_id, dest, room_token)

    def wait(self, job_id: str, room_token: str | None = None, progress: bool = True,
             raise_on_failure: bool = True, timeout: float | None = None, cancel_on_interrupt: bool = True,
             trackers=None) -> dict:
        """Block until the job ends, with a progress bar of its latest metrics, log lines and,
        while it waits for slots, why. Ctrl-C cancels the job (``cancel_on_interrupt=False``:
        leaves it running) and raises ``KeyboardInterrupt``; a second Ctrl-C stops at once.

        The result: ``{"job_id", "status", "complete", "results", "final_loss", "world_size",
        "placement", "failures", "reason", "warnings", "suspects", "job"}``; ``status`` is a
        ``ResultStatus``; ``warnings``: what to know about the result (the ranks' final weights
        differ, the weights that came back are not theirs);
        ``suspects``: the ranks named dishonest in any attempt (DILOCO's rounds, the spot and step
        checks, the weights check: ``[{rank, attempt, client_id, token_id, rounds, reason, at}]``,
        in attempt then rank order). ``trackers``
        as in ``submit_job`` (from the job's first metric, whenever this is called)."""
        token = self._token(room_token, job_id)
        try:
            job = self._follow(job_id, token, progress, timeout, trackers)
        except KeyboardInterrupt:
            self._interrupted(job_id, token, cancel_on_interrupt)
            raise interrupt(job_id) from None
        return self._result(job, raise_on_failure)


    @staticmethod
    def _result(job: dict, raise_on_failure: bool) -> Result:
        return result_of(job, raise_on_failure)

    def _follow(self, job_id: str, token: str, progress: bool, timeout: float | None, trackers=None,
                on_log=None) -> dict:
        """Follow the job until it ends (``follow.Follower``); its last document."""
        return Follower(self, job_id, token, progress, timeout, trackers, on_log).run()

    def _interrupted(self, job_id: str, token: str, cancel: bool) -> None:
        interrupted(self, job_id, token, cancel)


class _Buffers:
    """A request body made of buffers sent one after another (``requests`` sets the
    Content-Length from ``len``; urllib3 hands each buffer to the socket as it is)."""

    def __init__(self, parts: list):
        self.parts = [memoryview(p).cast("B") for p in parts]

    def __len__(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __iter__(self):
        return iter(self.parts)
