"""The REST API's OpenAPI document: generated from the route table and the models, valid
OpenAPI 3.1, covering every route; the page that renders it loads nothing from elsewhere; and
schemathesis, over every operation of it against a live server process, finds no server
error (5xx) and no answer that its schema does not describe.

The schemathesis run is bounded: ``ZWDX_FUZZ_EXAMPLES`` examples per operation and mode (default
25; schemathesis adds its own coverage cases), valid requests and invalid ones: about 1,800
requests, 15 s on 2 cores.
"""
from __future__ import annotations

import os
import platform
import threading

import pytest
import requests
import socketio

from procs import Server, free_port, wait_until
from zwdx import defaults
from zwdx.protocol import EV_HEARTBEAT, EV_JOB_ASSIGN, EV_REGISTER, EV_RESERVE_PORT, GPU_NAMESPACE, runtime_versions
from wire_auth import connect_auth

EXAMPLES = int(os.environ.get("ZWDX_FUZZ_EXAMPLES", "25"))


# -- in-process: the document and the page ---------------------------------------------------------
def test_the_document_is_valid_openapi_3_1_and_covers_every_route(app, client):
    from openapi_spec_validator import validate
    doc = client.get("/api/v1/openapi.json").json
    validate(doc)  # raises on anything OpenAPI 3.1 does not allow
    assert doc["openapi"] == "3.1.0"
    described = {(method.upper(), path) for path, item in doc["paths"].items() for method in item}
    routes = set()
    for rule in app.url_map.iter_rules():
        if (rule.rule.startswith("/api/") or rule.rule in ("/health", "/metrics")) and rule.endpoint != "api.no_route":
            path = rule.rule.replace("<", "{").replace(">", "}")
            routes |= {(m, path) for m in rule.methods - {"HEAD", "OPTIONS"}}
    assert routes == described
    assert len(described) > 20


def test_each_operation_says_how_it_authenticates_and_what_it_answers(client):
    doc = client.get("/api/v1/openapi.json").json
    ops = {op["operationId"]: op for item in doc["paths"].values() for op in item.values()}
    schemes = doc["components"]["securitySchemes"]
    assert {name: (s["type"], s["in"], s["name"]) for name, s in schemes.items()} == {
        "roomToken": ("apiKey", "header", "X-Zwdx-Room-Token"), "rankKey": ("apiKey", "header", "X-Zwdx-Rank-Key")}
    assert "submitter token" in schemes["roomToken"]["description"]
    assert ops["create_room"]["security"] == [] and ops["openapi_json"]["security"] == []
    assert ops["list_jobs"]["security"] == [{"roomToken": []}]
    assert ops["post_rank_status"]["security"] == [{"rankKey": []}]
    assert ops["get_checkpoint_file"]["security"] == [{"roomToken": []}, {"rankKey": []}]
    for name, op in ops.items():  # a credential refused: none or unknown (401), the wrong role or rank (403), an
        # address that failed too often (429); test/security/test_authorization.py checks each route answers so
        if name == "metrics":  # the operator's metrics token or a loopback address, no room credential
            assert {"401", "403"} <= set(op["responses"]) and op["security"] == []
            continue
        assert {"401", "403"} & set(op["responses"]) == ({"401", "403"} if op["security"] else set()), name
        assert "429" in op["responses"] or not op["security"], name
    assert "429" in ops["create_room"]["responses"]  # rooms one address may create (a rate limit)
    submit = ops["create_job"]
    assert submit["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/SubmitJob"}
    assert submit["responses"]["201"]["content"]["application/json"]["schema"] == \
        {"$ref": "#/components/schemas/Submitted"}
    for status in ("400", "401", "409"):
        assert submit["responses"][status]["content"]["application/json"]["schema"] == \
            {"$ref": "#/components/schemas/ErrorAnswer"}
    body = doc["components"]["schemas"]["SubmitJob"]
    assert body["additionalProperties"] is False and body["required"] == ["spec"]
    code = doc["components"]["schemas"]["Code"]
    assert code["additionalProperties"] is False and {"versions", "bundle_artifact"} <= set(code["required"])
    # Artifacts travel as bytes, with their sha256 in a header.
    upload, download = ops["upload_bundle"], ops["get_weights"]
    assert list(upload["requestBody"]["content"]) == ["application/octet-stream"]
    assert {p["name"]: p["in"] for p in upload["parameters"]} == {"X-Zwdx-Sha256": "header"}
    assert list(download["responses"]["200"]["content"]) == ["application/octet-stream"]
    assert "X-Zwdx-Sha256" in download["responses"]["200"]["headers"]
    events = {p["name"]: p for p in ops["get_events"]["parameters"]}
    assert events["after"]["in"] == "query" and events["after"]["schema"]["maximum"] == 2**53
    assert events["job_id"]["in"] == "path" and events["job_id"]["required"] is True


def test_the_docs_page_is_self_contained(client):
    resp = client.get("/api/v1/docs")
    assert resp.status_code == 200 and resp.mimetype == "text/html"
    page = resp.get_data(as_text=True)
    assert 'fetch("openapi.json")' in page
    for outside in ("http://", "https://", "src=\"//", "href=\"//", "@import"):
        assert outside not in page, outside


