"""The submitter's optimizer rebuilt over a rank's parameters (gpu_client/rank/strategies/
parallel.py, rebuild_optimizer): its param groups by name, a pipeline stage's part of them, and
one group with the first group's settings when the names do not match."""
import torch

from gpu_client.rank.strategies.parallel import rebuild_optimizer

torch.set_num_threads(1)


def model():
    return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))


def spec(*groups):
    return {"cls": torch.optim.SGD, "groups": [{"params": names, "hyper": hyper} for names, hyper in groups]}


def test_no_optimizer_is_none():
    assert rebuild_optimizer(None, model()) is None


def test_the_groups_by_name_keep_their_settings():
    m = model()
    opt = rebuild_optimizer(spec((["0.weight", "0.bias"], {"lr": 0.1}), (["1.weight", "1.bias"], {"lr": 0.01})), m)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]
    assert opt.param_groups[1]["params"][0] is m[1].weight


def test_a_stage_keeps_the_groups_it_has_parameters_of():
    stage = torch.nn.Sequential(torch.nn.Linear(2, 2))  # a part holding what was "0.*" only
    opt = rebuild_optimizer(spec((["0.weight", "0.bias"], {"lr": 0.1}), (["1.weight", "1.bias"], {"lr": 0.01})),
                            stage, part=True)
    assert [g["lr"] for g in opt.param_groups] == [0.1] and len(opt.param_groups[0]["params"]) == 2


def test_names_the_model_lacks_make_one_group_with_the_first_settings(caplog):
    m = model()
    opt = rebuild_optimizer(spec((["nope"], {"lr": 0.5, "momentum": 0.9}), (["1.bias"], {"lr": 0.01})), m)
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["momentum"] == 0.9
    assert len(opt.param_groups[0]["params"]) == 4
    assert "not in the model" in caplog.text and "2 param groups" in caplog.text


def test_unnamed_groups_take_the_trainable_parameters():
    m = model()
    m[0].weight.requires_grad_(False)
    opt = rebuild_optimizer(spec((None, {"lr": 0.2, "not_an_sgd_setting": 1})), m)
    assert opt.param_groups[0]["lr"] == 0.2 and len(opt.param_groups[0]["params"]) == 3
