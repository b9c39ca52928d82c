"""Ordinary language models for the FSDP/DDP tests, tiny: a Hugging Face GPT-2 built from a
config (no download) and a model in nanoGPT's shape (``transformer`` a ModuleDict of
embeddings, a ModuleList of blocks and a final norm; ``lm_head`` tied to the token embedding;
AdamW with a decay and a no-decay group). Also a small BatchNorm model, whose running statistics
differ per rank, and the synthetic token data, training and eval functions the jobs run.

Used by test/test_models.py (CPU, gloo) and test/gpu_e2e.py (NCCL).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

VOCAB, SEQ = 64, 24


# -- a model in nanoGPT's shape --------------------------------------------------------------------
@dataclass
class GPTConfig:
    vocab_size: int = VOCAB
    block_size: int = SEQ
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 48


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in self.c_attn(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig | None = None):
        super().__init__()
        self.config = config = config or GPTConfig()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay=0.1, lr=3e-3):
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=lr)


def gpt2(seed: int = 0):
    """A Hugging Face GPT2LMHeadModel from a tiny config: nothing downloaded."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=48, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def nanogpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT()


def tied(model) -> bool:
    """The token embedding and the LM head are one Parameter."""
    inner = model.transformer
    wte = inner.wte if hasattr(inner, "wte") else inner["wte"]
    return wte.weight is model.lm_head.weight


# -- losses: the same on the ranks and locally ------------------------------------------------------
def hf_loss(model, x):
    return model(input_ids=x, labels=x).loss  # shifts the labels itself


def nano_loss(model, x):
    return model(x[:, :-1], x[:, 1:])[1]


# -- data ------------------------------------------------------------------------------------------
def tokens(n: int, seed: int) -> torch.Tensor:
    """Arithmetic sequences modulo VOCAB with a step of 1 to 4: learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    step = torch.randint(1, 5, (n, 1), generator=g)
    return (start + step * torch.arange(SEQ)) % VOCAB


def eval_tokens() -> torch.Tensor:
    return tokens(64, seed=2)


def lm_loaders(rank, world_size):
    """(train, eval): 256 training sequences, 64 held out, 16 a batch, split over the ranks."""
    train, held_out = TensorDataset(tokens(256, seed=1)), TensorDataset(eval_tokens())
    return (DataLoader(train, batch_size=16, sampler=DistributedSampler(train, world_size, rank, seed=0)),
            DataLoader(held_out, batch_size=16, sampler=DistributedSampler(held_out, world_size, rank, shuffle=False)))


# -- what a job runs -------------------------------------------------------------------------------
def local_numel(model) -> int:
    """Elements of the parameters this rank holds: about 1/world of them when sharded."""
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())


def lm_train(loss_fn, pause: float = 0.0):
    """A plain training loop. It reports the parameters each rank holds, its param groups, the loss
    per step, and the loss on a fixed batch after each epoch's last step (the weights the epoch's
    checkpoint saves) and, resumed, before the first step (the weights restored). ``pause``:
    seconds of sleep per step, for a test that acts mid-job."""
    def train(model, loader, optimizer, rank, world_size, epochs, reporter, device):
        reporter.log_metrics(local_params=local_numel(model), total_params=sum(p.numel() for p in model.parameters()),
                             param_groups=len(optimizer.param_groups))
        if reporter.resume:
            reporter.log_metrics(probe_loss_resumed=probe_loss(model, loss_fn, device))
        model.train()
        loss = torch.tensor(0.0)
        for epoch in range(reporter.start_epoch, epochs):
            loader.sampler.set_epoch(epoch)
            for i, (x,) in enumerate(loader):
                optimizer.zero_grad()
                loss = loss_fn(model, x.to(device))
                loss.backward()
                optimizer.step()
                reporter.log_metrics(loss=loss.item(), epoch=epoch)
                if i == len(loader) - 1:
                    reporter.log_metrics(**{f"probe_loss_epoch_{epoch}": probe_loss(model, loss_fn, device)})
                time.sleep(pause)
        return loss.item()
    return train


def probe_loss(model, loss_fn, device="cpu") -> float:
    return mean_loss(model, loss_fn, [eval_tokens()[:16]], device)


def lm_eval(loss_fn):
    def evaluate(model, loader, device):
        return {"eval_loss": mean_loss(model, loss_fn, loader, device)}
    return evaluate


def mean_loss(model, loss_fn, batches, device="cpu") -> float:
    """Mean loss per sequence over every rank's batches (or, alone, over all of them)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for batch in batches:
            x = batch[0] if isinstance(batch, (list, tuple)) else batch
            total[0] += loss_fn(model, x.to(device)).double() * len(x)
            total[1] += len(x)
    if dist.is_initialized():
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def local_eval_loss(model, loss_fn) -> float:
    """What eval_func reports, recomputed here on the returned weights."""
    return mean_loss(model, loss_fn, eval_tokens().split(16))


