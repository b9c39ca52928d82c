"""Experiment trackers: a job's metrics in TensorBoard's event files and a W&B run (offline),
live while the SDK follows a job and afterwards from what the server stored; read back with
TensorBoard's own reader and from the W&B run file."""
from __future__ import annotations

import glob
import struct

import pytest

import needs
from conftest import placed_ranks
from security.test_limits import http_app  # noqa: F401  (fixture: an app served over HTTP)
import zwdx
from zwdx import ZWDX, BadRequest
from zwdx.trackers import TensorBoard, WandB

needs.module("tensorboard", "pip install tensorboard (./setup.sh --test)")
needs.module("wandb", "pip install wandb (./setup.sh --test)")


def report(rank_api, job_id: str, rank1=None) -> None:
    """Rank 0's loss at steps 0-2 (one of them NaN) and its throughput at step 2; with ``rank1``
    (rank 1's Api) rank 1's throughput at steps 1 and 2 and a loss at step 2, which trackers name
    ``<name>/rank1``."""
    events = [{"kind": "metric", "rank": 0, "step": s, "key": f"m{s}", "data": {"loss": v}}
              for s, v in enumerate([2.0, "NaN", 0.5])]
    events += [{"kind": "metric", "rank": 0, "step": 2, "key": "t0", "data": {"throughput": 100.0}}]
    resp = rank_api.post(f"/jobs/{job_id}/events", json={"events": events})
    assert resp.status_code == 200, resp.json
    if rank1 is not None:
        events = [{"kind": "metric", "rank": 1, "step": s, "key": f"r1t{s}", "data": {"throughput": v}}
                  for s, v in ((1, 90.0), (2, 95.0))]
        events += [{"kind": "metric", "rank": 1, "step": 2, "key": "r1l2", "data": {"loss": 0.75}}]
        resp = rank1.post(f"/jobs/{job_id}/events", json={"events": events})
        assert resp.status_code == 200, resp.json


def tensorboard_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_history(run_dir_root: str) -> list[dict]:
    """The history rows of the one offline run under ``run_dir_root``, read from its run file
    (W&B's record log: 32 KiB blocks of records with a 7-byte header, each a protobuf Record)."""
    from wandb.proto import wandb_internal_pb2 as pb
    [path] = glob.glob(f"{run_dir_root}/wandb/offline-run-*/run-*.wandb")
    data, pos, part, rows = open(path, "rb").read(), 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _crc, size, kind = struct.unpack("<IHB", data[pos:pos + 7])
        part, pos = part + data[pos + 7:pos + 7 + size], pos + 7 + size
        if kind in (1, 4):  # a whole record, or its last piece
            record = pb.Record()
            record.ParseFromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
    return rows


def test_export_sends_what_the_job_reported_to_tensorboard_and_wandb(http_app, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    app, url = http_app
    room, (rank0, rank1), job = placed_ranks(app, "tracked", 2)
    report(rank0, job["id"], rank1)
    sdk = ZWDX(url, room_token=room.token, remember=False)
    sent = sdk.export_metrics(job["id"], [TensorBoard(log_dir=str(tmp_path / "tb")),
                                          WandB(project="zwdx-test", dir=str(tmp_path / "wb"))])
    assert sent == 7
    # TensorBoard: the loss at steps 0 and 2 (the NaN is a gap, as on the dashboard), rank 0's throughput
    # under its own name, rank 1's series as <name>/rank1.
    scalars = tensorboard_scalars(str(tmp_path / "tb"))
    assert scalars == {"loss": [(0, 2.0), (2, 0.5)], "throughput": [(2, 100.0)],
                       "throughput/rank1": [(1, 90.0), (2, 95.0)], "loss/rank1": [(2, 0.75)]}, scalars
    # W&B: the same points, on the job's own step axis.
    rows = wandb_history(str(tmp_path / "wb"))
    points = sorted((float(r["zwdx/step"]), name, float(v)) for r in rows for name, v in r.items()
                    if name.split("/")[0] in ("loss", "throughput"))
    assert points == [(0, "loss", 2.0), (1, "throughput/rank1", 90.0), (2, "loss", 0.5), (2, "loss/rank1", 0.75),
                      (2, "throughput", 100.0), (2, "throughput/rank1", 95.0)], points


def test_wait_feeds_trackers_live_and_names_other_ranks_series(http_app, tmp_path):  # noqa: F811
    app, url = http_app
    room, (rank0, rank1), job = placed_ranks(app, "live", 2)
    report(rank0, job["id"], rank1)
    assert room.post(f"/jobs/{job['id']}/cancel").status_code == 200
    sdk = ZWDX(url, room_token=room.token, remember=False)
    result = sdk.wait(job["id"], progress=False, trackers=[TensorBoard(log_dir=str(tmp_path / "tb"))])
    assert result["status"] == "cancelled"
    scalars = tensorboard_scalars(str(tmp_path / "tb"))
    assert scalars["loss"] == [(0, 2.0), (2, 0.5)] and scalars["throughput"] == [(2, 100.0)], scalars
    assert scalars["throughput/rank1"] == [(1, 90.0), (2, 95.0)] and scalars["loss/rank1"] == [(2, 0.75)], scalars


def test_a_tracker_zwdx_does_not_know_is_refused_before_anything_is_sent(http_app):  # noqa: F811
    app, url = http_app
    room = __import__("conftest").Api(app.test_client()).create_room("no-trackers")
    sdk = ZWDX(url, room_token=room.token, remember=False)
    with pytest.raises(BadRequest, match="trackers: each is one of tensorboard, wandb"):
        sdk.submit_job(object(), lambda: None, lambda: None, run=zwdx.Run(trackers=["mlflow"]))
    assert room.jobs() == [] and room.get("/room").json["usage"]["artifact_bytes"] == 0


def test_exporting_again_into_one_log_dir_adds_only_the_new_points(http_app, tmp_path):  # noqa: F811
    app, url = http_app
    room, (rank0,), job = placed_ranks(app, "twice", 1)
    report(rank0, job["id"])
    sdk = ZWDX(url, room_token=room.token, remember=False)
    log_dir = str(tmp_path / "tb")
    counts = [sdk.export_metrics(job["id"], [TensorBoard(log_dir=log_dir)]) for _ in range(2)]
    assert tensorboard_scalars(log_dir) == {"loss": [(0, 2.0), (2, 0.5)], "throughput": [(2, 100.0)]}
    assert counts == [4, 0]
    resp = rank0.post(f"/jobs/{job['id']}/events",
                      json={"events": [{"kind": "metric", "rank": 0, "step": 3, "key": "m3", "data": {"loss": 0.25}}]})
    assert resp.status_code == 200, resp.json
    assert sdk.export_metrics(job["id"], [TensorBoard(log_dir=log_dir)]) == 1
    scalars = tensorboard_scalars(log_dir)
    assert scalars == {"loss": [(0, 2.0), (2, 0.5), (3, 0.25)], "throughput": [(2, 100.0)]}, scalars
    # followed live into the same dir, then exported: still one copy of each point
    assert room.post(f"/jobs/{job['id']}/cancel").status_code == 200
    live = str(tmp_path / "live")
    sdk.wait(job["id"], progress=False, trackers=[TensorBoard(log_dir=live)])
    assert sdk.export_metrics(job["id"], [TensorBoard(log_dir=live)]) == 0
    assert tensorboard_scalars(live) == scalars
