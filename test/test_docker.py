"""The Docker stack for real: a Docker engine, both images built from this checkout, the compose
stack up with its ``cpu`` and ``tls`` profiles (MongoDB, the server, the profile's room and
GPU client, Caddy in front) until every service's healthcheck passes. Then the operator's path:
a room made inside the server's container, a GPU client started by gpu_client/run_gpu_client.sh
in its container, the example job submitted from the host through the SDK, trained, its weights
downloaded; and the README's path: the profile room's token read from its volume, the same job
through the TLS proxy (trusting Caddy's local CA) on the profile's GPU client. Then
``docker-compose down -v``. Every stage is timed and printed (``-s`` shows them).

Where no engine answers, ``dockerd.Engine`` starts one with ../shared/docker-sandbox (which
also builds stand-ins for the registry's base images: Docker Hub is unreachable here; Caddy's
is built by dockerd.caddy_image). The engine is stopped again only if this test started it;
everything the test made (containers, networks, volumes: one compose project of its own) is
removed even when it fails. Without an engine the test is skipped, and fails under CI (needs.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest
import torch

import dockerd
import zwdx
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

    def healthy(self, services: set[str]) -> bool:
        """Whether each of ``services`` runs and its healthcheck passes."""
        ids = self.compose("ps", "-q", check=False).stdout.split()
        if not ids:
            return False
        states = json.loads(dockerd.docker("inspect", *ids).stdout)
        health = {c["Config"]["Labels"]["com.docker.compose.service"]: c["State"].get("Health", {}).get("Status")
                  for c in states}
        return all(health.get(name) == "healthy" for name in services)

    def logs(self) -> str:
        return self.compose("--profile", "cpu", "--profile", "tls", "logs", "--tail", "30", check=False).stdout

    def remove(self) -> None:
        self.compose("--profile", "cpu", "--profile", "tls", "down", "-v", "--remove-orphans", "--timeout", "5",
                     check=False)
        for kind, names in self.leftovers().items():  # down failed half-way: by name
            if names:
                dockerd.docker(*(("rm", "-f") if kind == "containers" else (kind[:-1], "rm")), *names, check=False)


def test_images_build_and_the_stack_trains_the_example_job(engine, tmp_path, monkeypatch):
    stages = dockerd.Stages("docker stack")
    with stages("build server image"):
        dockerd.build("server", dockerd.SERVER_IMAGE)
    with stages("build gpu-client image (CPU torch)"):
        dockerd.build_client_image()
    with stages("caddy image (a stand-in where missing)"):
        dockerd.caddy_image(str(tmp_path / "caddy"))

    port, https_port, http_port = free_port(), free_port(), free_port()
    project = f"zwdxtest{uuid.uuid4().hex[:10]}"
    url = f"http://127.0.0.1:{port}"
    stack = Stack(project, {**os.environ, "ZWDX_BIND": "127.0.0.1", "ZWDX_PORT": str(port),
                            "ZWDX_HTTPS_PORT": str(https_port), "ZWDX_HTTP_PORT": str(http_port),
                            "ZWDX_PROXY_HOPS": "1", "ZWDX_SERVER_IMAGE": dockerd.SERVER_IMAGE,
                            "ZWDX_GPU_CLIENT_IMAGE": dockerd.CLIENT_IMAGE})
    client = None
    try:
        with stages("docker-compose --profile cpu --profile tls up (every service healthy)"):
            stack.compose("--profile", "cpu", "--profile", "tls", "up", "-d", "--no-build")
            wait_until(lambda: stack.healthy({"mongo", "server", "cpu-client", "proxy"}), 180, interval=1,
                       what=f"every service of compose project {project} healthy\n{stack.logs()}")

        # -- the operator's path: a room by hand, a GPU client from run_gpu_client.sh, plain HTTP
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
            wait_until(lambda: _online(sdk, room["submitter_token"], client_id, client), 120, interval=0.5,
                       what=f"the GPU client in Docker\n{client.output()}")
            assert "gpu client in Docker" in client.output()

        with stages("example job (submit from the host, train, complete)"):
            result = _train(sdk, room["submitter_token"])
            assert [p["client_id"] for p in result["placement"]] == [client_id]

        with stages("weights downloaded"):
            trained = sdk.get_trained_model(result["job_id"], mnist.Net(), room_token=room["submitter_token"])
            assert mnist.held_out_accuracy(trained) > 0.6

        # -- the README's path: the profile's room and GPU client, through the TLS proxy
        with stages("the profile's room, over HTTPS (Caddy's local CA)"):
            token = stack.compose("run", "--rm", "--no-deps", "--entrypoint", "cat", "room",
                                  "/room/submitter_token").stdout.strip()
            assert token.startswith("zs_")
            ca = tmp_path / "caddy-root.crt"
            ca.write_text(stack.compose("exec", "-T", "proxy", "cat",
                                        "/data/caddy/pki/authorities/local/root.crt").stdout)
            monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(ca))
            over_tls = ZWDX(f"https://localhost:{https_port}", remember=False)
            clients = over_tls.get_room(token)["clients"]
            assert [c["status"] for c in clients] == ["online"], clients  # the cpu-client service
            result = _train(over_tls, token)
            trained = over_tls.get_trained_model(result["job_id"], mnist.Net(), room_token=token)
            assert mnist.held_out_accuracy(trained) > 0.6

        with stages("docker-compose down -v"):
            client.stop()
            stack.compose("--profile", "cpu", "--profile", "tls", "down", "-v", "--timeout", "10")
            assert stack.leftovers() == {"containers": [], "networks": [], "volumes": []}
    finally:
        if client is not None:
            client.stop()
        dockerd.docker("rm", "-f", f"docker-{project}", check=False)
        stack.remove()
    print(stages)


def _train(sdk, token: str) -> dict:
    result = sdk.submit_job(mnist.Net(), mnist.create_loader, mnist.train, mnist.test,
                            torch.optim.AdamW(mnist.Net().parameters(), lr=3e-3), "DDP", 0,
                            resources=zwdx.Resources(world_size=1), training=zwdx.Training(epochs=2),
                            run=zwdx.Run(room_token=token, progress=False))
    assert result["status"] == "completed", result
    return result


def _healthy(url: str) -> bool:
    import requests
    try:
        return requests.get(f"{url}/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def _online(sdk, token: str, client_id: str, client: Proc) -> bool:
    if not client.alive():
        raise AssertionError(f"run_gpu_client.sh exited:\n{client.output()}")
    clients = sdk.get_room(token)["clients"]
    return any(c["id"] == client_id and c["status"] == "online" for c in clients)
