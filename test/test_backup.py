"""``zwdx server backup DEST`` and ``zwdx server restore SRC`` (issue 34 item 5): a backup taken
while the server runs, restored into another data dir, serves the same jobs, metrics and weights
(the same sha256) from a new server; a damaged backup, an existing destination, a data dir a
server is serving, and one that holds a store already (without --force) are refused, changing
nothing."""
from __future__ import annotations

import contextlib
import io
import os
import subprocess

import pytest
import torch

from procs import GpuClient, Proc, Server, wait_until
from workloads import logged_steps
import zwdx
from zwdx import ZWDX
from zwdx.cli import main

pytestmark = pytest.mark.slow  # server and GPU-client processes


def zwdx_cli(*args: str) -> subprocess.CompletedProcess:
    """``zwdx ARGS`` in this process (the server's own process is another): its exit code and output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def pairs(rank, world_size):
    from torch.utils.data import DataLoader, TensorDataset
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(8, 2, generator=g), torch.randint(0, 2, (8,), generator=g)),
                      batch_size=4)


def test_a_restored_backup_serves_the_same_jobs_metrics_and_weights(tmp_path):
    data, backup, restored = tmp_path / "data", tmp_path / "backup", tmp_path / "restored"
    procs = []
    try:
        server = Server(str(data))
        procs.append(server)
        sdk = ZWDX(server.url, remember=False)
        room = sdk.create_room("backed-up")
        sdk.room_token = room["token"]
        procs.append(GpuClient(server.url, room["donor_token"], str(tmp_path / "client"), "backup-client"))
        model = torch.nn.Linear(2, 2)
        job = sdk.submit_job(model, pairs, logged_steps, None, torch.optim.SGD(model.parameters(), lr=0.1), "DDP",
                             resources=zwdx.Resources(world_size=1), run=zwdx.Run(progress=False, timeout=120))
        assert job["status"] == "completed"
        before = {"job": sdk.get_job(job["job_id"]), "metrics": sdk.get_job_metrics(job["job_id"]),
                  "weights": sdk.download_weights(job["job_id"], str(tmp_path / "weights-before.pt"))}

        made = zwdx_cli("server", "backup", str(backup), "--data-dir", str(data))  # the server runs meanwhile
        assert made.returncode == 0, made.stderr
        assert "1 artifact" not in made.stdout and "artifact(s)" in made.stdout  # the bundle and the weights
        again = zwdx_cli("server", "backup", str(backup), "--data-dir", str(data))
        assert again.returncode == 1 and "exists already" in again.stderr

        live = zwdx_cli("server", "restore", str(backup), "--data-dir", str(data), "--force")  # the server runs
        assert live.returncode == 1 and f"a zwdx server is serving {data}" in live.stderr
        assert not any(name.startswith("before-restore") for name in os.listdir(data))

        damaged = tmp_path / "damaged"
        subprocess.run(["cp", "-a", str(backup), str(damaged)], check=True)
        victim = damaged / "artifacts" / sorted(os.listdir(damaged / "artifacts"))[0]
        content = victim.read_bytes()
        victim.write_bytes(content[:-1] + bytes([content[-1] ^ 1]))
        bad = zwdx_cli("server", "restore", str(damaged), "--data-dir", str(tmp_path / "never"))
        assert bad.returncode == 1 and "does not match its sha256" in bad.stderr
        assert not (tmp_path / "never").exists()

        done = zwdx_cli("server", "restore", str(backup), "--data-dir", str(restored))
        assert done.returncode == 0, done.stderr
        Proc.stop_all(procs)
        refused = zwdx_cli("server", "restore", str(backup), "--data-dir", str(data))
        assert refused.returncode == 1 and "holds a store already" in refused.stderr and "--force" in refused.stderr
        forced = zwdx_cli("server", "restore", str(backup), "--data-dir", str(data), "--force")  # stopped now
        assert forced.returncode == 0, forced.stderr
        aside = [name for name in os.listdir(data) if name.startswith("before-restore-")]
        assert len(aside) == 1 and os.path.exists(data / aside[0] / "zwdx.sqlite3") and aside[0] in forced.stdout
        procs = [Server(str(restored))]
        again = ZWDX(procs[0].url, room_token=room["token"], remember=False)
        after = {"job": again.get_job(job["job_id"]), "metrics": again.get_job_metrics(job["job_id"]),
                 "weights": again.download_weights(job["job_id"], str(tmp_path / "weights-after.pt"))}
        assert after["job"] == before["job"] and after["job"]["status"] == "completed"
        assert after["metrics"] == before["metrics"] and before["metrics"]["loss"]
        assert after["weights"]["sha256"] == before["weights"]["sha256"]
        assert (tmp_path / "weights-after.pt").read_bytes() == (tmp_path / "weights-before.pt").read_bytes()
        wait_until(lambda: [j["id"] for j in again.list_jobs()] == [job["job_id"]], 10, what="the job listed")
    finally:
        Proc.stop_all(procs)


def test_backup_and_restore_say_what_is_wrong(tmp_path):
    empty = zwdx_cli("server", "backup", str(tmp_path / "b"), "--data-dir", str(tmp_path / "nothing"))
    assert empty.returncode == 1 and "no embedded store" in empty.stderr
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.partial").exists()
    missing = zwdx_cli("server", "restore", str(tmp_path), "--data-dir", str(tmp_path / "d"))
    assert missing.returncode == 1 and "not a zwdx backup" in missing.stderr
    mongo = zwdx_cli("server", "--mongo-uri", "mongodb://127.0.0.1:9/zwdx", "backup", str(tmp_path / "m"))
    assert mongo.returncode == 2 and "mongodump" in mongo.stderr


def test_a_backup_naming_an_artifact_outside_its_folder_restores_nothing(tmp_path):
    """A backup is the operator's file, but one from elsewhere may be crafted: an artifact id that
    is a path (``../x``) would be read and written outside the backup and the data dir."""
    import json

    from zwdx.server import backup
    src = tmp_path / "backup"
    (src / backup.ARTIFACTS).mkdir(parents=True)
    (tmp_path / "outside").write_bytes(b"x")
    (src / backup.MANIFEST).write_text(json.dumps({"artifacts": {"../../outside": {"size": 1, "sha256": "0" * 64}}}))
    with pytest.raises(backup.BackupError, match="no file name"):
        backup.restore(str(src), str(tmp_path / "data"))
    assert not (tmp_path / "data").exists()
