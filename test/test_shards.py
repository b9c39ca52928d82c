"""zwdx's sharded checkpoint (``gpu_client/rank/shards.py``): FSDP ranks write their shards as
safetensors with a JSON index, no pickle; a job of another world size reads them back resharded
(2 ranks -> 1, 2, 3), reading only the files whose shards it needs, and a file that does not fit
its index, or an index that does not fit the model, is refused.

Real torch.distributed over gloo, one process per rank (``torch.multiprocessing``), FSDP2 on CPU.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from procs import free_port

pytestmark = pytest.mark.slow


def _model():
    torch.manual_seed(0)
    # 7 and 3 rows over 2 or 3 ranks: uneven shards, and a rank with no row of the last layer
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


def _sharded(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model, mesh = _model(), init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _full(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return {"model": model_sd, "optim": optim_sd["state"], "lr": [g["lr"] for g in optim_sd["param_groups"]]}


def _worker(rank: int, world: int, port: int, folder: str, mode: str, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from gpu_client.rank import shards
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model, optimizer = _sharded(world)
        if mode == "save":
            for _ in range(3):
                model(torch.randn(4, 5)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd, "rng": {"torch": torch.get_rng_state(), "rank": rank}}
            if rank == 0:
                state["tracked"] = {"StepLR-0": {"last_epoch": 3, "_last_lr": [0.025], "betas": (0.9, 0.99),
                                                 "scale": float("inf"), "none": None}}
            shards.save(state, folder, rank, world)
            result = {"full": _full(model, optimizer), "rng": torch.get_rng_state()}
        else:
            saved = len([f for f in os.listdir(folder) if f.endswith(".json")])
            indexes = [shards.read_index(os.path.join(folder, f"shard-{r}.json"), r, saved) for r in range(saved)]
            fetched = []

            def fetch(r):
                fetched.append(r)
                return os.path.join(folder, f"shard-{r}.safetensors")
            reader = shards.Reader(indexes, fetch, rank)
            try:
                model_sd, optim_sd = get_state_dict(model, optimizer)
                set_state_dict(model, optimizer, model_state_dict=reader.value("model", model_sd),
                               optim_state_dict=reader.value("optim", optim_sd))
                result = {"full": _full(model, optimizer), "fetched": sorted(set(fetched)),
                          "rng": reader.value("rng") if reader.has("rng", rank) else None,
                          "tracked": reader.value("tracked", rank=0)}
            except ValueError as exc:
                result = {"error": str(exc)}
            finally:
                reader.close()
        torch.save(result, f"{out}-{rank}.pt")
        # Every rank done with the group before rank 0, which serves its store, tears it down (as a
        # rank's finish does): once, rank 0 aborted in teardown ("terminate called without an active
        # exception") while a peer still read or wrote.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(world: int, folder: str, mode: str, out: str) -> list[dict]:
    mp.spawn(_worker, args=(world, free_port(), folder, mode, out), nprocs=world)
    return [torch.load(f"{out}-{rank}.pt", weights_only=True) for rank in range(world)]


def _same(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys() and a["lr"] == b["lr"]
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for name, states in a["optim"].items():
        for key, value in states.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["optim"][name][key])), (name, key)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoint")
    ranks = run(2, str(folder), "save", str(folder / "saved"))
    return str(folder), ranks


def test_each_rank_writes_safetensors_and_a_json_index_and_no_pickle(saved):
    folder, _ = saved
    from safetensors import safe_open
    assert sorted(f for f in os.listdir(folder) if f.startswith("shard-")) == [
        "shard-0.json", "shard-0.safetensors", "shard-1.json", "shard-1.safetensors"]
    for rank in (0, 1):
        with open(os.path.join(folder, f"shard-{rank}.json")) as fh:
            index = json.load(fh)
        assert index["format"] == "zwdx-shards-1" and index["rank"] == rank and index["world_size"] == 2
        weight = dict(index["tree"]["dict"])["model"]["dict"][0]
        assert weight[0] == "0.weight" and weight[1]["shape"] == [7, 5] and weight[1]["dtype"] == "float32"
        assert weight[1]["offset"] == [[0, 0], [4, 0]][rank] and weight[1]["local"] == [[4, 5], [3, 5]][rank]
        with safe_open(os.path.join(folder, f"shard-{rank}.safetensors"), framework="pt") as fh:
            assert list(fh.get_slice(weight[1]["dtensor"]).get_shape()) == weight[1]["local"]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_checkpoint_of_two_ranks_restores_on_any_world_size(saved, tmp_path, world):
    folder, before = saved
    after = run(world, folder, "load", str(tmp_path / "loaded"))
    for rank, got in enumerate(after):
        assert "error" not in got, got
        _same(before[0]["full"], got["full"])
        # this rank's generators where the checkpoint has the rank, and the tracked state (rank 0's)
        if rank < 2:
            assert torch.equal(got["rng"]["torch"], before[rank]["rng"]) and got["rng"]["rank"] == rank
        assert got["tracked"] == {"StepLR-0": {"last_epoch": 3, "_last_lr": [0.025], "betas": (0.9, 0.99),
                                               "scale": float("inf"), "none": None}}
    # each rank reads only the files that hold what it needs
    assert [got["fetched"] for got in after] == {1: [[0, 1]], 2: [[0], [1]], 3: [[0], [0, 1], [0, 1]]}[world]


def test_a_shard_that_does_not_fit_its_index_is_refused(saved, tmp_path):
    folder, _ = saved
    import shutil
    forged = tmp_path / "forged"
    shutil.copytree(folder, forged)
    with open(forged / "shard-1.json") as fh:
        index = json.load(fh)
    weight = dict(index["tree"]["dict"])["model"]["dict"][0][1]
    weight["offset"] = [3, 0]  # overlaps rank 0's rows and leaves row 6 to no one
    with open(forged / "shard-1.json", "w") as fh:
        json.dump(index, fh)
    got = run(1, str(forged), "load", str(tmp_path / "loaded"))[0]
    assert "overlap" in got["error"], got
    for change, says in (({"offset": [4, 0], "shape": [9, 5]}, "a tensor of shape [9, 5]"),   # another tensor
                         ({"offset": [5, 0], "local": [2, 5]}, "its index says [2, 5]")):     # not the file's
        weight.update({"offset": [4, 0], "local": [3, 5], "shape": [7, 5], **change})
        with open(forged / "shard-1.json", "w") as fh:
            json.dump(index, fh)
        got = run(1, str(forged), "load", str(tmp_path / f"loaded-{says[:5]}"))[0]
        assert says in got["error"], got
