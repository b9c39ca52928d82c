"""Script jobs (``zwdx run``), in-process and quick: what the edge refuses, working dirs found by
their sha256 and kept while a job names them, outputs, placement by ``gpus_per_client``, the
working dir as it is packed (``zwdx.workdir``), and the environment a rank's script gets.
test_scripts_e2e.py runs scripts on real GPU-client processes."""
from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import tarfile
import time

import pytest

from conftest import placed_job
from zwdx import defaults
from zwdx.errors import BadRequest
from zwdx.protocol.job import JobSpec
from zwdx.protocol.rank import RankSpec
from zwdx.protocol.script import TORCHRUN_VARIABLES
from zwdx.server.placement import plan, unschedulable
from zwdx.workdir import list_files, pack

PY = {"python": platform.python_version()}


def put_workdir(api, data: bytes = b"a working dir's bytes", **kwargs):
    return api.put(f"/workdirs/{hashlib.sha256(data).hexdigest()}", data=data, **kwargs)


def script_job(workdir_id: str, **fields) -> dict:
    return {"kind": "script", "bundle_artifact": workdir_id, "versions": PY, "world_size": 2,
            "script": {"path": "train.py", "args": ["--lr", "3e-4"], "env": {"SEED": "1"}}, **fields}


# -- the edge ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, field, words", [
    ({"world_size": None}, "world_size", "--nproc"),
    ({"script": None}, "script", "needs its script"),
    ({"kind": "function"}, "script", "only a job of kind"),
    ({"script": {"path": "/etc/passwd"}}, "script.path", "not absolute"),
    ({"script": {"path": "../up.py"}}, "script.path", "inside the working dir"),
    ({"script": {"path": "-c"}}, "script.path", "option"),
    ({"script": {"path": "t.py", "args": ["--lr", 3]}}, "script.args.1", "must be str"),
    ({"script": {"path": "t.py", "args": ["x"] * 1001}}, "script.args", "at most 1000"),
    ({"script": {"path": "t.py", "args": ["a\x00b"]}}, "script.args.0", "must match"),
    ({"script": {"path": "t.py", "env": {"RANK": "3"}}}, "script.env", "must not set RANK"),
    ({"script": {"path": "t.py", "env": {"ZWDX_OUTPUT_DIR": "/"}}}, "script.env", "ZWDX_OUTPUT_DIR"),
    ({"script": {"path": "t.py", "env": {"TORCHELASTIC_RUN_ID": "x"}}}, "script.env", "TORCHELASTIC_RUN_ID"),
    ({"script": {"path": "t.py", "env": {"lower": "x"}}}, "script.env.lower", "must match"),
    ({"gpus_per_client": 3}, "gpus_per_client", "must divide world_size (2)"),
])
def test_a_bad_script_job_is_refused_naming_the_field_and_nothing_is_stored(api, fields, field, words):
    workdir = put_workdir(api).json
    resp = api.post("/jobs", json={k: v for k, v in script_job(workdir["id"], **fields).items() if v is not None})
    assert resp.status_code == 400, resp.text
    assert resp.json["error"]["field"] == field and words in resp.json["error"]["message"], resp.json
    assert api.jobs() == []
    assert api.get(f"/workdirs/{workdir['sha256']}").json == workdir  # the room's working dir, untouched


def test_a_working_dir_is_uploaded_once_and_found_by_its_sha256(api, room_api):
    sha = hashlib.sha256(b"a working dir's bytes").hexdigest()
    assert api.get(f"/workdirs/{sha}").status_code == 404
    first = put_workdir(api)
    assert first.status_code == 201 and first.json["kind"] == "workdir" and first.json["sha256"] == sha
    used = api.get("/room").json["usage"]["artifact_bytes"]
    again = put_workdir(api)
    assert again.status_code == 200 and again.json["id"] == first.json["id"]
    assert api.get(f"/workdirs/{sha}").json["id"] == first.json["id"]
    assert api.get("/room").json["usage"]["artifact_bytes"] == used  # kept once
    assert room_api("other").get(f"/workdirs/{sha}").status_code == 404  # another room's is not this one's


