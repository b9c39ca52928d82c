"""The submitter's client.

    from zwdx import ZWDX
    zwdx = ZWDX("http://localhost:4461")
    result = zwdx.submit_job(model=Net(), data_loader_func=..., train_func=..., room_token=token)
    model = zwdx.get_trained_model(result["job_id"], Net())   # later, in any process of this user

``room_token`` is always a submitter token of the room (``zs_...``, from ``zwdx room create``;
the room's donor token, ``zd_...``, is for GPU clients and opens nothing here). The submitter
tokens of the rooms this user created or submitted to are remembered per server URL
(``zwdx.credentials``), so a job id alone opens its job. ``zwdx.tokens`` manages a room's tokens
(``zwdx.room_tokens``). The earlier project's surface works
as it did: ``parse_args()`` (``-rt/--room_token``), ``get_logger()`` and a result whose
``status`` also equals "complete" and whose ``complete`` is a bool.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import os
import sys
import tempfile
import threading
import time

import requests

from . import __version__, defaults, tls, trackers as _trackers
from . import lora as _lora
from .bundle import HEAD_PARTS, pack_parts, required_modules
from . import start_weights
from .checks import check_devices, check_pipeline, check_tp_plan
from .credentials import CredentialStore, remember_by_default
from .datasets import Datasets, check_datasets
from .errors import BadRequest, Conflict, JobFailed, ServerUnreachable, ZwdxError, from_response
from .protocol import WAITING, JobStatus, runtime_versions
from .protocol.base import PROTOCOL, PROTOCOL_HEADER, VERSION_HEADER, parse
from .protocol.report import from_wire
from .protocol.rest import SubmitJob
from .protocol.spec import nest

log = logging.getLogger(__name__)

#: What a proxy (nginx, HAProxy) answers while the server behind it is away: without zwdx's JSON
#: error body, these are read as "server unreachable" (a wait goes on), not as the server's answer.
PROXY_AWAY = (502, 503, 504)


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


#: ``submit_job``'s arguments that may be given by position, in the earlier project's order.
SUBMIT_POSITIONAL = ("model", "data_loader_func", "train_func", "eval_func", "optimizer", "parallelism",
                     "memory_required")


def _positional_at_most(names: tuple[str, ...]):
    """Refuse more positional arguments than ``names`` with a TypeError that says what to do
    (Python's own would count ``self`` and name no argument)."""
    def decorate(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            if len(args) > len(names):
                raise TypeError(f"{method.__name__}() takes at most {len(names)} positional arguments "
                                f"({', '.join(names)}) but {len(args)} were given; pass the others by name, "
                                f"e.g. room_token=...")
            return method(self, *args, **kwargs)
        return call
    return decorate


def _numbers(job: dict) -> dict:
    """A job as the API answers it, with the non-finite numbers it reported (its final loss, its
    results) as floats again: JSON carries them as "NaN", "Infinity", "-Infinity"."""
    out = dict(job)
    for name in ("final_loss", "results"):
        if out.get(name) is not None:
            out[name] = from_wire(out[name])
    return out


def log_line(event: dict) -> str:
    """A job's log event as one line, labelled with the rank that wrote it (the server's own
    lines, such as DILOCO's round summaries, have no rank)."""
    rank = event.get("rank")
    return f"[{'server' if rank is None else f'rank {rank}'}] {(event.get('data') or {}).get('text', '')}"


def _say(message: str) -> None:
    """A line for the person at the terminal (stderr), never carrying a token."""
    print(message, file=sys.stderr, flush=True)


def _interrupt(job_id: str) -> KeyboardInterrupt:
    """The ``KeyboardInterrupt`` a Ctrl-C while following a job raises: raised ``from None`` in
    a fresh one, so that its traceback ends in the SDK's call, not in the socket read it cut."""
    return KeyboardInterrupt(f"job {job_id}: interrupted")


class ZWDX:
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

    # -- the earlier project's surface -------------------------------------------------------
    def parse_args(self, args: list[str] | None = None) -> argparse.Namespace:
        """The earlier project's command line: ``-rt/--room_token`` (required unless
        ``ZWDX_ROOM_TOKEN`` is set), a submitter token of the room. It becomes this object's
        default room token. ``--room-token-file F`` reads it from a file instead; a token on the
        command line warns, as every user of the machine can read it there."""
        from .token_source import FILE_VARIABLE, TOKEN_VARIABLE, token_from
        given = bool(os.environ.get(TOKEN_VARIABLE) or os.environ.get(FILE_VARIABLE))
        parser = argparse.ArgumentParser(description="zwdx user argument parser.")
        parser.add_argument("-rt", "--room_token", "--room-token", dest="room_token", type=str, default=None,
                            help="a submitter token (zs_...) of the room to submit to; every user of the machine "
                                 "can read a command line, so prefer --room-token-file or $ZWDX_ROOM_TOKEN")
        parser.add_argument("--room-token-file", default=None, help="a file holding the submitter token")
        parsed = parser.parse_args(args)
        if not (parsed.room_token or parsed.room_token_file or given):
            parser.error("a room token is required: -rt/--room_token TOKEN, --room-token-file FILE or $ZWDX_ROOM_TOKEN")
        try:
            parsed.room_token = token_from(parsed.room_token, parsed.room_token_file, parser.prog)
        except BadRequest as err:
            parser.error(err.message)
        self.room_token = parsed.room_token or self.room_token
        return parsed

    def get_logger(self) -> logging.Logger:
        """The "zwdx" logger, printing INFO lines to stderr (the SDK's own lines too). Calling
        it again adds no second handler; its lines do not also go to the root logger."""
        logger = logging.getLogger("zwdx")
        logger.setLevel(logging.INFO)
        if not any(getattr(h, "zwdx_handler", False) for h in logger.handlers):
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s - %(levelname)s - %(message)s"))
            handler.zwdx_handler = True
            logger.addHandler(handler)
        logger.propagate = False
        return logger

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
        from .room_tokens import RoomTokens
        return RoomTokens(self)

    # -- jobs --------------------------------------------------------------------------------
    @_positional_at_most(SUBMIT_POSITIONAL)
    def submit_job(self, model, data_loader_func, train_func, eval_func=None, optimizer=None,
                   parallelism: str = "DDP", memory_required: int = 0, *, room_token: str | None = None,
                   epochs: int | None = None, world_size: int | None = None, wait: bool = True, progress: bool = True,
                   raise_on_failure: bool = True, name: str = "", collective_timeout: float | None = None,
                   timeout: float | None = None, min_world_size: int | None = None,
                   max_restarts: int = defaults.MAX_RESTARTS, keep_checkpoints: int = defaults.KEEP_CHECKPOINTS,
                   checkpoint_every_epoch: bool = True, fail_if_unschedulable: bool = False,
                   cancel_on_interrupt: bool = True, fsdp_units=None, trackers=None, diloco: dict | None = None,
                   datasets=None, image: str | None = None, pipeline: dict | None = None, lora=None,
                   devices: str = "same", global_batch: int | None = None,
                   tp_plan: dict | None = None, tp_size: int | None = None):
        """Send a training job to a room. Blocks with live progress until it ends and returns the
        result (``wait=False``: returns the job id at once). The first seven arguments may be
        given by position, in this order; the others only by name.

        ``epochs`` is passed to ``train_func``; None (the default) leaves the function's own
        default to win (1 if it declares none). ``name`` defaults to ``train_func``'s name.

        A job the room cannot run as it is now (more ranks than its slots, more memory than any
        slot has) waits for GPU clients to join, and a line says so; with
        ``fail_if_unschedulable=True`` it is refused instead (``zwdx.Unschedulable``).

        Ctrl-C while it blocks cancels the job and raises ``KeyboardInterrupt``;
        ``cancel_on_interrupt=False`` leaves it running and says how to re-attach.

        If a GPU client of the job is lost, the job goes on from its last checkpoint, on the
        remaining clients if ``min_world_size`` allows or when a replacement joins, at most
        ``max_restarts`` times. A checkpoint is saved at every epoch end unless
        ``checkpoint_every_epoch=False``; the last ``keep_checkpoints`` are kept.

        ``fsdp_units`` (FSDP only): the modules to shard as units, as a list of classes or a
        function ``fn(module) -> bool``; by default each block of a repeated ModuleList/Sequential.

        ``parallelism="DILOCO"`` trains across the internet: each GPU client a worker on its own,
        an outer step through the server every ``inner_steps``. ``diloco`` sets it: ``{"inner_steps":
        500, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True, "compression": "int8"}``
        (those are the defaults; ``"fp16"`` and ``"none"`` compress less).

        ``image``: the container image its ranks run in; only GPU clients that run ranks in
        containers and whose donor allows that image take the job (it waits, saying which
        images each client allows). None: any client, ranks in its default image or none.
        ``parallelism="PIPELINE"`` cuts the model into stages, one a rank (``torch.distributed.pipelining``).
        ``pipeline`` sets it: ``{"schedule": "gpipe" | "1f1b" | "interleaved1f1b", "microbatches": n
        (default: the ranks), "stage_plan": [(0, 6), (6, 12)] (ranges of the repeated blocks, or of
        the children of an nn.Sequential without them) or ["transformer.h.6"] (where stages begin),
        "stages_per_rank": n (interleaved1f1b only; default 2, or as many as the plan names a
        rank)}``; left out, the blocks are cut evenly (the children by parameters); a model the
        default plan cannot cut is refused here, naming ``pipeline.stage_plan``.
        ``train_func`` declares ``pipeline`` and calls ``pipeline.step(x, y, loss_fn)`` for
        forward and backward (it returns the batch's loss): the first stage's batch is the one
        trained on, its targets sent to the last stage; see docs/modes/pipeline.md.

        ``parallelism="TP"`` splits the model's Linear pairs over the job's ranks, all on one GPU
        client (``torch.distributed.tensor.parallel``); ``"FSDP+TP"`` does so within each GPU
        client's group of ``tp_size`` ranks (default: the ranks placed on each) and shards with
        FSDP across the groups. ``tp_plan`` names the modules to split, ``{"blocks.*.mlp.up":
        "colwise", "blocks.*.mlp.down": "rowwise"}``; left out, it is derived from the model's
        MLP and attention Linear layers. Checked against the model here, before the upload.

        ``lora``: a ``peft.LoraConfig``: a copy of the model gets the adapter
        (``peft.get_peft_model``) and only the adapter trains and comes back; a peft model given
        as ``model`` does the same. ``get_trained_model`` returns the peft model with the trained
        adapter, ``get_adapter`` the adapter's tensors alone. DDP or FSDP.

        ``devices="mixed"`` (DDP): GPU and CPU slots together, over gloo; each rank measures its
        speed on a sample batch and takes its share of ``global_batch`` (None: the world size
        times the default of ``data_loader_func``'s ``batch_size``), which ``data_loader_func``
        gets as ``batch_size`` with a ``sampler`` (``sampler(dataset, shuffle=True, seed=0)``)
        that cuts every global batch into the shares; each rank's gradient is weighted by its
        share, so a step is one process's over the global batch. See docs/modes/mixed.md.

        ``trackers``: also send the job's metrics, live while this call follows the job, to
        ``"tensorboard"`` (event files in ``./zwdx-runs/<job id>``), ``"wandb"`` (a W&B run;
        your API key stays here, nothing of it goes to a donor) or ``zwdx.trackers.Tracker``
        objects; ``export_metrics`` sends a finished job's.

        ``datasets``: what the GPU clients fetch before the job's code runs (``zwdx.datasets``):
        the room's datasets by name (``zwdx data push``; the newest version, pinned now), URLs
        (``https://``, ``s3://``) or ``{"url": ..., "sha256": ..., "name": ...}``. ``data_loader_func``
        then gets ``data_dir``: a read-only folder holding one folder per dataset, by its name
        (``data_dir/digits/...``). A name the room has none of is refused here, naming it."""
        token = self._token(room_token)
        _trackers.make(trackers)  # a wrong name is refused before anything is uploaded
        if str(parallelism).upper() not in ("DDP", "FSDP", "DILOCO", "PIPELINE", "TP", "FSDP+TP"):
            raise BadRequest(f"parallelism must be 'DDP', 'FSDP', 'DILOCO', 'PIPELINE', 'TP' or 'FSDP+TP', got "
                             f"{parallelism!r}", field="parallelism")
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
            raise BadRequest(f"epochs must be a whole number of at least 1 or None, got {epochs!r}", field="epochs")
        if fsdp_units is not None and str(parallelism).upper() not in ("FSDP", "FSDP+TP"):
            raise BadRequest(f"fsdp_units applies to FSDP and FSDP+TP only, not {parallelism}", field="fsdp_units")
        tensor_parallel = str(parallelism).upper() in ("TP", "FSDP+TP")
        if diloco is not None or pipeline is not None or tensor_parallel or tp_plan is not None or tp_size is not None \
                or str(parallelism).upper() == "PIPELINE" or devices != "same" or global_batch is not None:
            checked = parse(SubmitJob, {  # as the server will, before anything is uploaded
                "bundle_artifact": "unsent", "versions": runtime_versions(), "parallelism": str(parallelism).upper(),
                "diloco": diloco, "pipeline": pipeline, "world_size": world_size, "tp_plan": tp_plan,
                "tp_size": tp_size, "min_world_size": min_world_size, "devices": devices, "global_batch": global_batch})
            settings = checked.spec.pipeline
            if settings is not None:
                pipeline = settings.model_dump(mode="json", exclude={"type"})
                stages = (checked.spec.resources.world_size or 2) * (settings.stages_per_rank or 1)  # None: 2 at least
                check_pipeline(model, settings.stage_plan, stages)
            if tensor_parallel:
                check_tp_plan(model, checked.spec.tp and checked.spec.tp.plan, str(parallelism).upper())
            devices = "mixed" if checked.spec.mixed else "same"
        check_devices(devices == "mixed", global_batch, data_loader_func)
        if (lora is not None or _lora.is_peft_model(model)) and str(parallelism).upper() not in ("DDP", "FSDP"):
            raise BadRequest(f"LoRA jobs run with DDP or FSDP, not {parallelism}", field="lora")
        model, lora_config = _lora.prepare(model, lora)  # the model with its adapter, the adapter's config
        datasets = check_datasets(self, token, datasets)  # before the upload: a name the room lacks is refused
        parts = pack_parts(model, data_loader_func, train_func, eval_func, optimizer, fsdp_units=fsdp_units)
        diloco = start_weights.upload(self, token, model, parallelism, diloco)  # DILOCO: what the server steps
        artifact = self._upload_bundle(token, parts)
        submit = parse(SubmitJob, {  # the server's own check, here first: a BadRequest naming the field
            "bundle_artifact": artifact["id"], "parallelism": str(parallelism).upper(), "epochs": epochs,
            "world_size": world_size, "memory_required": memory_required, "versions": runtime_versions(),
            "name": name or getattr(train_func, "__name__", ""), "collective_timeout": collective_timeout,
            "min_world_size": min_world_size, "max_restarts": max_restarts, "keep_checkpoints": keep_checkpoints,
            "checkpoint_every_epoch": checkpoint_every_epoch, "fail_if_unschedulable": fail_if_unschedulable,
            "required_modules": required_modules(b"".join(parts[:HEAD_PARTS])), "diloco": diloco,
            "datasets": datasets, "image": image,
            "pipeline": pipeline, "lora": lora_config, "devices": devices, "global_batch": global_batch,
            "tp_plan": tp_plan, "tp_size": tp_size})
        job = self._json("POST", "/jobs", token, json=submit.model_dump(mode="json"))
        try:  # from here on, Ctrl-C has a job to cancel
            self._job_tokens[job["id"]] = token
            self._remember("remember_job", job["id"], job["room_id"], token)
            log.info("job %s submitted (%d bytes bundle)", job["id"], artifact["size"])
            if job.get("unschedulable"):
                _say(f"zwdx: job {job['id']} cannot run in this room as it is now: {job['unschedulable']}; it "
                     f"waits for GPU clients that fit (submit_job(..., fail_if_unschedulable=True) refuses it)")
            if not wait:
                return job["id"]
            return self._result(self._follow(job["id"], token, progress, timeout, trackers), raise_on_failure)
        except KeyboardInterrupt:
            if wait:
                self._interrupted(job["id"], token, cancel_on_interrupt)
            raise _interrupt(job["id"]) from None  # not the internals (requests, sockets) it came through

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
        from .script_jobs import ScriptJobs
        return ScriptJobs(self).submit(script, args, nproc=nproc, working_dir=working_dir, **options)

    def download_outputs(self, job_id: str, dest: str | None = None, room_token: str | None = None) -> str | None:
        """A script job's outputs (what its rank 0 wrote under ``$ZWDX_OUTPUT_DIR``) unpacked into
        ``dest`` (default ``zwdx-output/<job id>``): that folder, or None when it has none."""
        from .script_jobs import ScriptJobs
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
        differ);
        ``suspects``: the DILOCO workers named dishonest and dropped (``[{rank, client_id, rounds,
        reason, at}]``). ``trackers``
        as in ``submit_job`` (from the job's first metric, whenever this is called)."""
        token = self._token(room_token, job_id)
        try:
            job = self._follow(job_id, token, progress, timeout, trackers)
        except KeyboardInterrupt:
            self._interrupted(job_id, token, cancel_on_interrupt)
            raise _interrupt(job_id) from None
        return self._result(job, raise_on_failure)

    @staticmethod
    def _result(job: dict, raise_on_failure: bool) -> dict:
        job = _numbers(job)
        status = ResultStatus(job["status"])
        result = {"job_id": job["id"], "status": status, "complete": status == JobStatus.COMPLETED.value,
                  "results": job.get("results") or {}, "final_loss": job.get("final_loss"),
                  "world_size": job.get("world_size"), "placement": job.get("placement"),
                  "failures": job.get("failures") or {}, "failure_order": job.get("failure_order") or [],
                  "reason": job.get("reason"), "job": job,
                  "warnings": job.get("warnings") or [],
                  "suspects": [{"rank": int(r), **v} for r, v in sorted((job.get("suspects") or {}).items(),
                                                                         key=lambda kv: int(kv[0]))]}
        if job["status"] == JobStatus.FAILED.value and raise_on_failure:
            raise JobFailed(f"job {job['id']} failed: {job.get('reason')}", job_id=job["id"],
                            failures=job.get("failures"), reason=job.get("reason") or "", result=result,
                            failure_order=job.get("failure_order"))
        return result

    def _follow(self, job_id: str, token: str, progress: bool, timeout: float | None, trackers=None,
                on_log=None) -> dict:
        """Follow the job (held polls, ``GET /jobs/<id>?wait=``) until it ends; show its progress
        (``on_log``: each log event to it, and changes of status as lines, instead of a progress
        bar; ``trackers``: its metrics to them).
        Returns its last document."""
        bar, feed, said = None, None, None
        if trackers:
            feed = _trackers.Feed(_trackers.make(trackers), self._json("GET", f"/jobs/{job_id}", token))
        if progress and on_log is None:
            from tqdm.auto import tqdm
            bar = tqdm(desc=f"job {job_id}", unit="step", dynamic_ncols=True)
        after, latest, deadline = 0, {}, (time.time() + timeout) if timeout else None
        unreachable_since = None
        try:
            while True:
                asked = time.monotonic()
                try:
                    # A long poll: the server holds the call until the job has news (at most
                    # LONG_POLL s), so waiting on a quiet job costs a call every LONG_POLL s.
                    hold = defaults.LONG_POLL if not deadline else max(0.0, min(defaults.LONG_POLL,
                                                                               deadline - time.time()))
                    job = self._json("GET", f"/jobs/{job_id}", token, params={"events_after": after, "wait": hold},
                                     timeout=max(self.timeout, defaults.LONG_POLL + 15))
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
                        latest.update(from_wire(ev["data"]))
                        if feed is not None:
                            feed.event(ev.get("rank"), ev.get("step"), from_wire(ev["data"]), ev["seq"])
                        if bar is not None and ev.get("step") is not None:
                            bar.n = max(bar.n, ev["step"] + 1)
                    elif ev["kind"] == "log" and on_log is not None:
                        on_log(ev)
                    elif ev["kind"] == "log" and bar is not None:
                        bar.write(log_line(ev))
                waiting = JobStatus(job["status"]) in WAITING and job.get("waiting_reason")
                if on_log is not None and (job["status"], waiting) != said:
                    said = (job["status"], waiting)
                    _say(f"zwdx: job {job_id} {job['status']}" + (f": {waiting}" if waiting else ""))
                if bar is not None:
                    bar.set_description(f"job {job_id} {job['status']}" + (f": {waiting}" if waiting else ""))
                    bar.set_postfix({k: f"{v:.4g}" for k, v in sorted(latest.items())[:6]}, refresh=True)
                if JobStatus(job["status"]).finished:
                    if not events:  # its last events may fill more than one answer (a page each)
                        return job
                    continue
                if deadline and time.time() > deadline:
                    raise TimeoutError(f"job {job_id} still {job['status']} after {timeout} s")
                # News came at once: let more gather (one call per POLL_INTERVAL at most, also
                # against a server that does not hold polls).
                time.sleep(max(0.0, defaults.POLL_INTERVAL - (time.monotonic() - asked)))
        finally:
            if bar is not None:
                bar.close()
            if feed is not None:
                feed.close()

    def _interrupted(self, job_id: str, token: str, cancel: bool) -> None:
        """Ctrl-C while waiting: cancel the job, or leave it running and say how to get back to it."""
        server = f" --server {self.server_url}"
        if not cancel:
            _say(f"zwdx: stopped waiting; job {job_id} goes on running. Re-attach with zwdx.wait({job_id!r}) or "
                 f"`zwdx jobs show {job_id}{server}`; cancel it with `zwdx jobs cancel {job_id}{server}`")
            return
        _say(f"zwdx: Ctrl-C: cancelling job {job_id} (Ctrl-C again to stop at once)")
        try:
            # A fresh session: the interrupted request may have left its connection half read.
            with self._new_session() as session:
                self._json("POST", f"/jobs/{job_id}/cancel", token, session=session, timeout=15)
            _say(f"zwdx: job {job_id} cancelled")
        except KeyboardInterrupt:
            _say(f"zwdx: stopped; job {job_id} may still be running: `zwdx jobs cancel {job_id}{server}`")
            raise _interrupt(job_id) from None
        except Conflict as exc:
            _say(f"zwdx: job {job_id} had already ended ({exc.context.get('status', 'finished')})")
        except ZwdxError as exc:
            _say(f"zwdx: could not cancel job {job_id} ({exc}); cancel it with `zwdx jobs cancel {job_id}{server}`")

    def get_job(self, job_id: str, room_token: str | None = None) -> dict:
        return _numbers(self._json("GET", f"/jobs/{job_id}", self._token(room_token, job_id)))

    def list_jobs(self, room_token: str | None = None, status: str | None = None) -> list[dict]:
        params = {"status": status} if status else None
        return [_numbers(j) for j in self._json("GET", "/jobs", self._token(room_token), params=params)["jobs"]]

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
        config = (nest(self.get_job(job_id, room_token).get("spec") or {}).get("strategy") or {}).get("lora")
        state = self._weights(job_id, room_token)
        if config is not None:
            return _lora.load_adapter(model, config, state)
        model.load_state_dict(state)
        return model

    def get_adapter(self, job_id: str, room_token: str | None = None) -> dict:
        """A LoRA job's trained adapter: its tensors by name, as ``peft.get_peft_model_state_dict``
        names them (``set_peft_model_state_dict`` loads them)."""
        if (nest(self.get_job(job_id, room_token).get("spec") or {}).get("strategy") or {}).get("lora") is None:
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


class _Buffers:
    """A request body made of buffers sent one after another (``requests`` sets the
    Content-Length from ``len``; urllib3 hands each buffer to the socket as it is)."""

    def __init__(self, parts: list):
        self.parts = [memoryview(p).cast("B") for p in parts]

    def __len__(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __iter__(self):
        return iter(self.parts)
