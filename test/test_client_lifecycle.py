"""GPU clients that donors restart and reconfigure (issue 30 item 6), and the small things a user
meets at the terminal: Ctrl-C, a closed pipe, the units ``room show`` prints, whose line a log
line is. In-process and fast; the one test that starts a server and GPU clients is ``slow``."""
from __future__ import annotations

import os
import signal
import stat
import sys
import traceback

import pytest

import zwdx
from zwdx import cli
from zwdx.sdk import ZWDX

SERVER = "http://127.0.0.1:9"  # nothing listens: every call the tests make is patched


@pytest.fixture
def token(monkeypatch):
    monkeypatch.setenv("ZWDX_ROOM_TOKEN", "zs_test")
    return "zs_test"


# -- Ctrl-C ---------------------------------------------------------------------------------------
def _deep_read(*_args, **_kwargs):
    """Where a Ctrl-C lands while the SDK follows a job: deep in a socket read."""
    def recv_into():
        raise KeyboardInterrupt
    recv_into()


def _cancel_answers(sdk, calls):
    def answer(method, path, token=None, **kwargs):
        calls.append((method, path))
        if path == "/jobs":
            return {"id": "job1", "room_id": "room1"}
        return {"status": "cancelled"}
    sdk._json = answer


def _frames(err: BaseException) -> list[str]:
    return [frame.name for frame in traceback.extract_tb(err.__traceback__)]


def test_ctrl_c_in_wait_cancels_and_raises_a_keyboard_interrupt_without_the_internals(token, capsys):
    sdk, calls = ZWDX(SERVER, room_token=token, remember=False), []
    _cancel_answers(sdk, calls)
    sdk._follow = _deep_read
    with pytest.raises(KeyboardInterrupt) as caught:
        sdk.wait("job1")
    assert ("POST", "/jobs/job1/cancel") in calls
    err = caught.value
    assert err.__cause__ is None and err.__suppress_context__, "the cut read is chained to it"
    assert "recv_into" not in _frames(err) and "_deep_read" not in _frames(err), _frames(err)
    assert "job job1 cancelled" in capsys.readouterr().err


def test_ctrl_c_in_submit_job_cancels_and_raises_a_keyboard_interrupt_without_the_internals(token, capsys):
    import torch
    sdk, calls = ZWDX(SERVER, room_token=token, remember=False), []
    _cancel_answers(sdk, calls)
    sdk._upload_bundle = lambda token, parts: {"id": "art1", "size": 10}
    sdk._follow = _deep_read
    model = torch.nn.Linear(2, 2)
    with pytest.raises(KeyboardInterrupt) as caught:
        sdk.submit_job(model, _loader, _train, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                       run=zwdx.Run(progress=False))
    assert ("POST", "/jobs/job1/cancel") in calls
    err = caught.value
    assert err.__suppress_context__ and "recv_into" not in _frames(err), _frames(err)
    assert len(traceback.format_exception(err)) < 12  # its whole traceback, as Python prints it


def _loader(rank, world_size):
    return [(None, None)]


def _train(model, loader, optimizer, epochs=1):
    return {}


