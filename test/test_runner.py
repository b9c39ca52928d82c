"""What a user sees around a running job: when it ends, the metric series it always has, and the
package a GPU client lacks, named with the client and its host."""
from __future__ import annotations

import hashlib
import signal
import socket
import sys
import time

import psutil
import pytest
import torch

import mnist
from procs import wait_until
from workloads import a_few_steps
import zwdx
from zwdx import JobFailed, defaults
from zwdx.bundle import pack
from zwdx.protocol import runtime_versions


def train_then_linger(model, loader, optimizer):
    """Done at once, but its process takes 10 s more to exit (an atexit hook, as some libraries
    register to flush their buffers): longer than the SDK takes to see the job completed and
    than the scheduler takes to place the next job on a slot it wrongly thought free."""
    import atexit
    import os
    atexit.register(time.sleep, 10)
    return {"pid": os.getpid()}


def quick_train(model, loader):
    return {"loss": 0.0}


def train_then_linger_on_rank_1(model, loader, rank):
    import atexit
    if rank == 1:
        atexit.register(time.sleep, 30)  # lingers after its job: what is tested
    return {"loss": 0.0}


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_job_completes_while_its_rank_process_lingers_and_its_slot_waits_for_the_exit(sdk, room, start_client):
    start_client("a")
    first = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=train_then_linger,
                           resources=zwdx.Resources(world_size=1),
                           run=zwdx.Run(room_token=room["token"], progress=False, timeout=120))
    assert first["status"] == "completed"
    rank = psutil.Process(first["results"]["pid"])
    assert _alive(rank), "the job should complete on its rank's report, not wait for the process to exit"

    second = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=quick_train,
                            resources=zwdx.Resources(world_size=1), run=zwdx.Run(room_token=room["token"]), wait=False)
    # the slot stays the lingering process's until it is gone
    status, lingering = wait_until(lambda: (s := sdk.get_job(second)["status"]) != "queued" and (s, _alive(rank)),
                                   60, 0.2, what="the next job placed once the lingering rank exited")
    assert not lingering, f"the next job went {status} while the last one's rank process still ran"
    assert sdk.wait(second, progress=False, timeout=120)["status"] == "completed"
    wait_until(lambda: all(s["job_id"] is None for c in sdk.get_room(room["token"])["clients"] for s in c["slots"]),
               30, what="the slot freed")


def test_a_completed_job_stays_completed_when_its_lingering_rank_dies_with_its_gpu_client(sdk, room, start_client):
    _, b = start_client.together("a", "b")
    result = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader,
                            train_func=train_then_linger_on_rank_1, resources=zwdx.Resources(world_size=2),
                            run=zwdx.Run(room_token=room["token"], progress=False, timeout=120))
    assert result["status"] == "completed"
    b.kill(signal.SIGKILL)  # rank 1 is still in its teardown there
    assert_startup_line_lists_every_stage(sdk.get_job_logs(result["job_id"]))
    wait_until(lambda: any(c["id"] == "client-b" and c.get("lost_at") for c in sdk.get_room(room["token"])["clients"]),
               30, what="gpu client b declared lost")
    job = sdk.get_job(result["job_id"])
    assert job["status"] == "completed" and not job.get("restarts") and not job.get("failures"), job
    assert [t["status"] for t in job["timeline"]][-1] == "completed"


#: The stages of a rank's start, in the order the rank's main thread passes them; the bundle is
#: fetched and loaded meanwhile, in another thread, before the user's data_loader_func runs.
MAIN_STAGES = ["rank_process", "met", "joined", "data_loader", "wrapped", "optimizer_checkpoint", "train_func"]


def assert_startup_line_lists_every_stage(logs: list[dict]) -> None:
    """Rank 0 says where its start went: one log line with every stage, in seconds after the
    job reached its GPU client, in the order they happened."""
    lines = [e["text"] for e in logs if e.get("rank") == 0 and e["text"].startswith("startup, ")]
    assert len(lines) == 1, logs
    marks = {k: float(v) for k, v in (p.split("=") for p in lines[0].split(": ", 1)[1].split())}
    assert set(marks) == set(MAIN_STAGES) | {"bundle_fetched", "bundle_loaded"}, lines[0]
    assert [marks[k] for k in MAIN_STAGES] == sorted(marks[k] for k in MAIN_STAGES), lines[0]
    assert marks["bundle_fetched"] <= marks["bundle_loaded"] <= marks["data_loader"], lines[0]


def test_metrics_always_have_the_platform_series_and_a_short_job_has_its_samples(sdk, room, start_client):
    start_client("a")
    model = mnist.Net()
    short = sdk.submit_job(model=model, data_loader_func=mnist.create_loader, train_func=a_few_steps,
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                           resources=zwdx.Resources(world_size=1),
                           run=zwdx.Run(room_token=room["token"], progress=False, timeout=120))
    metrics = sdk.get_job_metrics(short["job_id"])
    assert metrics["gpu_utilization"] == []  # a CPU slot has no GPU to sample
    assert len(metrics["throughput"]) >= 2, metrics["throughput"]  # after the first step, and at the end
    assert all(p["value"] > 0 and p["rank"] == 0 for p in metrics["throughput"])

    idle = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=quick_train,
                          resources=zwdx.Resources(world_size=1),
                          run=zwdx.Run(room_token=room["token"], progress=False, timeout=120))
    assert sdk.get_job_metrics(idle["job_id"]) == {"throughput": [], "gpu_utilization": []}  # nothing to sample


