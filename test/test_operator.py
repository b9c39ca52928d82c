"""Smaller things an operator hit (issue 34 item 6), in process: size flags and variables take
units, `zwdx room show` prints a small quota in a unit that reads, `zwdx server --help` shows
its defaults, the missing-token error names --room-token-file, and zwdx_queue_depth has a
sample at 0 for a room with no job waiting."""
from __future__ import annotations

import argparse

import pytest

from zwdx import ZWDX, sizes
from zwdx.cli import build_parser
from zwdx.errors import BadRequest


@pytest.mark.parametrize("flag", ["--max-artifact-bytes", "--max-request-bytes", "--room-max-artifact-bytes",
                                  "--min-free-bytes"])
def test_server_size_flags_take_units(flag):
    args = build_parser().parse_args(["server", flag, "100GiB"])
    assert getattr(args, flag[2:].replace("-", "_")) == 100 * 2**30
    with pytest.raises(SystemExit):
        build_parser().parse_args(["server", flag, "100 GiBs"])


def test_the_dataset_chunk_size_takes_units():
    args = build_parser().parse_args(["data", "push", "folder", "--name", "d", "--chunk-bytes", "64MiB"])
    assert args.chunk_bytes == 64 * 2**20
    with pytest.raises(SystemExit):
        build_parser().parse_args(["data", "push", "folder", "--name", "d", "--chunk-bytes", "lots"])


def test_server_size_variables_take_units(tmp_path, monkeypatch):
    from zwdx.server import create_app
    monkeypatch.setenv("ZWDX_MAX_ARTIFACT_BYTES", "2MiB")
    app = create_app({"DATA_DIR": str(tmp_path / "a"), "ASYNC_MODE": "threading"})
    assert app.config["MAX_ARTIFACT_BYTES"] == 2 * 2**20
    monkeypatch.setenv("ZWDX_MAX_ARTIFACT_BYTES", "lots")
    with pytest.raises(ValueError, match="ZWDX_MAX_ARTIFACT_BYTES: 'lots' is not a size"):
        create_app({"DATA_DIR": str(tmp_path / "b"), "ASYNC_MODE": "threading"})


def test_sizes_read_back_in_a_unit_that_fits():
    assert [sizes.human(n) for n in (0, 512, 12 * 1024, 3 * 2**20 + 2**19, 8 * 2**30)] == \
        ["0 B", "512 B", "12.0 KiB", "3.5 MiB", "8.0 GiB"]


class _Room:
    """What `zwdx room show` asks of the SDK: one room with a small quota."""
    room_token, credentials, server_url = "zs_x", None, "http://127.0.0.1:9"

    def get_room(self, token):
        return {"name": "lab", "id": "r1", "clients": [], "totals": {},
                "usage": {"jobs": 0, "jobs_limit": 10, "artifact_bytes": 12 * 1024, "event_bytes": 0,
                          "artifact_bytes_limit": 2**20, "events": 3, "events_limit": 100}}


def test_room_show_prints_a_small_quota_readably(capsys):
    from zwdx.jobs_cli import room_show
    assert room_show(_Room(), argparse.Namespace(json=False)) == 0
    assert "12.0 KiB of 1.0 MiB" in capsys.readouterr().out


def test_server_help_shows_its_defaults():
    server = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "server")[1]
    text = " ".join(server.format_help().split())
    assert "default 127.0.0.1" in text and "default 4461" in text and "else zwdx-data" in text


def test_a_missing_token_names_the_token_file_flag(monkeypatch, tmp_path):
    monkeypatch.delenv("ZWDX_ROOM_TOKEN", raising=False)
    with pytest.raises(BadRequest, match="--room-token-file"):
        ZWDX("http://127.0.0.1:9", remember=False).get_room()


def test_queue_depth_has_a_sample_at_zero():
    from zwdx.server.prometheus import StoreCollector

    class Store:
        def job_counts(self):
            return {("r1", "completed"): 2}

        def list_jobs(self, statuses):
            return []
    depth = next(m for m in StoreCollector(Store()).collect() if m.name == "zwdx_queue_depth")
    assert [(s.labels, s.value) for s in depth.samples] == [({"room": "r1"}, 0.0)]


@pytest.mark.parametrize("refusal", ["job quota", "unknown dataset", "unknown field", "tree: unknown dataset"])
def test_a_refused_submits_bundle_frees_the_quota_at_once(make_app, refusal):
    from conftest import Api
    api = Api(make_app(ROOM_MAX_JOBS=1, ROOM_MAX_ARTIFACT_BYTES=10_000).test_client()).create_room()
    if refusal == "job quota":
        assert api.submit().status_code == 201
    used = api.get("/room").json["usage"]["artifact_bytes"]
    fields = {"unknown dataset": {"datasets": ["nope"]}, "unknown field": {"future_field": 1}}.get(refusal, {})
    bundle = api.upload(b"b" * 4000)
    body = {"bundle_artifact": bundle["id"], "versions": {"python": "3.11"}, **fields}
    if refusal.startswith("tree"):  # the shape the SDK sends (zwdx.protocol.spec)
        body = {"spec": {"code": {"bundle_artifact": bundle["id"], "versions": {"python": "3.11"}},
                         "datasets": ["nope"]}}
    resp = api.post("/jobs", json=body)
    assert resp.status_code in (400, 429), resp.text
    assert api.get("/room").json["usage"]["artifact_bytes"] == used
    assert api.get(f"/artifacts/{bundle['id']}").status_code == 404


@pytest.mark.parametrize("slots", [["--cpu"], ["--cpu-slots", "2"]])
def test_gpu_client_refuses_gpus_and_cpu_slots_together(monkeypatch, capsys, slots):
    from zwdx.cli import main
    monkeypatch.delenv("ZWDX_ROOM_TOKEN", raising=False)
    assert main(["gpu-client", "--gpus", "0,1", *slots]) == 2
    said = capsys.readouterr().err
    assert "--gpus 0,1 offers GPUs" in said and f"{slots[0]} offers CPU slots instead" in said, said
    assert main(["gpu-client", "--gpus", "zero"]) == 2
    assert "--gpus takes GPU indices separated by commas (0,1), got 'zero'" in capsys.readouterr().err