def test_a_working_dir_whose_bytes_are_not_its_name_is_refused_and_nothing_kept(api):
    name = hashlib.sha256(b"what was announced").hexdigest()
    resp = api.put(f"/workdirs/{name}", data=b"what came")
    assert resp.status_code == 422 and resp.json["error"]["code"] == "integrity_error"
    other = hashlib.sha256(b"x").hexdigest()
    resp = api.put(f"/workdirs/{name}", data=b"what was announced", headers={defaults.SHA256_HEADER: other})
    assert resp.status_code == 400 and resp.json["error"]["field"] == defaults.SHA256_HEADER
    assert api.put("/workdirs/NOT-A-DIGEST", data=b"x").json["error"]["field"] == "digest"
    assert api.get(f"/workdirs/{name}").status_code == 404
    assert api.get("/room").json["usage"]["artifact_bytes"] == 0


def test_jobs_of_a_room_share_its_working_dir_and_each_kind_names_its_own(api):
    workdir = put_workdir(api).json
    one, two = (api.post("/jobs", json=script_job(workdir["id"])) for _ in range(2))
    assert one.status_code == two.status_code == 201, (one.text, two.text)
    assert one.json["spec"]["kind"] == "script" and one.json["spec"]["strategy"]["args"] == ["--lr", "3e-4"]
    assert one.json["spec"]["code"]["bundle_artifact"] == two.json["spec"]["code"]["bundle_artifact"] == workdir["id"]
    bundle = api.upload()
    wrong = api.post("/jobs", json=script_job(bundle["id"]))
    assert wrong.status_code == 400 and "no uploaded working dir" in wrong.json["error"]["message"]
    wrong = api.post("/jobs", json={"bundle_artifact": workdir["id"], "versions": PY})
    assert wrong.status_code == 400 and "no uploaded bundle" in wrong.json["error"]["message"]
    assert len(api.jobs()) == 2


def test_an_unschedulable_script_job_refused_keeps_the_rooms_working_dir(api):
    workdir = put_workdir(api).json
    resp = api.post("/jobs", json=script_job(workdir["id"], fail_if_unschedulable=True))
    assert resp.status_code == 409
    assert api.get(f"/workdirs/{workdir['sha256']}").status_code == 200  # other jobs of the room may run it


def test_rank_0_uploads_the_outputs_and_the_submitter_reads_them(app):
    room, rank0, job = placed_job(app, "outputs")
    missing = room.get(f"/jobs/{job['id']}/outputs")
    assert missing.status_code == 404 and "has no outputs" in missing.json["error"]["message"]
    assert rank0.put(f"/jobs/{job['id']}/outputs", data=b"attempt 0's tar").status_code == 201
    assert rank0.put(f"/jobs/{job['id']}/outputs", data=b"the last tar").status_code == 201
    got = room.get(f"/jobs/{job['id']}/outputs")
    assert got.status_code == 200 and got.data == b"the last tar"
    assert got.headers[defaults.SHA256_HEADER] == hashlib.sha256(b"the last tar").hexdigest()
    assert room.get(f"/jobs/{job['id']}").json["outputs_artifact"]


def test_a_rooms_working_dirs_stay_while_a_job_names_them_or_they_were_used_lately(app, api):
    ctx = app.extensions["zwdx"]
    named = put_workdir(api, b"named by a job").json
    assert api.post("/jobs", json=script_job(named["id"])).status_code == 201
    unused = put_workdir(api, b"never run").json
    later = time.time() + defaults.UNATTACHED_GRACE + 10
    assert ctx.sweeper.sweep(later) == {"unattached": 1}
    assert ctx.store.get_artifact(unused["id"]) is None and ctx.artifacts.stored(later) == [named["id"]]
    assert api.get(f"/workdirs/{named['sha256']}").status_code == 200


# -- the job's moves ----------------------------------------------------------------------------------
def test_a_script_that_exited_badly_fails_the_job_with_its_words_once_every_rank_exited(app):
    from zwdx.server.jobs import Job
    room, rank0, job = placed_job(app, "exits")
    resp = rank0.post(f"/jobs/{job['id']}/ranks/0", json={
        "status": "failed", "error": "script train.py exited with code 1", "traceback": "ValueError: boom",
        "exit_code": 1})
    assert resp.status_code == 200, resp.text
    record = app.extensions["zwdx"].store.get_job(job["id"])
    assert record.suspect_since is not None and record.failures["0"].kind.value == "exited"
    handle = Job(app.extensions["zwdx"].store, record)
    assert handle.overdue(set(), 8.0, 25.0) is None  # a GPU client may yet turn out lost: it would resume
    handle.ranks_exited({"0": 1})
    assert handle.overdue(set(), 8.0, 25.0) == "rank 0 failed: script train.py exited with code 1"