def _submit_as_is(sdk, token: str, train_func) -> str:
    """Submit without the SDK's own checks (an older SDK): the bundle meets the GPU client as it is."""
    blob = pack(mnist.Net(), mnist.create_loader, train_func)
    artifact = sdk._json("POST", "/artifacts", token, data=blob,
                         headers={defaults.SHA256_HEADER: hashlib.sha256(blob).hexdigest()})
    return sdk._json("POST", "/jobs", token, json={"bundle_artifact": artifact["id"], "world_size": 1,
                                                   "versions": runtime_versions()})["id"]


def test_a_package_missing_on_the_gpu_client_is_named_with_the_client_and_its_host(sdk, room, start_client,
                                                                                   tmp_path):
    site = tmp_path / "site-packages"  # looks installed: the bundle refers to it by name
    (site / "zwdx_absent_pkg").mkdir(parents=True)
    (site / "zwdx_absent_pkg" / "__init__.py").write_text("def scale(x):\n    return 2 * x\n")
    sys.path.insert(0, str(site))
    try:
        import zwdx_absent_pkg
        start_client("a")

        def train_with_it(model, loader):
            return {"loss": zwdx_absent_pkg.scale(0.5)}
        job_id = _submit_as_is(sdk, room["token"], train_with_it)  # unpickling its bundle imports the package
        with pytest.raises(JobFailed) as info:
            sdk.wait(job_id, room_token=room["token"], progress=False, timeout=120)
        where = f"gpu client client-a on host {socket.gethostname()}"
        assert f"{where} lacks package 'zwdx_absent_pkg'" in info.value.reason

        def train_importing_it(model, loader):
            import importlib
            importlib.import_module("zwdx_absent_pkg")  # as the train function runs: no check can see it
        with pytest.raises(JobFailed) as info:
            sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=train_importing_it,
                           resources=zwdx.Resources(world_size=1),
                           run=zwdx.Run(room_token=room["token"], progress=False, timeout=120))
        assert f"{where} lacks package 'zwdx_absent_pkg'" in info.value.reason
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("zwdx_absent_pkg", None)


def test_a_rank_has_no_secret_in_its_environment_or_command_line(sdk, room, start_client):
    token, donor = room["token"], room["donor_token"]
    start_client("a", env={"ZWDX_ROOM_TOKEN": donor})  # as run_gpu_client.sh starts one: the token in its env

    def train_looking_around(model, loader):
        import os
        with open("/proc/self/cmdline", "rb") as fh:
            cmdline = fh.read().decode(errors="replace")
        return {"zwdx_variables": sorted(k for k in os.environ if k.startswith("ZWDX_")),
                "secrets": sorted(k for k, v in os.environ.items() if token in v or donor in v or "rk_" in v
                                  or "zc_" in v),
                "in_cmdline": token in cmdline or donor in cmdline or "rk_" in cmdline,
                "torch": [os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")],
                "allocator": os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    result = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=train_looking_around,
                            resources=zwdx.Resources(world_size=1),
                            run=zwdx.Run(room_token=token, progress=False, timeout=120))
    seen = result["results"]
    assert seen["secrets"] == [] and seen["in_cmdline"] is False
    # no ZWDX_* variable of zwdx's own for the rank: only what the GPU client's environment had
    # (the test's, and the isolation procs.py pins), never its token
    import os

    from procs import PROCESSES
    from gpu_client.rank import tuning
    given = {k for k in (*os.environ, *PROCESSES) if k.startswith("ZWDX_")} - {"ZWDX_ROOM_TOKEN"}
    given |= set(tuning.VARIABLES.values())  # the donor's switches (AgentConfig.tuning), handed on: no secret
    assert set(seen["zwdx_variables"]) <= given
    assert seen["torch"] == ["0", "1", "0"]  # torch's variables, for libraries that read them
    assert "pinned_use_cuda_host_register:True" in seen["allocator"]  # a checkpoint's pinning off the training thread


def test_the_allocator_setting_a_rank_gets_keeps_the_donors_own():
    from gpu_client.agent.launcher import pinning_environ
    added = pinning_environ({})["PYTORCH_CUDA_ALLOC_CONF"].split(",")
    assert added[0] == "pinned_use_cuda_host_register:True" and added[1].startswith("pinned_num_register_threads:")
    assert pinning_environ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})["PYTORCH_CUDA_ALLOC_CONF"] \
        .startswith("expandable_segments:True,pinned_use_cuda_host_register:True,")
    # PyTorch reads PYTORCH_ALLOC_CONF first: the setting goes there when it is set
    both = pinning_environ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128", "PYTORCH_CUDA_ALLOC_CONF": "x:1"})
    assert list(both) == ["PYTORCH_ALLOC_CONF"] and both["PYTORCH_ALLOC_CONF"].startswith("max_split_size_mb:128,")
    # a donor who chose the pinning themselves keeps their choice
    assert pinning_environ({"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False"}) == {}
