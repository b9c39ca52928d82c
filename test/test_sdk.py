"""The SDK as a user meets it: checks at submit, the epochs a train function gets, the
credential store, Ctrl-C, the earlier project's surface. Real server and GPU-client processes
where the behaviour needs them; the submitter's side runs in real subprocesses where a fresh
process or a signal is the point."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading

import pytest
import torch

import mnist
from procs import ROOT, wait_until
import zwdx
from zwdx import ZWDX, BadRequest, JobStatus, Unschedulable
from zwdx.checks import OFFERED, call_with
from zwdx.credentials import CredentialStore
from zwdx.sdk import ResultStatus

NOWHERE = "http://127.0.0.1:9"  # nothing listens: a check that raises BadRequest ran before any upload
ENV = {"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "test")])}


def python(code: str, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python process of this tree (the config dir of the test goes along)."""
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **ENV, **(env or {})}, timeout=timeout)


def tiny_loader(rank, world_size):
    from torch.utils.data import DataLoader, TensorDataset
    g = torch.Generator().manual_seed(rank)
    return DataLoader(TensorDataset(torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)),
                      batch_size=8)


def _fit(model, loader, optimizer, epochs):
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()


def train_with_default(model, loader, optimizer, epochs=5):
    _fit(model, loader, optimizer, epochs)
    return {"epochs_run": epochs}


def train_without_default(model, loader, optimizer, epochs):
    _fit(model, loader, optimizer, epochs)
    return {"epochs_run": epochs}


def train_with_kwargs(model, loader, **offered):
    _fit(model, loader, offered["optimizer"], offered["epochs"])
    return {"epochs_run": offered["epochs"]}


def tiny(sdk, room, train_func, **kwargs):
    model = torch.nn.Linear(4, 2)
    return sdk.submit_job(model, tiny_loader, train_func, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          resources=zwdx.Resources(world_size=1),
                          run=zwdx.Run(room_token=room["token"], progress=False), **kwargs)


# -- the earlier project's surface ------------------------------------------------------------------
def test_result_status_is_the_word_of_either_project():
    status = ResultStatus("completed")
    assert status == "completed" and status == "complete" and "complete" == status
    assert status == JobStatus.COMPLETED and not status != "complete"
    assert json.dumps({"status": status}) == '{"status": "completed"}' and str(status) == "completed"
    assert {"completed": 1}[status] == 1
    assert ResultStatus("failed") != "complete" and ResultStatus("cancelled") != "complete"


def test_parse_args_reads_the_earlier_command_line(capsys, monkeypatch):
    monkeypatch.delenv("ZWDX_ROOM_TOKEN", raising=False)
    sdk = ZWDX(NOWHERE)
    assert sdk.parse_args(["-rt", "zr_a"]).room_token == "zr_a"
    assert sdk.room_token == "zr_a"  # later calls need no token
    assert ZWDX(NOWHERE).parse_args(["--room_token", "zr_b"]).room_token == "zr_b"
    with pytest.raises(SystemExit):
        ZWDX(NOWHERE).parse_args([])
    assert "-rt/--room_token" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ZWDX(NOWHERE).parse_args(["--help"])
    assert "zwdx user argument parser." in capsys.readouterr().out


