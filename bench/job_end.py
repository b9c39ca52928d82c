"""How long a job takes to end once its ranks are done: last rank's completion report -> job completed.

    python bench/job_end.py --jobs 20                 # 2 GPU clients with a CPU slot each, world size 2
    python bench/job_end.py --jobs 20 --out $OUT/job_end.md

It starts a server and two GPU clients (CPU slots), runs ``--jobs`` small DDP jobs one after
the other and reads, per job, what the server stored: the time each rank's completion report
arrived (``ranks.N.ended_at``) and the time the job became ``completed`` (``ended_at``). It
needs nothing else from the code it measures, so the same script measures older versions
(copy it into their tree and run it there). Where the GPU clients' logs say when the ranks'
processes exited ("ranks exited"), it also shows the last rank's report -> the last process
exit seen by its GPU client: the teardown a rank does after reporting. And the last report ->
``submit_job`` returned, which adds the SDK's wait (a held poll, answered when the job ends;
up to ``POLL_INTERVAL``, 1 s, more when news had just come).
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import GpuClientProc, ServerProc, median, percentile, table  # noqa: E402


def data_loader(rank, world_size):
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g))
    return DataLoader(ds, batch_size=32, sampler=DistributedSampler(ds, world_size, rank))


def train(model, loader, optimizer, reporter):
    import torch.nn.functional as F
    loss = None
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        reporter.log_metrics(loss=loss.item())
    return loss.item()


_EXITED = re.compile(r"^(\S+ \S+) INFO gpu_client\.agent: gpu-client \S+: job (\w+) \(attempt \d+\) ranks exited")


def exit_lines(work: str) -> list[tuple[str, str, float]]:
    """(GPU client, job id, when) of each "ranks exited" its log holds."""
    out = []
    for name in os.listdir(work):
        path = os.path.join(work, name, "gpu-client.log")
        if not os.path.exists(path):
            continue
        with open(path, errors="replace") as fh:
            for line in fh:
                m = _EXITED.match(line)
                if m:
                    out.append((name, m.group(2),
                                datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()))
    return out


def exits_seen(work: str) -> dict[str, float]:
    """job id -> when the last of its rank processes exited, as the GPU clients logged it."""
    seen: dict[str, float] = {}
    for _, job_id, at in exit_lines(work):
        seen[job_id] = max(seen.get(job_id, 0.0), at)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--settle", type=float, default=1.0, help="seconds between jobs (standby processes start)")
    parser.add_argument("--out", help="append the table to this file (raw figures to FILE.json)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs)")
    args = parser.parse_args()
    harness.require(harness.SERVER_MODULES + harness.CLIENT_MODULES)
    import torch

    import zwdx
    from zwdx import ZWDX
    work = tempfile.mkdtemp(prefix="zwdx-job-end-")
    server = ServerProc(os.path.join(work, "server"))
    clients = []
    try:
        sdk = ZWDX(server.url)
        room = sdk.create_room("job-end")
        token = room["submitter_token"]
        clients = [GpuClientProc(server.url, room["donor_token"], os.path.join(work, f"c{i}"), f"c{i}", None)
                   for i in range(2)]
        harness.wait_until(lambda: sum(c["status"] == "online" for c in sdk.get_room(token)["clients"]) == 2, 60,
                           what="2 GPU clients online")
        returned = {}
        for _ in range(args.jobs):
            time.sleep(args.settle)
            model = torch.nn.Linear(16, 4)
            result = sdk.submit_job(model=model, data_loader_func=data_loader, train_func=train,
                                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                    resources=zwdx.Resources(world_size=2),
                                    run=zwdx.Run(room_token=token, progress=False, timeout=120))
            returned[result["job_id"]] = time.time()
        try:  # each GPU client (one rank of each job) logs its ranks' exit
            harness.wait_until(lambda: len({(c, j) for c, j, _ in exit_lines(work) if j in returned})
                               == 2 * len(returned), 10, what="the GPU clients' logs of the last exits")
        except TimeoutError:
            pass  # an older checkout's clients may not say: the table shows no exit for those jobs
        seen = exits_seen(work)
        rows, to_end, to_exit, to_sdk = [], [], [], []
        for job_id, back in returned.items():
            job = sdk.get_job(job_id, token)
            last = max(r["ended_at"] for r in job["ranks"].values())
            to_end.append(job["ended_at"] - last)
            exited = seen.get(job_id)
            to_exit.append(exited - last if exited else None)
            to_sdk.append(back - last)
            rows.append([job_id, to_end[-1], to_exit[-1], to_sdk[-1]])
        summary = [[name, median(vals), percentile(vals, 90), max(vals, default=float("nan"))]
                   for name, vals in (("report -> job completed", to_end),
                                      ("report -> processes exited", [v for v in to_exit if v is not None]),
                                      ("report -> submit_job returned", to_sdk))]
        text = (f"{harness.machine()}; {args.jobs} jobs, world size 2, 2 GPU clients (CPU slots)\n\n"
                + table(["job", "last report -> completed (s)", "-> processes exited (s)", "-> submit_job returned (s)"],
                        rows, digits=3)
                + "\n" + table(["interval", "median (s)", "p90 (s)", "max (s)"], summary, digits=3))
        print(text)
        harness.write_out(args.out, text, {"jobs": args.jobs, "to_end": to_end, "to_exit": to_exit,
                                           "to_sdk": to_sdk})
    finally:
        GpuClientProc.stop_all(clients)  # together: each takes seconds to stop its ranks
        server.stop()
        if args.keep:
            print(f"logs in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
