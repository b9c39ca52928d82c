"""Mutation score of the core modules (issue 31 item 3), measured with mutmut 3.

    .venv/bin/python bench/mutation.py                      # every module below, in parallel
    .venv/bin/python bench/mutation.py --module auth codec  # some of them
    .venv/bin/python bench/mutation.py --module limits --mutant '*check_job_quota*'   # a rerun

Each module runs in its own scratch copy of the tree (``--work``, kept between runs so a rerun
only tests what changed) against its own test selection: the fast lane of the test files that
exercise it in-process, plus the slow tests named below. mutmut maps every test to the functions
it calls and runs, per mutant, only those tests, so the selection bounds the cost. It prints per
module: mutants, killed, survived, no tests (no selected test calls the function), timeouts and
the score, (killed + timeouts) / (mutants checked - skipped), and writes the surviving mutants' diffs to
``<work>/survivors-<module>.txt`` (docs/testing.md lists them). It is not run in CI: the whole
set takes about 8 minutes on 16 cores (docs/testing.md: how, and the figures) (``bench/requirements.txt`` plus mutmut on a bare host).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAST = ["-m", "not slow"]

#: module -> (file, test selection). Slow tests that matter are named by node id; mutmut only sees
#: calls made in the pytest process, so a test that reaches the module through a started server
#: process could never be credited with a kill.
MODULES: dict[str, tuple[str, list[str]]] = {
    "auth": ("zwdx/server/auth.py", ["test/test_api.py", "test/test_edge.py", "test/test_mutants_auth.py"] + FAST),
    "job": ("zwdx/server/jobs/model.py", ["test/test_job.py", "test/test_scheduler.py", "test/test_mutants_job.py",
                                          "test/test_mutants_job2.py"] + FAST),
    "placement": ("zwdx/server/placement/filters.py", ["test/test_placement_filters.py", "test/test_scheduler.py",
                                                       "test/test_mutants_placement.py", "test/test_mutants_placement2.py"]
                  + FAST),
    "placement-groups": ("zwdx/server/placement/groups.py", ["test/test_placement_filters.py", "test/test_scheduler.py",
                                                             "test/test_tensor_parallel.py", "test/test_mutants_placement2.py"]
                         + FAST),
    "placement-plan": ("zwdx/server/placement/plan.py", ["test/test_placement_filters.py", "test/test_scheduler.py",
                                                         "test/test_mutants_placement.py", "test/test_mutants_placement2.py",
                                                         "test/test_mutants_placement3.py"]
                       + FAST),
    "placement-records": ("zwdx/server/placement/records.py", ["test/test_placement_filters.py", "test/test_scheduler.py",
                                                               "test/test_mutants_placement.py",
                                                               "test/test_mutants_placement2.py",
                                                               "test/test_mutants_placement3.py"] + FAST),
    "scheduler": ("zwdx/server/scheduler.py",
                  ["test/test_scheduler.py", "test/test_placement.py", "test/test_job.py", "test/test_auto.py",
                   "test/test_diloco_join.py", "test/test_mutants_scheduler.py", "test/test_mutants_scheduler2.py",
                   "test/test_mutants_scheduler3.py"]
                  + FAST),
    "limits": ("zwdx/server/limits.py",
               ["test/test_api.py", "test/test_mutants_limits.py", "test/test_limits_purge.py",
                "test/test_limits_rates.py", "test/test_mutants_limits2.py"] + FAST),
    "codec": ("zwdx/codec.py", ["test/test_diloco.py", "test/test_diloco_join.py", "test/test_mutants_codec.py"] + FAST),
    "checkpoint": ("gpu_client/rank/checkpoint.py", ["test/test_checkpointer.py", "test/test_mutants_checkpoint.py",
                                                     "test/test_checkpoint_shadow.py"] + FAST),
    "parallel": ("gpu_client/rank/strategies/parallel.py", ["test/test_layout.py", "test/test_digests.py",
                                                            "test/test_mutants_parallel.py"] + FAST),
    "diloco": ("gpu_client/rank/strategies/diloco.py", ["test/test_mutants_diloco.py", "test/test_mutants_diloco_rounds.py"]
               + FAST),
}
SKIP = {".git", ".venv", ".whl", ".gl", "node_modules", "build", "mutants", "zwdx-data", "test-artifacts",
        "__pycache__", ".pytest_cache", "zwdx.egg-info", ".mutation"}
KILLED, TIMEOUT = {1, 3, 37}, {24, -24, 36, 152, 255}
SURVIVED, NO_TESTS, SKIPPED = {0}, {5, 33}, {34}


def _cfg_list(name: str, values: list[str]) -> str:
    return f"{name} =\n" + "".join(f"    {v}\n" for v in values)


def prepare(module: str, work: Path) -> Path:
    """A scratch tree for one module: the sources as they are now, and mutmut's config."""
    path, tests = MODULES[module]
    tree = work / module
    tests = [t for t in tests if t.startswith("-") or (ROOT / t.split("::")[0]).exists() or t in FAST]
    if tree.exists():  # keep mutants/ (its results are reused) but refresh the sources
        for entry in tree.iterdir():
            if entry.name != "mutants":
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    shutil.copytree(ROOT, tree, ignore=lambda d, names: [n for n in names if n in SKIP], dirs_exist_ok=True)
    top = sorted(e.name for e in tree.iterdir() if e.name not in {"zwdx", "gpu_client", "mutants", "setup.cfg"})
    (tree / "pyproject.toml").write_text(
        (tree / "pyproject.toml").read_text().replace("[tool.mutmut]", "[tool.mutmut-unused]"))
    (tree / "setup.cfg").write_text(
        "[mutmut]\n" + _cfg_list("source_paths", ["zwdx", "gpu_client"]) + _cfg_list("only_mutate", [path])
        + _cfg_list("also_copy", top)
        + _cfg_list("pytest_add_cli_args", ["-p", "no:randomly", "-p", "no:cacheprovider", "-q"])
        + _cfg_list("pytest_add_cli_args_test_selection", tests))
    return tree


