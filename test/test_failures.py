"""Jobs whose code fails: every failing rank's traceback comes back, GPU clients stay up. The
tests that leave their GPU clients up share conftest's ``cluster``."""
from __future__ import annotations

import os
import time

import psutil
import pytest
import torch

import mnist
from procs import wait_until
from workloads import slow_train
import zwdx
from zwdx import JobFailed


def train_that_raises(model, loader, optimizer, rank):
    for x, y in loader:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        break
    raise ValueError(f"boom on rank {rank}")


def train_that_crashes(rank):
    if rank == 1:
        os._exit(3)  # the process dies without a word
    time.sleep(60)


def test_failing_train_func_returns_every_rank_traceback_and_clients_take_the_next_job(cluster):
    sdk, room, (a, b) = cluster.sdk, cluster.room, cluster.clients
    with pytest.raises(JobFailed) as info:
        sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=train_that_raises,
                       resources=zwdx.Resources(world_size=2), run=zwdx.Run(room_token=room["token"], progress=False))
    err = info.value
    assert err.job_id and "failed" in str(err)
    assert set(err.failures) == {"0", "1"}
    for rank, tb in err.failures.items():
        assert "Traceback" in tb and f"ValueError: boom on rank {rank}" in tb and "train_that_raises" in tb

    result = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=train_that_raises,
                            resources=zwdx.Resources(world_size=2),
                            run=zwdx.Run(room_token=room["token"], progress=False, raise_on_failure=False))
    assert result["status"] == "failed" and set(result["failures"]) == {"0", "1"}

    assert a.alive() and b.alive()
    ok = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=mnist.train,
                        optimizer=torch.optim.SGD(mnist.Net().parameters(), lr=0.05),
                        resources=zwdx.Resources(world_size=2), training=zwdx.Training(epochs=1),
                        run=zwdx.Run(room_token=room["token"], progress=False))
    assert ok["status"] == "completed"


def test_rank_process_that_dies_fails_the_job_quickly(cluster):
    sdk, room, (a, b) = cluster.sdk, cluster.room, cluster.clients
    result = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=train_that_crashes,
                            resources=zwdx.Resources(world_size=2),
                            run=zwdx.Run(room_token=room["token"], progress=False, raise_on_failure=False, timeout=60))
    assert result["status"] == "failed"
    assert "rank process died" in result["reason"] and "exit code 3" in result["reason"]
    assert a.alive() and b.alive()
    wait_until(lambda: all(s["job_id"] is None for c in sdk.get_room(room["token"])["clients"] for s in c["slots"]),
               10, what="the other rank stopped and every slot freed")


def quick_train(model, loader):
    return {"loss": 0.0, "pid": os.getpid()}


def slow_train_saying_its_pid(model, loader, optimizer, rank, world_size, epochs, reporter, device):
    reporter.log_metrics(pid=os.getpid())
    return slow_train(model, loader, optimizer, rank, world_size, epochs, reporter, device)


def _standbys(client) -> list:
    """The GPU client's standby rank processes; a child that exited and is not reaped yet (a
    zombie: its command line unreadable) or is gone meanwhile is none."""
    out = []
    for p in psutil.Process(client.pid).children():
        try:
            if "--standby" in p.cmdline():
                out.append(p)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            pass
    return out


def test_standby_rank_processes_wait_between_jobs_and_their_ranks_die_with_the_gpu_client(sdk, room, start_client):
    a = start_client("a")
    result = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=quick_train,
                            resources=zwdx.Resources(world_size=1),
                            run=zwdx.Run(room_token=room["token"], progress=False))
    assert result["status"] == "completed"
    # the job's rank process was the slot's standby; once it is gone, the slot gets a new one, which stays
    ran_in = result["results"]["pid"]
    wait_until(lambda: not psutil.pid_exists(ran_in) and len(_standbys(a)) == 1, 30,
               what="the job's rank process gone and a new standby on the slot")
    standby = _standbys(a)[0]
    # the next job runs in it (so it waited), and it dies with its GPU client, even with no peer to notice
    model = mnist.Net()
    job_id = sdk.submit_job(model=model, data_loader_func=mnist.create_loader, train_func=slow_train_saying_its_pid,
                            optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                            resources=zwdx.Resources(world_size=1), training=zwdx.Training(epochs=20),
                            run=zwdx.Run(room_token=room["token"], progress=False), wait=False)
    said = wait_until(lambda: sdk.get_job_metrics(job_id).get("pid"), 60, what="the job training")
    assert int(said[0]["value"]) == standby.pid, (said, standby.pid)  # the rank is the standby that waited
    a.kill()  # SIGKILL
    standby.wait(timeout=10)


USER_CODE = '''\
import torch.distributed as dist


def train(rank):
    if rank == 1:
        raise ValueError("rank 1 gives up")
    dist.barrier()  # rank 0 waits here for a peer that is gone
'''


