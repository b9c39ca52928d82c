"""``zwdx gpu-client --isolation docker``: each rank in a fresh locked-down container
(gpu_client/container.py), seen from the job's own code and from the machine.

A job's code reports what it can see and do from inside its container (its uid, capabilities,
seccomp, no-new-privileges, a read-only root, its tmpfs work dir, its limits, the agent's
environment and files, a connection to an address that is neither the server nor a peer); the
tests check it against what the donor asked for, that the container is gone when the rank
ends, that none outlives its agent killed with SIGKILL, and that the ways it can go wrong (no
engine, an image the donor does not allow, a container that exits at start, an image on
another Python) reach the submitter as a failure or a waiting reason naming the GPU client
and the cause. Needs a Docker engine (dockerd.Engine starts one where none answers).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

import dockerd
import mnist
import needs
from procs import SLACK, GpuClient, Server, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.docker]

IMAGE = dockerd.CLIENT_IMAGE
MiB = 1024**2


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


@pytest.fixture
def stack(engine, tmp_path):
    """A server, a room, and ``start(name, *args)``: a GPU client in docker isolation (stopped
    after the test, its containers checked gone)."""
    from zwdx import ZWDX
    server = Server(str(tmp_path / "server"))
    sdk = ZWDX(server.url, remember=False)
    room = sdk.create_room("boxes")
    clients = []

    def start(name: str, *args: str, env: dict | None = None) -> GpuClient:
        client = GpuClient(server.url, room["donor_token"], str(tmp_path / name), name,
                           extra=["--isolation", "docker", "--allow-image", IMAGE, *args], env=env)
        clients.append(client)
        return client

    def online(client: GpuClient) -> None:
        def up():
            if not client.alive():
                raise AssertionError(f"gpu client exited:\n{client.output()}")
            return any(c["id"] == client.client_id and c["status"] == "online"
                       for c in sdk.get_room(room["submitter_token"])["clients"])
        wait_until(up, 60 + SLACK, what=f"gpu client {client.client_id}")

    yield type("Stack", (), {"server": server, "sdk": sdk, "room": room, "start": staticmethod(start),
                             "online": staticmethod(online), "token": room["submitter_token"]})
    for client in clients:
        client.stop()
        from gpu_client.container import agent_tag
        wait_until(lambda: not _containers(agent_tag(os.path.join(str(tmp_path), client.client_id))), 30,
                   what="the containers of a stopped GPU client gone")
    server.stop()


def _containers(tag: str, job: str | None = None) -> list[str]:
    label = ["--filter", f"label=zwdx.agent={tag}"] + (["--filter", f"label=zwdx.job={job}"] if job else [])
    return dockerd.docker("ps", "-a", "-q", *label).stdout.split()


def _submit(sdk, token: str, train, **kwargs) -> dict:
    return sdk.submit_job(mnist.Net(), mnist.create_loader, train, None,
                          torch.optim.AdamW(mnist.Net().parameters(), lr=3e-3), "DDP", 0, room_token=token,
                          world_size=1, progress=False, **kwargs)


def _host_address() -> str:
    """An address of this machine that is neither loopback (where the test's server listens)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # no packet leaves: the kernel picks the route's source
        return probe.getsockname()[0]


def probe(target: str, agent_dir: str):
    """The job's code: from inside its container, what it is, has and can reach (``target``:
    ``host:port`` neither the server nor a peer; ``agent_dir``: the agent's work dir)."""
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
        "seccomp": status["Seccomp"].strip(), "root": root, "home": env.get("HOME", ""),
        "work_fs": mounts.get("/work", ""), "bundle_in_work": os.path.exists("/work/bundle.zwdx"),
        "pids_max": read("/sys/fs/cgroup/pids/pids.max").strip() or read("/sys/fs/cgroup/pids.max").strip(),
        "memory_max": read("/sys/fs/cgroup/memory/memory.limit_in_bytes").strip(),
        "env_names": ",".join(sorted(env)), "env_values": "\n".join(env.values()), "egress": egress,
        "agent_dir": os.path.exists(agent_dir),
    }


