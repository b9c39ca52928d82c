"""TP and FSDP+TP: the settings checked at the edge and by the SDK (in-process), the placement of a
TP group on one GPU client, the derived plan; and, with a server and two GPU clients of two CPU
slots each (gloo), a small transformer trained with a derived and an explicit plan on one client
(each step's loss is one process's, the returned weights evaluate here to the loss the job
reported) and FSDP+TP over both clients (dp 2 x tp 2); the shards checkpoint of an FSDP+TP model
read back into a fresh one; a TP job no client can hold waits saying why; a TP job whose GPU
client is lost goes on from its checkpoint on the other."""
from __future__ import annotations

import math
import platform
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from conftest import Cluster
from procs import free_port, wait_until
from earlier_form import earlier_form
import zwdx
from zwdx import ZWDX, tp_plan
from zwdx.errors import BadRequest
from zwdx.server.placement import plan as place

VOCAB, SEQ, DIM = 32, 8, 16


# -- a small transformer: attention (q, k, v, o) and an MLP (up, down) in each block ---------------
class Attention(nn.Module):
    def __init__(self, dim: int, n_head: int, sdpa: bool):
        super().__init__()
        self.n_head, self.sdpa = n_head, sdpa
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.register_buffer("mask", torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ), persistent=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z(x).view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (self.q, self.k, self.v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # a plain mask buffer meets the split heads
            att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.n_head)
            y = F.softmax(att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf")), dim=-1) @ v
        return self.o(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, n_head: int, sdpa: bool):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.mlp = Attention(dim, n_head, sdpa), MLP(dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, n_head: int = 2, dim: int = DIM):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList([Block(dim, n_head, sdpa=False), Block(dim, n_head, sdpa=True)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def tiny(seed: int = 0, n_head: int = 2, dim: int = DIM) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(n_head, dim)


DERIVED = {f"blocks.{i}.{m}": s for i in (0, 1) for m, s in
           [("attn.q", "colwise"), ("attn.k", "colwise"), ("attn.v", "colwise"), ("attn.o", "rowwise"),
            ("mlp.up", "colwise"), ("mlp.down", "rowwise")]}


def tokens(n: int, seed: int) -> TensorDataset:
    t = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return TensorDataset(t[:, :-1], t[:, 1:])


def loaders(rank, world_size):
    """(train, eval): the training data sharded by the dp rank (a TP group reads the same); every
    rank evaluates on all of the held-out data."""
    train = tokens(64, seed=1)
    return (DataLoader(train, batch_size=8, sampler=DistributedSampler(train, world_size, rank, shuffle=False)),
            DataLoader(tokens(16, seed=2), batch_size=8))


def lm_loss(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def train(model, loader, optimizer, epochs, reporter):
    torch.set_num_threads(1)
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = lm_loss(model, x, y)
            loss.backward()
            optimizer.step()
            reporter.log_metrics(loss=loss.item())
    return loss.item()


def evaluate(model, loader):
    with torch.no_grad():
        losses = [lm_loss(model, x, y).double().item() for x, y in loader]
    return {"eval_loss": sum(losses) / len(losses)}


def local_eval_loss(model) -> float:
    return evaluate(model, loaders(0, 1)[1])["eval_loss"]


def alone(epochs: int) -> tuple[TinyLM, list[float]]:
    """The same training in one process: what a TP group of any size must equal."""
    torch.set_num_threads(1)
    model = tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(epochs):
        for x, y in loaders(0, 1)[0]:
            optimizer.zero_grad()
            loss = lm_loss(model, x, y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return model, losses


# -- the settings, at the edge and in the SDK ------------------------------------------------------
def test_a_tp_job_is_one_group_on_one_gpu_client_and_fsdp_tp_groups_of_tp_size(api):
    job = api.submit(parallelism="tp", world_size=2, tp_plan={"blocks.*.mlp.up": "colwise"}).json
    assert job["spec"]["parallelism"] == "TP" and job["spec"]["resources"]["gpus_per_client"] == 2
    assert job["spec"]["strategy"] == {"type": "tp", "plan": {"blocks.*.mlp.up": "colwise"}, "size": None}
    assert api.submit(parallelism="TP", tp_size=2).json["spec"]["resources"]["world_size"] == 2
    job = api.submit(parallelism="fsdp+tp", world_size=4, tp_size=2).json
    assert (job["spec"]["parallelism"], job["spec"]["resources"]["gpus_per_client"],
            job["spec"]["strategy"]["tp"]["size"]) == ("FSDP+TP", 2, 2)
    assert api.submit(parallelism="FSDP+TP", world_size=4).json["spec"]["resources"]["gpus_per_client"] is None  # the placement's


@pytest.mark.parametrize("fields, field", [
    ({"parallelism": "TP", "tp_plan": {"blocks.*.mlp.up": "diagonal"}}, "tp_plan.blocks.*.mlp.up"),
    ({"parallelism": "TP", "tp_plan": {"blocks 0": "colwise"}}, "tp_plan"),
    ({"parallelism": "TP", "tp_plan": {}}, "tp_plan"),
    ({"parallelism": "TP", "tp_plan": ["blocks.0.mlp.up"]}, "tp_plan"),
    ({"parallelism": "DDP", "tp_plan": {"blocks.0.mlp.up": "colwise"}}, "tp_plan"),
    ({"parallelism": "FSDP", "tp_size": 2}, "tp_size"),
    ({"parallelism": "TP", "world_size": 2, "tp_size": 4}, "tp_size"),
    ({"parallelism": "FSDP+TP", "world_size": 4, "tp_size": 3}, "tp_size"),
    ({"parallelism": "FSDP+TP", "world_size": 4, "tp_size": 0}, "tp_size"),
    ({"parallelism": "FSDP+TP", "world_size": 4, "tp_size": 2, "gpus_per_client": 4}, "tp_size"),
    ({"parallelism": "TP", "world_size": 2, "gpus_per_client": 1}, "gpus_per_client"),
    ({"parallelism": "TP", "world_size": 2, "min_world_size": 1}, "min_world_size"),
    ({"parallelism": "TP", "lora": {"peft_type": "LORA"}}, "lora")])
def test_bad_settings_are_a_400_naming_the_field_and_store_nothing(api, fields, field):
    api.refused(field, **fields)


def test_the_sdk_checks_the_plan_against_the_model_before_uploading_anything():
    sdk = ZWDX("http://127.0.0.1:9", room_token="zs_unused", remember=False)  # nothing listens: nothing is sent
    with earlier_form():  # its errors name the earlier keywords
        for plan, says in [({"blocks.*.mlp.gate": "colwise"}, "names no module"),
                           ({"blocks.*.ln1": "colwise"}, "a LayerNorm: only nn.Linear and nn.Embedding"),
                           ({"blocks.0.mlp.up": "colwise", "blocks.*.mlp.up": "rowwise"}, "named twice")]:
            with pytest.raises(BadRequest, match=says) as err:
                sdk.submit_job(tiny(), loaders, train, parallelism="TP", tp_plan=plan)
            assert err.value.field == "tp_plan"
        with pytest.raises(BadRequest, match="found no pair of Linear layers to split in Sequential") as err:
            sdk.submit_job(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), loaders, train, parallelism="FSDP+TP")
        assert err.value.field == "tp_plan"
        with pytest.raises(BadRequest) as err:
            sdk.submit_job(tiny(), loaders, train, parallelism="FSDP+TP", world_size=4, tp_size=3)
        assert err.value.field == "tp_size"


def test_the_derived_plan_splits_attention_and_mlp_pairs_and_leaves_what_it_cannot_tell_whole():
    plan, skipped = tp_plan.derive(tiny())
    assert plan == DERIVED and skipped == []  # embeddings, norms and the head stay whole
    assert tp_plan.whole_heads(tiny(), plan, 2) == (plan, [])
    kept, odd = tp_plan.whole_heads(tiny(n_head=1), plan, 2)  # one head cannot be split in two
    assert set(kept) == {n for n in plan if ".mlp." in n}
    assert odd == [("blocks.0.attn", "n_head=1 does not divide by the TP size 2"),
                   ("blocks.1.attn", "n_head=1 does not divide by the TP size 2")]

    class Square(nn.Module):  # four d -> d Linear layers, none named as an output
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))
    import models  # nanoGPT's shape: a fused q/k/v (split after) stays whole, the MLP is split
    assert tp_plan.derive(models.nanogpt()) == ({f"transformer.h.{i}.mlp.{n}": s for i in (0, 1)
                                                 for n, s in (("c_fc", "colwise"), ("c_proj", "rowwise"))}, [])
    plan, skipped = tp_plan.derive(Square())
    assert plan == {} and "cannot tell which of a, b, c, d is the output projection" in skipped[0][1]
    assert tp_plan.split_sizes(tiny(), DERIVED, 3)[0] == "blocks.0.attn.q (colwise: 16 features)"


def _room(*slots_per_client: int) -> tuple[list[dict], dict]:
    clients, slots = {}, []
    for i, n in enumerate(slots_per_client):
        cid = f"c{i}"
        clients[cid] = {"id": cid, "status": "online", "versions": {"python": platform.python_version()},
                        "hostname": cid, "slots": [{"id": f"{cid}:{j}", "client_id": cid, "index": j, "kind": "cuda",
                                                    "memory_total": 80, "memory_free": 80} for j in range(n)]}
        slots += clients[cid]["slots"]
    return slots, clients


def test_placement_keeps_a_tp_group_on_one_gpu_client():
    spec = {"versions": {"python": platform.python_version()}}
    slots, clients = _room(1, 3, 2)
    chosen, _ = place({"spec": {**spec, "parallelism": "TP", "world_size": 2, "gpus_per_client": 2}}, slots, clients)
    # on one client, the smallest that holds the group whole (c2's 2 slots; c1's 3 stay free for a bigger job)
    assert {s["client_id"] for s in chosen} == {"c2"} and len(chosen) == 2
    chosen, _ = place({"spec": {**spec, "parallelism": "TP"}}, slots, clients)  # no size: the largest group
    assert [s["client_id"] for s in chosen] == ["c1"] * 3
    chosen, reason = place({"spec": {**spec, "parallelism": "TP", "world_size": 4, "gpus_per_client": 4}}, slots,
                           clients)
    assert chosen is None and "TP keeps a TP group of 4 rank(s) on one GPU client: 3 gpu client(s) have fewer" in reason
    # FSDP+TP without tp_size: the largest group every client of the job can hold alike
    chosen, _ = place({"spec": {**spec, "parallelism": "FSDP+TP", "world_size": 4}}, *_room(2, 3, 1))
    assert [s["client_id"] for s in chosen] == ["c0", "c0", "c1", "c1"]
    chosen, _ = place({"spec": {**spec, "parallelism": "FSDP+TP", "world_size": 4}}, *_room(4, 2))
    assert [s["client_id"] for s in chosen] == ["c0"] * 4


# -- the shards checkpoint of a TP model -----------------------------------------------------------
def _checkpoint_worker(rank: int, world: int, port: int, folder: str, out: str, mode: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from gpu_client.rank import shards
    from gpu_client.rank.strategies.tensor_parallel import TensorParallel
    from zwdx.protocol.vocab import Parallelism
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        def wrapped(seed: int):
            spec = SimpleNamespace(parallelism=Parallelism(mode), world_size=world, rank=rank, tp_size=2, tp_plan=None)
            model = TensorParallel(spec).wrap(tiny(seed), torch.device("cpu"), {}, print)
            return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = wrapped(0)
        x, y = tokens(8, seed=3).tensors
        lm_loss(model, x, y).backward()
        optimizer.step()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        shards.save({"model": model_sd, "optim": optim_sd}, folder, rank, world)
        dist.barrier()
        fresh, fresh_optimizer = wrapped(1)
        indexes = [shards.read_index(f"{folder}/shard-{r}.json", r, world) for r in range(world)]
        reader = shards.Reader(indexes, lambda r: f"{folder}/shard-{r}.safetensors", rank)
        model_sd, optim_sd = get_state_dict(fresh, fresh_optimizer)
        set_state_dict(fresh, fresh_optimizer, model_state_dict=reader.value("model", model_sd),
                       optim_state_dict=reader.value("optim", optim_sd))
        reader.close()
        with torch.no_grad():
            same = lm_loss(fresh, x, y).item() == lm_loss(model, x, y).item()
        from gpu_client.rank.strategies.parallel import full_state_dict
        restored, saved = full_state_dict(fresh, "FSDP", rank), full_state_dict(model, "FSDP", rank)
        if rank == 0:
            torch.save({"same_loss": same, "equal": all(torch.equal(restored[k], saved[k]) for k in saved),
                        "names": sorted(saved)}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_an_fsdp_tp_models_shards_checkpoint_reads_back_into_a_fresh_one(tmp_path):
    """dp 2 x tp 2: each split weight's FSDP shard of its TP shard is one box of the whole (a TP
    job's checkpoint is read back by a real resume, at the end of this module)."""
    out = str(tmp_path / "out.pt")
    mp.start_processes(_checkpoint_worker, args=(4, free_port(), str(tmp_path), out, "FSDP+TP"), nprocs=4,
                       start_method="fork")  # no torch import per rank
    result = torch.load(out)
    assert result["equal"] and result["same_loss"]
    assert set(result["names"]) == set(tiny().state_dict())
    index = (tmp_path / "shard-3.json").read_text()
    assert '"dtensor"' in index  # the split weights as local shards with their offsets


def _failure_worker(rank: int, world: int, port: int, out: str) -> None:
    import datetime
    import os
    from gpu_client.rank.failures import is_collective_error
    from gpu_client.rank.strategies.tensor_parallel import TensorParallel
    from zwdx.protocol.vocab import Parallelism
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    seen = {}
    x, y = tokens(4, seed=3).tensors

    def wrapped(model, plan):
        spec = SimpleNamespace(parallelism=Parallelism.TP, world_size=world, rank=rank, tp_size=world, tp_plan=plan)
        return TensorParallel(spec).wrap(model, torch.device("cpu"), {}, print)
    # the model's own error: 3 heads cannot be viewed from halves of q (a plan that splits them anyway)
    odd = wrapped(tiny(n_head=3, dim=18), {"blocks.0.attn.q": "colwise", "blocks.0.attn.o": "rowwise"})
    try:
        lm_loss(odd, x, y)
    except Exception as exc:
        seen["own"] = (is_collective_error(exc), "\n".join(getattr(exc, "__notes__", [])))
    model = wrapped(tiny(), None)  # a peer lost mid-training
    try:
        for step in range(20):
            if rank == 1 and step == 2:
                os._exit(0)
            lm_loss(model, x, y).backward()
    except Exception as exc:
        seen["lost"] = is_collective_error(exc)
    if rank == 0:
        torch.save(seen, out)
    os._exit(0)


@pytest.mark.slow
def test_a_lost_tp_peer_is_told_from_the_models_own_error(tmp_path):
    """A rank whose TP peer is gone failed by a collective (its job waits to see whether a GPU client
    was lost); an op DTensor cannot split is the model's error, naming the module."""
    out = str(tmp_path / "seen.pt")
    ranks = mp.start_processes(_failure_worker, args=(2, free_port(), out), nprocs=2, start_method="fork", join=False)
    while not ranks.join():  # one at a time: rank 1 leaves early
        pass
    seen = torch.load(out)
    assert seen["lost"] is True
    collective, notes = seen["own"]
    assert collective is False and "TP: raised in blocks.0.attn (Attention), whose q, o the TP plan splits" in notes


# -- jobs: a server and two GPU clients of two CPU slots each --------------------------------------
@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """conftest's two GPU clients, each with 2 CPU slots: a TP group of 2 on either."""
    cluster = Cluster(tmp_path_factory.mktemp("tp"), client_args=["--cpu-slots", "2"])
    yield cluster
    cluster.stop()


def _run(pool, parallelism: str, world_size: int, epochs: int = 2, **options) -> tuple[dict, dict]:
    model = tiny()
    result = pool.sdk.submit_job(model, loaders, train, evaluate, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                 parallelism, resources=zwdx.Resources(world_size=world_size),
                                 training=zwdx.Training(epochs=epochs), run=zwdx.Run(progress=False, timeout=300),
                                 **options)
    assert result["status"] == "completed", result
    return result, pool.sdk.get_job(result["job_id"])


@pytest.mark.slow
@pytest.mark.parametrize("plan, says", [
    (None, "TP (one TP group of 2): 8 colwise, 4 rowwise (blocks.0.attn.q ... blocks.1.mlp.down), derived"),
    ({"blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise", "head": "colwise"},
     "TP (one TP group of 2): 3 colwise, 2 rowwise (blocks.0.mlp.up ... head), tp_plan")])
def test_tp_on_one_gpu_client_trains_as_one_process_would(pool, plan, says):
    epochs = 2
    result, job = _run(pool, "TP", 2, epochs, strategy=zwdx.TP(plan=plan))
    assert len({p["client_id"] for p in job["placement"]}) == 1  # the group on one GPU client
    logs = [line["text"] for line in pool.sdk.get_job_logs(result["job_id"])]
    assert any(says in t for t in logs), logs

    _, losses = alone(epochs)  # the split is exact: each step's loss is one process's
    series = pool.sdk.get_job_metrics(result["job_id"])["loss"]
    assert [p["value"] for p in series if p["rank"] == 0] == pytest.approx(losses, rel=1e-4)
    assert [p["value"] for p in series if p["rank"] == 1] == pytest.approx(losses, rel=1e-4)

    trained = pool.sdk.get_trained_model(result["job_id"], tiny(seed=1))  # whole weights, plain tensors
    reported = result["results"]["eval_loss"]
    assert local_eval_loss(trained) == pytest.approx(reported, rel=1e-4)
    assert reported < local_eval_loss(tiny())  # it learned
    checkpoint = job["latest_checkpoint"]
    assert checkpoint["format"] == "shards" and {"shard-0.json", "shard-1.safetensors"} <= set(checkpoint["files"])


@pytest.mark.slow
def test_fsdp_tp_splits_within_each_gpu_client_and_shards_across_them(pool):
    result, job = _run(pool, "FSDP+TP", 4)
    by_client = {}
    for p in job["placement"]:
        by_client.setdefault(p["client_id"], []).append(p["rank"])
    assert sorted(by_client.values()) == [[0, 1], [2, 3]]  # a TP group of 2 on each GPU client
    logs = [line["text"] for line in pool.sdk.get_job_logs(result["job_id"])]
    assert any("FSDP+TP (dp 2 x tp 2): 8 colwise, 4 rowwise" in t and "FSDP units: 2 x Block" in t for t in logs), logs
    trained = pool.sdk.get_trained_model(result["job_id"], tiny(seed=1))
    assert local_eval_loss(trained) == pytest.approx(result["results"]["eval_loss"], rel=1e-4)
    assert result["results"]["eval_loss"] < local_eval_loss(tiny())
    assert job["latest_checkpoint"]["format"] == "shards" and "shard-3.json" in job["latest_checkpoint"]["files"]


@pytest.mark.slow
def test_a_tp_job_no_gpu_client_can_hold_waits_saying_why(pool):
    job_id = pool.sdk.submit_job(tiny(), loaders, train, parallelism="TP", resources=zwdx.Resources(world_size=3),
                                 run=zwdx.Run(progress=False), wait=False)
    try:
        says = "TP keeps a TP group of 3 rank(s) on one GPU client: 2 gpu client(s) have fewer than 3 such slot(s)"
        wait_until(lambda: says in (pool.sdk.get_job(job_id).get("waiting_reason") or ""), 60, what=says)
        job = pool.sdk.get_job(job_id)
        assert job["status"] == "queued" and job["placement"] is None
    finally:
        pool.sdk.cancel_job(job_id)


def resumable_train(model, loader, optimizer, epochs, reporter):
    """``train``, going on from ``reporter.start_epoch``, slowed so that a GPU client can be lost mid-job."""
    import time
    torch.set_num_threads(1)
    for _ in range(reporter.start_epoch, epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = lm_loss(model, x, y)
            loss.backward()
            optimizer.step()
            reporter.log_metrics(loss=loss.item())
            time.sleep(0.1)
    return loss.item()


@pytest.mark.slow
def test_a_tp_job_whose_gpu_client_is_lost_goes_on_from_its_checkpoint_on_another(pool):
    """Last in the module: it kills a GPU client of the pool."""
    import signal
    epochs = 6
    model = tiny()
    job_id = pool.sdk.submit_job(model, loaders, resumable_train, evaluate, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                 "TP", resources=zwdx.Resources(world_size=2), training=zwdx.Training(epochs=epochs),
                                 run=zwdx.Run(progress=False), wait=False)
    job = wait_until(lambda: (j := pool.sdk.get_job(job_id)).get("latest_checkpoint") and
                     j["latest_checkpoint"]["epoch"] >= 1 and j, 120, what="a checkpoint of epoch 1")
    first = job["placement"][0]["client_id"]
    next(c for c in pool.clients if c.client_id == first).kill(signal.SIGKILL)
    result = pool.sdk.wait(job_id, progress=False, timeout=300)
    assert result["status"] == "completed", result
    job = result["job"]
    assert {p["client_id"] for p in job["placement"]} == {"client-a", "client-b"} - {first}
    assert len(job["restart_history"]) == 1 and job["restart_history"][0]["from_checkpoint"]["epoch"] >= 1
    # resumed from the shards checkpoint (weights, AdamW's state), it trained as one uninterrupted process
    trained, losses = alone(epochs)
    assert result["final_loss"] == pytest.approx(losses[-1], rel=1e-4)
    returned = pool.sdk.get_trained_model(job_id, tiny(seed=1))
    assert local_eval_loss(returned) == pytest.approx(result["results"]["eval_loss"], rel=1e-4)
    assert local_eval_loss(returned) == pytest.approx(local_eval_loss(trained), rel=1e-3)
