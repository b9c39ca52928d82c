"""The RankSpec a GPU client hands each rank process: decided values required, its one secret (the
rank's key; no room token) kept out of its printed form, one JSON line that reads back the same."""
from __future__ import annotations

import io

import pytest

from zwdx.errors import BadRequest
from zwdx.protocol.base import parse
from zwdx.protocol.rank import RankSpec

SPEC = {"job_id": "j1", "attempt": 1, "rank": 1, "local_rank": 0, "world_size": 2, "master_addr": "10.0.0.7",
        "master_port": 29500, "backend": "gloo", "device": "cpu",
        "job": {"code": {"bundle_artifact": "b1", "versions": {"python": "3.11"}}, "strategy": {"type": "fsdp"}},
        "collective_timeout": 300.0, "checkpoint": {"n": 3, "epoch": 1, "step": 40, "format": "shards",
                                                    "files": {"rng-0.pt": "a1"}},
        "threads": 4, "bundle_path": "/tmp/b.zwdx", "bundle_sha256": "ab" * 32,
        "bundle_pending": True,
        "assigned_at": 1700000000.5, "server": "http://10.0.0.1:4461", "client_id": "lab-2", "hostname": "gpu7",
        "rank_key": "rk_secret-key", "log_path": "/tmp/rank1.log"}


def test_a_spec_travels_as_one_json_line_and_reads_back_the_same():
    spec = parse(RankSpec, SPEC)
    line = spec.line()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    back = RankSpec.read(io.StringIO(line.decode() + "ready\n"))
    assert back == spec and back.rank_key.get_secret_value() == "rk_secret-key"
    assert back.checkpoint.n == 3 and back.parallelism == "FSDP" and back.epochs is None
    assert RankSpec.read(io.StringIO("")) is None  # end of input: no rank to run


def test_secrets_are_only_in_the_line_for_the_rank_process():
    spec = parse(RankSpec, SPEC)
    for shown in (repr(spec), str(spec), str(spec.model_dump())):
        assert "secret" not in shown
    assert b"rk_secret-key" in spec.line()


@pytest.mark.parametrize("name", ["room_token", "job_key"])
def test_a_rank_holds_no_room_level_secret(name):
    assert name not in RankSpec.model_fields
    with pytest.raises(BadRequest) as info:
        parse(RankSpec, {**SPEC, name: "zs_a-room-token"}, "rank spec")
    assert info.value.field == name and "not a field" in info.value.message


@pytest.mark.parametrize("name", ["collective_timeout", "backend", "device", "job", "rank_key", "bundle_sha256"])
def test_what_the_server_decided_must_be_given(name):
    with pytest.raises(BadRequest) as info:
        parse(RankSpec, {k: v for k, v in SPEC.items() if k != name}, "rank spec")
    assert info.value.field == name and "field required" in info.value.message


@pytest.mark.parametrize("name, value", [("device", "gpu0"), ("backend", "mpi"), ("master_port", 0),
                                         ("collective_timeout", "300"), ("world_size", 0), ("threads", 1.5)])
def test_a_wrong_value_is_named(name, value):
    with pytest.raises(BadRequest) as info:
        parse(RankSpec, {**SPEC, name: value}, "rank spec")
    assert info.value.field == name
