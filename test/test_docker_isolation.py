"""``zwdx gpu-client --isolation docker``: each rank in a fresh locked-down container
(gpu_client/sandbox/container.py), seen from the job's own code, from the machine and by the donor.

Two GPU clients in containers share one server (off loopback, so that loopback is neither the
server nor a peer). A job's code reports what it can see and do from inside its container (its
uid, capabilities, seccomp, no-new-privileges, a read-only root, its tmpfs sandbox, its limits,
the agent's environment and files, a connection to an address that is neither the server nor a
peer); the tests check it against what the donor asked for and what the dashboard's API and
``zwdx jobs show`` say it ran under, that two ranks train together between containers, that
the container is gone when the rank ends and none outlives its agent killed with SIGKILL, and
that the ways it can go wrong (no engine, an image that is not there, a container that exits
at start, an image on another Python) reach the donor or the submitter naming the GPU client
and the cause. Needs a Docker engine (dockerd.Engine starts one where none answers) and the
GPU-client image test_docker.py builds (built here if missing: the layer cache makes it quick).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest
import torch

import dockerd
import zwdx
import mnist
import needs
from procs import ROOT, SLACK, GpuClient, Server, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.docker]

IMAGE = dockerd.CLIENT_IMAGE
#: Another name of the same image, which only the GPU client ``right`` allows.
ALIAS = "zwdx-test-alias:1"
MiB = 1024**2
DECOY = "decoy-secret-7f3a"


@pytest.fixture(scope="module")
def engine():
    needs.tool("docker", dockerd.HOW)
    try:
        running = dockerd.Engine.start()
    except dockerd.Missing as missing:
        needs.missing(missing.what, missing.how)
    dockerd.build_client_image()
    yield running
    running.stop()


def _host_address() -> str:
    """An address of this machine that is not loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # no packet leaves: the kernel picks the route's source
        return probe.getsockname()[0]


class Stack:
    """A server off loopback, a room, GPU clients in docker isolation (``start``)."""

    def __init__(self, root: str):
        from zwdx import ZWDX
        self.root = root
        self.server = Server(os.path.join(root, "server"), host=_host_address())
        self.sdk = ZWDX(self.server.url, remember=False)
        self.room = self.sdk.create_room("boxes")
        self.token = self.room["submitter_token"]
        self.clients: dict[str, GpuClient] = {}

    def start(self, name: str, *args: str, image: str = IMAGE) -> GpuClient:
        client = GpuClient(self.server.url, self.room["donor_token"], os.path.join(self.root, name), name,
                           extra=["--isolation", "docker", "--allow-image", image, *args],
                           env={"DECOY_SECRET": DECOY, "OMP_NUM_THREADS": "1"})
        self.clients[name] = client
        return client

    def online(self, *clients: GpuClient) -> None:
        def up():
            for client in clients:
                if not client.alive():
                    raise AssertionError(f"gpu client {client.client_id} exited:\n{client.output()}")
            ids = {c["id"] for c in self.sdk.get_room(self.token)["clients"] if c["status"] == "online"}
            return {c.client_id for c in clients} <= ids
        wait_until(up, 90 + SLACK, what=f"gpu clients {[c.client_id for c in clients]} online")

    def slots(self, name: str) -> list[dict]:
        return next(c for c in self.sdk.get_room(self.token)["clients"] if c["id"] == name)["slots"]

    def stop(self, name: str) -> None:
        from gpu_client.sandbox.container import agent_tag
        client = self.clients.pop(name)
        client.stop()
        wait_until(lambda: not _containers(agent_tag(os.path.join(self.root, name))), 30,
                   what=f"the containers of stopped GPU client {name} gone")

    def close(self) -> None:
        for name in list(self.clients):
            self.stop(name)
        self.server.stop()


@pytest.fixture(scope="module")
def stack(engine, tmp_path_factory):
    """Clients ``left`` (3g, 512 pids) and ``right`` (the defaults; it allows ``ALIAS`` too), and
    ``py399``, whose image runs another Python: no job of these tests is placed on it, and one
    that needs it says why."""
    stack = Stack(str(tmp_path_factory.mktemp("boxes")))
    try:
        other = _derived_image("zwdx-test-py399:latest", tmp_path_factory.mktemp("py399"), [
            "RUN echo 'import platform; platform.python_version = lambda: \"3.99.0\"' > /opt/zwdx/sitecustomize.py"])
        dockerd.docker("tag", IMAGE, ALIAS)
        left = stack.start("left", "--container-memory", "3g", "--container-pids", "512")
        right = stack.start("right", "--allow-image", ALIAS)
        stack.online(left, right, stack.start("py399", image=other))
        yield stack
    finally:
        stack.close()