def test_the_rank_whose_code_raised_comes_first_with_its_file_and_lines(sdk, room, start_client, tmp_path):
    import importlib
    import sys
    import uuid
    name = f"user_code_{uuid.uuid4().hex[:8]}"
    source = tmp_path / f"{name}.py"
    source.write_text(USER_CODE)
    sys.path.insert(0, str(tmp_path))
    try:
        train = importlib.import_module(name).train
        job_id = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=train,
                                resources=zwdx.Resources(world_size=2), run=zwdx.Run(room_token=room["token"]),
                                wait=False)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)
    source.unlink()  # the GPU clients have only what the bundle carries
    start_client.together("a", "b")
    with pytest.raises(JobFailed) as info:
        sdk.wait(job_id, progress=False, timeout=120)
    err, text = info.value, str(info.value)
    assert err.failure_order[0] == "1", err.failure_order  # the cause first
    assert text.index("--- rank 1 ---") < text.index("Traceback")
    assert f'File "{source}", line 6, in train' in err.failures["1"]
    assert 'raise ValueError("rank 1 gives up")' in err.failures["1"]
    assert "<dynamic-code>" not in text
    # rank 0, which lost its peer, tells too unless the job failed (and stopped it) first: the race's
    # two outcomes, and both orders of the reports, are driven in-process by the test after the next
    assert err.failure_order == ["1", "0"][:len(err.failures)] and set(err.failures) <= {"0", "1"}
    if "0" in err.failures:
        assert text.index("--- rank 1 ---") < text.index("--- rank 0 ---")
        assert f'File "{source}", line 7, in train' in err.failures["0"] and "dist.barrier()" in err.failures["0"]


@pytest.mark.parametrize("order", ["raised first", "lost peer first", "lost peer after the job failed",
                                   "lost peer never told"])
def test_the_rank_whose_code_raised_comes_first_whichever_report_the_server_hears_first(app, order):
    """The orders the real-process test above may see, each made to happen: the rank whose own
    code raised leads the failures, and the rank that lost its peer follows whenever it told."""
    from conftest import placed_ranks
    from zwdx.server.jobs import lifecycle
    room, (r0, r1), job = placed_ranks(app, order.replace(" ", "-"), 2)
    raised = {"status": "failed", "error": "ValueError: rank 1 gives up", "traceback": "Traceback: rank 1 gives up"}
    lost = {"status": "failed", "error": "RuntimeError: Connection closed by peer", "collective": True,
            "traceback": "Traceback: dist.barrier()"}

    def report(rank, body):
        return (r0 if rank == 0 else r1).post(f"/jobs/{job['id']}/ranks/{rank}", json=body)

    if order == "lost peer first":
        assert report(0, lost).json["ok"]
    assert report(1, raised).json["ok"]
    if order in ("lost peer after the job failed", "lost peer never told"):
        assert lifecycle.fail(app.extensions["zwdx"], job["id"], "rank 1 failed: ValueError: rank 1 gives up")
    if order in ("raised first", "lost peer after the job failed"):
        report(0, lost)  # a job that failed already keeps the traceback too
    seen = room.get(f"/jobs/{job['id']}").json
    told = order != "lost peer never told"
    assert seen["failure_order"] == (["1", "0"] if told else ["1"]), seen["failure_order"]
    assert seen["failure_info"]["1"]["kind"] == "raised"
    if told:
        assert seen["failure_info"]["0"]["kind"] == "collective" and "dist.barrier()" in seen["failures"]["0"]


def train_that_times_out_on_its_own(rank):
    import torch.distributed as dist
    if rank == 1:
        raise TimeoutError("timed out reading data")  # the user's own timeout, not a lost peer
    dist.barrier()  # rank 0 waits here for a peer that is gone: it lost its peer


def test_a_users_own_timeout_error_fails_the_job_as_raised_not_as_a_lost_peer(cluster):
    sdk, room = cluster.sdk, cluster.room
    result = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader,
                            train_func=train_that_times_out_on_its_own, resources=zwdx.Resources(world_size=2),
                            run=zwdx.Run(room_token=room["token"], progress=False, raise_on_failure=False, timeout=120))
    job = result["job"]
    assert result["status"] == "failed"
    assert "rank 1 failed: TimeoutError: timed out reading data" in result["reason"], result["reason"]
    assert job["failure_info"]["1"]["kind"] == "raised"
    assert result["failure_order"] == ["1", "0"][:len(result["failures"])]  # rank 0 tells, unless stopped first
    assert "TimeoutError: timed out reading data" in result["failures"]["1"]
    if "0" in job["failure_info"]:
        assert job["failure_info"]["0"]["kind"] == "collective"


def test_failure_order_puts_ranks_whose_code_raised_before_those_that_lost_their_peers():
    from zwdx.protocol.job import RankFailure, failure_order
    failures = {"0": RankFailure(traceback="...", at=10.0, kind="collective"),  # heard of first, but only a knock-on
                "1": RankFailure(traceback="...", at=12.0, kind="raised"),
                "2": RankFailure(traceback="...", at=11.0, kind="exited"),
                "3": RankFailure(traceback="...", at=11.5, kind="raised")}
    assert failure_order(failures) == ["3", "1", "0", "2"]
    unknown = {"1": RankFailure(traceback="..."), "0": RankFailure(traceback="...")}  # kept by an older zwdx
    assert failure_order(unknown) == ["0", "1"]  # no times known: by rank
