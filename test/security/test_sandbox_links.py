"""Issue 29, C1: job code may run while the root GPU client still writes into its sandbox (ranks
load a streamed bundle, and run the model's ``__setstate__``, before the job's datasets are
shared). It replaced ``<sandbox>/data`` with a link to a folder of root's, and the agent created
folders, chmodded and linked files there: a root-owned file of the submitter's bytes in a 0700
root folder, made 0755. Replayed here with a real per-job user (``sandbox_rig``) against the
agent's own functions (``isolation.share``, ``datasets.share``): the link, a link swapped in
between the agent's check and its write, a hard link to a root file, a FIFO where it writes:
all refused, nothing written or chmodded outside the sandbox, the agent never blocked."""
from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import threading

import pytest
import torch

import needs
from gpu_client.agent import datasets
from gpu_client.agent.datasets import Provided
from procs import SLACK, GpuClient, Server, wait_until
from sandbox_rig import as_job, rig, root_secret_dir, untouched  # noqa: F401  (rig: a fixture)
import zwdx
from zwdx import ZWDX

pytestmark = pytest.mark.slow


def dataset(base: str) -> Provided:
    """A dataset in an agent's cache (root's, 0444), two files, one in a folder."""
    files = os.path.join(base, "cache", "files")
    os.makedirs(os.path.join(files, "sub"), 0o700)
    for rel, text in (("a.txt", "alpha"), ("sub/b.txt", "beta")):
        with open(os.path.join(files, rel), "w") as fh:
            fh.write(text)
        os.chmod(os.path.join(files, rel), 0o444)
    return Provided(name="ds", path=files, files=["a.txt", "sub/b.txt"], fetched=False, size=9)


def bundle(base: str) -> str:
    path = os.path.join(base, "bundle.part")
    with open(path, "wb") as fh:
        fh.write(b"the submitter's bytes")
    os.chmod(path, 0o600)
    return path


def test_job_code_that_swaps_data_for_a_link_makes_root_write_nothing_outside(rig):
    iso, base, boxes = rig
    target = root_secret_dir(base)
    box = iso.lease("c", "job-link", 0)
    boxes.append(box)
    iso.share(bundle(base), box)  # the bundle streams in; the ranks load it and run the job's code
    attack = as_job(box, f"""
import json, os, shutil
data, got = {str(box.dir)!r} + "/data", {{}}
for name, step in (("rmtree", lambda: shutil.rmtree(data)), ("symlink", lambda: os.symlink({target!r}, data)),
                   ("own_dir", lambda: os.mkdir(data))):
    try:
        step(); got[name] = "done"
    except OSError as exc:
        got[name] = type(exc).__name__
print(json.dumps(got))
""")
    got = json.loads(attack.stdout.strip().splitlines()[-1])
    try:
        datasets.share(iso, box, dataset(base))
    except PermissionError:
        pass  # refused: a link where the agent writes
    untouched(target)
    assert got["symlink"] == got["own_dir"] == "PermissionError", got  # the sandbox is not the job's to change
    data = os.path.join(str(box.dir), "data")
    assert not os.path.islink(data) and os.lstat(data).st_uid == 0
    # the ranks read their dataset, and change none of it
    check = as_job(box, f"""
import os
d = {data!r} + "/ds"
print(open(d + "/a.txt").read(), open(d + "/sub/b.txt").read())
for step in (lambda: open(d + "/a.txt", "a"), lambda: os.unlink(d + "/a.txt"), lambda: os.mkdir(d + "/x")):
    try:
        step(); print("changed")
    except OSError:
        pass
""")
    assert check.stdout.split() == ["alpha", "beta"], check.stdout + check.stderr