def _containers(tag: str, job: str | None = None) -> list[str]:
    label = ["--filter", f"label=zwdx.agent={tag}"] + (["--filter", f"label=zwdx.job={job}"] if job else [])
    return dockerd.docker("ps", "-a", "-q", *label).stdout.split()


def _submit(stack: Stack, train, world_size: int = 1, epochs: int | None = None, image: str | None = None,
            max_restarts: int | None = None, eval_func=None, wait: bool = True) -> dict:
    recovery = None if max_restarts is None else zwdx.Recovery(max_restarts=max_restarts)
    return stack.sdk.submit_job(mnist.Net(), mnist.create_loader, train, eval_func,
                                torch.optim.AdamW(mnist.Net().parameters(), lr=3e-3), "DDP", 0,
                                resources=zwdx.Resources(world_size=world_size, image=image),
                                training=zwdx.Training(epochs=epochs),
                                run=zwdx.Run(room_token=stack.token, progress=False, recovery=recovery), wait=wait)


def probe(target: str, agent_dir: str):
    """The job's code: from inside its container, what it is, has and can reach (``target``:
    ``host:port`` neither the server nor a peer; ``agent_dir``: the agents' work dirs' parent)."""
    def what_the_rank_sees(model, loader, optim, rank, world_size, epochs=1, reporter=None):
        return _sees(target, agent_dir)
    return what_the_rank_sees


def _sees(target: str, agent_dir: str) -> dict:
    import os
    import socket

    def read(path):
        try:
            with open(path) as fh:
                return fh.read()
        except OSError as exc:
            return f"unreadable: {exc}"

    status = dict(line.split(":", 1) for line in read("/proc/self/status").splitlines() if ":" in line)
    mounts = {line.split()[1]: line.split()[2] for line in read("/proc/self/mounts").splitlines()}
    try:
        open("/opt/zwdx/planted.py", "w").close()
        root = "writable"
    except OSError as exc:
        root = exc.strerror
    try:
        host, port = target.rsplit(":", 1)
        socket.create_connection((host, int(port)), timeout=5).close()
        egress = "connected"
    except OSError as exc:
        egress = type(exc).__name__
    env = dict(os.environ)
    return {
        "uid": os.getuid(), "cap_eff": status["CapEff"].strip(), "no_new_privs": status["NoNewPrivs"].strip(),
        "seccomp": status["Seccomp"].strip(), "root": root, "cwd": os.getcwd(), "home": env.get("HOME", ""),
        "work_fs": max(((m, fs) for m, fs in mounts.items() if os.getcwd().startswith(m.rstrip("/") + "/")),
                       key=lambda mf: len(mf[0]))[1],
        "bundle_here": os.path.exists("../bundle.zwdx"),  # the sandbox's; its home is the job's working dir
        "pids_max": read("/sys/fs/cgroup/pids/pids.max").strip() or read("/sys/fs/cgroup/pids.max").strip(),
        "memory_max": read("/sys/fs/cgroup/memory/memory.limit_in_bytes").strip(),
        "env_names": ",".join(sorted(env)), "env_values": "\n".join(env.values()), "egress": egress,
        "agent_dir": [p for p in ("secrets", "agents", "bundles", "jobs", "standby")
                      if any(os.path.exists(os.path.join(agent_dir, c, p)) for c in ("left", "right"))],
    }


def _egress_filtered() -> bool:
    from gpu_client.sandbox.egress import Egress
    return Egress("probe").available


def test_the_donor_sees_the_isolation_at_start_and_per_slot(stack):
    left = stack.clients["left"]
    assert "isolation: container" in left.output() and f"image {IMAGE}" in left.output(), left.output()
    assert "memory 3072 MiB" in left.output() and "pids 512" in left.output()
    slot = stack.slots("left")[0]
    assert slot["isolation"] == "docker"
    assert slot["terms"]["image"] == IMAGE and slot["terms"]["pids"] == 512
    assert slot["terms"]["memory_bytes"] == 3 * 1024 * MiB and slot["terms"]["root_fs"] == "read-only"