# -- placement ----------------------------------------------------------------------------------------
def _room(*slots_per_client: int) -> tuple[list[dict], dict]:
    clients, slots = {}, []
    for i, n in enumerate(slots_per_client):
        cid = f"c{i}"
        clients[cid] = {"id": cid, "status": "online", "versions": {"python": "3.9.1"}, "hostname": cid,
                        "slots": [{"id": f"{cid}:{j}", "client_id": cid, "index": j, "kind": "cuda",
                                   "memory_total": 80, "memory_free": 80} for j in range(n)]}
        slots += clients[cid]["slots"]
    return slots, clients


def test_gpus_per_client_places_whole_groups_and_a_script_runs_on_any_python():
    slots, clients = _room(1, 3, 2, 2)
    spec = {"kind": "script", "versions": PY, "world_size": 4, "gpus_per_client": 2}
    chosen, reason = plan({"spec": spec}, slots, clients)
    assert reason == "" and [(s["client_id"], s["index"]) for s in chosen] == [("c1", 0), ("c1", 1), ("c2", 0),
                                                                               ("c2", 1)]
    chosen, reason = plan({"spec": {**spec, "world_size": 8}}, slots, clients)
    assert chosen is None and "1 gpu client(s) have fewer than 2" in reason
    assert unschedulable({**spec, "world_size": 8}, list(clients.values())).startswith(
        "world_size 8 is more than the 6 slot(s)")
    function = {**spec, "kind": "function"}  # a bundle loads only on the Python that made it
    assert plan({"spec": function}, slots, clients)[0] is None
    assert "Python" in unschedulable(function, list(clients.values()))


# -- the working dir as it travels ---------------------------------------------------------------------
def tree(root, files: dict[str, str]) -> str:
    for name, text in files.items():
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text)
    return str(root)


FILES = {"train.py": "print('hi')\n", "lib/model.py": "X = 1\n", ".gitignore": "*.ckpt\ndata/\n",
         "big.ckpt": "x" * 1000, "data/train.bin": "d" * 1000, "lib/.gitignore": "!keep.ckpt\n", "lib/keep.ckpt": "k",
         "__pycache__/train.cpython-311.pyc": "c", "zwdx-output/job1/model.pt": "o"}
TRAVELS = [".gitignore", "lib/.gitignore", "lib/keep.ckpt", "lib/model.py", "train.py"]


def test_the_working_dir_leaves_out_what_gitignore_files_say_with_or_without_git(tmp_path):
    root = tree(tmp_path / "plain", FILES)
    assert list_files(root) == TRAVELS
    repo = tree(tmp_path / "repo", FILES)
    subprocess.run(["git", "init", "-q", repo], check=True)
    subprocess.run(["git", "-C", repo, "add", "train.py"], check=True)
    os.remove(os.path.join(repo, "lib", "model.py"))  # deleted, never committed: gone
    assert list_files(repo) == [n for n in TRAVELS if n != "lib/model.py"]


def test_the_same_tree_packs_to_the_same_bytes_and_a_change_to_others(tmp_path):
    root = tree(tmp_path / "a", FILES)
    first, second = pack(root, "train.py"), pack(root, os.path.join(root, "train.py"))
    try:
        assert first.sha256 == second.sha256 and first.script == second.script == "train.py"
        os.utime(os.path.join(root, "train.py"), (0, 0))  # a touched file is the same tree
        assert pack(root, "train.py").sha256 == first.sha256
        with tarfile.open(first.path) as tar:
            assert sorted(tar.getnames()) == TRAVELS
            assert {(m.uid, m.uname, m.mtime) for m in tar} == {(0, "", 315532800)}
        tree(root, {"lib/model.py": "X = 2\n"})
        assert pack(root, "train.py").sha256 != first.sha256
    finally:
        first.discard()
        second.discard()


