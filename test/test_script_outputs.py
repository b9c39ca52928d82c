"""Script jobs that lost data and outputs without a word (issue 30 item 5).

- What a .gitignore ignores is said at upload (how many, the biggest, their bytes) and
  ``include`` packs it; a script that fails opening such a file fails saying so and names
  ``--include``.
- A script that writes outside ``$ZWDX_OUTPUT_DIR`` is told where it wrote when no outputs come
  back; ``outputs_from`` collects a folder of its working dir, following no link out of it.
- ``$ZWDX_OUTPUT_DIR`` and ``$ZWDX_DATA_DIR`` in a script's arguments are the rank's folders.

The ranks here are ``gpu_client.rank.script.ScriptRank`` in this process with its script a real
child process (slow lane, about a second), reporting to a stand-in for the server;
test_scripts_e2e.py runs ``zwdx run`` and ``zwdx jobs download`` through real processes.
"""
from __future__ import annotations

import os
import signal
import subprocess
import tarfile

import pytest

from zwdx.errors import BadRequest
from zwdx.protocol.job import JobSpec
from zwdx.protocol.rank import RankSpec
from zwdx.workdir import pack


def tree(root, files: dict[str, str | bytes]) -> str:
    for name, body in files.items():
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(body.encode() if isinstance(body, str) else body)
    return str(root)


NANOGPT = {"train.py": "print('hi')\n", ".gitignore": "*.bin\n__pycache__/\nout/\n",
           "data/shakespeare/prepare.py": "", "data/shakespeare/train.bin": b"t" * 3000,
           "data/shakespeare/val.bin": b"v" * 1000, "out/old.pt": b"o" * 10, "__pycache__/x.pyc": b"c"}


# -- what a .gitignore leaves out -------------------------------------------------------------------
@pytest.mark.parametrize("git", [False, True])
def test_what_a_gitignore_leaves_out_is_said_and_include_packs_it(tmp_path, git):
    root = tree(tmp_path / "wd", NANOGPT)
    if git:
        subprocess.run(["git", "init", "-q", root], check=True)
    packed = pack(root, "train.py")
    packed.discard()
    assert packed.left_out == {"data/shakespeare/train.bin": 3000, "data/shakespeare/val.bin": 1000,
                               "out/old.pt": 10}
    line = packed.left_out_line()
    assert line.startswith("left out 3 file(s), 3.9 KiB, that a .gitignore ignores: data/shakespeare/train.bin "
                           "(2.9 KiB), data/shakespeare/val.bin (1000 B), out/old.pt (10 B)"), line
    assert "--include PATTERN (e.g. --include 'data/shakespeare/train.bin')" in line
    assert sorted(packed.left_out_entries) == ["data/shakespeare/train.bin", "data/shakespeare/val.bin", "out/"]

    packed = pack(root, "train.py", include=["*.bin", "nothing-*"])
    with tarfile.open(packed.path) as tar:
        names = tar.getnames()
    packed.discard()
    assert "data/shakespeare/train.bin" in names and "data/shakespeare/val.bin" in names
    assert "out/old.pt" not in names and not any("__pycache__" in n for n in names)
    assert packed.left_out == {"out/old.pt": 10} and packed.left_out_entries == ["out/"]
    assert packed.unmatched == ["nothing-*"]


def test_included_files_count_against_the_working_dirs_limit(tmp_path):
    root = tree(tmp_path / "wd", NANOGPT)
    pack(root, "train.py", max_bytes=1000).discard()  # 3 KiB left out: under the limit
    with pytest.raises(BadRequest) as err:
        pack(root, "train.py", max_bytes=1000, include=["data/"])
    assert "the biggest: data/shakespeare/train.bin (2.9 KiB)" in err.value.message


# -- the edge --------------------------------------------------------------------------------------
@pytest.mark.parametrize("folder, words", [("../up", "inside the working dir"), ("/etc", "not absolute"),
                                           ("a/../../b", "inside the working dir")])
def test_outputs_from_outside_the_working_dir_is_refused_at_the_edge(api, folder, words):
    import hashlib
    data = b"a working dir"
    workdir = api.put(f"/workdirs/{hashlib.sha256(data).hexdigest()}", data=data).json
    resp = api.post("/jobs", json={"kind": "script", "bundle_artifact": workdir["id"], "world_size": 1,
                                   "versions": {"python": "3.11.0"},
                                   "script": {"path": "train.py", "outputs_from": ["out", folder]}})
    assert resp.status_code == 400, resp.text
    assert resp.json["error"]["field"] == "script.outputs_from" and words in resp.json["error"]["message"]
    assert api.jobs() == []


def test_args_that_name_the_data_dir_of_a_job_without_datasets_are_refused_before_upload(tmp_path):
    from zwdx import ZWDX
    from zwdx.script_jobs import ScriptJobs
    sdk = ZWDX("http://127.0.0.1:9", room_token="zs_" + "x" * 40, remember=False)  # never reached
    with pytest.raises(BadRequest) as err:
        ScriptJobs(sdk).submit("train.py", ["--data", "${ZWDX_DATA_DIR}/shakespeare"], nproc=1,
                               working_dir=tree(tmp_path / "wd", NANOGPT), progress=False)
    assert err.value.field == "args" and "--dataset" in err.value.message


# -- on the GPU client ----------------------------------------------------------------------------
class Reports:
    """Stands in for ``gpu_client.rank.reporter.Reporter``: what a rank said."""
    said: list[tuple[str, object]] = []

    def __init__(self, *args, **kwargs):
        pass

    def log(self, text):
        self.said.append(("log", text))

    def status(self, status, **fields):
        self.said.append((status, fields))

    def upload(self, path, file_path):
        with tarfile.open(file_path) as tar:
            self.said.append(("upload", sorted((m.name, m.size) for m in tar.getmembers() if not m.isdir())))

    def close(self):
        pass