def test_a_rank_runs_in_a_locked_down_container_that_is_gone_when_it_ends(stack, tmp_path):
    decoy, donor = "decoy-secret-7f3a", stack.room["donor_token"]
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen()
    target = f"{_host_address()}:{listener.getsockname()[1]}"
    work = str(tmp_path / "box")
    client = stack.start("box", "--container-memory", "3g", "--container-pids", "512",
                         env={"ZWDX_ROOM_TOKEN": donor, "DECOY_SECRET": decoy, "OMP_NUM_THREADS": "1"})
    stack.online(client)
    assert "isolation docker (" in client.output() and "read-only" in client.output()
    from gpu_client.container import agent_tag
    standby = set(wait_until(lambda: _containers(agent_tag(work), "standby"), 30, what="the slot's standby container"))
    try:
        result = _submit(stack.sdk, stack.token, probe(target, work))
    finally:
        listener.close()
    assert "no standby container" not in client.output()  # the standby took the rank
    seen = result["results"]
    assert seen["uid"] >= 2_000_000                                       # not root, no login's uid
    assert int(seen["cap_eff"], 16) == 0 and seen["no_new_privs"] == "1"  # no capabilities, no setuid gains
    assert seen["seccomp"] == "2"                                         # Docker's default seccomp filter
    assert seen["root"] == "Read-only file system"
    assert seen["home"] == "/work" and seen["work_fs"] == "tmpfs" and seen["bundle_in_work"]
    assert seen["pids_max"] == "512" and int(seen["memory_max"]) == 3 * 1024 * MiB
    assert not seen["agent_dir"]                                          # nothing of the host's files
    assert "DECOY_SECRET" not in seen["env_names"] and "ZWDX_ROOM_TOKEN" not in seen["env_names"]
    assert decoy not in seen["env_values"] and donor not in seen["env_values"]
    wait_until(lambda: not standby & set(_containers(agent_tag(work))), 20 + SLACK,
               what="the rank's container (the slot's standby) removed once the rank ended")
    from gpu_client.egress import Egress
    if not Egress("probe").available:
        needs.missing("root and iptables (the rank's egress rules; all else above was checked)",
                      "run the suite as root, as CI does")
    assert seen["egress"] in ("ConnectionRefusedError", "ConnectionResetError"), seen["egress"]  # not a peer


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


def test_ranks_of_two_clients_train_together_and_reach_only_each_other_and_the_server(engine, tmp_path):
    from gpu_client.egress import Egress
    if not Egress("probe").available:
        needs.missing("root and iptables (the ranks' egress rules)", "run the suite as root, as CI does")
    from zwdx import ZWDX
    server = Server(str(tmp_path / "server"), host=_host_address())  # peers and server off loopback
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    clients = []
    try:
        sdk = ZWDX(server.url, remember=False)
        room = sdk.create_room("pair")
        for name in ("left", "right"):
            clients.append(GpuClient(server.url, room["donor_token"], str(tmp_path / name), name,
                                     extra=["--isolation", "docker", "--allow-image", IMAGE]))
        wait_until(lambda: sum(c["status"] == "online" for c in sdk.get_room(room["submitter_token"])["clients"]) == 2,
                   60 + SLACK, what="both GPU clients")
        train = trains_then_dials(f"127.0.0.1:{listener.getsockname()[1]}")
        result = sdk.submit_job(mnist.Net(), mnist.create_loader, train, mnist.test,
                                torch.optim.AdamW(mnist.Net().parameters(), lr=3e-3), "DDP", 0,
                                room_token=room["submitter_token"], world_size=2, epochs=1, progress=False)
        assert sorted(p["client_id"] for p in result["placement"]) == ["left", "right"]
        assert result["results"]["accuracy"] > 0.5  # the ranks trained together, over gloo between containers
        assert result["results"]["egress"] in ("ConnectionRefusedError", "ConnectionResetError")  # loopback: neither
    finally:
        listener.close()
        for client in clients:
            client.stop()
        server.stop()


def _sleep_train(model, loader, optim, rank, world_size, epochs=1, reporter=None):
    import time
    reporter.log("sleeping")
    time.sleep(600)
    return 0.0


def test_no_container_outlives_its_agent_killed(stack, tmp_path):
    from gpu_client.container import agent_tag
    client = stack.start("doomed")
    stack.online(client)
    job_id = _submit(stack.sdk, stack.token, _sleep_train, wait=False)
    logs = lambda: stack.sdk.get_job_logs(job_id, room_token=stack.token)  # noqa: E731
    wait_until(lambda: any(line["text"] == "sleeping" for line in logs()), 60 + SLACK, what="the rank running")
    tag = agent_tag(str(tmp_path / "doomed"))
    assert _containers(tag)  # the rank's, and maybe a standby
    client.kill(signal.SIGKILL)  # the agent alone, as a crash: no shutdown of its own
    wait_until(lambda: not _containers(tag), 20 + SLACK, what="every container of the killed agent gone")
    from gpu_client.egress import Egress
    Egress(tag).remove()  # its rules stay until an agent of its work dir starts again: none will


