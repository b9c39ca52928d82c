"""A zoo of small seeded models of the kinds users write, each a ``Case`` the parity harness
trains in one process and as a zwdx job (``harness.py``). Each trains in about a second on CPU.

    from parity.zoo import CASES, case
    c = case("dropout")
    c.model()            # the same initial weights on every call (seeded)
    c.data()             # the training set, the same on every call
    c.loss(model, batch) # a mean over the batch
    c.batch, c.epochs    # the global batch (samples per optimizer step over all replicas), passes

What each case exercises: ``mlp`` a shuffled loader (``DistributedSampler(shuffle=True)``,
``set_epoch``: the loader the manual asks for); ``unsharded`` a plain ``DataLoader(shuffle=True)``
written for one process (no sampler); ``dropout`` the replicas' random generators;
``batchnorm`` per-replica batch statistics and buffers; ``tied_lm`` a nanoGPT (test/models.py:
tied embeddings, LayerNorm and residual blocks, two param groups); ``residual`` LayerNorm +
residual MLP blocks (FSDP units, TP pairs); ``sequential`` an ``nn.Sequential`` of mixed layers;
``hf_gpt2`` a Hugging Face GPT-2 built from a config; ``augment`` random augmentation drawn in
the dataset and in the collate function. Cases are plain module-level objects: the job's
functions close over them and travel by value with the bundle.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import models  # test/models.py

#: Every case's seed: model init, data, and (plus the replica's index) the replicas' generators.
SEED = 0


@dataclass(frozen=True)
class Case:
    """One model of the zoo. ``model``/``data`` are factories (seeded: equal on every call);
    ``loss(model, batch)`` a mean over the batch; ``batch`` the global batch (the replicas split
    it); ``collate`` the DataLoader's (None: the default); ``lr`` the optimizer's (SGD with momentum,
    see ``make_optimizer``); ``optimizer(model)`` overrides it (a case with param groups); ``tp`` whether TP can split it (Linear pairs);
    ``needs``: packages it imports (its tests skip where absent, CI has them); ``independent``:
    a sample's output depends on it alone and nothing is drawn at random (no BatchNorm, dropout
    or augmentation), so any split of a global batch trains alike; ``sharded``: the loader has a
    ``DistributedSampler`` (the manual's advice; False: ``DataLoader(shuffle=True)`` as written for
    one process, every replica reading the whole set, ``batch`` samples a step each)."""
    name: str
    model: Callable[[], nn.Module]
    data: Callable[[], Dataset]
    loss: Callable
    batch: int = 16
    epochs: int = 2
    lr: float = 0.05
    shuffle: bool = True
    collate: Callable | None = None
    optimizer: Callable | None = None
    tp: bool = False
    independent: bool = True
    sharded: bool = True
    needs: tuple = field(default_factory=tuple)

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """SGD with momentum: linear in the gradients, so round-off stays round-off. (Adam divides
        each gradient by its own running scale: a gradient that is zero but for round-off, as
        attention's key bias has, becomes a step of ``lr`` whose sign is the round-off's, and two
        correct single-process runs that sum in another order differ by 1e-3 within 20 steps.)"""
        if self.optimizer is not None:
            return self.optimizer(model)
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9)


def seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """``build`` under ``torch.manual_seed(SEED)``, without moving the caller's generator."""
    def make() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            return build()
    make.__name__ = getattr(build, "__name__", "model")
    return make


# -- data ------------------------------------------------------------------------------------------
def blobs(n: int = 64, dim: int = 8, classes: int = 4) -> TensorDataset:
    """Points whose class is the argmax of their first ``classes`` features, scaled unevenly."""
    g = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(n, dim, generator=g) * torch.linspace(0.5, 2.0, dim) + 0.5
    return TensorDataset(x, x[:, :classes].argmax(1))


def token_rows(n: int = 48) -> TensorDataset:
    return TensorDataset(models.tokens(n, seed=SEED + 1)[:, :LM_SEQ])


def classify(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


# -- models ----------------------------------------------------------------------------------------
def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def dropout_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 32), nn.ReLU(),
                         nn.Dropout(0.3), nn.Linear(32, 4))


def batchnorm_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


class ResidualBlock(nn.Module):
    """Pre-norm residual MLP: ``x + down(gelu(up(norm(x))))``."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Residual(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 2):
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.blocks = nn.ModuleList([ResidualBlock(dim) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 4)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def mixed_sequential() -> nn.Module:
    """No repeated blocks: a Conv1d over the features, pooling, norms, activations, a Linear head."""
    return nn.Sequential(nn.Unflatten(1, (1, 8)), nn.Conv1d(1, 4, 3, padding=1), nn.GELU(), nn.MaxPool1d(2),
                         nn.Flatten(), nn.LayerNorm(16), nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4))


LM_SEQ = 12
LM_CONFIG = models.GPTConfig(block_size=LM_SEQ, n_layer=2, n_head=2, n_embd=32)


def tied_lm() -> nn.Module:
    return models.GPT(LM_CONFIG)


def lm_loss(model, batch):
    (x,) = batch
    return model(x[:, :-1], x[:, 1:])[1]


def lm_optimizer(model) -> torch.optim.Optimizer:
    """nanoGPT's two param groups (decay for matrices, none for biases and norms), over SGD."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
                            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                           lr=0.1, momentum=0.9)


def hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=models.VOCAB, n_positions=LM_SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return GPT2LMHeadModel(config)


def hf_loss(model, batch):
    (x,) = batch
    return model(input_ids=x, labels=x, use_cache=False).loss


# -- an augmentation drawn from the global generator, in the dataset and in the collate ------------
class Jittered(Dataset):
    """``blobs`` whose each sample is flipped in sign at random (a draw per ``__getitem__``)."""

    def __init__(self):
        self.inner = blobs()

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        x, y = self.inner[i]
        sign = 1.0 if torch.rand(()) < 0.8 else -1.0
        return x * sign, y


def noisy_collate(samples):
    """The default collate, then Gaussian noise on the inputs (a draw per batch)."""
    x = torch.stack([s[0] for s in samples])
    y = torch.stack([s[1] for s in samples])
    return x + 0.1 * torch.randn_like(x), y


CASES: list[Case] = [
    Case("mlp", seeded(mlp), blobs, classify),
    Case("unsharded", seeded(mlp), blobs, classify, sharded=False),
    Case("dropout", seeded(dropout_mlp), blobs, classify, independent=False),
    Case("batchnorm", seeded(batchnorm_mlp), blobs, classify, independent=False),
    Case("tied_lm", seeded(tied_lm), token_rows, lm_loss, optimizer=lm_optimizer, tp=True),
    Case("residual", seeded(Residual), blobs, classify, tp=True),
    Case("sequential", seeded(mixed_sequential), blobs, classify),
    Case("hf_gpt2", seeded(hf_gpt2), token_rows, hf_loss, lr=0.1, needs=("transformers",)),
    Case("augment", seeded(mlp), Jittered, classify, collate=noisy_collate, independent=False),
]

#: The cases by name.
BY_NAME = {c.name: c for c in CASES}


def case(name: str) -> Case:
    return BY_NAME[name]