def test_a_rank_runs_in_a_locked_down_container_under_the_terms_its_job_page_shows(stack):
    donor = stack.room["donor_token"]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))  # loopback: neither the server nor a peer (both off it)
    listener.listen()
    from gpu_client.sandbox.container import agent_tag
    tags = {name: agent_tag(os.path.join(stack.root, name)) for name in ("left", "right")}
    wait_until(lambda: all(_containers(t, "standby") for t in tags.values()), 30, what="the slots' standby containers")
    standby = {name: set(_containers(tag, "standby")) for name, tag in tags.items()}
    try:
        job = _submit(stack, probe(f"127.0.0.1:{listener.getsockname()[1]}", stack.root))
    finally:
        listener.close()
    name = job["placement"][0]["client_id"]
    assert "no standby container" not in stack.clients[name].output()  # the standby took the rank
    seen, terms = job["results"], stack.slots(name)[0]["terms"]
    assert seen["uid"] >= 2_000_000                                       # not root, no login's uid
    assert int(seen["cap_eff"], 16) == 0 and seen["no_new_privs"] == "1"  # no capabilities, no setuid gains
    assert seen["seccomp"] == "2"                                         # Docker's default seccomp filter
    assert seen["root"] == "Read-only file system"
    assert seen["cwd"] == seen["home"] and seen["home"].startswith(os.path.join(stack.root, name, "ranks") + "/")
    assert seen["work_fs"] == "tmpfs"                                     # the sandbox: in the container's tmpfs
    assert seen["bundle_here"]                                            # the job's bundle, in its sandbox
    assert seen["pids_max"] == str(terms["pids"]) and int(seen["memory_max"]) == terms["memory_bytes"]
    assert seen["agent_dir"] == []                                        # nothing of the agent's files
    assert "DECOY_SECRET" not in seen["env_names"] and "ZWDX_ROOM_TOKEN" not in seen["env_names"]
    assert DECOY not in seen["env_values"] and donor not in seen["env_values"]
    if _egress_filtered():
        assert seen["egress"] in ("ConnectionRefusedError", "ConnectionResetError"), seen["egress"]
    # what the job's page and `zwdx jobs show` say its rank ran under: its slot's terms
    state = stack.sdk.get_job(job["job_id"], room_token=stack.token)["ranks"]["0"]
    assert state["isolation"] == "docker" and state["terms"] == terms
    shown = subprocess.run([sys.executable, "-m", "zwdx.cli", "jobs", "show", job["job_id"], "--server", stack.server.url],
                           capture_output=True, text=True, timeout=60, cwd=ROOT,
                           env={**os.environ, "ZWDX_ROOM_TOKEN": stack.token})
    assert shown.returncode == 0, shown.stderr
    assert "container" in shown.stdout and f"rank 0 ran in a container: image {IMAGE}" in shown.stdout, shown.stdout
    assert f"pids {terms['pids']}" in shown.stdout
    wait_until(lambda: not standby[name] & set(_containers(tags[name])), 20 + SLACK,
               what="the rank's container (a slot's standby) removed once the rank ended")
    if not _egress_filtered():
        needs.missing("root and iptables (the rank's egress rules; all else above was checked)",
                      "run the suite as root, as CI does")


def trains_then_dials(target: str):
    """The job's code: the example's training (a collective per step between the ranks' containers),
    then a connection to ``target``, which is neither a peer nor the server."""
    def train(model, loader, optim, eval_func, rank, world_size, epochs=1, reporter=None):
        import socket
        loss = mnist.train(model, loader, optim, eval_func, rank, world_size, epochs, reporter)
        host, port = target.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
            egress = "connected"
        except OSError as exc:
            egress = type(exc).__name__
        return {"final_loss": loss, "egress": egress}
    return train


def test_ranks_of_two_clients_train_together_and_reach_only_each_other_and_the_server(stack):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        job = _submit(stack, trains_then_dials(f"127.0.0.1:{listener.getsockname()[1]}"), world_size=2, epochs=1,
                      eval_func=mnist.test)
    finally:
        listener.close()
    assert sorted(p["client_id"] for p in job["placement"]) == ["left", "right"]
    assert job["results"]["accuracy"] > 0.5  # the ranks trained together, over gloo between containers
    if not _egress_filtered():
        needs.missing("root and iptables (the ranks' egress rules)", "run the suite as root, as CI does")
    assert job["results"]["egress"] in ("ConnectionRefusedError", "ConnectionResetError")  # loopback: neither


