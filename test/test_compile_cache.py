"""Issue 30 item 3: torch.compile in an SDK job on a default donor (root, standby rank processes,
a per-job user). The standby imported torch as root, which fixed Inductor's cache at
/tmp/torchinductor_root (``TORCHINDUCTOR_CACHE_DIR``, and the path ``torch._dynamo.package``
computed as it loaded); once it became the job's user, compiling failed with PermissionError.
Now the caches go to the job's sandbox, or with ``--compile-cache DIR`` to its room's folder
there, kept for that room's next job and given to no other room."""
from __future__ import annotations

import glob
import os
import shutil
import stat
import tempfile

import pytest
import torch

from procs import SLACK, wait_until
from gpu_client.sandbox.compile_cache import RoomCaches
from gpu_client.sandbox.isolation import SYSTEM_RANK_DIR
import zwdx
from zwdx import ZWDX

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="per-job users (the default as root) need root")


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        return torch.relu(self.fc(x))


def loader(rank, world_size):
    from torch.utils.data import DataLoader, TensorDataset
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)),
                      batch_size=4)


def train(model, loader, optimizer):
    """Compiles the model, trains a pass, and says where the compile caches went."""
    import os
    import time

    import torch
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    compiled = torch.compile(model)
    started = time.time()
    for x, y in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        optimizer.step()
    inductor = cache_dir()
    written = sorted(os.path.relpath(os.path.join(d, f), inductor) for d, _, fs in os.walk(inductor) for f in fs)
    from torch._dynamo import package
    from torch._dynamo.utils import counters
    return {"final_loss": float(loss), "compile_s": time.time() - started, "cache_dir": inductor,
            "files": len(written), "dynamo_cache": package.DynamoCache.path_prefix(), "uid": os.getuid(),
            "triton": os.environ.get("TRITON_CACHE_DIR"), "hits": counters["inductor"]["fxgraph_cache_hit"]}


def standby_ready(work_dir) -> bool:
    from gpu_client.rank.standby import READY
    return any(READY in open(p).read() for p in glob.glob(os.path.join(work_dir, "**", "standby", "slot0.log"),
                                                           recursive=True))


def run_compiled(sdk: ZWDX, client, work_dir) -> tuple[str, dict]:
    """A job that compiles, handed to the client's standby rank process (waited for): its id and results."""
    wait_until(lambda: standby_ready(work_dir), 60 + SLACK, what=f"the standby rank process\n{client.output()}")
    result = sdk.submit_job(Tiny(), loader, train, None, torch.optim.SGD(Tiny().parameters(), lr=0.1), "DDP",
                            resources=zwdx.Resources(world_size=1),
                            run=zwdx.Run(progress=False, timeout=240 + SLACK), memory_required=0)
    assert result["status"] == "completed", (result.get("error"), [line["text"] for line in
                                                                   sdk.get_job_logs(result["job_id"])][-30:])
    return result["job_id"], result["results"]


@pytest.mark.slow
@pytest.mark.parametrize("isolation", ["user", "process"])
def test_torch_compile_in_a_standby_rank_caches_in_the_jobs_sandbox(start_client, server, room, tmp_path, isolation):
    """user: the default as root, where it failed; process: it compiled into /tmp/torchinductor_root,
    which every job of every room on the machine shares."""
    client = start_client("compile", env={"ZWDX_ISOLATION": isolation})
    sdk = ZWDX(server.url, room_token=room["token"])
    job_id, out = run_compiled(sdk, client, tmp_path / "compile")
    assert (out["uid"] != 0) == (isolation == "user")
    assert out["files"] > 0, out  # it compiled, and wrote its kernels where it said
    ranks = SYSTEM_RANK_DIR if isolation == "user" else str(tmp_path / "compile" / "ranks")
    sandbox = os.path.join(ranks, "client-compile", f"{job_id}.0")
    for key in ("cache_dir", "dynamo_cache", "triton"):
        assert (out[key] or "").startswith(sandbox + "/"), (key, out)
    print(f"compile of a Linear+ReLU and its backward, first pass: {out['compile_s']:.1f} s")


@pytest.mark.slow
def test_a_rooms_compile_cache_serves_its_next_job_and_is_the_agents_between_jobs(start_client, server, room,
                                                                                   tmp_path):
    cache = tempfile.mkdtemp(prefix="zwdx-compile-cache-", dir="/tmp")
    os.chmod(cache, 0o711)  # per-job users pass it
    try:
        client = start_client("kept", extra=["--compile-cache", cache])
        sdk = ZWDX(server.url, room_token=room["token"])
        ran = [run_compiled(sdk, client, tmp_path / "kept")[1] for _ in range(2)]
        folder = os.path.join(cache, f"room-{room['id']}")
        assert ran[0]["cache_dir"] == os.path.join(folder, "inductor"), ran[0]
        assert ran[0]["files"] > 0 and ran[0]["uid"] != ran[1]["uid"] != 0
        assert ran[1]["hits"] > 0 and ran[0]["hits"] == 0, ran  # the second job's graphs came from the first's
        # between jobs: all of it the agent's, shut to every job's user (given back once the ranks are gone)
        wait_until(lambda: not not_the_agents(folder), 30,
                   what=f"the room's compile cache given back: {not_the_agents(folder)[:5]}\n{client.tail()}")
        print(f"compile of a Linear+ReLU and its backward: {ran[0]['compile_s']:.1f} s, again from the room's "
              f"cache {ran[1]['compile_s']:.1f} s")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def not_the_agents(folder: str) -> list[str]:
    """What in ``folder`` is not the agent's alone (root's, no group or other access)."""
    paths = [folder, *(os.path.join(d, n) for d, ds, fs in os.walk(folder) for n in ds + fs)]
    return [p for p in paths if os.lstat(p).st_uid != 0 or stat.S_IMODE(os.lstat(p).st_mode) & 0o077]