def test_get_logger_prints_info_lines_once_however_often_it_is_called():
    done = python("from zwdx import ZWDX\n"
                  "z = ZWDX('http://127.0.0.1:9')\n"
                  "log = z.get_logger(); assert z.get_logger() is log\n"
                  "log.info('hello from the earlier surface')\n"
                  "print(len(log.handlers))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"
    lines = [line for line in done.stderr.splitlines() if "hello from the earlier surface" in line]
    assert len(lines) == 1 and " - INFO - " in lines[0], done.stderr


# -- checks at submit, before any upload ------------------------------------------------------------
def train_needing_lr(model, loader, optimizer, lr):
    return None


def train_positional(model, loader, /):
    return None


@pytest.mark.parametrize("loader, train, message", [
    (tiny_loader, train_needing_lr,
     "train_func 'train_needing_lr' declares argument 'lr', which zwdx does not provide"),
    (lambda rank, path: None, train_with_default, "data_loader_func '<lambda>' declares argument 'path'"),
    (tiny_loader, train_positional, "declares positional-only arguments 'model', 'loader'"),
])
def test_a_function_declaring_what_zwdx_does_not_offer_is_refused_before_upload(loader, train, message):
    with pytest.raises(BadRequest) as info:
        ZWDX(NOWHERE, room_token="zr_x").submit_job(torch.nn.Linear(4, 2), loader, train)
    assert message in str(info.value)


def test_eval_func_is_checked_and_defaults_args_and_kwargs_are_fine():
    def judge(model, loader, labels):
        return 0

    with pytest.raises(BadRequest, match="eval_func 'judge' declares argument 'labels'"):
        ZWDX(NOWHERE, room_token="zr_x").submit_job(torch.nn.Linear(4, 2), tiny_loader, train_with_default,
                                                     eval_func=judge)
    accepted = [lambda rank, world_size, path="/data": None, lambda *args, **kwargs: None,
                lambda rank, **kwargs: None]
    for loader in accepted:  # passes the checks: fails only when it reaches the (absent) server
        with pytest.raises(Exception) as info:
            ZWDX(NOWHERE, room_token="zr_x").submit_job(torch.nn.Linear(4, 2), loader, train_with_kwargs)
        assert type(info.value).__name__ == "ServerUnreachable"


def test_the_runner_offers_exactly_the_names_the_submit_check_knows():
    with pytest.raises(TypeError, match="does not name"):
        call_with(lambda **kw: None, {"learning_rate": 1}, "train_func")
    assert call_with(lambda rank, world_size, device="cpu": (rank, world_size, device),
                     dict.fromkeys(OFFERED["data_loader_func"], 1), "data_loader_func") == (1, 1, 1)


def test_an_unpicklable_closure_is_named_with_its_function_and_type():
    lock = threading.Lock()

    def train_locked(model, loader):
        with lock:
            return None

    def helper():
        with lock:
            return None

    def train_via_helper(model, loader):
        helper()

    sdk = ZWDX(NOWHERE, room_token="zr_x")
    with pytest.raises(BadRequest) as info:
        sdk.submit_job(torch.nn.Linear(4, 2), tiny_loader, train_locked)
    text = str(info.value)
    assert "train_func" in text and "train_locked" in text and "'lock'" in text and "_thread.lock" in text, text
    assert (info.value.field, info.value.variable, info.value.variable_type) == ("train_func", "lock", "_thread.lock")
    with pytest.raises(BadRequest) as info:
        sdk.submit_job(torch.nn.Linear(4, 2), tiny_loader, train_via_helper)
    assert "train_via_helper" in str(info.value) and "through helper" in str(info.value)
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    model[0].handle = lock
    with pytest.raises(BadRequest, match=r"model attribute 'model\.0\.handle' of type _thread.lock"):
        sdk.submit_job(model, tiny_loader, train_with_default)


# -- the credential store ---------------------------------------------------------------------------
def test_credential_store_is_private_and_keeps_every_concurrent_write(config_dir):
    code = ("import sys\nfrom zwdx.credentials import CredentialStore\nstore = CredentialStore()\n"
            "for i in range(25):\n"
            "    store.remember_job('http://s:1/', f'{sys.argv[1]}-{i}', 'room-' + sys.argv[1], 'zr_' + sys.argv[1])\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, name], cwd=ROOT, env={**os.environ, **ENV})
             for name in ("a", "b", "c")]
    assert [p.wait(120) for p in procs] == [0, 0, 0]
    store = CredentialStore()
    assert store.path == str(config_dir / "credentials.json")
    assert stat.S_IMODE(os.stat(config_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o600
    for name in ("a", "b", "c"):
        assert all(store.token_for_job("http://s:1", f"{name}-{i}") == f"zr_{name}" for i in range(25))
    assert store.token_for_job("http://other:1", "a-0") is None
    assert sorted(os.listdir(config_dir)) == ["credentials.json", "credentials.json.lock"]  # no temp file left


def test_a_broken_credential_file_is_ignored_and_replaced(config_dir):
    config_dir.mkdir(mode=0o700)
    (config_dir / "credentials.json").write_text("{not json")
    store = CredentialStore()
    assert store.token_for_job("http://s:1", "j") is None
    store.remember_job("http://s:1", "j", "r", "zr_t")
    assert store.token_for_job("http://s:1", "j") == "zr_t"


def test_the_job_id_alone_opens_a_job_in_a_fresh_process(cluster, config_dir):
    from zwdx import ZWDX
    sdk, room = ZWDX(cluster.server.url), cluster.room  # this SDK remembers, in the test's config dir
    model = mnist.Net()
    result = sdk.submit_job(model, mnist.create_loader, mnist.train, optimizer=torch.optim.AdamW(model.parameters()),
                            resources=zwdx.Resources(world_size=1),
                            run=zwdx.Run(room_token=room["token"], progress=False))
    waiting = sdk.submit_job(model, mnist.create_loader, mnist.train, resources=zwdx.Resources(world_size=4),
                             run=zwdx.Run(room_token=room["token"]),
                             wait=False)
    fresh = python(
        "import json, sys, mnist\nfrom zwdx import ZWDX\nfrom digests import state_digest\n"
        "done, waiting = sys.argv[1], sys.argv[2]\nz = ZWDX(sys.argv[3])\n"
        "trained = z.get_trained_model(done, mnist.Net())\n"
        "print(json.dumps({'status': z.get_job(done)['status'], 'fingerprint': state_digest(trained.state_dict()),\n"
        "                  'metrics': sorted(z.get_job_metrics(done)), 'logs': len(z.get_job_logs(done)),\n"
        "                  'cancel': z.cancel_job(waiting)['status']}))",
        result["job_id"], waiting, sdk.server_url)
    assert fresh.returncode == 0, fresh.stderr
    seen = json.loads(fresh.stdout)
    ranks = sdk.get_job(result["job_id"], room["token"])["ranks"]
    assert seen == {"status": "completed", "fingerprint": ranks["0"]["fingerprint"],
                    "metrics": sorted(sdk.get_job_metrics(result["job_id"], room["token"])),
                    "logs": len(sdk.get_job_logs(result["job_id"], room["token"])), "cancel": "cancelled"}
    assert "loss" in seen["metrics"] and seen["logs"] > 0
    assert room["token"] not in fresh.stdout + fresh.stderr

    off = python("import sys\nfrom zwdx import ZWDX, BadRequest\n"
                 "try:\n    ZWDX(sys.argv[1]).get_job(sys.argv[2])\nexcept BadRequest as e:\n    print(e)",
                 sdk.server_url, result["job_id"], env={"ZWDX_REMEMBER": "0"})
    assert "a room token is needed" in off.stdout and result["job_id"] in off.stdout, off.stdout + off.stderr
    elsewhere = python("import sys\nfrom zwdx import ZWDX\nZWDX(sys.argv[1], remember=False).create_room('x')",
                       sdk.server_url, env={"ZWDX_CONFIG_DIR": str(config_dir.parent / "unused")})
    assert elsewhere.returncode == 0 and not (config_dir.parent / "unused").exists()


# -- epochs, names --------------------------------------------------------------------------------
def test_the_train_function_default_wins_when_no_epochs_are_given(cluster):
    sdk, room = cluster.sdk, cluster.room
    runs = {
        "own default": tiny(sdk, room, train_with_default),
        "none declared": tiny(sdk, room, train_without_default),
        "given": tiny(sdk, room, train_with_default, training=zwdx.Training(epochs=2)),
        "kwargs": tiny(sdk, room, train_with_kwargs),
    }
    assert {k: r["results"]["epochs_run"] for k, r in runs.items()} == \
        {"own default": 5, "none declared": 1, "given": 2, "kwargs": 1}
    job = runs["own default"]["job"]
    assert job["spec"]["training"]["epochs"] is None and runs["given"]["job"]["spec"]["training"]["epochs"] == 2
    assert job["name"] == "train_with_default"
    model = torch.nn.Linear(4, 2)
    # the earlier project's positional order: model, loader, train, eval, optimizer, parallelism,
    # memory_required; the rest by name
    result = sdk.submit_job(model, tiny_loader, train_without_default, None, torch.optim.SGD(model.parameters(), 0.1),
                            "DDP", 0, resources=zwdx.Resources(world_size=1), training=zwdx.Training(epochs=3),
                            run=zwdx.Run(room_token=room["token"], name="named", progress=False))
    assert result["results"]["epochs_run"] == 3 and result["job"]["name"] == "named"
    assert result["status"] == "completed" and result["complete"] is True


def test_submit_job_takes_seven_arguments_by_position_and_the_rest_by_name():
    model = torch.nn.Linear(4, 2)
    with pytest.raises(TypeError) as info:  # room_token by position: refused before anything is sent
        ZWDX(NOWHERE).submit_job(model, tiny_loader, train_with_default, None, None, "DDP", 0, "zr_x")
    message = str(info.value)
    assert "submit_job() takes at most 7 positional arguments" in message and "8 were given" in message
    assert "model, data_loader_func, train_func, eval_func, optimizer, parallelism, memory_required" in message
    assert "room_token=" in message
    with pytest.raises(Exception) as info:  # seven by position pass: it fails only at the (absent) server
        ZWDX(NOWHERE, room_token="zr_x").submit_job(model, tiny_loader, train_with_default, None,
                                                     torch.optim.SGD(model.parameters(), lr=0.1), "DDP", 0)
    assert type(info.value).__name__ == "ServerUnreachable"


def _connections_to(port: int) -> list:
    import psutil
    return [c for c in psutil.Process().net_connections(kind="tcp")
            if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED]


def test_zwdx_as_a_context_manager_closes_its_connections_to_the_server(server):
    with ZWDX(server.url) as sdk:
        assert sdk.health()["status"] == "ok"
        assert len(_connections_to(server.port)) == 1  # kept alive for the next call
    wait_until(lambda: not _connections_to(server.port), 10, what="the connection closed")
    assert sdk.health()["status"] == "ok"  # still usable: a new connection
    sdk.close()
    sdk.close()  # twice is fine
    wait_until(lambda: not _connections_to(server.port), 10, what="the connection closed again")


# -- Ctrl-C ---------------------------------------------------------------------------------------
SUBMIT_SLOW = """
import signal, sys, torch, mnist, workloads
signal.signal(signal.SIGINT, signal.default_int_handler)  # a test run started in the background ignores it
from zwdx import ZWDX, Resources, Run, Training
url, token, mode, world = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ZWDX(url).submit_job(mnist.Net(), mnist.create_loader, workloads.slow_train,
                     optimizer=torch.optim.SGD(mnist.Net().parameters(), lr=0.01), resources=Resources(world_size=world),
                     training=Training(epochs=50),
                     run=Run(room_token=token, progress=mode == "bar", cancel_on_interrupt=mode != "detach"))
"""


def _submit_in_background(sdk, room, tmp_path, mode: str, world: int = 1):
    before = {j["id"] for j in sdk.list_jobs(room["token"])}
    err = open(tmp_path / f"submitter-{mode}.err", "w+")
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", SUBMIT_SLOW, sdk.server_url, room["token"], mode,
                             str(world)],
                            cwd=ROOT, env={**os.environ, **ENV}, stdout=err, stderr=subprocess.STDOUT, text=True)
    job = wait_until(lambda: next((j for j in sdk.list_jobs(room["token"]) if j["id"] not in before), None), 60,
                     what="the submitter's job")
    return proc, err, job["id"]


def _interrupt(proc, err) -> str:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:  # say where it hung (faulthandler's dump)
        proc.send_signal(signal.SIGABRT)
        proc.wait(30)
        err.seek(0)
        pytest.fail(f"the submitter was still running 60 s after its Ctrl-C; its threads:\n{err.read()[-8000:]}")
    err.seek(0)
    return err.read()


def test_ctrl_c_cancels_the_job_it_started_or_detaches_on_request(cluster, tmp_path):
    sdk, room = cluster.sdk, cluster.room
    proc, err, job_id = _submit_in_background(sdk, room, tmp_path, "cancel")
    wait_until(lambda: sdk.get_job_metrics(job_id, room["token"]).get("loss"), 120, what="the job training")
    out = _interrupt(proc, err)
    assert proc.returncode != 0 and "KeyboardInterrupt" in out
    assert f"cancelling job {job_id}" in out and f"job {job_id} cancelled" in out, out
    assert sdk.get_job(job_id, room["token"])["status"] == "cancelled"

    proc, err, job_id = _submit_in_background(sdk, room, tmp_path, "detach")
    wait_until(lambda: sdk.get_job(job_id, room["token"])["status"] == "running", 120, what="the job running")
    out = _interrupt(proc, err)
    assert proc.returncode != 0
    assert f"zwdx.wait('{job_id}')" in out and f"zwdx jobs cancel {job_id}" in out, out
    assert room["token"] not in out
    assert sdk.get_job(job_id, room["token"])["status"] == "running"  # it goes on
    # what it said to type works, with the job id alone (the credential store has the token)
    cli = [sys.executable, "-m", "zwdx.cli", "jobs"]
    status = subprocess.run([*cli, "show", job_id, "--json", "--server", sdk.server_url], cwd=ROOT,
                            capture_output=True, text=True, env={**os.environ, **ENV}, timeout=60)
    assert json.loads(status.stdout)["status"] == "running", status.stderr
    cancel = subprocess.run([*cli, "cancel", job_id, "--server", sdk.server_url], cwd=ROOT, capture_output=True,
                            text=True, env={**os.environ, **ENV}, timeout=60)
    assert cancel.stdout.strip() == f"job {job_id}: cancelled", cancel.stderr


def test_the_progress_bar_says_why_a_job_waits_and_ctrl_c_cancels_it_there(cluster, tmp_path):
    sdk, room = cluster.sdk, cluster.room
    proc, err, job_id = _submit_in_background(sdk, room, tmp_path, "bar", world=3)

    def said() -> str:
        err.seek(0)
        return err.read()
    wait_until(lambda: "waiting for 3 free slot" in said(), 60, what=f"the waiting reason in the bar:\n{said()}")
    assert f"job {job_id} queued: waiting for 3 free slot" in said()
    out = _interrupt(proc, err)
    assert f"job {job_id} cancelled" in out, out
    assert sdk.get_job(job_id, room["token"])["status"] == "cancelled"


# -- a job the room cannot run as it is -----------------------------------------------------------
def test_an_unschedulable_job_is_said_at_submit_and_refused_on_request(cluster, capfd):
    sdk, room = cluster.sdk, cluster.room  # two GPU clients of one CPU slot each
    model = torch.nn.Linear(4, 2)
    before = {j["id"] for j in sdk.list_jobs(room["token"])}
    with pytest.raises(Unschedulable) as refused:
        sdk.submit_job(model, tiny_loader, train_with_default, resources=zwdx.Resources(world_size=3),
                       run=zwdx.Run(room_token=room["token"], fail_if_unschedulable=True), wait=False)
    assert "world_size 3" in str(refused.value)  # the server's reason
    assert {j["id"] for j in sdk.list_jobs(room["token"])} == before  # nothing stored
    capfd.readouterr()
    job_id = sdk.submit_job(model, tiny_loader, train_with_default, resources=zwdx.Resources(world_size=3),
                            run=zwdx.Run(room_token=room["token"]),
                            wait=False)
    lines = [line for line in capfd.readouterr().err.splitlines() if "cannot run in this room" in line]
    assert len(lines) == 1 and job_id in lines[0] and "fail_if_unschedulable=True" in lines[0], lines
    assert sdk.get_job(job_id, room["token"])["status"] == "queued"  # it waits: donors may join


def test_a_bundle_the_server_hashes_differently_is_refused_before_any_job(tmp_path):
    """The SDK uploads the bundle's buffers while hashing them; a server (or anything between)
    that stored other bytes than were sent says so in its sha256, and no job is created."""
    import http.server
    seen = []

    class Corrupting(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.path, len(body)))
            answer = json.dumps({"id": "a1", "room_id": "r1", "kind": "bundle", "size": len(body),
                                 "sha256": "0" * 64, "created_at": 0.0}).encode()
            self.send_response(201)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Corrupting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        sdk = ZWDX(f"http://127.0.0.1:{server.server_address[1]}", remember=False)
        with pytest.raises(Exception, match="arrived changed"):
            sdk.submit_job(torch.nn.Linear(64, 64), tiny_loader, train_with_default, run=zwdx.Run(room_token="zs_x"),
                           wait=False)
    finally:
        server.shutdown()
    assert [path for path, _ in seen] == ["/api/v1/artifacts"]  # no POST /jobs followed
    assert seen[0][1] > 64 * 64 * 4  # the weights travelled whole