def test_a_script_job_and_a_diloco_job_run_in_containers_too(stack, tmp_path):
    wd = tmp_path / "wd"
    wd.mkdir()
    shutil.copy(os.path.join(ROOT, "test", "scripts", "ddp.py"), wd / "ddp.py")
    python = next(c for c in stack.sdk.get_room(stack.token)["clients"] if c["id"] == "left")["versions"]["python"]
    if _has_data_filter(python):
        script = stack.sdk.submit_script("ddp.py", ["--steps", "2"], nproc=2, working_dir=str(wd),
                                         room_token=stack.token, progress=False)
        assert script["complete"], script
        job = stack.sdk.get_job(script["job_id"], room_token=stack.token)
        assert {state["isolation"] for state in job["ranks"].values()} == {"docker"}
        outputs = stack.sdk.download_outputs(script["job_id"], str(tmp_path / "out"), room_token=stack.token)
        assert sorted(os.listdir(outputs)) == ["model.pt", "summary.txt"]  # written in the rank's sandbox, sent back
    else:  # the sandbox's stand-in image (Debian's Python 3.11.2): refused, naming the client and why
        from zwdx.errors import JobFailed
        with pytest.raises(JobFailed) as failed:
            stack.sdk.submit_script("ddp.py", ["--steps", "2"], nproc=2, working_dir=str(wd), room_token=stack.token,
                                    progress=False, max_restarts=0)
        assert "on host" in str(failed.value) and f"its Python {python} lacks tarfile's data filter" in str(
            failed.value), failed.value
    model = mnist.Net()
    diloco = stack.sdk.submit_job(model, mnist.create_loader, mnist.train, None,
                                  torch.optim.AdamW(model.parameters(), lr=3e-3), "DILOCO", 0,
                                  strategy=zwdx.Diloco(inner_steps=10), resources=zwdx.Resources(world_size=2),
                                  training=zwdx.Training(epochs=1),
                                  run=zwdx.Run(room_token=stack.token, progress=False))
    assert diloco["complete"] and diloco["final_loss"] < 2.0  # rounds through the server, from containers
    job = stack.sdk.get_job(diloco["job_id"], room_token=stack.token)
    assert {state["isolation"] for state in job["ranks"].values()} == {"docker"}


def _has_data_filter(python: str) -> bool:
    """Whether tarfile of this Python version has the data filter script jobs unpack with."""
    v = tuple(int(part) for part in python.split(".")[:3])
    return v >= (3, 12) or v >= (3, 11, 4) and v < (3, 12) or (3, 10, 12) <= v < (3, 11)


def _derived_image(tag: str, folder, lines: list[str]) -> str:
    folder.mkdir(exist_ok=True)
    (folder / "Dockerfile").write_text("\n".join([f"FROM {IMAGE}", "USER root", *lines, "USER 10001:10001", ""]))
    dockerd.docker("build", "-q", "-t", tag, str(folder), timeout=600)
    return tag


def test_a_job_runs_in_an_image_its_donor_allows_and_else_waits_naming_who_allows_what(stack):
    job = _submit(stack, mnist.train, epochs=1, image=ALIAS)
    assert job["complete"] and [p["client_id"] for p in job["placement"]] == ["right"]  # the one that allows it
    state = stack.sdk.get_job(job["job_id"], room_token=stack.token)["ranks"]["0"]
    assert state["terms"]["image"] == ALIAS
    job_id = _submit(stack, mnist.train, image="evil:latest", wait=False)
    reason = wait_until(lambda: stack.sdk.get_job(job_id, room_token=stack.token).get("waiting_reason"), 30,
                        what="a waiting reason")
    assert "do not run image evil:latest" in reason and f"gpu client left allows {IMAGE};" in reason, reason
    assert f"gpu client right allows {IMAGE}, {ALIAS}" in reason, reason
    stack.sdk.cancel_job(job_id, room_token=stack.token)


def _noise_loader(data_dir):
    import os

    import torch
    from torch.utils.data import DataLoader, TensorDataset
    raw = open(os.path.join(data_dir, "noise", "sub dir", "noise.bin"), "rb").read()
    x = torch.frombuffer(bytearray(raw[:64 * 100]), dtype=torch.uint8).float().reshape(100, 64) / 255
    return DataLoader(TensorDataset(x, torch.zeros(100, dtype=torch.long)), batch_size=50)


def _noise_train(model, loader, optimizer):
    import torch.nn.functional as F
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    return {"final_loss": float(loss)}


