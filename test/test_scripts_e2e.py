"""Script jobs end to end (``zwdx run``): a real server and two CPU GPU-client processes shared by
the module, scripts from test/scripts/ that know nothing of zwdx, ``zwdx run`` as a subprocess.

- PyTorch's DDP tutorial shape runs on 2 ranks: both ranks' lines come back live, the output
  file comes back, exit 0, and the same script under real ``torchrun --nproc-per-node 2``
  prints the same losses;
- a script that raises fails the job with its traceback (and ``zwdx run`` exits 1);
- a missing script, a working dir over the limit: refused before anything is uploaded;
- an unchanged working dir is not uploaded twice;
- ``--outputs-from out`` and ``'$ZWDX_OUTPUT_DIR/summary.txt'`` as an argument: both come back,
  and ``zwdx jobs download`` gets them again;
- a SIGKILLed GPU client: the script restarts on the new placement with
  ``TORCHELASTIC_RESTART_COUNT=1`` (last: it leaves the module one GPU client short).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from procs import ROOT, SLACK, GpuClient, Server, wait_until
from zwdx import ZWDX
from zwdx.script_jobs import ScriptJobs
from zwdx.testing import child_env

pytestmark = pytest.mark.slow

SCRIPTS = os.path.join(ROOT, "test", "scripts")
#: Seconds a 2-rank script job of a few steps may take here, start to end (torch imported twice on
#: two shared cores), plus the slack.
JOB_TIME = 180 + SLACK


class Room:
    """A server, a room, two CPU GPU clients (client-a, client-b), and its submitter token in a file."""

    def __init__(self, base):
        self.base = base
        self.server = Server(str(base / "server"))
        self.sdk = ZWDX(self.server.url, remember=False)
        room = self.sdk.create_room("scripts")
        self.sdk.room_token, self.donor_token = room["submitter_token"], room["donor_token"]
        self.token_file = base / "token"
        self.token_file.write_text(room["submitter_token"] + "\n")
        self.clients = {name: self.start(name, wait=False) for name in ("a", "b")}  # their starts overlap
        self.online(*self.clients.values())

    def start(self, name: str, wait: bool = True) -> GpuClient:
        client = GpuClient(self.server.url, self.donor_token, str(self.base / name), client_id=f"client-{name}")
        if wait:
            self.online(client)
        return client

    def online(self, *clients: GpuClient) -> None:
        ids = {c.client_id for c in clients}
        wait_until(lambda: ids <= {c["id"] for c in self.sdk.get_room()["clients"] if c["status"] == "online"},
                   30 + SLACK, what=f"gpu clients {sorted(ids)} online\n" + "\n".join(c.tail() for c in clients))

    def idle(self) -> None:
        wait_until(lambda: all(s["job_id"] is None for c in self.sdk.get_room()["clients"] for s in c["slots"]),
                   30 + SLACK, what="the room's slots free")

    def artifact_bytes(self) -> int:
        return self.sdk.get_room()["usage"]["artifact_bytes"]

    def run(self, cwd, *args: str) -> subprocess.CompletedProcess:
        """``zwdx run ARGS`` in ``cwd``, as a user types it."""
        self.idle()
        env = child_env({"PYTHONPATH": ROOT, "ZWDX_CONFIG_DIR": str(self.base / "config")})
        return subprocess.run([sys.executable, "-m", "zwdx.cli", "run", "--server", self.server.url,
                               "--room-token-file", str(self.token_file), *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=JOB_TIME)

    def stop(self) -> None:
        for client in self.clients.values():
            client.stop()
        self.server.stop()


@pytest.fixture(scope="module")
def room(tmp_path_factory):
    room = Room(tmp_path_factory.mktemp("scripts"))
    yield room
    room.stop()


def workdir(tmp_path, *scripts: str) -> str:
    """A working dir holding these scripts of test/scripts/ and nothing else."""
    folder = tmp_path / "wd"
    folder.mkdir(parents=True)
    for name in scripts:
        shutil.copy(os.path.join(SCRIPTS, name), folder / name)
    return str(folder)


def job_id(err: str) -> str:
    return re.search(r"zwdx: job ([0-9a-f]+):", err).group(1)


LOSSES = re.compile(r"^(rank \d step \d+ loss [0-9.]+|mean final loss [0-9.]+)$")


def losses(lines) -> list[str]:
    return sorted(line for line in lines if LOSSES.match(line))


def test_an_unmodified_torchrun_script_runs_on_two_gpu_clients_as_under_torchrun(room, tmp_path):
    wd = workdir(tmp_path, "ddp.py")
    out = room.run(wd, "--nproc", "2", "ddp.py", "--", "--steps", "3", "--lr", "0.05")
    assert out.returncode == 0, out.stdout + out.stderr
    job = job_id(out.stderr)
    lines = out.stdout.splitlines()
    for rank in (0, 1):  # each rank's own lines, as they came, prefixed as torchrun's --tee does
        assert f"[rank{rank}]:Start running basic DDP example on rank {rank} of 2 (local rank 0 of 1, restart 0)." \
            in lines, out.stdout
        assert f"[rank{rank}]:Finished running basic DDP example on rank {rank}." in lines
    outputs = os.path.join(wd, "zwdx-output", job)
    assert sorted(os.listdir(outputs)) == ["model.pt", "summary.txt"]
    import torch
    assert set(torch.load(os.path.join(outputs, "model.pt"), weights_only=True)) == {
        "net1.weight", "net1.bias", "net2.weight", "net2.bias"}
    # The same script under torchrun itself, on this machine: the same numbers.
    local = workdir(tmp_path / "torchrun", "ddp.py")
    # --tee: each rank's lines through its own file, whole (two ranks writing one pipe may cut them)
    ran = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--tee", "3",
                          "ddp.py", "--steps", "3", "--lr", "0.05"], cwd=local, env=child_env(), capture_output=True,
                         text=True, timeout=JOB_TIME)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    ours = losses(line.split(":", 1)[1] for line in lines if line.startswith("[rank"))
    theirs = losses(line.split(":", 1)[1] for line in ran.stdout.splitlines() if line.startswith("["))
    assert len(ours) == 7 and ours == theirs, ran.stdout
    with open(os.path.join(outputs, "summary.txt")) as zwdx_summary, \
            open(os.path.join(local, "outputs", "summary.txt")) as torchrun_summary:
        assert zwdx_summary.read() == torchrun_summary.read()
    assert room.sdk.get_job(job)["spec"]["strategy"] == {"type": "script", "path": "ddp.py",
                                                        "args": ["--steps", "3", "--lr", "0.05"], "env": {}}


def test_a_script_that_raises_fails_the_job_with_its_traceback(room, tmp_path):
    wd = workdir(tmp_path, "fails.py")
    out = room.run(wd, "--nproc", "2", "fails.py")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[rank1]:rank 1 up" in out.stdout.splitlines()
    assert "ValueError: boom on rank 1" in out.stderr  # zwdx run prints each failing rank's traceback
    job = room.sdk.get_job(job_id(out.stderr))
    assert job["status"] == "failed" and "exited with code 1" in job["reason"]
    assert "ValueError: boom on rank 1" in job["failures"]["1"]
    assert 'fails.py", line 7' in job["failures"]["1"]  # its own file and line


def test_a_missing_script_or_a_working_dir_over_the_limit_is_refused_before_upload(room, tmp_path):
    wd = workdir(tmp_path, "ddp.py")
    jobs, stored = len(room.sdk.list_jobs()), room.artifact_bytes()
    out = room.run(wd, "--nproc", "2", "train.py")
    assert out.returncode == 1 and "no script train.py in the working dir" in out.stderr, out.stderr
    with open(os.path.join(wd, "weights.bin"), "wb") as fh:
        fh.write(b"w" * 4096)
    out = room.run(wd, "--nproc", "2", "--max-workdir-bytes", "4KiB", "ddp.py")
    assert out.returncode == 1 and "more than the limit of 4.0 KiB; the biggest: weights.bin (4.0 KiB)" in out.stderr
    assert len(room.sdk.list_jobs()) == jobs and room.artifact_bytes() == stored  # nothing reached the server


def test_an_unchanged_working_dir_is_not_uploaded_twice(room, tmp_path):
    wd = workdir(tmp_path, "ddp.py", "fails.py")
    scripts = ScriptJobs(room.sdk)
    before = room.artifact_bytes()
    first = scripts.push(wd, "ddp.py")
    assert first["uploaded"] and room.artifact_bytes() == before + first["size"]
    again = scripts.push(wd, "fails.py")
    assert again == {**first, "uploaded": False} and room.artifact_bytes() == before + first["size"]
    with open(os.path.join(wd, "ddp.py"), "a") as fh:
        fh.write("# changed\n")
    changed = scripts.push(wd, "ddp.py")
    assert changed["uploaded"] and changed["sha256"] != first["sha256"]


def test_outputs_from_and_the_output_dir_in_arguments_come_back_and_jobs_download_gets_them(room, tmp_path):
    wd = workdir(tmp_path, "writes.py")
    out = room.run(wd, "--nproc", "1", "--outputs-from", "out", "writes.py", "--", "$ZWDX_OUTPUT_DIR/summary.txt")
    assert out.returncode == 0, out.stdout + out.stderr
    job = job_id(out.stderr)
    assert re.search(r"^\[rank0\]:wrote /.*/outputs/summary.txt$", out.stdout, re.M), out.stdout

    def files(folder: str) -> dict[str, bytes]:
        found = {}
        for base, _, names in os.walk(folder):
            for name in names:
                with open(os.path.join(base, name), "rb") as fh:
                    found[os.path.relpath(os.path.join(base, name), folder)] = fh.read()
        return found
    assert files(os.path.join(wd, "zwdx-output", job)) == {"out/ckpt.pt": b"weights", "summary.txt": b"loss 0.1\n"}
    env = child_env({"PYTHONPATH": ROOT, "ZWDX_CONFIG_DIR": str(room.base / "config")})
    got = subprocess.run([sys.executable, "-m", "zwdx.cli", "jobs", "download", job, "-o", str(tmp_path / "again"),
                          "--server", room.server.url, "--room-token-file", str(room.token_file)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 0 and f"job {job}: outputs in {tmp_path / 'again'}" in got.stdout, got.stderr
    assert files(str(tmp_path / "again")) == files(os.path.join(wd, "zwdx-output", job))


def test_a_lost_gpu_client_restarts_the_script_with_the_restart_count(room, tmp_path):
    """Last in the module: it kills a GPU client."""
    room.idle()
    wd = workdir(tmp_path, "resumes.py")
    job = room.sdk.submit_script("resumes.py", nproc=2, working_dir=wd, wait=False, progress=False)

    def said(text: str) -> int:
        return sum(text in line["text"] for line in room.sdk.get_job_logs(job))
    wait_until(lambda: said("restart 0 world 2") == 2, JOB_TIME, what=f"both ranks of job {job} up")
    room.clients["c"] = room.start("c")  # the replacement, idle until then
    placement = {p["rank"]: p["client_id"] for p in room.sdk.get_job(job)["placement"]}
    victim = next(name for name, c in room.clients.items() if c.client_id == placement[1])
    room.clients[victim].kill()  # SIGKILL: its rank goes with it, the other's collective breaks
    result = room.sdk.wait(job, progress=False, timeout=JOB_TIME)
    assert result["status"] == "completed", result
    assert said("restart 1 world 2 max restarts 3") == 2
    record = result["job"]
    assert record["restarts"] == 1 and "lost" in record["restart_history"][0]["reason"]
    assert {p["client_id"] for p in record["placement"]} == {placement[0], "client-c"}
    dest = room.sdk.download_outputs(job, str(tmp_path / "out"))
    with open(os.path.join(dest, "restart.txt")) as fh:
        assert fh.read() == "1\n"