def test_without_an_engine_docker_isolation_refuses_to_start_and_says_why(tmp_path):
    done = subprocess.run([sys.executable, "-m", "zwdx.cli", "gpu-client", "--room-token", "zd_x", "--cpu",
                           "--isolation", "docker", "--work-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"})
    assert done.returncode == 2
    assert "--isolation docker: no Docker engine answers" in done.stderr, done.stderr


def test_an_image_the_donor_did_not_allow_is_refused_naming_the_client(engine, tmp_path):
    from pydantic import SecretStr

    from gpu_client.container import Confinement, ContainerLauncher, ImageDenied
    from zwdx.protocol.rank import RankSpec
    launcher = ContainerLauncher(str(tmp_path), standby=False, confinement=Confinement(images=[IMAGE]))
    spec = RankSpec(job_id="j1", attempt=0, rank=0, local_rank=0, world_size=1, master_addr="127.0.0.1",
                    master_port=1234, backend="gloo", device="cpu", parallelism="DDP", epochs=1,
                    collective_timeout=30, checkpoint=None, checkpoint_every_epoch=False, threads=1,
                    bundle_path=str(tmp_path / "b"), bundle_pending=True, assigned_at=0, server="http://127.0.0.1:1",
                    client_id="lender", hostname="gpu7", rank_key=SecretStr("rk_x"))
    try:
        with pytest.raises(ImageDenied, match=r"gpu client lender on host gpu7 does not run image evil:latest: "
                                              r"its donor allows " + IMAGE):
            launcher.start(0, spec, "lender", image="evil:latest")
        assert not _containers(launcher.tag)
    finally:
        launcher.shutdown()


def _derived_image(tag: str, tmp_path, lines: list[str]) -> str:
    folder = tmp_path / tag.replace(":", "-")
    folder.mkdir()
    (folder / "Dockerfile").write_text("\n".join([f"FROM {IMAGE}", "USER root", *lines, "USER 10001:10001", ""]))
    dockerd.docker("build", "-q", "-t", tag, str(folder), timeout=600)
    return tag


def test_a_container_that_exits_at_start_fails_the_job_naming_the_client_and_the_cause(stack, tmp_path):
    broken = _derived_image("zwdx-test-broken:latest", tmp_path, [
        "RUN echo 'raise SystemExit(\"this image has no rank runner\")' > /opt/zwdx/gpu_client/rank_container.py"])
    client = _client(stack, tmp_path, "broken", broken, "--no-standby")  # a fresh container per rank
    try:
        stack.online(client)
        from zwdx.errors import JobFailed
        with pytest.raises(JobFailed) as failed:
            _submit(stack.sdk, stack.token, mnist.train, epochs=1)
        message = str(failed.value)
        assert "gpu client broken on host" in message and "exited with code 1 before the rank started" in message
        assert "this image has no rank runner" in message
    finally:
        client.stop()


def _client(stack, tmp_path, name: str, image: str, *args: str) -> GpuClient:
    """A GPU client whose ranks run in ``image`` (the default of its --allow-image list)."""
    return GpuClient(stack.server.url, stack.room["donor_token"], str(tmp_path / name), name,
                     extra=["--isolation", "docker", "--allow-image", image, *args])


def test_an_image_on_another_python_keeps_jobs_waiting_naming_the_client(stack, tmp_path):
    other = _derived_image("zwdx-test-py399:latest", tmp_path, [
        "RUN echo 'import platform; platform.python_version = lambda: \"3.99.0\"' > /opt/zwdx/sitecustomize.py"])
    client = _client(stack, tmp_path, "py399", other)
    try:
        stack.online(client)
        clients = stack.sdk.get_room(stack.token)["clients"]
        assert [c["versions"]["python"] for c in clients] == ["3.99.0"]  # the image's, not the agent's
        job_id = _submit(stack.sdk, stack.token, mnist.train, wait=False)
        reason = wait_until(lambda: stack.sdk.get_job(job_id, room_token=stack.token).get("waiting_reason"), 30,
                            what="a waiting reason")
        assert "Python 3.99 (gpu client py399)" in reason, reason
        stack.sdk.cancel_job(job_id, room_token=stack.token)
    finally:
        client.stop()