def test_job_code_racing_every_path_the_agent_writes_gets_nothing(rig):
    """Links, hard links and FIFOs put (as fast as the job can) where the agent writes, while it
    shares the bundle, the CA file and the datasets again and again."""
    iso, base, boxes = rig
    target = root_secret_dir(base)
    box = iso.lease("c", "job-race", 0)
    boxes.append(box)
    iso.share(bundle(base), box)
    stop = os.path.join(base, "stop")
    paths = [os.path.join(str(box.dir), rel) for rel in
             ("data", "data/ds", "data/ds/a.txt", "data/ds/sub", "bundle.zwdx", "ca.pem")]
    racer = as_job(box, f"""
import os, shutil, time
made, tries, end = 0, 0, time.time() + 20
print("racing", flush=True)
while not os.path.exists({stop!r}) and time.time() < end:
    for path in {paths!r}:
        for plant in (lambda p: os.symlink({target!r}, p), lambda p: os.link({target!r} + "/secret", p),
                      lambda p: os.mkfifo(p)):
            tries += 1
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                elif os.path.lexists(path):
                    os.unlink(path)
                plant(path)
                made += 1
            except OSError:
                pass
print(tries, made)
""", wait=False)
    ca = os.path.join(base, "ca.pem")
    with open(ca, "w") as fh:
        fh.write("-----BEGIN CERTIFICATE-----\n")
    provided = dataset(base)
    assert racer.stdout.readline().strip() == "racing", racer.stderr.read()
    try:
        worker = threading.Thread(target=lambda: [(iso.share(ca, box, "ca.pem", link=False), iso.share(
            os.path.join(base, "bundle.part"), box), datasets.share(iso, box, provided)) for _ in range(30)],
            daemon=True)
        worker.start()
        worker.join(60)
        assert not worker.is_alive(), "the agent blocked on something the job put where it writes (a FIFO?)"
    finally:
        open(stop, "w").close()
    out, err = racer.communicate(timeout=30)
    tries, made = (int(v) for v in out.split())
    assert tries > 0 and made == 0, f"the job put {made} of {tries} things where the agent writes\n{err}"
    untouched(target)
    assert stat.S_ISREG(os.lstat(os.path.join(str(box.dir), "ca.pem")).st_mode)


# -- the agent writes as if the job could reach those paths anyway (what a looser sandbox, a
# -- future layout or a bug would leave): planted by root here, as the job would have -----------------
def test_a_link_or_a_folder_of_the_job_where_datasets_go_is_refused(rig):
    iso, base, boxes = rig
    target = root_secret_dir(base)
    box = iso.lease("c", "job-planted", 0)
    boxes.append(box)
    data = os.path.join(str(box.dir), "data")
    os.symlink(target, data)
    os.lchown(data, box.uid, box.gid)
    with pytest.raises(PermissionError, match="not a folder"):
        datasets.share(iso, box, dataset(base))
    untouched(target)
    os.unlink(data)
    os.makedirs(os.path.join(data, "ds"))
    os.chown(os.path.join(data, "ds"), box.uid, box.gid)  # the job's own folder: the agent writes nothing into it
    with pytest.raises(PermissionError, match="not the GPU client's folder"):
        datasets.share(iso, box, dataset(os.path.join(base, "again")))
    assert os.listdir(os.path.join(data, "ds")) == []


def test_a_hard_link_to_a_root_file_or_a_fifo_where_a_file_goes_is_replaced_not_written(rig):
    iso, base, boxes = rig
    target = root_secret_dir(base)
    secret = os.path.join(target, "secret")
    box = iso.lease("c", "job-hard", 0)
    boxes.append(box)
    ca = os.path.join(base, "ca.pem")
    with open(ca, "w") as fh:
        fh.write("the CA\n")
    there = os.path.join(str(box.dir), "ca.pem")
    os.link(secret, there)  # where fs.protected_hardlinks is 0, a job may link any file of root's
    iso.share(ca, box, "ca.pem", link=False)
    assert open(there).read() == "the CA\n"
    os.unlink(there)
    os.mkfifo(there)
    worker = threading.Thread(target=iso.share, args=(ca, box, "ca.pem"), kwargs={"link": False}, daemon=True)
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), "the agent opened the FIFO the job left where the CA file goes"
    assert stat.S_ISREG(os.lstat(there).st_mode) and open(there).read() == "the CA\n"
    untouched(target)


@pytest.mark.parametrize("link", [True, False], ids=["hard-link", "copy"])
def test_a_link_swapped_in_between_the_agents_check_and_its_write_is_refused(rig, monkeypatch, link):
    """The job wins the race: right after the agent took the old name away, a link is there."""
    iso, base, boxes = rig
    target = root_secret_dir(base)
    box = iso.lease("c", f"job-swap-{link}", 0)
    boxes.append(box)
    source = bundle(base)
    iso.share(source, box, "bundle.zwdx", link=link)  # there already: the agent takes it away first
    real_unlink = os.unlink

    def unlink_then_race(path, *args, **kwargs):
        real_unlink(path, *args, **kwargs)
        fd = kwargs.get("dir_fd")
        os.symlink(os.path.join(target, "secret"), path, dir_fd=fd)
    monkeypatch.setattr(os, "unlink", unlink_then_race)
    with pytest.raises(PermissionError, match="appeared"):
        iso.share(source, box, "bundle.zwdx", link=link)
    monkeypatch.undo()
    untouched(target)


