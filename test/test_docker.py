"""The Docker stack for real: a Docker engine, both images built from this checkout, the compose
stack up (MongoDB and the server), a room made inside the server's container, a GPU client
started by gpu_client/run_gpu_client.sh in its container, the example job submitted from the
host through the SDK, trained and its weights downloaded; then ``docker-compose down -v``.
Every stage is timed and printed (``-s`` shows them).

Where no engine answers, ``dockerd.Engine`` starts one with ../shared/docker-sandbox (which
also builds stand-ins for the registry's base images: Docker Hub is unreachable here). The
engine is stopped again only if this test started it; everything the test made (containers,
networks, volumes: one compose project of its own) is removed even when it fails. Without an
engine the test is skipped, and fails under CI (needs.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest
import torch

import dockerd
import mnist
import needs
from procs import ROOT, Proc, free_port, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.docker]

COMPOSE = os.path.join(ROOT, "docker-compose.yml")
SCRIPT = os.path.join(ROOT, "gpu_client", "run_gpu_client.sh")


@pytest.fixture(scope="module")
def engine():
    needs.tool("docker", dockerd.HOW)
    try:
        running = dockerd.Engine.start()
    except dockerd.Missing as missing:
        needs.missing(missing.what, missing.how)
    print(f"docker stack: engine {running.seconds:.1f} s ({'started' if running.started else 'already up'})")
    yield running
    running.stop()


class Stack:
    """One compose project of the stack, named for this test run: ``compose(...)`` runs
    docker-compose on it; ``remove()`` takes down whatever it made, volumes included."""

    def __init__(self, project: str, env: dict):
        self.project, self.env = project, env
        self.tool = needs.tool("docker-compose", "apt-get install docker-compose (./setup.sh --test)")

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([self.tool, "-f", COMPOSE, "-p", self.project, *args], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"docker-compose {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
        return done

    def leftovers(self) -> dict[str, list[str]]:
        """What of the project is still there: containers, networks, volumes (by its label)."""
        label = f"label=com.docker.compose.project={self.project}"
        return {kind: dockerd.docker(*cmd, "--filter", label, "--format", "{{.Name}}" if kind != "containers"
                                     else "{{.Names}}").stdout.split()
                for kind, cmd in (("containers", ("ps", "-a")), ("networks", ("network", "ls")),
                                  ("volumes", ("volume", "ls")))}

    def remove(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "--timeout", "5", check=False)
        for kind, names in self.leftovers().items():  # down failed half-way: by name
            if names:
                dockerd.docker(*(("rm", "-f") if kind == "containers" else (kind[:-1], "rm")), *names, check=False)


def test_images_build_and_the_stack_trains_the_example_job(engine, tmp_path):
    stages = dockerd.Stages("docker stack")
    with stages("build server image"):
        dockerd.build("server", dockerd.SERVER_IMAGE)
    with stages("build gpu-client image (CPU torch)"):
        dockerd.build_client_image()

    port, project = free_port(), f"zwdxtest{uuid.uuid4().hex[:10]}"
    url = f"http://127.0.0.1:{port}"
    stack = Stack(project, {**os.environ, "ZWDX_PORT": str(port), "ZWDX_SERVER_IMAGE": dockerd.SERVER_IMAGE,
                            "ZWDX_GPU_CLIENT_IMAGE": dockerd.CLIENT_IMAGE})
    client = None
    try:
        with stages("docker-compose up (to a healthy server)"):
            stack.compose("up", "-d", "--no-build")
            wait_until(lambda: _healthy(url), 120, interval=0.5,
                       what=f"the server of compose project {project}\n{stack.compose('logs', check=False).stdout}")

        with stages("room create (in the server container)"):
            made = stack.compose("exec", "-T", "server", "python", "-m", "zwdx.cli", "room", "create", "--server",
                                 "http://127.0.0.1:4461", "--name", "docker", "--json")
            room = json.loads(made.stdout.strip().splitlines()[-1])
            assert room["submitter_token"].startswith("zs_") and room["donor_token"].startswith("zd_")

        from zwdx import ZWDX
        sdk = ZWDX(url, remember=False)
        with stages("gpu client up (run_gpu_client.sh, in Docker)"):
            client_id = f"docker-{project}"
            env = {"ZWDX_GPU_CLIENT_IMAGE": dockerd.CLIENT_IMAGE}
            client = Proc([SCRIPT, "-rt", room["donor_token"], "-s", url, "--name", client_id, "--cpu",
                           "--threads", "1", "--client-id", client_id], str(tmp_path / "gpu-client.log"), env)
            wait_until(lambda: _online(sdk, room, client_id, client), 120, interval=0.5,
                       what=f"the GPU client in Docker\n{client.output()}")
            assert "gpu client in Docker" in client.output()

        with stages("example job (submit from the host, train, complete)"):
            result = sdk.submit_job(mnist.Net(), mnist.create_loader, mnist.train, mnist.test,
                                    torch.optim.AdamW(mnist.Net().parameters(), lr=3e-3), "DDP", 0,
                                    room_token=room["submitter_token"], epochs=2, world_size=1, progress=False)
            assert result["status"] == "completed", result
            assert [p["client_id"] for p in result["placement"]] == [client_id]

        with stages("weights downloaded"):
            trained = sdk.get_trained_model(result["job_id"], mnist.Net(), room_token=room["submitter_token"])
            assert mnist.held_out_accuracy(trained) > 0.6

        with stages("docker-compose down -v"):
            client.stop()
            stack.compose("down", "-v", "--timeout", "10")
            assert stack.leftovers() == {"containers": [], "networks": [], "volumes": []}
    finally:
        if client is not None:
            client.stop()
        dockerd.docker("rm", "-f", f"docker-{project}", check=False)
        stack.remove()
    print(stages)


def _healthy(url: str) -> bool:
    import requests
    try:
        return requests.get(f"{url}/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def _online(sdk, room, client_id: str, client: Proc) -> bool:
    if not client.alive():
        raise AssertionError(f"run_gpu_client.sh exited:\n{client.output()}")
    clients = sdk.get_room(room["submitter_token"])["clients"]
    return any(c["id"] == client_id and c["status"] == "online" for c in clients)
