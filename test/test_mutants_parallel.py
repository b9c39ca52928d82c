"""gpu_client/rank/strategies/parallel.py called in this process (issue 31 item 3: its mutation
score): the strategy's answers, ``wrap``'s calls, the FSDP plan and its line, buffer sync, the
optimizer rebuilt by name, the gathered weights and their fingerprint. Fast lane; a process group
of one (gloo) where torch needs one, torch's collectives replaced by recorders where one rank
could not tell."""
from __future__ import annotations

import hashlib
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gpu_client.rank.strategies import parallel
from gpu_client.rank.strategies.parallel import (Collective, _depth, _plain_names, _selector, describe_plan,
                                                 fingerprint, fsdp_plan, full_state_dict, rebuild_optimizer,
                                                 sync_buffers, wrap)
from zwdx.protocol.vocab import Parallelism

torch.set_num_threads(1)
CPU = torch.device("cpu")


def spec(parallelism="DDP", rank=2, world_size=4):
    return SimpleNamespace(parallelism=Parallelism(parallelism), rank=rank, world_size=world_size,
                           master_addr="10.0.0.7", master_port=29511)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        return self.lin(x)


class Net(nn.Module):
    def __init__(self, blocks=3):
        super().__init__()
        self.embed = nn.Linear(2, 2)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.act = nn.ReLU()
        self.head = nn.Linear(2, 2)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = self.act(block(x))
        return self.head(x)


# -- the strategy's answers ------------------------------------------------------------------------
def test_the_strategy_meets_at_rank_0s_port_and_tells_the_loader_its_replica():
    strategy = Collective(spec("FSDP"))
    assert strategy.wrap_as == "FSDP" and strategy.part is False
    assert strategy.rendezvous() == {"init_method": "tcp://10.0.0.7:29511", "rank": 2, "world_size": 4}
    assert strategy.loader_arguments() == {"rank": 2, "world_size": 4}
    assert strategy.replicas() == 4
    assert strategy.train_arguments() == {"pipeline": None}
    assert strategy.uploads_weights() is False and Collective(spec(rank=0)).uploads_weights() is True
    assert strategy.global_fingerprint(nn.Linear(1, 1), {}) is None
    loader = object()
    assert strategy.train_loader(loader) is loader
    seen = []
    assert strategy.loaders(lambda arguments: seen.append(arguments) or ("train", "eval"), {}, CPU) \
        == ("train", "eval")
    assert seen == [{"rank": 2, "world_size": 4}]
    model = nn.Linear(1, 1)
    assert strategy.evaluated(model, CPU) == (model, CPU)
    assert strategy.attach(model, None) is None and strategy.trained() is None


def test_the_strategy_wraps_with_the_bundles_units_its_report_and_its_tuning(monkeypatch):
    calls = []
    monkeypatch.setattr(parallel, "wrap", lambda *a, **k: calls.append((a, k)) or "wrapped")
    strategy = Collective(spec("FSDP"))
    strategy.tuning = SimpleNamespace(ddp_init_sync="sync?")
    moved = []

    class Moving(nn.Linear):
        def to(self, *args):
            moved.append(args)
            return self

    model, report = Moving(1, 1), print
    assert strategy.wrap(model, CPU, {"fsdp_units": [nn.Linear]}, report) == "wrapped"
    assert calls == [((model, "FSDP", CPU), {"units": [nn.Linear], "report": report, "init_sync": "sync?"})]
    assert moved == [(CPU,)]
    calls.clear()
    strategy.wrap(model, CPU, {}, None)
    assert calls[0][1]["units"] is None and calls[0][1]["report"] is None


def test_the_strategy_syncs_buffers_and_gathers_the_weights_as_it_wraps(monkeypatch):
    seen = []
    monkeypatch.setattr(parallel, "sync_buffers", lambda model: seen.append(("sync", model)))
    monkeypatch.setattr(parallel, "full_state_dict", lambda *a: seen.append(("full", *a)) or {"w": 1})
    strategy, model = Collective(spec("FSDP", rank=3)), nn.Linear(1, 1)
    strategy.sync_buffers(model)
    assert strategy.full_state(model) == {"w": 1}
    assert seen == [("sync", model), ("full", model, "FSDP", 3)]


