"""The parity suite as a table, without the test bench: every mode x every zoo model it applies
to, trained as a zwdx job and in this process, the largest relative difference of the weights.

    python test/parity/run.py                           # a local platform: a server, two GPU clients of 2 CPU slots
    python test/parity/run.py --gpus 0,1                # ... a GPU client of those GPUs (the one process trains
                                                        # on cuda); for mixed devices one of a CPU slot joins
    python test/parity/run.py --server URL --token T    # a room of yours (the submitter token; or $ZWDX_ROOM_TOKEN)
    python test/parity/run.py --modes DDP,TP --cases mlp,residual

Exit status 0 when every row passed. The local platform's processes are stopped at the end.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]  # test/ and the checkout

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

from parity import harness, zoo  # noqa: E402


#: Modes whose rows a test module makes, with its own cases (its ``outcomes(sdk)``; the one
#: process on the CPU): PIPELINE's schedules, DILOCO, script jobs.
OWN_ROWS = {"PIPELINE": "parity.test_parity_pipeline", "DILOCO": "parity.test_parity_diloco",
            "script": "parity.test_parity_script"}


def rows(sdk, modes: list[str], cases: list[str], device: str = "cpu", out=print, mixed=None) -> list[harness.Outcome]:
    """Each row, printed as it comes. ``mixed()``: called before the first mixed-devices job,
    returns the mode to run it as (the GPU variant adds a CPU client then)."""
    done = []
    for name in (m for m in modes if m in OWN_ROWS):
        import importlib
        for o in importlib.import_module(OWN_ROWS[name]).outcomes(sdk):
            done.append(o)
            out(f"{o.mode:10} {o.case:11} {_diff(o):>9}  {_verdict(o)}  {o.seconds:5.1f} s  {o.where}  {o.error[:200]}")
    for mode in (harness.MODES[m] for m in modes if m not in OWN_ROWS):
        if mode.mixed and mixed is not None:
            mode = mixed()
        for case in (zoo.case(c) for c in cases):
            if not harness.supports(case, mode):
                continue
            outcome = harness.check(sdk, case, mode, device=device)
            done.append(outcome)
            out(f"{outcome.mode:10} {outcome.case:11} {_diff(outcome):>9}  {_verdict(outcome)}  {outcome.seconds:5.1f} s"
                f"  {outcome.where}  {outcome.error[:200]}")
    return done


def _diff(o: harness.Outcome) -> str:
    return "-" if o.diff is None else f"{o.diff:.2e}"


def _verdict(o: harness.Outcome) -> str:
    return "pass" if o.passed else "FAIL"


def table(outcomes: list[harness.Outcome]) -> str:
    return tabulate([(o.mode, o.case, o.where, _diff(o), f"{o.tolerance:.0e}", _verdict(o), f"{o.seconds:.1f}")
                     for o in outcomes],
                    headers=["mode", "model", "ranks on", "max rel diff", "tolerance", "result", "s"],
                    tablefmt="github")


def local_pool(base: str, gpus: str | None):
    from gpu_pool import GpuPool
    pool = GpuPool(base, clients=())
    own = {"env": {"ZWDX_ISOLATION": "process"}}  # ranks as this user: no per-job users to make
    try:
        if gpus:  # the GPU client alone: every job on GPUs, until the mixed-devices ones (mixed_phase)
            from zwdx.testing import GpuClientProc, wait_until
            client = GpuClientProc(pool.server.url, pool.donor_token, os.path.join(base, "gpu"), "client-gpu",
                                   gpu=gpus, **own)  # (test/procs.GpuClient offers CPU slots only)
            pool.clients.append(client)
            wait_until(lambda: pool.online(client), 120, what="the GPU client online")
        else:
            pool.start_all(("a", "b"), extra=["--cpu-slots", "2"], **own)
    except BaseException:
        pool.stop()
        raise
    return pool


def mixed_phase(pool, gpus: str):
    """For the GPU variant's mixed-devices jobs: a GPU client of one CPU slot joins, and the
    job takes every GPU and it (GPUs first), so that CUDA and CPU ranks train together."""
    def start():
        pool.start("cpu", env={"ZWDX_ISOLATION": "process"})
        return dataclasses.replace(harness.MODES["mixed"], world_size=len(gpus.split(",")) + 1)
    return start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", help="a zwdx server's URL (default: start a local platform)")
    parser.add_argument("--token", default=os.environ.get("ZWDX_ROOM_TOKEN"),
                        help="the room's submitter token (default: $ZWDX_ROOM_TOKEN)")
    parser.add_argument("--gpus", help="local platform: a GPU client of these GPUs (e.g. 0,1); one of a CPU slot joins "
                                       "for the mixed-devices jobs")
    parser.add_argument("--reference-device", help="where the one process trains (default: cuda with --gpus, else cpu)")
    parser.add_argument("--modes", default=",".join([*harness.MODES, *OWN_ROWS]), help="comma-separated (default: all)")
    parser.add_argument("--cases", default=",".join(c.name for c in zoo.CASES), help="comma-separated (default: all)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    modes, cases = args.modes.split(","), args.cases.split(",")
    device = args.reference_device or ("cuda" if args.gpus else "cpu")
    for name in modes:
        if name not in harness.MODES and name not in OWN_ROWS:
            parser.error(f"--modes: no mode {name!r} (modes: {', '.join([*harness.MODES, *OWN_ROWS])})")
    for name in cases:
        if name not in zoo.BY_NAME:
            parser.error(f"--cases: no case {name!r} (cases: {', '.join(zoo.BY_NAME)})")
    began = time.time()
    if args.server:
        if not args.token:
            parser.error("--server needs --token (or $ZWDX_ROOM_TOKEN): the room's submitter token")
        from zwdx import ZWDX
        with ZWDX(args.server, room_token=args.token, remember=False) as sdk:
            outcomes = rows(sdk, modes, cases, device)
    else:
        with tempfile.TemporaryDirectory(prefix="zwdx-parity-") as base:
            pool = local_pool(base, args.gpus)
            try:
                outcomes = rows(pool.sdk, modes, cases, device, mixed=mixed_phase(pool, args.gpus) if args.gpus else None)
            finally:
                pool.stop()
    print()
    print(table(outcomes))
    failed = [o for o in outcomes if not o.passed]
    print(f"\n{len(outcomes) - len(failed)} of {len(outcomes)} passed in {time.time() - began:.0f} s "
          f"(torch {torch.__version__})")
    for o in failed:
        print(f"FAIL {o.mode} {o.case}: {o.error or f'relative difference {o.diff:.3g}'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
