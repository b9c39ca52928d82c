"""The switches of a GPU client's rank start (gpu_client/rank/tuning.py) are fields of its config,
settable by ``zwdx gpu-client`` flags or their ZWDX_* variables at the edge, and reach each rank
through its environment, read once at the rank process's start."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpu_client.agent.config import AgentConfig
from gpu_client.agent.launcher import rank_environ
from gpu_client.rank.strategies.registry import strategy
from gpu_client.rank.tuning import VARIABLES, Tuning
from zwdx.cli import build_parser
from zwdx.protocol.spec import DDP, FSDP, TP, Diloco, Mixed, Pipeline, TensorParallel

TUNED = Tuning(eager_nccl=True, nccl_connect="init", warm_cuda=True, ddp_init_sync=True,
               standby_warmup=("imports", "kernels"))


def test_the_variables_read_as_the_ranks_read_them():
    assert Tuning.from_environ({}) == Tuning()
    assert Tuning.from_environ({"ZWDX_EAGER_NCCL": " 1 ", "ZWDX_NCCL_CONNECT": "INIT", "ZWDX_WARM_CUDA": "1",
                                "ZWDX_DDP_INIT_SYNC": "1", "ZWDX_STANDBY_WARMUP": "imports,kernels"}) == TUNED
    assert Tuning.from_environ({"ZWDX_NCCL_CONNECT": "other", "ZWDX_STANDBY_WARMUP": "none"}) == \
        Tuning(standby_warmup=("none",))


@pytest.mark.parametrize("tuning", [Tuning(), TUNED])
def test_a_rank_process_reads_back_what_the_launcher_gave_it(tuning):
    env = rank_environ(1, {}, tuning)
    assert {env[v] for v in VARIABLES.values()} and Tuning.from_environ(env) == tuning


def test_the_flags_default_to_the_variables_and_override_them(monkeypatch):
    base = ["gpu-client", "--room-token", "zd_x"]
    args = build_parser().parse_args(base)
    assert (args.eager_nccl, args.nccl_connect, args.warm_cuda, args.ddp_init_sync, args.standby_warmup) == \
        (False, "runtime", False, False, "imports")
    monkeypatch.setenv("ZWDX_EAGER_NCCL", "1")
    monkeypatch.setenv("ZWDX_STANDBY_WARMUP", "kernels")
    parse = build_parser().parse_args  # the variables are read as the parser is made (the edge)
    args = parse(base + ["--nccl-connect", "init", "--ddp-init-sync"])
    assert (args.eager_nccl, args.nccl_connect, args.ddp_init_sync, args.standby_warmup) == \
        (True, "init", True, "kernels")
    assert parse(base + ["--no-eager-nccl"]).eager_nccl is False
    assert "--standby-warmup" in build_parser()._subparsers._group_actions[0].choices["gpu-client"].format_help()


def test_the_config_is_frozen_and_the_strategy_gets_its_tuning():
    config = AgentConfig(server="http://127.0.0.1:1", room_token="zd_x", tuning=TUNED)
    with pytest.raises(AttributeError):
        config.server = "elsewhere"  # type: ignore[misc]
    spec = SimpleNamespace(job=SimpleNamespace(strategy=DDP()), parallelism=SimpleNamespace(value="DDP"))
    assert strategy(spec, None, config.tuning).tuning.ddp_init_sync is True
    assert strategy(spec, None).tuning == Tuning()


def test_the_flags_are_declared_where_gpu_client_is_not_installed(monkeypatch):
    """zwdx/tuning.py declares them: a zwdx without gpu_client (the server image) still shows and
    parses them (they were left out there, as their declarations were gpu_client's)."""
    import sys
    for name in [n for n in sys.modules if n == "gpu_client" or n.startswith("gpu_client.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "gpu_client", None)  # import gpu_client: ModuleNotFoundError
    from zwdx.tuning import Tuning
    args = build_parser().parse_args(["gpu-client", "--warm-cuda", "--standby-warmup", "imports,nccl"])
    assert Tuning.from_arguments(args) == Tuning(warm_cuda=True, standby_warmup=("imports", "nccl"))


@pytest.mark.parametrize("kind, cls", [
    (DDP(), "Collective"), (FSDP(), "Collective"), (FSDP(tp=TensorParallel(size=2)), "TensorParallel"),
    (TP(), "TensorParallel"), (Pipeline(), "Pipeline"), (Diloco(), "Diloco"), (Mixed(), "Mixed")])
def test_the_registry_is_keyed_on_the_specs_strategy_type(kind, cls):
    """gpu_client/rank/strategies/registry.py looks a rank's strategy up by its job's strategy
    (its type; FSDP with a tp dimension is FSDP+TP), not by a flat parallelism string."""
    from gpu_client.rank.strategies.registry import STRATEGIES, strategy_type
    assert STRATEGIES[strategy_type(SimpleNamespace(strategy=kind))][1] == cls