def test_a_jobs_dataset_reaches_its_container(stack, tmp_path):
    folder = tmp_path / "noise" / "sub dir"
    folder.mkdir(parents=True)
    (folder / "noise.bin").write_bytes(os.urandom(64 * 100))
    stack.sdk.push_dataset(str(tmp_path / "noise"), "noise", room_token=stack.token, progress=False)
    model = torch.nn.Linear(64, 2)
    job = stack.sdk.submit_job(model, _noise_loader, _noise_train, None, torch.optim.SGD(model.parameters(), lr=0.1),
                               "DDP", 0, resources=zwdx.Resources(world_size=1),
                               run=zwdx.Run(room_token=stack.token, progress=False, datasets=["noise"]))
    assert job["complete"], job  # its loader read the dataset's file, nested, in the container's sandbox


def test_an_image_on_another_python_keeps_a_job_that_needs_it_waiting_naming_the_client(stack):
    clients = {c["id"]: c for c in stack.sdk.get_room(stack.token)["clients"]}
    assert clients["py399"]["versions"]["python"] == "3.99.0"  # what its image runs, not its agent
    job_id = _submit(stack, mnist.train, world_size=3, wait=False)  # three slots asked, two run this Python
    reason = wait_until(lambda: stack.sdk.get_job(job_id, room_token=stack.token).get("waiting_reason"), 30,
                        what="a waiting reason")
    assert "Python 3.99 (gpu client py399)" in reason, reason
    stack.sdk.cancel_job(job_id, room_token=stack.token)


def test_a_container_that_exits_at_start_fails_the_job_naming_the_client_and_the_cause(stack, tmp_path):
    broken = _derived_image("zwdx-test-broken:latest", tmp_path / "broken", [
        "RUN echo 'raise SystemExit(\"this image has no rank runner\")' > /opt/zwdx/gpu_client/sandbox/rank_container.py"])
    stack.online(stack.start("broken", "--no-standby", image=broken))  # a fresh container per rank
    from zwdx.errors import JobFailed
    with pytest.raises(JobFailed) as failed:  # three slots of this Python: broken's among them
        _submit(stack, mnist.train, world_size=3, epochs=1, max_restarts=0)
    message = str(failed.value)
    assert "gpu client broken on host" in message, message
    assert f"its container (image {broken}) exited with code 1 before the rank started" in message, message
    assert "this image has no rank runner" in message
    stack.stop("broken")


def _sleep_train(model, loader, optim, rank, world_size, epochs=1, reporter=None):
    import time
    reporter.log("sleeping")
    time.sleep(600)
    return 0.0


def test_no_container_outlives_its_agent_killed(stack):
    from gpu_client.sandbox.container import agent_tag
    job_id = _submit(stack, _sleep_train, world_size=2, wait=False)
    logs = lambda: stack.sdk.get_job_logs(job_id, room_token=stack.token)  # noqa: E731
    wait_until(lambda: sum(line["text"] == "sleeping" for line in logs()) == 2, 60 + SLACK, what="the ranks running")
    tag = agent_tag(os.path.join(stack.root, "left"))
    assert _containers(tag)  # its rank's (a standby that took it, labelled so) and maybe a fresh standby
    stack.clients.pop("left").kill(signal.SIGKILL)  # the agent alone, as a crash: no shutdown of its own
    wait_until(lambda: not _containers(tag), 20 + SLACK, what="every container of the killed agent gone")
    from gpu_client.sandbox.egress import Egress
    Egress(tag).remove()  # its rules stay until an agent of its work dir starts again: none will
    stack.sdk.cancel_job(job_id, room_token=stack.token)


def test_without_an_engine_or_the_image_docker_isolation_refuses_to_start_and_says_why(tmp_path):
    base = [sys.executable, "-m", "zwdx.cli", "gpu-client", "--server", "http://127.0.0.1:9", "--cpu",
            "--isolation", "docker", "--work-dir", str(tmp_path)]
    env = {**os.environ, "ZWDX_ROOM_TOKEN": "zd_x"}
    done = subprocess.run(base, capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**env, "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"})
    assert done.returncode == 2
    assert "--isolation docker: no Docker engine answers" in done.stderr, done.stderr
    if dockerd.answers():
        done = subprocess.run([*base, "--allow-image", "zwdx-no-such-image:1"], capture_output=True, text=True,
                              timeout=60, cwd=ROOT, env=env)
        assert done.returncode == 2
        assert "image zwdx-no-such-image:1 is not on this machine" in done.stderr, done.stderr