# -- a live server, fuzzed --------------------------------------------------------------------------
class PortOfferingClient(socketio.Client):
    """A GPU client as far as the server can tell: registers one CPU slot, heartbeats, offers a
    port when asked, and keeps the ``job_assign`` it gets (with its rank keys); it starts no rank."""

    def __init__(self, url: str, token: str):
        super().__init__(reconnection=False)
        self.assigned: list[dict] = []
        self.stopped = threading.Event()
        self.on(EV_RESERVE_PORT, lambda data: {"addr": "127.0.0.1", "port": free_port()}, namespace=GPU_NAMESPACE)
        self.on(EV_JOB_ASSIGN, self.assigned.append, namespace=GPU_NAMESPACE)
        self.connect(url, namespaces=[GPU_NAMESPACE], auth=connect_auth(token), transports=["websocket"])
        answer = self.call(EV_REGISTER, {
            "client_id": "fuzz-gpu", "hostname": "fuzz", "versions": runtime_versions(), "running": [],
            "slots": [{"index": 0, "kind": "cpu", "name": "CPU", "memory_total": 8 << 30, "memory_free": 8 << 30}]},
            namespace=GPU_NAMESPACE, timeout=15)
        assert answer["ok"], answer
        threading.Thread(target=self._beat, daemon=True).start()

    def _beat(self):
        while not self.stopped.wait(1.0):
            try:
                self.emit(EV_HEARTBEAT, {"slots": [{"index": 0, "memory_free": 8 << 30}], "running": []},
                          namespace=GPU_NAMESPACE)
            except Exception:
                return

    def stop(self):
        self.stopped.set()
        self.disconnect()


class Live:
    """A server process with a room, and a job placed on a GPU client: its id and its rank's key."""

    def __init__(self, data_dir: str):
        self.server = Server(data_dir)
        self.url = self.server.url
        self.gpu = None
        try:
            room = requests.post(f"{self.url}/api/v1/rooms", json={"name": "fuzz"}, timeout=10).json()
            self.token = room["token"]
            headers = {defaults.TOKEN_HEADER: self.token}
            bundle = requests.post(f"{self.url}/api/v1/artifacts", data=b"bundle", headers=headers, timeout=10).json()
            self.gpu = PortOfferingClient(self.url, room["donor_token"])
            self.job_id = requests.post(f"{self.url}/api/v1/jobs", headers=headers, timeout=10, json={
                "bundle_artifact": bundle["id"], "versions": {"python": platform.python_version()},
                "world_size": 1}).json()["id"]
            wait_until(lambda: self.gpu.assigned, 30, what="the job placed on the fuzzing GPU client")
            self.rank_key = self.gpu.assigned[0]["ranks"][0]["key"]
        except BaseException:
            self.stop()
            raise

    def stop(self):
        if self.gpu is not None:
            self.gpu.stop()
        self.server.stop()


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    served = Live(str(tmp_path_factory.mktemp("fuzz") / "server"))
    yield served
    served.stop()
    log = served.server.output()
    assert "unexpected error" not in log, log[-4000:]


@pytest.fixture(scope="module")
def api_schema(live):
    import schemathesis
    return schemathesis.openapi.from_url(f"{live.url}/api/v1/openapi.json")


def _short_hold(case) -> None:
    """A held poll (``?wait=``) of a job without news lasts its whole wait: at most 0.2 s here,
    where only what the server answers is checked (test_api.py checks the holding)."""
    wait = (case.query or {}).get("wait")
    try:
        if float(wait) > 0.2:
            case.query["wait"] = 0.2
    except (TypeError, ValueError):
        pass


try:
    import schemathesis
    from hypothesis import HealthCheck, settings
    from schemathesis.checks import (content_type_conformance, not_a_server_error, response_headers_conformance,
                                     response_schema_conformance, status_code_conformance)
except ImportError:  # CI installs the test extra, so there it is a failure
    schemathesis = None

if schemathesis is None:
    @pytest.mark.slow
    def test_every_operation_fuzzed():
        message = "schemathesis is missing: pip install -e '.[test]'"
        pytest.fail(message, pytrace=False) if os.environ.get("CI") else pytest.skip(message)
else:
    CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance,
              response_headers_conformance]
    schema = schemathesis.pytest.from_fixture("api_schema")

    @pytest.mark.slow  # a server process, fuzzed for a minute on two busy cores
    @schema.parametrize()
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    def test_every_operation_fuzzed(case, live):
        """Every operation, with a valid submitter token and rank key; a path that names a job
        names the live one three times in four (the others find nothing: 404, or 403 where a
        rank key speaks)."""
        if "job_id" in (case.path_parameters or {}) and len(case.path_parameters["job_id"]) % 4:
            case.path_parameters["job_id"] = live.job_id
        _short_hold(case)
        case.call_and_validate(headers={defaults.TOKEN_HEADER: live.token, defaults.RANK_KEY_HEADER: live.rank_key},
                               checks=CHECKS, timeout=30)