def tally(module: str, tree: Path) -> dict:
    meta = tree / "mutants" / (MODULES[module][0] + ".meta")
    codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
    count = {k: sum(1 for c in codes.values() if c in s) for k, s in
             [("killed", KILLED), ("survived", SURVIVED), ("no_tests", NO_TESTS), ("timeout", TIMEOUT),
              ("skipped", SKIPPED), ("unchecked", {None})]}
    count["other"] = len(codes) - sum(count.values())  # suspicious, segfault
    count["mutants"] = len(codes)
    scored = len(codes) - count["skipped"] - count["unchecked"]
    count["score"] = round(100 * (count["killed"] + count["timeout"]) / scored, 1) if scored else None
    count["survivors"] = sorted(k for k, c in codes.items() if c not in KILLED | TIMEOUT | SKIPPED | {None})
    return count


def run_module(module: str, work: Path, children: int, mutants: list[str], deadline: float, log) -> dict:
    tree = prepare(module, work)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    start = time.monotonic()
    with open(work / f"{module}.log", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mutmut", "run", "--max-children", str(children), *mutants],
                                cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # mutmut stops its workers on ^C and keeps what it has
            proc.send_signal(signal.SIGINT)
            try:
                rc = proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
    count = tally(module, tree)
    count.update(rc=rc, seconds=round(time.monotonic() - start))
    if count["survivors"]:  # their diffs, for docs/testing.md
        script = ("import sys\nfrom mutmut.mutation.diff_apply import get_diff_for_mutant\n"
                  "for name in sys.argv[2:]:\n    print(get_diff_for_mutant(name, path=sys.argv[1]), end='\\n\\n')\n")
        with open(work / f"survivors-{module}.txt", "w") as out:
            subprocess.call([sys.executable, "-c", script, MODULES[module][0], *count["survivors"]],
                            cwd=tree, stdout=out, stderr=subprocess.STDOUT)
    log(f"{module}: {count['mutants']} mutants, score {count['score']}% ({count['seconds']} s, rc {rc})")
    return count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--module", nargs="+", choices=sorted(MODULES), default=sorted(MODULES))
    ap.add_argument("--mutant", nargs="*", default=[], help="mutmut names or globs to (re)run only")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 2, help="mutmut children in all")
    ap.add_argument("--work", type=Path, default=ROOT / ".mutation", help="scratch trees and results")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    ap.add_argument("--seconds", type=float, default=0, help="stop after this long, keeping what ran (0: none)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    children = max(1, args.cores // len(args.module))
    deadline = time.monotonic() + (args.seconds or 1e9)
    with ThreadPoolExecutor(len(args.module)) as pool:
        results = dict(zip(args.module, pool.map(
            lambda m: run_module(m, args.work, children, args.mutant, deadline, lambda s: print(s, flush=True)),
            args.module)))
    cols = ["mutants", "killed", "survived", "no_tests", "timeout", "other", "unchecked", "score"]
    print(f"\n{'module':<11}" + "".join(f"{c:>10}" for c in cols))
    for m, r in results.items():
        print(f"{m:<11}" + "".join(f"{str(r[c]):>10}" for c in cols))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if all(r["rc"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
