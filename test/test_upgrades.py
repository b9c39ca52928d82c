"""Upgrades and version skew (issue 34 item 4, docs/operations.md, Upgrades), in process: the protocol
version each side says (a GPU client at connect, the server in its register answer, on every
HTTP answer and in /health, an SDK in a header), a peer of another major refused naming both
versions and what to upgrade, a newer minor's extra fields ignored (logged once) in what GPU
clients and ranks send, and still refused in what submitters send."""
from __future__ import annotations

import logging

import pytest

from zwdx import __version__
from zwdx.errors import BadRequest
from zwdx.protocol import base
from zwdx.protocol.base import PROTOCOL, PROTOCOL_HEADER, incompatible, parse
from zwdx.protocol.gpu import Heartbeat, Register
from zwdx.protocol.report import RankReport

REGISTER = {"client_id": "c1", "hostname": "h", "versions": {"python": "3.11.7"},
            "slots": [{"index": 0, "kind": "cpu", "memory_total": 10, "memory_free": 10}]}


def test_the_protocol_is_major_dot_minor_and_only_another_major_is_refused():
    major = int(PROTOCOL.split(".")[0])
    assert incompatible(f"{major}.99", "GPU client", "server", None, __version__) is None
    unversioned = incompatible(None, "GPU client", "server", None, __version__)  # from before versions: 1.0
    assert (unversioned is None) == (major == 1) and (major == 1 or "upgrade the GPU client" in unversioned)
    newer = incompatible(f"{major + 1}.0", "GPU client", "server", "9.0.0", __version__)
    assert newer == (f"this GPU client speaks zwdx protocol {major + 1}.0 (zwdx 9.0.0); this server speaks "
                     f"{PROTOCOL} (zwdx {__version__}): another major version, which the server does not "
                     f"understand: upgrade the server (pip install -U zwdx; docs/operations.md, Upgrades)")
    older = incompatible(f"{major - 1}.3", "client", "server", None, __version__)
    assert "upgrade the client" in older and f"{major - 1}.3" in older and PROTOCOL in older
    assert "no protocol version" in incompatible("two\x1b[2J", "client", "server", None, "0.1.0")


def test_a_newer_gpu_clients_extra_fields_are_ignored_and_logged_once(caplog):
    base._IGNORED.clear()
    with caplog.at_level(logging.WARNING, logger="zwdx.protocol.base"):
        for _ in range(3):
            hello = parse(Register, {**REGISTER, "future_field": {"x": 1},
                                     "slots": [{**REGISTER["slots"][0], "future_slot_field": 2}]})
        parse(Heartbeat, {"slots": [], "future_field": 1})
        parse(RankReport, {"status": "completed", "future_field": 1})
    assert hello.client_id == "c1" and not hasattr(hello, "future_field")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 4, said  # once per message type and field
    assert any("a Register carried field 'future_field'" in s and f"protocol {PROTOCOL}" in s for s in said)
    # the fields it knows are as strict as ever
    with pytest.raises(BadRequest, match="field 'slots.0.index' must be int"):
        parse(Register, {**REGISTER, "slots": [{"index": "0"}], "future_field": 1})


def test_a_submitters_unknown_field_is_still_refused(api):
    resp = api.submit(future_option=1)
    assert resp.status_code == 400 and "future_option" in resp.json["error"]["message"], resp.json
    tokens = api.post("/room/tokens", json={"role": "donor", "name": "x", "expires_at": 1})
    assert tokens.status_code == 400 and "expires_at" in tokens.json["error"]["message"], tokens.json


def test_the_server_says_its_version_and_refuses_an_sdk_of_another_major(api):
    health = api.client.get("/health")
    assert health.json["zwdx"] == __version__ and health.json["protocol"] == PROTOCOL
    assert health.headers[PROTOCOL_HEADER] == PROTOCOL
    major = int(PROTOCOL.split(".")[0])
    assert api.get("/jobs", headers={PROTOCOL_HEADER: f"{major}.7"}).status_code == 200
    before = api.jobs()
    body = {"bundle_artifact": api.upload()["id"], "versions": {"python": "3.11"}}
    resp = api.post("/jobs", json=body, headers={PROTOCOL_HEADER: f"{major + 1}.0", "Zwdx-Version": "9.0.0"})
    assert resp.status_code == 400 and resp.json["error"]["field"] == PROTOCOL_HEADER
    assert "zwdx 9.0.0" in resp.json["error"]["message"] and "upgrade the server" in resp.json["error"]["message"]
    assert api.jobs() == before and resp.headers[PROTOCOL_HEADER] == PROTOCOL