def test_an_fsdp_layout_of_many_units_folds_them_within_the_bound_and_says_the_first_four(group_of_one):
    from zwdx.protocol.layout import MAX_MODULES
    many = nn.Sequential(*[nn.Linear(1, 1) for _ in range(MAX_MODULES + 6)])
    named = nn.Module()
    for i, layer in enumerate(many):
        named.add_module(f"m{i}", layer)
    strategy = Collective(spec("FSDP", rank=0, world_size=1))
    model = strategy.wrap(named, CPU, {"fsdp_units": nn.Linear}, report=None)
    layout = strategy.layout(model)
    assert layout["role"] == "shard" and layout["params"] == 2 * (MAX_MODULES + 6)
    assert len(layout["modules"]) == MAX_MODULES and layout["modules"][-1] == "(root)"
    assert layout["modules"][-2] == "... and 8 more"
    assert layout["text"] == f"1/1 of each of {MAX_MODULES + 7} FSDP units' weights (m0, m1, m2, m3, ..., then the root)"


@pytest.mark.parametrize("count", [4, 5])
def test_an_fsdp_layout_names_four_units_and_elides_a_fifth(group_of_one, count):
    strategy = Collective(spec("FSDP", rank=0, world_size=1))
    model = nn.Sequential()
    for name in "abcde"[:count]:
        model.add_module(name, nn.Linear(1, 1))
    layout = strategy.layout(strategy.wrap(model, CPU, {"fsdp_units": nn.Linear}, report=None))
    assert layout["text"] == f"1/1 of each of {count + 1} FSDP units' weights " \
        f"(a, b, c, d{', ...' if count == 5 else ''}, then the root)"


def test_an_fsdp_layout_of_four_blocks_folds_them(group_of_one):
    strategy = Collective(spec("FSDP", rank=0, world_size=1))
    model = strategy.wrap(Net(4), CPU, {}, report=None)
    layout = strategy.layout(model)
    assert layout["modules"] == ["blocks.0-3", "(root)"]
    assert layout["text"] == "1/1 of each of 5 FSDP units' weights (blocks.0-3, then the root)"
    assert layout["device"] == "cpu"


def test_a_ddp_layout_is_a_replica_of_the_whole_model(group_of_one):
    strategy = Collective(spec("DDP", rank=0, world_size=1))
    model = strategy.wrap(Net(2), CPU, {}, report=None)
    layout = strategy.layout(model)
    assert layout == {"params": sum(p.numel() for p in Net(2).parameters()), "device": "cpu", "role": "replica",
                      "modules": ["embed", "blocks.0-1", "head"], "text": "the whole model (replica 0 of 1)"}


# -- wrap --------------------------------------------------------------------------------------------
class Recorded:
    def __init__(self, model, **kwargs):
        self.module, self.kwargs = model, kwargs


def test_ddp_on_cpu_is_watched_and_keeps_the_init_sync_it_is_given(monkeypatch):
    import torch.nn.parallel
    watched = []
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", Recorded)
    monkeypatch.setattr(parallel, "watch_gradients", watched.append)
    model = nn.Linear(1, 1)
    out = wrap(model, "DDP", CPU, init_sync=False)
    assert out.module is model and out.kwargs == {"device_ids": None, "init_sync": False}
    assert watched == [out]
    assert wrap(model, "DDP", CPU).kwargs["init_sync"] is True


def test_ddp_on_a_gpu_names_its_device_and_is_not_watched(monkeypatch):
    import torch.nn.parallel
    watched = []
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", Recorded)
    monkeypatch.setattr(parallel, "watch_gradients", watched.append)
    out = wrap(nn.Linear(1, 1), "DDP", torch.device("cuda", 1))
    assert out.kwargs["device_ids"] == [1] and watched == []


