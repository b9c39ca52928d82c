"""PIPELINE and the data (issue 30 item 2): with a shuffled ``DataLoader`` (``shuffle=True``, no
seed, no generator) every stage's loader draws its own order, yet the last stage's loss must see
the targets of the inputs the first stage ran; and a model without repeated blocks (an
``nn.Sequential`` of mixed layers) is cut by its children, balanced by parameters, or refused at
submit naming ``pipeline.stage_plan``. The jobs run with a server and two GPU clients (CPU slots,
gloo) on a small separable 10-class task; the returned weights equal, bit for bit, one process's
trained on the same micro-batches in the order the first stage drew them, with the ranks' threads."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import zwdx
from zwdx import ZWDX
from zwdx.errors import BadRequest

CLASSES, DIM, BATCH, EPOCHS, LR = 10, 16, 32, 2, 0.1


def blobs(n: int, seed: int) -> TensorDataset:
    """A 10-class task one layer separates: each class a point, each sample near its class's."""
    centers = torch.randn(CLASSES, DIM, generator=torch.Generator().manual_seed(0)) * 3
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return TensorDataset(centers[y] + 0.5 * torch.randn(n, DIM, generator=g), y)


def shuffled_loaders(rank, world_size):
    """What a user writes: shuffle=True, no seed, no generator."""
    return (DataLoader(blobs(512, 1), batch_size=BATCH, shuffle=True, drop_last=True),
            DataLoader(blobs(256, 2), batch_size=64))


class SomeOfThem(torch.utils.data.Sampler):
    """Each pass a random number of random samples (a filter, a curriculum): no two stages' loaders
    would agree on how many batches a pass has."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(torch.randperm(self.n)[:BATCH * int(torch.randint(8, 16, ()))].tolist())

    def __len__(self):
        return self.n


def random_length_loaders(rank, world_size):
    train = blobs(512, 1)
    return (DataLoader(train, batch_size=BATCH, sampler=SomeOfThem(len(train)), drop_last=True),
            DataLoader(blobs(256, 2), batch_size=64))


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.relu(self.fc(x))


class BlockNet(nn.Module):
    """Repeated blocks between an input layer and a head: the automatic plan's kind of model."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, 32)
        self.blocks = nn.ModuleList([Block(32) for _ in range(4)])
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def block_net(seed: int = 0) -> BlockNet:
    torch.manual_seed(seed)
    return BlockNet()


def mixed_sequential(seed: int = 0) -> nn.Sequential:
    """No two children of one class in a row to call blocks: cut by its children, by parameters."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIM, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, CLASSES))


def train(model, loader, optimizer, epochs, pipeline):
    """docs/modes/pipeline.md's loop; it also says which samples each step drew (rank 0's answer is the job's)."""
    rows = {tuple(r.tolist()): i for i, r in enumerate(loader.dataset.tensors[0])}
    model.train()
    order, loss = [], None
    for _ in range(epochs):
        for x, y in loader:
            order.append([rows[tuple(r.tolist())] for r in x])
            optimizer.zero_grad()
            loss = pipeline.step(x, y, F.cross_entropy)
            optimizer.step()
    return {"loss": loss.item(), "order": order, "threads": torch.get_num_threads()}


def evaluate(model, loader, device):
    model.eval()
    right = total = 0
    with torch.no_grad():
        for x, y in loader:
            right += (model(x.to(device)).argmax(-1) == y.to(device)).sum().item()
            total += len(y)
    return {"accuracy": right / total}


def alone(make, order: list[list[int]], microbatches: int, threads: int) -> nn.Module:
    """One process on the same micro-batches in the same order, each batch's gradient as the
    pipeline's schedule forms it: every micro-batch's summed, then divided by their number; with
    the ranks' threads (a CPU matrix product's sums are split by them: 1e-7 apart otherwise)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _alone(make, order, microbatches)
    finally:
        torch.set_num_threads(before)


def _alone(make, order: list[list[int]], microbatches: int) -> nn.Module:
    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x_all, y_all = blobs(512, 1).tensors
    for idx in order:
        x, y = x_all[idx], y_all[idx]
        optimizer.zero_grad()
        for xm, ym in zip(x.tensor_split(microbatches), y.tensor_split(microbatches)):
            F.cross_entropy(model(xm), ym).backward()
        for p in model.parameters():
            p.grad.div_(microbatches)
        optimizer.step()
    return model


def accuracy(model) -> float:
    return evaluate(model, shuffled_loaders(0, 1)[1], "cpu")["accuracy"]


def worst_relative(a: nn.Module, b: nn.Module) -> float:
    """The largest difference of two models' tensors, relative to the tensor's largest value."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max(((sa[k] - sb[k]).abs().max() / sb[k].abs().max().clamp_min(1e-12)).item() for k in sa)