def test_a_gpu_client_of_another_major_is_refused_at_connect_and_a_newer_minor_registers(api, app):
    from zwdx.server import socketio
    major = int(PROTOCOL.split(".")[0])
    made = []

    def connect(protocol):
        auth = {"token": api.donor, **({"protocol": protocol, "zwdx": "9.0.0"} if protocol else {})}
        made.append(socketio.test_client(app, namespace="/gpu", auth=auth))
        return made[-1]
    try:
        assert not connect(f"{major + 1}.0").is_connected("/gpu")
        assert not connect(f"{major - 1}.9").is_connected("/gpu")
        # a client from before versions were exchanged speaks 1.0: refused since 2.0 (the spec's tree)
        assert connect(None).is_connected("/gpu") == (major == 1)
        gpu = connect(f"{major}.9")
        assert gpu.is_connected("/gpu")
        answer = gpu.emit("register", {**REGISTER, "client_id": "newer", "future_field": True}, namespace="/gpu",
                          callback=True)
        assert answer["ok"] and answer["protocol"] == PROTOCOL and answer["zwdx"] == __version__, answer
        assert {c["id"] for c in api.get("/room").json["clients"]} == {"newer"}
    finally:
        for sock in made:
            if sock.is_connected("/gpu"):
                sock.disconnect("/gpu")


@pytest.mark.parametrize("command", [[], ["server"], ["gpu-client"]])
def test_version_prints_zwdx_and_its_protocol(capsys, command):
    from zwdx.cli import main
    with pytest.raises(SystemExit) as done:
        main([*command, "--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"zwdx {__version__} (protocol {PROTOCOL}, Python 3.")


# -- real processes: a server and GPU clients of other versions ---------------------------------------
#: Run at a child's start (sitecustomize, on PYTHONPATH): the process then speaks ``protocol``;
#: with ``extra`` its register carries a field this version does not know; ``unchecked``: it lets
#: every peer in (as a server from before versions did).
PRETEND = '''import os, sys
sys.path.insert(0, os.getcwd())
import zwdx.protocol.base as base, zwdx.protocol.gpu as gpu
base.PROTOCOL = {protocol!r}
if {unchecked!r}:
    base.incompatible = lambda *args: None
if {extra!r}:
    class Register(gpu.Register):
        future_field: int = 1
    gpu.Register = Register
'''


def pretending(tmp_path, protocol: str, extra: bool = False, unchecked: bool = False) -> dict:
    """The environment of a child that speaks ``protocol`` (a newer or older zwdx, simulated)."""
    folder = tmp_path / f"pretend-{protocol}-{extra}-{unchecked}"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(PRETEND.format(protocol=protocol, extra=extra, unchecked=unchecked))
    return {"PYTHONPATH": str(folder)}


def test_a_gpu_client_of_a_newer_major_exits_saying_to_upgrade_the_server(server, room, tmp_path):
    from procs import GpuClient
    major = int(PROTOCOL.split(".")[0])
    client = GpuClient(server.url, room["donor_token"], str(tmp_path / "newer"),
                       env=pretending(tmp_path, f"{major + 1}.0"))
    try:
        assert client.wait(120) == 2, client.output()
        assert (f"this GPU client speaks zwdx protocol {major + 1}.0 (zwdx {__version__}); this server speaks "
                f"{PROTOCOL}") in client.output() and "upgrade the server" in client.output(), client.output()
    finally:
        client.stop()


@pytest.mark.parametrize("checked", [True, False], ids=["refused at connect", "server lets it in"])
def test_a_gpu_client_of_an_older_major_exits_saying_to_upgrade_it(tmp_path, checked):
    import requests

    from procs import GpuClient, Server
    major = int(PROTOCOL.split(".")[0])
    newer = Server(str(tmp_path / "server"), extra=["--async-mode", "threading"],
                   env=pretending(tmp_path, f"{major + 1}.0", unchecked=not checked))
    client = None
    try:
        room = requests.post(f"{newer.url}/api/v1/rooms", json={"name": "upgrades"}, timeout=30).json()  # no SDK:
        # this one would be refused, as another major
        client = GpuClient(newer.url, room["donor_token"], str(tmp_path / "older"))
        assert client.wait(120) == 2, client.output()
        said = f"this server speaks {major + 1}.0" if checked else f"this server speaks zwdx protocol {major + 1}.0"
        assert said in client.output(), client.output()
        assert "upgrade the GPU client" in client.output(), client.output()
    finally:
        if client is not None:
            client.stop()
        newer.stop()


def test_a_gpu_client_of_a_newer_minor_joins_and_its_extra_field_is_ignored(server, room, sdk, tmp_path):
    from procs import GpuClient, wait_until
    major = int(PROTOCOL.split(".")[0])
    client = GpuClient(server.url, room["donor_token"], str(tmp_path / "newer"), client_id="newer-minor",
                       env=pretending(tmp_path, f"{major}.9", extra=True))
    try:
        wait_until(lambda: any(c["id"] == "newer-minor" and c["status"] == "online"
                               for c in sdk.get_room(room["token"])["clients"]), 120,
                   what=f"the newer GPU client online\n{client.output()}")
        assert "a Register carried field 'future_field'" in server.output()
        # the client prints what it connected to once registered: its output may come a moment later
        wait_until(lambda: f"server zwdx {__version__}, protocol {PROTOCOL}" in client.output(), 30,
                   what=f"the client saying the server's version\n{client.output()}")
    finally:
        client.stop()