def test_fsdp_shards_inner_units_before_outer_then_the_root_and_rank_0_reports(monkeypatch, caplog):
    import torch.distributed.device_mesh
    import torch.distributed.fsdp
    sharded, meshes, reports = [], [], []
    monkeypatch.setattr(torch.distributed.device_mesh, "init_device_mesh",
                        lambda kind, shape: meshes.append((kind, shape)) or "mesh")
    monkeypatch.setattr(torch.distributed.fsdp, "fully_shard",
                        lambda module, mesh: sharded.append((module, mesh)))
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 3)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 0)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(1, 1)

        def forward(self, x):
            return self.inner(x)

    model = nn.Sequential(Outer(), nn.Linear(1, 1))
    with caplog.at_level(logging.INFO, logger=parallel.__name__):
        out = wrap(model, "FSDP", CPU, units=lambda m: isinstance(m, (Outer, nn.Linear)), report=reports.append)
    assert out is model and meshes == [("cpu", (3,))]
    assert sharded == [(model[0].inner, "mesh"), (model[0], "mesh"), (model[1], "mesh"), (model, "mesh")]
    line = "FSDP units: 1 x Outer (0), 2 x Linear (0.inner, 1), then the root Sequential"
    assert reports == [line] and caplog.messages == [line]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=parallel.__name__):
        wrap(Net(2), "FSDP", CPU, units=[Block, nn.ModuleList], report=None)  # no report: only the log
    assert caplog.messages == ["FSDP units: 2 x Block (blocks.0, blocks.1), then the root Net; "
                               "left to the enclosing unit: blocks (ModuleList has no forward)"]

    monkeypatch.setattr(dist, "get_rank", lambda *a: 1)
    reports.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=parallel.__name__):
        wrap(nn.Sequential(nn.Linear(1, 1)), "FSDP", CPU, report=reports.append)
    assert reports == [] and caplog.messages == []


def test_an_unknown_parallelism_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^unknown parallelism 'TP': use DDP or FSDP$"):
        wrap(nn.Linear(1, 1), "TP", CPU)


# -- the FSDP plan -----------------------------------------------------------------------------------
def test_a_units_depth_counts_its_dotted_parts():
    assert [_depth("a"), _depth("a.b"), _depth("a.b.c")] == [1, 2, 3]


def test_the_units_select_by_one_class_a_list_a_tuple_or_a_predicate():
    lin, relu = nn.Linear(1, 1), nn.ReLU()
    for units in (nn.Linear, [nn.Linear], (nn.Linear,)):
        select = _selector(units)
        assert select(lin) is True and select(relu) is False
    assert _selector([nn.Linear, nn.ReLU])(relu) is True
    predicate = lambda module: True  # noqa: E731
    assert _selector(predicate) is predicate


def test_the_default_plan_is_the_repeated_blocks_in_order():
    model = Net(3)
    chosen, skipped = fsdp_plan(model)
    assert chosen == [("blocks.0", model.blocks[0]), ("blocks.1", model.blocks[1]), ("blocks.2", model.blocks[2])]
    assert skipped == []


def test_named_units_skip_what_has_no_forward_no_parameters_or_a_tied_parameter():
    model = Net(2)
    model.head.weight = model.embed.weight  # tied
    chosen, skipped = fsdp_plan(model, [nn.Linear, nn.ModuleList, nn.ReLU, Block])
    assert chosen == [("blocks.0", model.blocks[0]), ("blocks.0.lin", model.blocks[0].lin),
                      ("blocks.1", model.blocks[1]), ("blocks.1.lin", model.blocks[1].lin)]
    assert skipped == [("embed", "shares a parameter with head.weight"), ("blocks", "ModuleList has no forward"),
                       ("head", "shares a parameter with embed.weight")]


def test_named_units_are_only_the_modules_of_the_classes_named():
    model = Net(2)
    assert fsdp_plan(model, Block) == ([("blocks.0", model.blocks[0]), ("blocks.1", model.blocks[1])], [])
    assert fsdp_plan(model, lambda module: isinstance(module, Net)) == ([], [])  # never the root


def test_a_unit_whose_name_prefixes_anothers_is_not_taken_as_holding_it():
    model = nn.Module()
    model.add_module("b", nn.Linear(1, 1))
    model.add_module("bb", nn.Linear(1, 1))
    model.bb.weight = model.b.weight
    _, skipped = fsdp_plan(model, nn.Linear)
    assert skipped == [("b", "shares a parameter with bb.weight"), ("bb", "shares a parameter with b.weight")]


def test_the_plans_line_groups_units_by_class_then_the_root():
    a, b = nn.Linear(1, 1), nn.ReLU()
    assert describe_plan(Net(1), [], []) == "FSDP units: none, then the root Net"
    assert describe_plan(Net(1), [("x", a)], []) == "FSDP units: 1 x Linear (x), then the root Net"
    assert describe_plan(Net(1), [("x", a), ("y", a)], []) == "FSDP units: 2 x Linear (x, y), then the root Net"
    assert describe_plan(Net(1), [("x", a), ("r", b), ("y", a), ("z", a)], [("e", "why"), ("f", "how")]) == (
        "FSDP units: 3 x Linear (x ... z), 1 x ReLU (r), then the root Net; "
        "left to the enclosing unit: e (why), f (how)")