@pytest.mark.parametrize("script, field, words", [
    ("nope.py", "script", "no script nope.py in the working dir"),
    ("big.ckpt", "script", "is left out of the working dir"),
    ("../elsewhere.py", "script", "must be inside the working dir"),
])
def test_a_script_that_would_not_travel_is_refused_before_anything_is_packed(tmp_path, script, field, words):
    root = tree(tmp_path / "a", FILES)
    with pytest.raises(BadRequest) as err:
        pack(root, script)
    assert err.value.field == field and words in err.value.message


def test_a_working_dir_over_the_limit_is_refused_naming_its_biggest_files(tmp_path):
    root = tree(tmp_path / "a", {**FILES, "lib/weights.npy": "w" * 5000, "notes.txt": "n" * 3000})
    with pytest.raises(BadRequest) as err:
        pack(root, "train.py", max_bytes=4096)
    assert err.value.field == "working_dir"
    assert "the biggest: lib/weights.npy (4.9 KiB), notes.txt (2.9 KiB)" in err.value.message


def test_a_link_out_of_the_working_dir_is_refused_naming_it(tmp_path):
    root = tree(tmp_path / "a", FILES)
    os.symlink("/etc/hostname", os.path.join(root, "host"))
    os.symlink("train.py", os.path.join(root, "alias.py"))
    with pytest.raises(BadRequest) as err:
        pack(root, "train.py")
    assert "host, a link out of it (to /etc/hostname)" in err.value.message
    os.remove(os.path.join(root, "host"))
    packed = pack(root, "alias.py")  # a link inside the tree travels as a link
    with tarfile.open(packed.path) as tar:
        assert tar.getmember("alias.py").issym() and tar.getmember("alias.py").linkname == "train.py"
    packed.discard()


# -- what a rank's script gets -------------------------------------------------------------------------
def test_a_ranks_script_gets_torchruns_environment_and_no_secret(monkeypatch):
    from gpu_client.rank.script import environ
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    spec = RankSpec(job_id="j1", attempt=2, rank=3, local_rank=1, world_size=4, master_addr="10.0.0.1",
                    master_port=29500, backend="nccl", device="cuda:3",
                    job=JobSpec(kind="script", script={"path": "train.py", "env": {"SEED": "7"}}, max_restarts=3,
                                versions={"python": "3.11"}, bundle_artifact="w", world_size=4),
                    collective_timeout=300, checkpoint=None, threads=4,
                    bundle_path="/w.tar.gz", bundle_sha256="0" * 64, bundle_pending=False, assigned_at=0,
                    server="http://s", client_id="c1",
                    hostname="h", rank_key="rk_secret", local_world_size=2, group_rank=1,
                    group_world_size=2, local_gpus=[2, 3])
    env = environ(spec, "/out")
    assert set(TORCHRUN_VARIABLES) <= set(env)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                                "CUDA_VISIBLE_DEVICES", "ZWDX_OUTPUT_DIR", "SEED")} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "j1",
        "TORCHELASTIC_RESTART_COUNT": "2", "CUDA_VISIBLE_DEVICES": "6,7", "ZWDX_OUTPUT_DIR": "/out", "SEED": "7"}
    assert "rk_secret" not in repr(env)
    assert "rk_secret" not in repr(spec) and "rk_secret" in spec.line().decode()  # only its stdin line holds it


def test_zwdx_run_reads_sizes_as_people_write_them():
    from zwdx.cli import byte_size
    assert byte_size("8GiB") == 8 * 1024**3 and byte_size("512MB") == 512 * 1000**2 and byte_size("100") == 100
    assert byte_size("1.5G") == int(1.5 * 1024**3)
    out = subprocess.run([sys.executable, "-m", "zwdx.cli", "run", "--nproc", "2", "--memory", "lots", "t.py"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "'lots' is not a size" in out.stderr


def test_the_history_shows_a_finished_script_job_as_a_script(api):
    """The dashboard's history says "script" for a script job, not the DDP its spec defaults to."""
    job = api.post("/jobs", json=script_job(put_workdir(api).json["id"])).json
    assert api.post(f"/jobs/{job['id']}/cancel").status_code == 200
    [row] = [r for r in api.get("/dashboard/history").json["jobs"] if r["id"] == job["id"]]
    assert row["parallelism"] == "script" and job["spec"]["parallelism"] == "DDP"