def run_rank(tmp_path, monkeypatch, files: dict, script: dict, include=(), data_dir=None):
    """Rank 0 of a one-rank script job over these files, run here; what it reported. ``include``
    None: the job is not told what was left out."""
    from gpu_client.rank import script as script_rank
    root = tree(tmp_path / "submitter", files)
    packed = pack(root, script["path"], **({"include": include} if include else {}))
    spec = RankSpec(job_id="j1", attempt=0, rank=0, local_rank=0, world_size=1, master_addr="127.0.0.1",
                    master_port=1, backend="gloo", device="cpu",
                    job=JobSpec(kind="script", script={**script, **({} if include is None else
                                                                    {"left_out": packed.left_out_entries})},
                                versions={"python": "3.11"}, bundle_artifact="w", world_size=1),
                    collective_timeout=30, checkpoint=None, threads=1,
                    bundle_path=packed.path, bundle_sha256=packed.sha256, bundle_pending=False, assigned_at=0,
                    server="http://s", client_id="c1", hostname="h", rank_key="rk",
                    data_dir=data_dir,
                    work_dir=str(tmp_path / "rank0"))
    Reports.said = []
    monkeypatch.setattr(script_rank, "Reporter", Reports)
    monkeypatch.setattr(script_rank.ScriptRank, "_serve_store", lambda self: None)  # no peers to serve
    before = signal.getsignal(signal.SIGTERM)
    try:
        code = script_rank.ScriptRank(spec).run()
    finally:
        signal.signal(signal.SIGTERM, before)
        packed.discard()
    return code, Reports.said


NANOGPT_TRAIN = """import os, sys
data = open(os.path.join('data', 'shakespeare', 'train.bin'), 'rb').read()
"""
WRITES_OUT = """import os
os.makedirs('out', exist_ok=True)
open('out/ckpt.pt', 'wb').write(b'c' * 2048)
open('log.txt', 'w').write('done')
"""


@pytest.mark.slow
def test_a_script_that_fails_opening_a_left_out_file_says_so_and_names_include(tmp_path, monkeypatch):
    code, said = run_rank(tmp_path, monkeypatch, {**NANOGPT, "train.py": NANOGPT_TRAIN}, {"path": "train.py"})
    [(status, fields)] = [s for s in said if s[0] in ("completed", "failed")]
    assert code == 1 and status == "failed"
    assert fields["error"].startswith("script train.py exited with code 1: data/shakespeare/train.bin is not in "
                                      "the job's working dir: the submitter's .gitignore ignores "
                                      "data/shakespeare/train.bin, so zwdx run left it out; pack it with zwdx run "
                                      "--include 'data/shakespeare/train.bin'"), fields["error"]
    assert "FileNotFoundError" in fields["traceback"] and fields["traceback"].endswith(
        "pack it with zwdx run --include 'data/shakespeare/train.bin'")
    assert not [text for kind, text in said if kind == "log" and "no outputs" in text]  # it wrote nothing: no note


@pytest.mark.slow
def test_a_script_that_wrote_only_outside_the_output_dir_is_told_where(tmp_path, monkeypatch):
    code, said = run_rank(tmp_path, monkeypatch, {**NANOGPT, "train.py": WRITES_OUT}, {"path": "train.py"},
                          include=None)
    assert code == 0 and said[-1] == ("completed", {"results": {}})
    assert not [s for s in said if s[0] == "upload"]
    [note] = [text for kind, text in said if kind == "log" and text.startswith("zwdx: no outputs")]
    assert note == ("zwdx: no outputs: rank 0 wrote nothing under $ZWDX_OUTPUT_DIR; in its working dir it wrote "
                    "out/ckpt.pt (2.0 KiB), log.txt (4 B) (2.0 KiB in all), dropped with it: collect that folder "
                    "with zwdx run --outputs-from out, or write under $ZWDX_OUTPUT_DIR")


LINKS_OUT = """import os, sys
open(sys.argv[1], 'w').write('summary')
os.makedirs('out/sub')
open('out/sub/ckpt.pt', 'wb').write(b'c' * 100)
os.symlink('/etc/passwd', 'out/passwd')           # a donor's file: never collected
os.symlink('sub/ckpt.pt', 'out/last.pt')          # inside the folder: a link, as written
os.symlink('/etc', 'etc')                          # a folder that is a link: not read through
os.mkfifo('out/fifo')
print(sys.argv[1:])
"""


@pytest.mark.slow
def test_outputs_from_collects_a_folder_following_no_link_and_args_name_the_ranks_folders(tmp_path, monkeypatch):
    data = tmp_path / "datasets"
    data.mkdir()
    code, said = run_rank(tmp_path, monkeypatch, {"train.py": LINKS_OUT},
                          {"path": "train.py", "args": ["$ZWDX_OUTPUT_DIR/summary.txt", "--data=${ZWDX_DATA_DIR}/x",
                                                        "$ZWDX_OUTPUT_DIRS", "$HOME", "${ZWDX_JOB_ID}"],
                           "outputs_from": ["out", "etc", "missing"]}, data_dir=str(data), include=None)
    assert code == 0, said
    [(_, uploaded)] = [s for s in said if s[0] == "upload"]
    assert uploaded == [("out/last.pt", 0), ("out/sub/ckpt.pt", 100), ("summary.txt", 7)]
    [args] = [text for kind, text in said if kind == "log" and text.startswith("[")]
    out = os.path.join(str(tmp_path / "rank0"), "outputs")
    assert args == repr([f"{out}/summary.txt", f"--data={data}/x", "$ZWDX_OUTPUT_DIRS", "$HOME", "${ZWDX_JOB_ID}"])