# -- buffers -----------------------------------------------------------------------------------------
def _buffered():
    model = nn.BatchNorm1d(2)
    model.register_buffer("scratch", torch.zeros(2), persistent=False)
    model.register_buffer("strided", torch.zeros(3, 2).t())
    return model


def test_buffers_are_left_alone_without_a_group_or_with_one_rank(monkeypatch):
    sent = []
    monkeypatch.setattr(dist, "broadcast", lambda tensor, src: sent.append(src))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    sync_buffers(_buffered())
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 1)
    sync_buffers(_buffered())
    assert sent == []


def test_every_persistent_buffer_takes_rank_0s_even_a_strided_one(monkeypatch):
    sent = []

    def broadcast(tensor, src):
        sent.append((tensor.is_contiguous(), src))
        tensor.fill_(7)

    monkeypatch.setattr(dist, "broadcast", broadcast)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    model = _buffered()
    sync_buffers(model)
    assert sent == [(True, 0)] * 4  # running_mean, running_var, num_batches_tracked, strided
    assert bool((model.running_mean == 7).all()) and int(model.num_batches_tracked) == 7
    assert bool((model.strided == 7).all()) and not model.strided.is_contiguous()
    assert bool((model.scratch == 0).all())


# -- the optimizer -----------------------------------------------------------------------------------
class Wrapper(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.module = inner
        self.modulex = nn.Linear(1, 1)


def test_plain_names_drop_a_wrappers_module_prefix_only():
    model = Wrapper(nn.Linear(1, 1))
    named = _plain_names(model)
    assert list(named) == ["weight", "bias", "modulex.weight", "modulex.bias"]
    assert named["weight"] is model.module.weight


def _groups(model, *names, **extra):
    return [{"params": list(n) if n is not None else None, "hyper": {"lr": 0.1 * (i + 1), "momentum": 0.5, **extra}}
            for i, n in enumerate(names)]


def test_no_optimizer_rebuilds_to_none():
    assert rebuild_optimizer(None, nn.Linear(1, 1)) is None


def test_named_groups_come_back_with_their_settings_and_unknown_settings_dropped():
    model = Wrapper(nn.Linear(1, 1))
    opt = rebuild_optimizer({"cls": torch.optim.SGD, "groups": _groups(model, ["weight"], ["bias", "modulex.weight"],
                                                                       nesterov=False, not_sgds=1)}, model)
    assert [g["params"] for g in opt.param_groups] == [[model.module.weight], [model.module.bias, model.modulex.weight]]
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.2]
    assert opt.defaults["lr"] == 0.1 and opt.defaults["momentum"] == 0.5 and "not_sgds" not in opt.defaults


def test_a_part_keeps_the_groups_it_holds_and_the_first_emptied_when_it_holds_none(caplog):
    model = nn.Linear(1, 1)
    opt = rebuild_optimizer({"cls": torch.optim.SGD, "groups": _groups(model, ["elsewhere"], ["weight", "gone"])},
                            model, part=True)
    assert [g["params"] for g in opt.param_groups] == [[model.weight]] and opt.param_groups[0]["lr"] == 0.2
    with caplog.at_level(logging.WARNING, logger=parallel.__name__):
        opt = rebuild_optimizer({"cls": torch.optim.SGD, "groups": _groups(model, ["x"], ["y"])}, model, part=True)
    assert caplog.messages == []  # none of the optimizer's parameters is on this stage
    assert [g["params"] for g in opt.param_groups] == [[]] and opt.defaults["lr"] == 0.1


def test_names_the_model_lacks_give_one_group_of_its_trainable_parameters(caplog):
    model = nn.Linear(1, 1)
    model.bias.requires_grad_(False)
    with caplog.at_level(logging.WARNING, logger=parallel.__name__):
        opt = rebuild_optimizer({"cls": torch.optim.SGD, "groups": _groups(model, ["weight", "x"], ["z"])}, model)
    assert caplog.messages == ["optimizer: 2 parameter name(s) not in the model; using one group",
                               "optimizer: 2 param groups over parameters of another model instance; "
                               "rebuilding one group with the first group's settings"]
    assert [g["params"] for g in opt.param_groups] == [[model.weight]] and opt.defaults["lr"] == 0.1