def test_ctrl_c_in_the_cli_prints_one_line_and_exits_130(token, monkeypatch, capsys, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    monkeypatch.setattr(ZWDX, "submit_script", lambda self, *a, **k: _deep_read())
    code = cli.main(["run", "--server", SERVER, "--nproc", "1", "--working-dir", str(tmp_path), "train.py"])
    err = capsys.readouterr().err
    assert code == 130
    assert err.strip().splitlines() == ["zwdx: interrupted"], err


# -- a closed pipe, units, log lines ----------------------------------------------------------------
def test_jobs_list_into_a_pipe_closed_early_exits_quietly(token, monkeypatch, capsys):
    jobs = [{"id": f"job{i}", "name": "", "status": "queued", "created_at": 0} for i in range(5000)]
    monkeypatch.setattr(ZWDX, "list_jobs", lambda self, token, status=None: jobs)
    read, write = os.pipe()
    os.close(read)  # `| head` has read its lines and gone
    monkeypatch.setattr(sys, "stdout", os.fdopen(write, "w"))
    previous = signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python starts a program
    try:
        code = cli.main(["jobs", "list", "--server", SERVER])
        sys.stdout.flush()  # what Python does at exit: nothing left to fail on
    finally:
        signal.signal(signal.SIGPIPE, previous)
        sys.stdout.close()
    assert code == 141
    assert "BrokenPipeError" not in capsys.readouterr().err


def test_room_show_prints_memory_in_gib(token, monkeypatch, capsys):
    room = {"id": "r1", "name": "lab", "clients": [{"id": "c1", "status": "online"}],
            "totals": {"clients_online": 1, "slots": 2, "slots_busy": 0, "memory_total": 3 * 2**30 + 2**29,
                       "memory_free": 2**30, "hosts": 1}}
    monkeypatch.setattr(ZWDX, "get_room", lambda self, token=None: room)
    assert cli.main(["room", "show", "--server", SERVER]) == 0
    out = capsys.readouterr().out
    assert "3.5 GiB" in out and "1.0 GiB" in out and str(3 * 2**30 + 2**29) not in out, out


def test_a_log_line_of_the_server_is_not_labelled_rank_none(token, monkeypatch, capsys):
    events = [{"seq": 1, "rank": None, "data": {"text": "diloco round 1: 2 workers"}},
              {"seq": 2, "rank": 0, "data": {"text": "epoch 1"}}]
    monkeypatch.setattr(ZWDX, "_json", lambda self, method, path, token=None, params=None, **kw:
                        {"events": [e for e in events if e["seq"] > params["after"]]})
    assert cli.main(["jobs", "logs", "job1", "--server", SERVER]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["[server] diloco round 1: 2 workers", "[rank 0] epoch 1"], out


# -- offline GPU clients: the room's retention, its owner's prune ----------------------------------
DAY = 86400.0


def _client(app, room_id: str, client_id: str, status: str = "offline", seen_ago: float = 0.0):
    import time
    now = time.time()
    app.extensions["zwdx"].store.upsert_client(
        {"id": client_id, "room_id": room_id, "hostname": "h", "status": status, "last_seen": now - seen_ago},
        [{"id": f"{client_id}:0", "client_id": client_id, "room_id": room_id, "index": 0, "kind": "cpu"}])


def _ids(api) -> list[str]:
    return sorted(c["id"] for c in api.get("/room").json["clients"])


def test_the_rooms_owner_prunes_its_offline_clients_and_no_one_else_can(app, room_api):
    api, other = room_api("lab"), room_api("other")
    _client(app, api.room["id"], "gone-a", seen_ago=60)
    _client(app, api.room["id"], "gone-b", seen_ago=5 * DAY)
    _client(app, api.room["id"], "up", status="online")
    _client(app, other.room["id"], "theirs", seen_ago=5 * DAY)
    before = _ids(api)
    for token in (api.donor, "zs_wrong", None):  # the room's donor token, a wrong one, none
        resp = api.as_(token).post("/room/clients/prune", json={})
        assert resp.status_code in (401, 403), (token, resp.status_code, resp.json)
    resp = api.post("/room/clients/prune", json={"offline_for": -1})
    assert resp.status_code == 400 and resp.json["error"]["field"] == "offline_for", resp.json
    resp = api.post("/room/clients/prune", json={"offline_since": 1})
    assert resp.status_code == 400 and "offline_since" in resp.json["error"]["message"], resp.json
    assert _ids(api) == before  # refused: nothing changed
    resp = api.post("/room/clients/prune", json={"offline_for": DAY})
    assert resp.status_code == 200 and resp.json["pruned"] == ["gone-b"], resp.json
    resp = api.post("/room/clients/prune")  # no body: every one offline now
    assert resp.status_code == 200 and resp.json["pruned"] == ["gone-a"], resp.json
    assert _ids(api) == ["up"] and _ids(other) == ["theirs"]
    _client(app, api.room["id"], "gone-c", seen_ago=60)
    assert other.post("/room/clients/prune").json["pruned"] == ["theirs"]  # its own room's, not this one's
    assert _ids(api) == ["gone-c", "up"]


def test_clients_offline_past_the_rooms_retention_are_dropped_by_the_sweeper(make_app, room_api):
    from zwdx.server import clients
    app = make_app(CLIENT_RETENTION=DAY)
    api, other, keeper = room_api("lab", app=app), room_api("other", app=app), room_api("keeper", app=app)
    for room in (api, other, keeper):
        _client(app, room.room["id"], f"{room.room['name']}-hour", seen_ago=3600)
        _client(app, room.room["id"], f"{room.room['name']}-week", seen_ago=7 * DAY)
    resp = other.request("PATCH", "/room", json={"client_retention": 600})
    assert resp.status_code == 200 and resp.json["client_retention"] == 600, resp.json
    assert keeper.request("PATCH", "/room", json={"client_retention": 0}).status_code == 200
    resp = api.request("PATCH", "/room", json={"client_retention": -5})
    assert resp.status_code == 400 and resp.json["error"]["field"] == "client_retention", resp.json
    assert api.get("/room").json["client_retention"] is None  # refused: the server's still
    assert clients.drop_expired(app.extensions["zwdx"]) == 3
    assert _ids(api) == ["lab-hour"]                          # the server's day
    assert _ids(other) == []                                  # its own ten minutes
    assert _ids(keeper) == ["keeper-hour", "keeper-week"]     # 0: never


def test_the_servers_retention_is_a_flag_and_an_environment_variable(make_app, monkeypatch):
    args = cli.build_parser().parse_args(["server", "--client-retention", "3600"])
    assert args.client_retention == 3600.0
    monkeypatch.setenv("ZWDX_CLIENT_RETENTION", "7200")
    assert make_app().config["CLIENT_RETENTION"] == 7200


def test_room_clients_prune_and_settings_on_the_command_line(token, monkeypatch, capsys):
    said = {}
    monkeypatch.setattr(ZWDX, "prune_clients", lambda self, token, offline_for=0: said.update(
        offline_for=offline_for) or ["old-1", "old-2"])
    monkeypatch.setattr(ZWDX, "set_room", lambda self, token, **settings: said.update(settings) or settings)
    assert cli.main(["room", "clients", "prune", "--offline-for", "60", "--server", SERVER]) == 0
    assert "2 offline gpu client(s) dropped: old-1, old-2" in capsys.readouterr().out
    assert cli.main(["room", "settings", "--client-retention", "0", "--server", SERVER]) == 0
    assert "never dropped" in capsys.readouterr().out
    assert said == {"offline_for": 60.0, "client_retention": 0.0}


# -- one work dir, one id across restarts ------------------------------------------------------------
def test_a_work_dir_gives_a_restarted_agent_its_id_and_two_agents_at_once_two_ids(tmp_path):
    from gpu_client.agent.identity import Identity
    from gpu_client.agent.workspace import Workspace, running_agents
    root = str(tmp_path / "work")
    first = Workspace(root)
    second = Workspace(root)  # another agent on the same work dir while the first runs
    assert first.client_id != second.client_id
    assert running_agents(root) == {first.client_id: os.getpid(), second.client_id: os.getpid()}
    Identity(root, first.client_id).keep("cs_not-for-anyone")
    first.close()
    assert running_agents(root) == {second.client_id: os.getpid()}
    again = Workspace(root)  # the first one restarted
    assert again.client_id == first.client_id and again.dir == first.dir
    assert Identity(root, again.client_id).secret == "cs_not-for-anyone"
    for path in (os.path.join(root, "client_ids"), Identity(root, again.client_id).path):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    assert stat.S_IMODE(os.stat(os.path.dirname(Identity(root, again.client_id).path)).st_mode) == 0o700
    # the server held another secret for it: the next start registers under the id it went on with
    again.renamed(again.client_id, "renewed-id")
    again.close()
    second.close()
    assert Workspace(root).client_id == "renewed-id"


def test_a_given_client_id_is_kept_and_not_remembered(tmp_path):
    from gpu_client.agent.workspace import Workspace
    root = str(tmp_path / "work")
    assert Workspace(root, "mine").client_id == "mine"
    assert not os.path.exists(os.path.join(root, "client_ids"))


# -- a package installed after the client started ---------------------------------------------------
def _register(socket_client, api, client_id: str, modules: list[str]):
    import platform
    gpu = socket_client("/gpu", api.donor)
    answer = gpu.emit("register", {"client_id": client_id, "hostname": "h", "modules": modules,
                                   "versions": {"python": platform.python_version()},
                                   "slots": [{"index": 0, "kind": "cpu", "memory_total": 1 << 30,
                                              "memory_free": 1 << 30}]}, namespace="/gpu", callback=True)
    assert answer["ok"], answer
    gpu.get_received("/gpu")
    return gpu


def _refreshes(gpu) -> list[dict]:
    return [m["args"][0] for m in gpu.get_received("/gpu") if m["name"] == "refresh"]


def test_a_job_waiting_for_a_package_asks_the_client_that_lacks_it_to_look_again(app, api, socket_client):
    ctx = app.extensions["zwdx"]
    lacking = _register(socket_client, api, "lacking", ["os", "sys", "torch"])
    having = _register(socket_client, api, "having", ["os", "sys", "torch", "late_pkg"])
    ctx.store.update_client("having", {"status": "offline"})  # away: the job must wait for "lacking"
    resp = api.submit(required_modules=["late_pkg"])
    assert resp.status_code == 201, resp.json
    job_id = resp.json["id"]
    ctx.scheduler.schedule_once()
    asked = _refreshes(lacking)
    assert [a["modules"] for a in asked] == [["late_pkg"]] and job_id in asked[0]["reason"], asked
    assert _refreshes(having) == []
    reason = api.get(f"/jobs/{job_id}").json["waiting_reason"]
    assert "lacks package(s) late_pkg" in reason and "zwdx gpu-client --refresh" in reason, reason
    ctx.scheduler.schedule_once()
    assert _refreshes(lacking) == []  # the same modules: not again within MODULES_REFRESH
    from zwdx import defaults
    from zwdx.server import clients
    waiting = api.get(f"/jobs/{job_id}").json["spec"]
    now = __import__("time").time()
    for later, asked in ((1.5, 1), (2.5, 0), (3.5, 1), (5, 0), (7.5, 1)):  # then after 2x, 4x MODULES_REFRESH
        assert clients.ask_refresh(job_id, waiting, [ctx.store.get_client("lacking")],
                                   now + later * defaults.MODULES_REFRESH) == asked, later
    assert len(_refreshes(lacking)) == 3
    # it looked, found the package and registered again: the job is placed on it
    lacking.emit("register", {"client_id": "lacking", "hostname": "h", "modules": ["os", "sys", "torch", "late_pkg"],
                              "versions": {"python": __import__("platform").python_version()},
                              "slots": [{"index": 0, "kind": "cpu", "memory_total": 1 << 30, "memory_free": 1 << 30}]},
                 namespace="/gpu", callback=True)
    ctx.scheduler.schedule_once()
    assert api.get(f"/jobs/{job_id}").json["status"] != "queued"


# -- real processes: a restarted client, a package installed meanwhile --------------------------------
def _gpu_client(server, room, work_dir, packages) -> "Child":  # noqa: F821 (imported below)
    from procs import ROOT
    from zwdx.testing import Child
    os.makedirs(work_dir, exist_ok=True)
    return Child([sys.executable, "-m", "zwdx.cli", "gpu-client", "--server", server.url, "--cpu", "--threads", "1",
                  "--work-dir", work_dir, "--no-standby"], os.path.join(work_dir, "gpu-client.log"),
                 {"ZWDX_ROOM_TOKEN": room["donor_token"], "ZWDX_ISOLATION": "process",
                  "PYTHONPATH": os.pathsep.join([packages, ROOT])})


@pytest.mark.slow
def test_a_restarted_client_keeps_its_id_and_a_package_installed_meanwhile_is_seen(server, room, sdk, tmp_path):
    from procs import ROOT, wait_until
    from zwdx.protocol import runtime_versions
    work, packages = str(tmp_path / "donor"), str(tmp_path / "site")
    os.makedirs(packages)
    token = room["token"]

    def online() -> list[str]:
        return [c["id"] for c in sdk.get_room(token)["clients"] if c["status"] == "online"]

    agent = _gpu_client(server, room, work, packages)
    try:
        first = wait_until(online, 60, what="the gpu client online")[0]
        agent.stop()
        wait_until(lambda: not online(), 30, what="the gpu client offline")
        agent = _gpu_client(server, room, work, packages)  # restarted on the same work dir
        assert wait_until(online, 60, what="the gpu client online again") == [first]
        assert [c["id"] for c in sdk.get_room(token)["clients"]] == [first]  # one client, not two
        with open(os.path.join(work, "secrets", f"{first}.secret")) as fh:
            secret = fh.read().strip()
        with open(agent.log_path) as fh:
            assert secret not in fh.read()

        os.makedirs(os.path.join(packages, "late_pkg"))  # pip install, after the client started
        open(os.path.join(packages, "late_pkg", "__init__.py"), "w").close()
        bundle = sdk._json("POST", "/artifacts", token, data=b"not a bundle: placed is enough here",
                           headers={"Content-Type": "application/octet-stream"})
        job = sdk._json("POST", "/jobs", token, json={"bundle_artifact": bundle["id"], "versions": runtime_versions(),
                                                      "required_modules": ["late_pkg"]})
        wait_until(lambda: sdk.get_job(job["id"], token)["status"] != "queued", 60,
                   what=f"the job placed: {sdk.get_job(job['id'], token).get('waiting_reason')}")

        os.makedirs(os.path.join(packages, "later_pkg"))
        open(os.path.join(packages, "later_pkg", "__init__.py"), "w").close()
        import subprocess
        done = subprocess.run([sys.executable, "-m", "zwdx.cli", "gpu-client", "--refresh", "--work-dir", work],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and first in done.stdout, done.stdout + done.stderr

        def said() -> bool:
            with open(agent.log_path) as fh:
                return "(SIGHUP): 1 new (later_pkg)" in fh.read()
        wait_until(said, 30, what="the gpu client reading its modules again on --refresh")
    finally:
        agent.stop()