# -- the room's folder, lent and given back (no processes) ------------------------------------------------
UID = 2_000_065_000  # in the default range of per-job users, with no passwd entry


def test_what_a_job_left_in_its_rooms_compile_cache_is_cleaned_when_given_back(tmp_path):
    caches = RoomCaches(str(tmp_path / "cc"))
    caches.check(other_users=False)
    lent = caches.lend("room-a", UID)
    assert os.stat(lent.path).st_uid == UID and caches.lend("room-a", UID + 1) is None  # one job at a time
    other = caches.lend("room-b", UID + 1)
    assert other.path != lent.path and stat.S_IMODE(os.stat(other.path).st_mode) == 0o700
    # what the job's user made there: a kernel, and what would follow it out of the folder
    os.makedirs(os.path.join(lent.path, "inductor", "ab"))
    kernel = os.path.join(lent.path, "inductor", "ab", "kernel.so")
    open(kernel, "w").close()
    os.chmod(kernel, 0o4777)
    outside = tmp_path / "outside"
    outside.write_text("not the job's")
    os.link(outside, os.path.join(lent.path, "inductor", "hard"))
    os.symlink("/etc", os.path.join(lent.path, "inductor", "ab", "etc"))
    os.mkfifo(os.path.join(lent.path, "fifo"))
    for d, ds, fs in os.walk(lent.path):
        for n in [*ds, *fs]:
            if n != "hard":  # a hard link to a file the user may write, not its own
                os.chown(os.path.join(d, n), UID, UID, follow_symlinks=False)
    os.chmod(outside, 0o666)
    caches.shut(lent)
    assert os.stat(lent.path).st_uid == 0
    caches.give_back(lent)
    left = sorted(os.path.relpath(os.path.join(d, n), lent.path) for d, ds, fs in os.walk(lent.path) for n in ds + fs)
    assert left == ["inductor", "inductor/ab", "inductor/ab/kernel.so"]
    st = os.stat(kernel)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, os.getegid(), 0o700)
    st = os.stat(outside)  # untouched: not the agent's to hand to the room's next job
    assert (outside.read_text(), st.st_uid, stat.S_IMODE(st.st_mode), st.st_nlink) == ("not the job's", 0, 0o666, 1)
    again = caches.lend("room-a", UID + 2)  # the room's next job: its user's, the kernel kept
    assert os.stat(kernel).st_uid == UID + 2 and os.stat(os.path.dirname(kernel)).st_uid == UID + 2
    caches.give_back(again)
    caches.give_back(other)


def test_a_rooms_folder_a_killed_agent_left_lent_is_emptied_before_it_is_lent_again(tmp_path):
    caches = RoomCaches(str(tmp_path / "cc"))
    caches.check(other_users=False)
    lent = caches.lend("room-a", UID)
    open(os.path.join(lent.path, "kernel.so"), "w").close()
    os.close(lent.lock)  # the agent died with it lent: the folder still the job's user's (who may serve another room)
    RoomCaches(str(tmp_path / "cc")).check(other_users=False)  # an agent of this folder starts
    assert os.listdir(lent.path) == [] and os.stat(lent.path).st_uid == 0
    os.chown(lent.path, UID, UID)  # or none started: the room's next job finds it so
    open(os.path.join(lent.path, "kernel.so"), "w").close()
    again = caches.lend("room-a", UID + 1)
    assert os.listdir(again.path) == [] and os.stat(again.path).st_uid == UID + 1
    caches.give_back(again)


def test_a_compile_cache_folder_the_jobs_users_cannot_reach_or_not_the_agents_is_refused_at_start(tmp_path):
    from gpu_client.sandbox.isolation import IsolationError
    os.chmod(tmp_path, 0o700)
    with pytest.raises(IsolationError, match="the jobs. users cannot reach it.*chmod o\\+x /"):
        RoomCaches(str(tmp_path / "cc")).check(other_users=True)  # per-job users could not pass tmp_path
    RoomCaches(str(tmp_path / "cc")).check(other_users=False)     # the same user: fine
    os.symlink(tmp_path / "cc", tmp_path / "link")
    with pytest.raises(IsolationError, match="not a link nor another user's"):
        RoomCaches(str(tmp_path / "link")).check(other_users=False)
