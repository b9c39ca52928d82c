"""Issue 29, M5: rank processes were started ``python -m gpu_client.rank.runner`` with no working
directory of their own, so the GPU client's (wherever its donor started it) came first on their
import path: a ``gpu_client/`` package planted there ran, as root, in the next rank process.
Replayed with a real server and a GPU client started from a folder a job could write, into
which a package is planted once the client runs; a job then starts a fresh rank process."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

from procs import PROCESSES, SLACK, Server, wait_until
import zwdx
from zwdx import ZWDX
from zwdx.testing import GpuClientProc

pytestmark = pytest.mark.slow


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.fc(x)


def loader(rank, world_size):
    from torch.utils.data import DataLoader, TensorDataset
    return DataLoader(TensorDataset(torch.randn(8, 2), torch.randint(0, 2, (8,))), batch_size=4)


def train(model, loader, optimizer):
    import gpu_client
    return {"final_loss": 0.0, "gpu_client_from": os.path.dirname(gpu_client.__file__)}


def test_a_package_planted_in_the_gpu_clients_working_directory_never_runs_in_a_rank():
    base = tempfile.mkdtemp(prefix="zwdx-m5-", dir="/tmp")
    os.chmod(base, 0o755)
    started_in = os.path.join(base, "started-in")  # where the donor happened to start the GPU client
    os.makedirs(started_in)
    os.chmod(started_in, 0o777)  # a folder a job could write (a shared scratch folder, /tmp itself)
    marker = os.path.join(base, "planted-package-ran")
    server = Server(os.path.join(base, "server"))
    client = None
    try:
        sdk = ZWDX(server.url, remember=False)
        room = sdk.create_room("m5")
        sdk.room_token = room["token"]
        client = GpuClientProc(server.url, room["donor_token"], os.path.join(base, "work"), "donor-m5",
                               extra=["--no-standby"], env=PROCESSES, cwd=started_in)
        wait_until(lambda: any(c["status"] == "online" for c in sdk.get_room()["clients"]), 60 + SLACK,
                   what=f"the GPU client online\n{client.tail()}")
        planted = os.path.join(started_in, "gpu_client")  # what a job's code would write there
        os.makedirs(planted)
        for name in ("__init__.py", "runner.py"):
            with open(os.path.join(planted, name), "w") as fh:
                fh.write(f"import os\nopen({marker!r}, 'a').write(f'{{os.getuid()}} ran {name}\\n')\n")
        job_id = sdk.submit_job(Tiny(), loader, train, None, torch.optim.SGD(Tiny().parameters(), lr=0.1), "DDP",
                                resources=zwdx.Resources(world_size=1), wait=False)
        wait_until(lambda: os.path.exists(marker) or sdk.get_job(job_id)["status"] in ("completed", "failed"),
                   120 + SLACK, what=f"job {job_id} ended\n{client.tail()}")
        assert not os.path.exists(marker), f"the planted package ran: {open(marker).read()}"
        result = sdk.wait(job_id, progress=False, timeout=30)
        assert result["status"] == "completed", result
        assert result["results"]["gpu_client_from"] != planted
    finally:
        if client is not None:
            client.stop()
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
