"""What a user sees around a running job: when it ends, the metric series it always has, and the
package a GPU client lacks, named with the client and its host."""
from __future__ import annotations

import time

import psutil

import mnist
from procs import wait_until


def train_then_linger(model, loader, optimizer):
    """Done at once, but its process takes 20 s more to exit (an atexit hook, as some libraries
    register to flush their buffers)."""
    import atexit
    import os
    atexit.register(time.sleep, 20)
    return {"pid": os.getpid()}


def quick_train(model, loader):
    return {"loss": 0.0}


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_job_completes_while_its_rank_process_lingers_and_its_slot_waits_for_the_exit(sdk, room, start_client):
    start_client("a")
    first = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=train_then_linger,
                           room_token=room["token"], world_size=1, progress=False, timeout=120)
    assert first["status"] == "completed"
    rank = psutil.Process(first["results"]["pid"])
    assert _alive(rank), "the job should complete on its rank's report, not wait for the process to exit"

    second = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=quick_train,
                            room_token=room["token"], world_size=1, wait=False)
    while True:  # the slot stays the lingering process's until it is gone
        status = sdk.get_job(second)["status"]
        if status != "queued":
            assert not _alive(rank), f"the next job went {status} while the last one's rank process still ran"
            break
        time.sleep(0.2)
    assert sdk.wait(second, progress=False, timeout=120)["status"] == "completed"
    wait_until(lambda: all(s["job_id"] is None for c in sdk.get_room(room["token"])["clients"] for s in c["slots"]),
               30, what="the slot freed")