# -- the attack as it happened: a real GPU client as root, the model's __setstate__ -----------------------
class Trap(torch.nn.Module):
    """A model whose unpickling (in the rank, as the bundle streams in, before the job's datasets
    are shared) starts a process that keeps swapping ``<sandbox>/data`` for a link to ``target``."""

    def __init__(self, target: str):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        self.target = target

    def forward(self, x):
        return self.fc(x)

    def __setstate__(self, state):
        super().__setstate__(state)
        import os
        import time
        here = os.getcwd()  # the sandbox's home (before issue 29: the sandbox itself)
        box = here if os.path.exists(os.path.join(here, "bundle.zwdx")) else os.path.dirname(here)
        data = os.path.join(box, "data")
        if os.fork() == 0:  # a swapper that outlives the unpickling, bounded
            tries = done = 0
            end = time.time() + 3  # the agent shares the datasets within a second
            while time.time() < end and done == 0:
                tries += 1
                try:
                    if os.path.lexists(data) and not os.path.islink(data):
                        os.rename(data, f"{data}.{tries}")
                    os.symlink(self.target, data)
                    done += 1
                except OSError:
                    time.sleep(0.001)
            with open(os.path.join(here, "swapper"), "w") as fh:
                fh.write(f"{tries} {done}")
            os._exit(0)


def data_loader(rank, world_size, data_dir):
    import os
    from torch.utils.data import DataLoader, TensorDataset
    assert open(os.path.join(data_dir, "ds", "a.txt")).read() == "alpha"
    return DataLoader(TensorDataset(torch.randn(8, 2), torch.randint(0, 2, (8,))), batch_size=4)


def report(model, loader, optimizer):
    import os
    import time
    end = time.time() + 30
    while not os.path.exists("swapper") and time.time() < end:
        time.sleep(0.05)
    return {"final_loss": 0.0, "swapper": open("swapper").read() if os.path.exists("swapper") else "none"}


def test_a_models_setstate_on_a_real_gpu_client_gets_root_to_write_nothing_outside():
    needs.root("a GPU client runs each job as a user of its own only as root")
    base = tempfile.mkdtemp(prefix="zwdx-c1-", dir="/tmp")
    os.chmod(base, 0o755)
    target = root_secret_dir(base)
    folder = os.path.join(base, "ds")
    os.makedirs(folder)
    with open(os.path.join(folder, "a.txt"), "w") as fh:
        fh.write("alpha")
    server = Server(os.path.join(base, "server"))
    client = None
    try:
        sdk = ZWDX(server.url, remember=False)
        room = sdk.create_room("c1")
        sdk.room_token = room["token"]
        sdk.push_dataset(folder, "ds", progress=False)
        client = GpuClient(server.url, room["donor_token"], os.path.join(base, "work"), "donor-c1")
        wait_until(lambda: any(c["status"] == "online" for c in sdk.get_room()["clients"]), 60 + SLACK,
                   what=f"the GPU client online\n{client.tail()}")
        model = Trap(target)
        result = sdk.submit_job(model, data_loader, report, None, torch.optim.SGD(model.parameters(), lr=0.1), "DDP",
                                resources=zwdx.Resources(world_size=1),
                                run=zwdx.Run(progress=False, raise_on_failure=False, timeout=120, datasets=["ds"]))
        untouched(target)
        assert result["status"] == "completed", (result.get("reason"), result.get("failures"))
        tries, done = (int(v) for v in result["results"]["swapper"].split())
        assert tries > 0 and done == 0, result["results"]
    finally:
        if client is not None:
            client.stop()
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_a_rank_waiting_for_its_streamed_bundle_never_finds_it_unreadable(rig):
    """A streamed bundle is shared again and again as it arrives (unlinked, linked afresh); a
    rank polling for it finds it missing or readable, never the agent's 0600 file (EACCES failed
    the rank: CI saw ``PermissionError: .../bundle.zwdx``)."""
    iso, base, boxes = rig
    box = iso.lease("c", "job-stream", 0)
    boxes.append(box)
    path = os.path.join(str(box.dir), "bundle.zwdx")
    reader = as_job(box, f"""
import os, time
seen = {{"ok": 0, "missing": 0, "denied": 0}}
end = time.monotonic() + 4
while time.monotonic() < end:
    try:
        with open({path!r}, "rb") as fh:
            fh.read(1)
        seen["ok"] += 1
    except FileNotFoundError:
        seen["missing"] += 1
    except PermissionError:
        seen["denied"] += 1
print(seen)
""", wait=False)
    deadline = __import__("time").monotonic() + 3.5
    shares = 0
    while __import__("time").monotonic() < deadline:
        part = os.path.join(base, f"bundle.part{shares % 2}")  # a cache file as the agent writes one: 0600
        if os.path.exists(part):
            os.unlink(part)
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"x" * 4096)
        iso.share(part, box)  # while it is still being written, as a streamed bundle is
        os.close(fd)
        shares += 1
    out, err = reader.communicate(timeout=30)
    seen = eval(out.strip().splitlines()[-1])  # noqa: S307 (our own child's dict)
    assert seen["denied"] == 0 and seen["ok"] > 0, (seen, shares, err)
