"""Attacks by job code on the machines that run it (the trust issue's item 10), each replayed with
real processes and shown to fail: a job's code, running on a GPU client started as root, tries
to read the client's token file and client secret, another job's bundle (in the client's cache
and in the other job's sandbox), the client's and another job's ``/proc/<pid>/environ``, to
signal them, to write into the installed ``gpu_client`` package and the client's cache, and to
leave a process and a file behind; it reports what it got through the job's result. The room
token is on no command line of the machine (the suite starts its GPU clients with it in their
environment or a file; ``--room-token`` still works, and warns without showing it).

The GPU clients' work dirs here sit where every user may pass (unlike pytest's own temporary
directory, 0700), so that what stops the job is the client's isolation and nothing else.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
import torch

import gpu_client
import needs
from procs import ROOT, SLACK, GpuClient, Server, wait_until
import zwdx
from zwdx import ZWDX

pytestmark = pytest.mark.slow


# -- what the jobs run (functions travel by value, with what they close over) -------------------------
class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.fc(x)


def tiny_loader(rank, world_size):
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler
    data = TensorDataset(torch.randn(16, 2), torch.randint(0, 2, (16,)))
    return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, world_size, rank))


def victim(release: str, wait_s: float):
    """A job that says where it runs (pid, directory), then waits until ``release`` exists."""
    def train(model, loader, optimizer):
        import os
        import time
        print(f"victim pid={os.getpid()} cwd={os.getcwd()} uid={os.getuid()}", flush=True)
        end = time.time() + wait_s
        while not os.path.exists(release) and time.time() < end:
            time.sleep(0.2)
        return 0.0
    return train


def attacker(reads: dict, writes: dict, listings: dict, victim_pid: int, leftover: str):
    """A job that tries each attack and returns what it got: ``denied: <error>`` or ``got: ...``."""
    def train(model, loader, optimizer):
        import os
        import subprocess
        got = {}

        def attempt(name, action):
            try:
                got[name] = f"got: {action()!r}"[:300]
            except OSError as exc:
                got[name] = f"denied: {type(exc).__name__}"
        for name, path in reads.items():
            attempt(name, lambda p=path: open(p, "rb").read(64))
        for name, path in writes.items():
            attempt(name, lambda p=path: open(p, "ab").write(b"# written by a job\n"))
        for name, path in listings.items():
            attempt(name, lambda p=path: os.listdir(p))
        agent = os.getppid()
        attempt("agent_environ", lambda: open(f"/proc/{agent}/environ", "rb").read(64))
        attempt("victim_environ", lambda: open(f"/proc/{victim_pid}/environ", "rb").read(64))
        attempt("signal_agent", lambda: os.kill(agent, 0))
        attempt("signal_victim", lambda: os.kill(victim_pid, 0))
        with open(f"/proc/{agent}/cmdline", "rb") as fh:  # public: every user reads a command line
            got["agent_cmdline"] = fh.read().replace(b"\0", b" ").decode(errors="replace")
        got["uid"], got["cwd"] = os.getuid(), os.getcwd()
        got["daemon"] = subprocess.Popen(["sleep", "600"], start_new_session=True).pid  # outlives the job
        with open(leftover, "w") as fh:
            fh.write("left behind")
        return got
    return train


def whoami(model, loader, optimizer, rank):
    import os
    print(f"rank {rank} runs as uid {os.getuid()} in {os.getcwd()}", flush=True)
    return {"final_loss": 0.0, f"uid_{rank}": os.getuid(), f"home_{rank}": os.environ["HOME"]}


# -- the machine ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def donors():
    """A server and two GPU clients as root, their work dirs where every user may pass: ``a``
    given its donor token by a file (0600), ``b`` by its environment."""
    needs.root("GPU clients run each job as a user of its own only when they run as root")
    base = tempfile.mkdtemp(prefix="zwdx-donors-", dir="/tmp")
    os.chmod(base, 0o755)
    server = Server(os.path.join(base, "server"))
    clients = []
    try:
        sdk = ZWDX(server.url, remember=False)
        room = sdk.create_room("donors")
        sdk.room_token = room["token"]
        token_file = os.path.join(base, "a-token")
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, room["donor_token"].encode() + b"\n")
        os.close(fd)
        clients.append(GpuClient(server.url, None, os.path.join(base, "a"), "donor-a",
                                 extra=["--room-token-file", token_file]))
        clients.append(GpuClient(server.url, room["donor_token"], os.path.join(base, "b"), "donor-b"))
        wait_until(lambda: sum(c["status"] == "online" for c in sdk.get_room()["clients"]) == 2, 60,
                   what=f"both GPU clients online\n{clients[0].tail()}\n{clients[1].tail()}")
        yield {"server": server, "sdk": sdk, "room": room, "token_file": token_file, "base": base,
               "work": {c.client_id: os.path.join(base, c.client_id[len("donor-"):]) for c in clients}}
    finally:
        for client in clients:
            client.stop()
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


def log_line(sdk, job_id: str, prefix: str) -> str | None:
    return next((line["text"] for line in sdk.get_job_logs(job_id) if line["text"].startswith(prefix)), None)


def test_job_code_reaches_neither_its_gpu_client_nor_another_job(donors):
    sdk, work = donors["sdk"], donors["work"]
    release = os.path.join(donors["base"], "release")
    victim_id = sdk.submit_job(Tiny(), tiny_loader, victim(release, 300), None,
                               torch.optim.SGD(Tiny().parameters(), lr=0.1), "DDP",
                               resources=zwdx.Resources(world_size=1), wait=False)
    said = wait_until(lambda: log_line(sdk, victim_id, "victim pid="), 60 + SLACK, what="the victim job running")
    fields = dict(part.split("=", 1) for part in said.split()[1:])
    victim_pid, victim_home = int(fields["pid"]), fields["cwd"]
    assert int(fields["uid"]) != 0 and victim_home != ROOT
    victim_dir = os.path.dirname(victim_home)  # the sandbox (root's): its home is the job's working dir
    victim_client = sdk.get_job(victim_id)["placement"][0]["client_id"]
    attacker_client = next(c for c in work if c != victim_client)
    victim_work, attacker_work = work[victim_client], work[attacker_client]
    # each agent's own files: agents/<client id> under its work dir (gpu_client/agent/workspace.py)
    victim_agent = os.path.join(victim_work, "agents", victim_client)
    attacker_agent = os.path.join(attacker_work, "agents", attacker_client)
    [cached] = [f for f in os.listdir(os.path.join(victim_agent, "bundles")) if f.endswith(".zwdx")]
    package = os.path.dirname(gpu_client.__file__)
    leftover = os.path.join("/tmp", f"zwdx-left-behind-{os.getpid()}-{time.time_ns()}")
    reads = {"token_file": donors["token_file"],
             "victim_secret": os.path.join(victim_work, "secrets", f"{victim_client}.secret"),
             "own_secret": os.path.join(attacker_work, "secrets", f"{attacker_client}.secret"),
             "victim_cached_bundle": os.path.join(victim_agent, "bundles", cached),
             "victim_sandbox_bundle": os.path.join(victim_dir, "bundle.zwdx"),
             "victim_rank_log": os.path.join(victim_agent, "jobs", victim_id, "rank0.log")}
    writes = {"package_module": os.path.join(package, "rank", "runner.py"),
              "package_new_file": os.path.join(package, "sitecustomize.py"),
              "own_bundle_cache": os.path.join(attacker_agent, "bundles", cached),
              "sandbox_parent": os.path.join(os.path.dirname(victim_dir), "planted")}
    listings = {"victim_sandbox": victim_dir, "sandboxes": os.path.dirname(os.path.dirname(victim_dir)),
                "own_work_dir_jobs": os.path.join(attacker_agent, "jobs")}
    try:
        result = sdk.submit_job(Tiny(), tiny_loader, attacker(reads, writes, listings, victim_pid, leftover), None,
                                torch.optim.SGD(Tiny().parameters(), lr=0.1), "DDP",
                                resources=zwdx.Resources(world_size=1), run=zwdx.Run(progress=False, timeout=120))
    finally:
        open(release, "w").close()
    got = result["results"]
    assert sdk.get_job(result["job_id"])["placement"][0]["client_id"] == attacker_client
    for name in [*reads, *writes, *listings, "agent_environ", "victim_environ", "signal_agent", "signal_victim"]:
        assert got[name].startswith("denied: "), f"{name}: {got[name]}"
    assert "gpu-client" in got["agent_cmdline"]  # it did read the command line: no secret is there
    for secret in (donors["room"]["token"], donors["room"]["donor_token"]):
        assert secret not in got["agent_cmdline"]
    assert got["uid"] not in (0, int(fields["uid"])) and got["cwd"] != victim_home  # a user and a directory per job
    assert os.path.getsize(os.path.join(package, "rank", "runner.py")) > 0 and not os.path.exists(writes["package_new_file"])
    assert sdk.wait(victim_id, progress=False, timeout=60)["status"] == "completed"  # the victim itself was not disturbed

    daemon = int(got["daemon"])  # what outlived the job went with its user
    wait_until(lambda: not psutil.pid_exists(daemon) or psutil.Process(daemon).status() == psutil.STATUS_ZOMBIE,
               10 + SLACK, what=f"the job's leftover process {daemon} killed")
    wait_until(lambda: not os.path.exists(leftover), 10 + SLACK, what=f"the job's leftover file {leftover} removed")
    wait_until(lambda: not os.path.exists(got["cwd"]) and not os.path.exists(victim_dir), 10 + SLACK,
               what="the jobs' sandboxes removed")


@pytest.mark.parametrize("parallelism", ["DDP", "FSDP"])
def test_an_ordinary_job_trains_across_both_clients_as_per_job_users(donors, parallelism):
    """(Resuming from a checkpoint as per-job users: test_resilience.py, whose GPU clients run as root too.)"""
    sdk = donors["sdk"]
    for client in sdk.get_room()["clients"]:
        assert [s["isolation"] for s in client["slots"]] == ["user"], client
    result = sdk.submit_job(Tiny(), tiny_loader, whoami, None, torch.optim.SGD(Tiny().parameters(), lr=0.1),
                            parallelism, resources=zwdx.Resources(world_size=2),
                            run=zwdx.Run(progress=False, timeout=120))
    assert result["status"] == "completed"
    uid = result["results"]["uid_0"]
    assert uid >= 2_000_000_000 and result["results"]["home_0"].startswith("/var/lib/zwdx/ranks/")
    lines = [line["text"] for line in sdk.get_job_logs(result["job_id"])]
    assert any(line.startswith(f"rank 0 runs as uid {uid} in /var/lib/zwdx/ranks/") for line in lines), lines
    assert any(line.startswith("rank 1 runs as uid ") for line in lines), lines


def test_no_room_token_on_any_command_line_of_the_machine(donors):
    secrets = (donors["room"]["token"], donors["room"]["donor_token"])

    def scanned() -> int:
        seen = 0
        for proc in psutil.process_iter(["cmdline"]):
            line = " ".join(proc.info.get("cmdline") or [])
            seen += "gpu-client" in line or "gpu_client.sandbox.rank_process" in line
            assert not any(secret in line for secret in secrets), f"a token on the command line of {proc.pid}"
        return seen

    # the two agents and their standby rank processes, every one scanned: a standby is made again
    # after each job, so right after another test's job one may still be starting (CI saw 3)
    wait_until(lambda: scanned() >= 4, 30 + SLACK, 0.5, what="both agents and their standby rank processes up")


def run_cli(*args, env=None, user=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zwdx.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, user=user, group=user, extra_groups=[] if user else None,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("ZWDX_")}, **(env or {})})


def test_a_token_on_the_command_line_works_and_warns_without_showing_it(donors):
    server, room, base = donors["server"], donors["room"], donors["base"]
    done = run_cli("job", "list", "--server", server.url, "-rt", room["token"])
    assert done.returncode == 0 and "can be read by every user" in done.stderr, done.stderr
    assert room["token"] not in done.stderr + done.stdout

    token_file = os.path.join(base, "submitter-token")
    with open(token_file, "w") as fh:  # 0644 under the usual umask: others may read it
        fh.write(room["token"] + "\n")
    os.chmod(token_file, 0o644)
    done = run_cli("job", "list", "--server", server.url, "--room-token-file", token_file)
    assert done.returncode == 0 and "may be read by other users (mode 0644)" in done.stderr, done.stderr
    os.chmod(token_file, 0o600)
    done = run_cli("job", "list", "--server", server.url, "--room-token-file", token_file)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    done = run_cli("job", "list", "--server", server.url, "--room-token-file", os.path.join(base, "missing"))
    assert done.returncode == 1 and "cannot read the room token file" in done.stderr

    done = run_cli("gpu-client", "--server", server.url, "--cpu", "--work-dir", os.path.join(base, "wrong"),
                   "--room-token", "zd_not-the-token")
    assert done.returncode == 2 and "can be read by every user" in done.stderr, done.stderr[-2000:]
    assert "zd_not-the-token" not in done.stderr


def test_isolation_as_registered_and_refused_where_it_cannot_hold(donors):
    server, sdk, base = donors["server"], donors["sdk"], donors["base"]
    same = GpuClient(server.url, donors["room"]["donor_token"], os.path.join(base, "same"), "donor-same",
                     extra=["--isolation", "process"])
    try:
        wait_until(lambda: any(c["id"] == "donor-same" and c["status"] == "online" for c in sdk.get_room()["clients"]),
                   30 + SLACK, what=f"the process-isolated GPU client online\n{same.tail()}")
        [client] = [c for c in sdk.get_room()["clients"] if c["id"] == "donor-same"]
        assert [s["isolation"] for s in client["slots"]] == ["process"]
        assert "isolation: same user" in same.output() and "can read what that user can" in same.output()
    finally:
        same.stop()
    done = run_cli("gpu-client", "--server", server.url, "--cpu", "--isolation", "user",
                   "--work-dir", os.path.join(base, "nobody"), env={"ZWDX_ROOM_TOKEN": "zd_x", "HOME": base},
                   user=65534)
    assert done.returncode == 2 and "--isolation user needs the GPU client to run as root" in done.stderr, done.stderr


def test_a_package_only_root_can_read_is_missing_for_the_jobs_of_a_per_job_user(donors, tmp_path):
    """What a GPU client says its jobs can import is what a rank user can, not what root can."""
    import importlib
    from zwdx.errors import Unschedulable
    site = tmp_path / "site"  # under pytest's own directory, 0700: root reads it, other users do not
    (site / "zwdx_root_only").mkdir(parents=True)
    (site / "zwdx_root_only" / "__init__.py").write_text("def scale(x):\n    return 2 * x\n")
    sys.path.insert(0, str(site))
    client = GpuClient(donors["server"].url, donors["room"]["donor_token"], str(tmp_path / "root-only"),
                       "donor-root-only", env={"PYTHONPATH": str(site)})
    try:
        extra = importlib.import_module("zwdx_root_only")

        def train(model, loader, optimizer):
            return extra.scale(0.5)
        wait_until(lambda: any(c["id"] == "donor-root-only" and c["status"] == "online"
                               for c in donors["sdk"].get_room()["clients"]), 30 + SLACK,
                   what=f"the GPU client online\n{client.tail()}")
        with pytest.raises(Unschedulable) as refused:
            donors["sdk"].submit_job(Tiny(), tiny_loader, train, None, torch.optim.SGD(Tiny().parameters(), lr=0.1),
                                     "DDP", resources=zwdx.Resources(world_size=1),
                                     run=zwdx.Run(progress=False, fail_if_unschedulable=True))
        said = str(refused.value)  # root's view would have placed it on donor-root-only
        assert "donor-root-only on host" in said and "lack package(s) zwdx_root_only" in said, said
    finally:
        client.stop()
        sys.path.remove(str(site))
        sys.modules.pop("zwdx_root_only", None)