# -- BatchNorm: buffers that differ per rank -------------------------------------------------------
def bn_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def bn_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g) * torch.linspace(0.5, 3.0, 8) + 1.0
    return TensorDataset(x, (x[:, :4].argmax(1)))


def bn_loaders(rank, world_size):
    train, held_out = bn_data(256, seed=1), bn_data(64, seed=2)
    return (DataLoader(train, batch_size=16, sampler=DistributedSampler(train, world_size, rank, seed=0)),
            DataLoader(held_out, batch_size=16, sampler=DistributedSampler(held_out, world_size, rank, shuffle=False)))


def bn_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def bn_train(model, loader, optimizer, epochs, reporter, device):
    model.train()
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            bn_loss(model, (x.to(device), y.to(device))).backward()
            optimizer.step()
    # this rank's running statistics, before zwdx gives every rank rank 0's
    norm = next(m for m in model.modules() if isinstance(m, nn.BatchNorm1d))
    reporter.log_metrics(running_mean=norm.running_mean.sum().item())


def bn_eval(model, loader, device):
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for x, y in loader:
            total[0] += bn_loss(model, (x.to(device), y.to(device))).double() * len(x)
            total[1] += len(x)
    dist.all_reduce(total)
    return {"eval_loss": (total[0] / total[1]).item()}


def bn_local_eval_loss(model) -> float:
    model.eval()
    x, y = bn_data(64, seed=2).tensors
    with torch.no_grad():
        return sum(bn_loss(model, (xb, yb)).double().item() * len(xb)
                   for xb, yb in zip(x.split(16), y.split(16))) / len(x)



# -- a pipeline's model: tokens in, logits out, nothing tied ---------------------------------------
class StageLM(nn.Module):
    """nanoGPT's blocks without the loss inside or tied weights: what a pipeline cuts into stages
    (the loss is the last stage's ``loss_fn``)."""

    def __init__(self, config: GPTConfig | None = None):
        super().__init__()
        config = config or GPTConfig(n_layer=4)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


def stage_lm(seed: int = 0) -> StageLM:
    torch.manual_seed(seed)
    return StageLM()


def next_token_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.reshape(-1))


def shifted(t: torch.Tensor) -> TensorDataset:
    return TensorDataset(t[:, :-1], t[:, 1:])


def pipe_loaders(rank, world_size):
    """(train, eval) of (tokens, next tokens); a pipeline is one replica, told rank 0 of 1."""
    train = shifted(tokens(128, seed=1))
    return (DataLoader(train, batch_size=16, drop_last=True,
                       sampler=DistributedSampler(train, world_size, rank, seed=0)),
            DataLoader(shifted(eval_tokens()), batch_size=16))


def pipe_train(model, loader, optimizer, epochs, reporter, pipeline):
    """The plain loop, with ``pipeline.step`` where forward and backward were."""
    model.train()
    loss = None
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = pipeline.step(x, y, next_token_loss)
            optimizer.step()
            reporter.log_metrics(loss=loss.item())
    return loss.item()


def pipe_train_then_wait(model, loader, optimizer, epochs, reporter, pipeline, start_epoch):
    """``pipe_train`` from ``start_epoch`` on; the first attempt stops as epoch 1 begins (epoch 0's
    checkpoint is taken as that pass starts) and waits there for its GPU client to be taken away."""
    import time
    model.train()
    loss = None
    for epoch in range(start_epoch, epochs):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            if epoch == 1 and reporter.resume is None:
                time.sleep(3600)
            optimizer.zero_grad()
            loss = pipeline.step(x, y, next_token_loss)
            optimizer.step()
            reporter.log_metrics(loss=loss.item())
    return loss.item()


def pipe_eval(model, loader, device):
    """Mean loss per sequence over the held-out batches (one replica: no all-reduce)."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            total += next_token_loss(model(x.to(device)), y.to(device)).double().item() * len(x)
            count += len(x)
    return {"eval_loss": total / count}


def pipe_local_eval_loss(model) -> float:
    return pipe_eval(model, DataLoader(shifted(eval_tokens()), batch_size=16), "cpu")["eval_loss"]


def pipe_alone(epochs: int, microbatches: int, seed: int = 0) -> tuple[StageLM, list[float]]:
    """The same training in one process, each batch split into the same micro-batches, each
    micro-batch's loss scaled by 1/micro-batches: what a pipeline of any split must equal."""
    model = stage_lm(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader, _ = pipe_loaders(0, 1)
    losses = []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            parts = [next_token_loss(model(xm), ym) for xm, ym in zip(x.tensor_split(microbatches),
                                                                     y.tensor_split(microbatches))]
            for part in parts:
                (part / microbatches).backward()
            optimizer.step()
            losses.append(torch.stack([p.detach() for p in parts]).mean().item())
    return model, losses