# -- where a model without repeated blocks is cut, and what the SDK refuses ----------------------------
def test_a_sequential_of_mixed_layers_is_cut_by_its_children_balanced_by_parameters():
    from gpu_client.rank.strategies.pipeline import split_points
    points, line = split_points(mixed_sequential(), None, 2)
    # parameters: 1088, 128, 0 | 4160, 0, 650: the cut nearest to half, before a layer that has some
    assert points == ["3"], line
    assert line == "PIPELINE: 2 stages over 6 children, by parameters: 0..2, 3..5"
    assert split_points(mixed_sequential(), None, 3)[0] == ["3", "5"]
    assert split_points(mixed_sequential(), [[0, 4], [4, 6]], 2)[0] == ["4"]  # ranges of the children
    assert split_points(block_net(), None, 2)[0] == ["blocks.2"]  # repeated blocks: as before


class TwoLayers(nn.Module):
    """Neither repeated blocks nor a Sequential: nothing the default plan can cut."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(DIM, 8), nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("make, fields, says", [
    (TwoLayers, {}, "no repeated blocks and no nn.Sequential"),
    (lambda: nn.Sequential(nn.Linear(DIM, CLASSES), nn.ReLU()), {"resources": zwdx.Resources(world_size=3)},
     "2 children of its nn.Sequential (the model itself) cannot make 3 stages"),
    (mixed_sequential, {"strategy": zwdx.Pipeline(stage_plan=[[0, 2], [2, 5]])}, "the model has 6 children of its nn.Sequential"),
    (block_net, {"resources": zwdx.Resources(world_size=5)}, "4 repeated blocks cannot make 5 stages")])
def test_a_model_the_default_plan_cannot_cut_is_refused_at_submit_naming_the_stage_plan(make, fields, says):
    sdk = ZWDX("http://127.0.0.1:9", room_token="zs_unused", remember=False)  # nothing listens: nothing is sent
    with pytest.raises(BadRequest) as err:
        sdk.submit_job(make(), shuffled_loaders, train, parallelism="PIPELINE", **fields)
    assert err.value.field == "pipeline.stage_plan"
    assert says in str(err.value)


def test_a_model_the_default_plan_can_cut_passes_the_sdks_checks():
    from zwdx.checks import check_pipeline
    check_pipeline(mixed_sequential(), None, 2)
    check_pipeline(mixed_sequential(), [[0, 3], [3, 6]], 2)
    check_pipeline(block_net(), None, 4)
    check_pipeline(TwoLayers(), ["b"], 2)  # a plan by names cuts anything


# -- jobs ------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("make, loaders", [(block_net, shuffled_loaders), (mixed_sequential, shuffled_loaders),
                                           (block_net, random_length_loaders)])
def test_a_shuffled_loader_trains_as_one_process_on_the_first_stages_batches(cluster, make, loaders):
    model = make()
    result = cluster.sdk.submit_job(model, loaders, train, evaluate, torch.optim.SGD(model.parameters(), lr=LR),
                                    "PIPELINE", resources=zwdx.Resources(world_size=2),
                                    training=zwdx.Training(epochs=EPOCHS, collective_timeout=60),
                                    run=zwdx.Run(progress=False, timeout=240))
    assert result["status"] == "completed", result
    order = result["results"]["order"]
    assert order[0] != list(range(BATCH))  # shuffled
    assert len(order) == EPOCHS * 512 // BATCH if loaders is shuffled_loaders else 16 <= len(order) < 32

    single = alone(make, order, microbatches=2, threads=result["results"]["threads"])
    trained = cluster.sdk.get_trained_model(result["job_id"], make(seed=1))
    got, want = result["results"]["accuracy"], accuracy(single)
    print(f"\n{make.__name__}, {loaders.__name__}: {len(order)} steps, held-out accuracy {got:.3f}, "
          f"one process {want:.3f}, "
          f"weights' worst relative difference {worst_relative(trained, single):.2e} "
          f"({result['results']['threads']} thread(s))")
    assert want > 0.9 and got >= want - 0.02
    assert worst_relative(trained, single) == 0.0  # bit for bit: the split adds no arithmetic