def test_only_the_optimizers_own_settings_are_passed_never_self_or_params():
    model = nn.Linear(1, 1)
    groups = [{"params": None, "hyper": {"lr": 0.3, "self": 0, "params": 0, "betas": (0.9, 0.9)}}]
    opt = rebuild_optimizer({"cls": torch.optim.SGD, "groups": groups}, model)
    assert opt.defaults["lr"] == 0.3 and "betas" not in opt.defaults


def test_unnamed_groups_take_every_parameter_when_none_is_trainable(caplog):
    model = nn.Linear(1, 1).requires_grad_(False)
    with caplog.at_level(logging.WARNING, logger=parallel.__name__):
        opt = rebuild_optimizer({"cls": torch.optim.SGD, "groups": _groups(model, None)}, model)
    assert caplog.messages == []
    assert [g["params"] for g in opt.param_groups] == [[model.weight, model.bias]]
    opt = rebuild_optimizer({"cls": torch.optim.SGD, "groups": _groups(model, ["weight"], None)}, model)
    assert [g["params"] for g in opt.param_groups] == [[model.weight, model.bias]]


# -- the whole weights -------------------------------------------------------------------------------
def test_ddp_weights_are_the_inner_models_on_cpu_detached():
    inner = nn.Linear(2, 1)
    state = full_state_dict(SimpleNamespace(module=inner), "DDP", 1)
    assert list(state) == ["weight", "bias"] and not state["weight"].requires_grad
    assert torch.equal(state["weight"], inner.weight.detach())


def test_small_fsdp_weights_reach_every_rank_and_large_ones_rank_0_alone(group_of_one, monkeypatch):
    import torch.distributed.checkpoint.state_dict as dcp
    from torch.distributed.fsdp import fully_shard
    asked = []
    real = dcp.get_model_state_dict
    monkeypatch.setattr(dcp, "get_model_state_dict", lambda model, options: asked.append(
        (options.full_state_dict, options.cpu_offload)) or real(model, options=options))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fully_shard(model)
    numel = sum(p.numel() for p in expected.values())
    monkeypatch.setattr(parallel, "FINGERPRINT_MAX_NUMEL", numel + 1)
    state = full_state_dict(model, "FSDP", 1)
    assert asked == [(True, False)] and list(state) == list(expected)
    assert all(torch.equal(state[k], expected[k]) and not state[k].requires_grad for k in expected)
    monkeypatch.setattr(parallel, "FINGERPRINT_MAX_NUMEL", numel)
    assert full_state_dict(model, "FSDP", 1) is None
    state = full_state_dict(model, "FSDP", 0)
    assert asked[1:] == [(True, True), (True, True)] and all(torch.equal(state[k], expected[k]) for k in expected)


def test_large_fsdp_weights_count_every_ranks_share(monkeypatch):
    import torch.distributed.checkpoint.state_dict as dcp
    monkeypatch.setattr(dcp, "get_model_state_dict", lambda model, options: {"w": torch.ones(1)})
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    model = nn.Linear(2, 1)  # 3 parameters a rank, 6 in all
    monkeypatch.setattr(parallel, "FINGERPRINT_MAX_NUMEL", 6)
    assert full_state_dict(model, "FSDP", 1) is None
    monkeypatch.setattr(parallel, "FINGERPRINT_MAX_NUMEL", 7)
    assert full_state_dict(model, "FSDP", 1) == {"w": torch.ones(1)}


def test_the_fingerprint_is_sha256_over_names_and_bytes_in_name_order():
    state = {"b": torch.tensor([1.0, 2.0]), "a": torch.zeros(2, 2).t(), "e": torch.zeros(0)}
    digest = hashlib.sha256()
    for name in ("a", "b", "e"):
        digest.update(name.encode())
        digest.update(state[name].contiguous().numpy().tobytes())
    assert fingerprint(state) == digest.hexdigest()
    assert fingerprint(dict(reversed(list(state.items())))) == digest.hexdigest()
    assert fingerprint({"c": state["b"], "a": state["a"], "e": state["e"]}) != digest.hexdigest()
    assert fingerprint(None) is None
