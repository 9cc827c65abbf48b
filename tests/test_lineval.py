"""Linear evaluation as VISSL runs it: list meters named by the evaluated layers (num_meters and
meter_names inferred from LINEAR_EVAL_FEAT_POOL_OPS_MAP), the heads' own param groups
(head_optimizer_params, param_schedulers.lr_head) and MODEL.HEAD.PARAMS_MULTIPLIER."""

import copy
import json
import math
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
import torch.nn as nn

from conftest import run_tool
from ssl_engine.config import compose
from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.config.infer import infer_head_optimizer, infer_meters, is_feature_eval_model
from ssl_engine.config.validate import compat_keys
from ssl_engine.errors import CheckpointError, UserError
from ssl_engine.meters import build_meters, check_meters_fit_model
from ssl_engine.models import build_model
from ssl_engine.models.heads.mlp import MLPHead
from ssl_engine.optim import build_optimizer

POOL_MAP = [["res5avg", ["Identity", []]], ["res4", ["AdaptiveAvgPool2d", [[2, 2]]]]]


# ------------------------------------------------------------------ meter inference


def meters_cfg(fe: Dict[str, Any], **meters: Any) -> Dict[str, Any]:
    base = {"name": "accuracy_list_meter", "names": [],
            "accuracy_list_meter": {"num_meters": 1, "topk_values": [1], "meter_names": []},
            "precision_at_k_list_meter": {"num_meters": 1, "topk_values": [1], "meter_names": []}}
    base.update(meters)
    settings = {"EVAL_MODE_ON": True, "FREEZE_TRUNK_ONLY": True, "EXTRACT_TRUNK_FEATURES_ONLY": False,
                "LINEAR_EVAL_FEAT_POOL_OPS_MAP": POOL_MAP}
    settings.update(fe)
    return {"METERS": base, "MODEL": {"FEATURE_EVAL_SETTINGS": settings}}


def test_list_meters_take_count_and_names_from_the_pool_ops_map() -> None:
    cfg = meters_cfg({})
    infer_meters(cfg)
    assert cfg["METERS"]["accuracy_list_meter"]["num_meters"] == 2
    assert cfg["METERS"]["accuracy_list_meter"]["meter_names"] == ["res5avg", "res4"]
    assert cfg["METERS"]["precision_at_k_list_meter"]["num_meters"] == 1  # not named: untouched

    # METERS.names too, and EXTRACT_TRUNK_FEATURES_ONLY counts as a feature-eval model
    cfg = meters_cfg({"FREEZE_TRUNK_ONLY": False, "EXTRACT_TRUNK_FEATURES_ONLY": True}, name="",
                     names=["accuracy_list_meter", "precision_at_k_list_meter"])
    infer_meters(cfg)
    for name in ("accuracy_list_meter", "precision_at_k_list_meter"):
        assert (cfg["METERS"][name]["num_meters"], cfg["METERS"][name]["meter_names"]) == (2, ["res5avg", "res4"])


def test_explicit_meter_names_are_replaced_as_vissl_does() -> None:
    # VISSL's infer_and_assert_hydra_config overwrites both for a feature-eval model
    cfg = meters_cfg({}, accuracy_list_meter={"num_meters": 2, "topk_values": [1], "meter_names": ["a", "b"]})
    infer_meters(cfg)
    assert cfg["METERS"]["accuracy_list_meter"]["meter_names"] == ["res5avg", "res4"]


@pytest.mark.parametrize("fe", [
    {"EVAL_MODE_ON": False},
    {"FREEZE_TRUNK_ONLY": False},  # full fine-tuning of the heads on the trunk layers
    {"LINEAR_EVAL_FEAT_POOL_OPS_MAP": []},
])
def test_no_inference_outside_a_feature_eval_model(fe: Dict[str, Any]) -> None:
    cfg = meters_cfg(fe, accuracy_list_meter={"num_meters": 3, "topk_values": [1], "meter_names": ["x", "y", "z"]})
    before = copy.deepcopy(cfg)
    assert not is_feature_eval_model(cfg["MODEL"])
    infer_meters(cfg)
    assert cfg == before


LINEAR = ["config=quick/linear_eval_digits", "config.MODEL.TRUNK.RESNETS.DEPTH=18"]


def test_composed_vissl_style_config_gets_layer_names_and_fits_the_model() -> None:
    # VISSL's quick_eval_in1k_linear_imagefolder says num_meters: 1 with two heads
    cfg = compose([*LINEAR, "config.METERS.accuracy_list_meter.num_meters=1",
                   "config.METERS.accuracy_list_meter.meter_names=[]"])
    assert cfg.METERS.accuracy_list_meter.num_meters == 2
    assert list(cfg.METERS.accuracy_list_meter.meter_names) == ["res5avg", "res4"]
    meters = build_meters(cfg.METERS)
    check_meters_fit_model(meters, build_model(cfg.MODEL, cfg.OPTIMIZER))  # no error
    out = [torch.tensor([[0.0, 1.0] + [0.0] * 8]), torch.tensor([[1.0] + [0.0] * 9])]
    meters[0].update(out, torch.tensor([1]))
    assert meters[0].value == {"top_1": {"res5avg": 100.0, "res4": 0.0}}


def test_a_layer_the_map_lists_twice_feeds_two_heads_with_a_meter_and_features_each() -> None:
    """VISSL's MobileNet linear evaluation lists one layer several times, a head on each entry (other
    pool ops or head settings); VISSL's trunk returns the layer once per entry. It was refused
    ('layer ... is listed twice; each layer may appear once'); now each entry feeds its head, and
    the second entry of a layer is named <layer>_1 in the meters and the extracted features, so
    that neither hides the other's value or file."""
    pool_map = ("[[res5avg,[Identity,[]]],[res5avg,[Identity,[]]],[res4,[AdaptiveAvgPool2d,[[2,2]]]],"
                "[res4,[AdaptiveMaxPool2d,[[1,1]]]]]")
    heads = ("[[eval_mlp,{in_channels:512,dims:[512,10]}],[eval_mlp,{in_channels:512,dims:[512,10],use_relu:true}],"
             "[eval_mlp,{in_channels:256,dims:[1024,10]}],[eval_mlp,{in_channels:256,dims:[256,10]}]]")
    cfg = compose([*LINEAR, f"config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP={pool_map}",
                   f"config.MODEL.HEAD.PARAMS={heads}"])
    assert list(cfg.METERS.accuracy_list_meter.meter_names) == ["res5avg", "res5avg_1", "res4", "res4_1"]
    model = build_model(cfg.MODEL, cfg.OPTIMIZER)
    check_meters_fit_model(build_meters(cfg.METERS), model)  # no error
    model.eval()
    x = torch.randn(2, 3, 32, 32)
    out = model(x)
    assert [tuple(o.shape) for o in out] == [(2, 10)] * 4
    feats = model.extract_features(x)
    assert list(feats) == ["res5avg", "res5avg_1", "res4", "res4_1"]
    assert torch.equal(feats["res5avg"], feats["res5avg_1"])
    assert (feats["res4"].flatten(1).shape[1], feats["res4_1"].flatten(1).shape[1]) == (1024, 256)


def test_prelaunch_check_still_catches_a_real_mismatch() -> None:
    # not a feature-eval model (trunk not frozen): nothing is inferred, 1 meter for 2 outputs
    cfg = compose([*LINEAR, "config.MODEL.FEATURE_EVAL_SETTINGS.FREEZE_TRUNK_ONLY=false",
                   "config.METERS.accuracy_list_meter.num_meters=1",
                   "config.METERS.accuracy_list_meter.meter_names=[]"])
    assert cfg.METERS.accuracy_list_meter.num_meters == 1
    with pytest.raises(UserError, match=r"accuracy_list_meter\.num_meters=1 but the model returns 2 outputs"):
        check_meters_fit_model(build_meters(cfg.METERS), build_model(cfg.MODEL, cfg.OPTIMIZER))


# ------------------------------------------------------------ head optimizer inference


def test_head_settings_follow_the_trunk_unless_asked() -> None:
    lr = {"name": "multistep", "values": [0.1, 0.01], "milestones": [1]}
    opt = {"weight_decay": 5e-4, "param_schedulers": {"lr": lr, "lr_head": {"name": "constant", "value": 9.0}},
           "head_optimizer_params": {"use_different_lr": False, "use_different_wd": False, "weight_decay": 1e-4}}
    cfg = {"OPTIMIZER": copy.deepcopy(opt)}
    infer_head_optimizer(cfg)
    assert cfg["OPTIMIZER"]["param_schedulers"]["lr_head"] == lr
    assert cfg["OPTIMIZER"]["head_optimizer_params"]["weight_decay"] == 5e-4

    opt["head_optimizer_params"].update(use_different_lr=True, use_different_wd=True)
    cfg = {"OPTIMIZER": copy.deepcopy(opt)}
    infer_head_optimizer(cfg)
    assert cfg["OPTIMIZER"]["param_schedulers"]["lr_head"] == {"name": "constant", "value": 9.0}
    assert cfg["OPTIMIZER"]["head_optimizer_params"]["weight_decay"] == 1e-4


def test_head_keys_are_no_longer_compat() -> None:
    marked = compat_keys()
    for key in ("config.OPTIMIZER.head_optimizer_params", "config.OPTIMIZER.param_schedulers.lr_head",
                "config.MODEL.HEAD.PARAMS_MULTIPLIER"):
        assert not any(key.startswith(m) or m.startswith(key) for m in marked), key


# ------------------------------------------------------------------ head param groups


class TrunkAndHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        self.heads = nn.ModuleList([nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 2))])


def sched(**kw: Any) -> Dict[str, Any]:
    base = {"name": "multistep", "values": [0.1, 0.01], "milestones": [1], "update_interval": "epoch",
            "auto_lr_scaling": {"auto_scale": False, "base_value": 0.1, "base_lr_batch_size": 256,
                                "scaling_type": "linear"}}
    base.update(kw)
    return base


def head_opt_cfg(different_lr: bool = True, different_wd: bool = True, lr_head: Any = None, **kw: Any) -> AttrDict:
    cfg = {
        "name": "sgd", "momentum": 0.9, "nesterov": False, "weight_decay": 1e-4, "num_epochs": 2,
        "regularize_bn": False, "regularize_bias": True, "non_regularized_parameters": [], "use_larc": False,
        "larc_config": {"clip": False, "eps": 1e-8, "trust_coefficient": 0.001},
        "head_optimizer_params": {"use_different_lr": different_lr, "use_different_wd": different_wd,
                                  "weight_decay": 1e-3},
        "param_schedulers": {"lr": sched(), "lr_head": lr_head or sched(values=[1.0, 0.5])},
    }
    cfg.update(kw)
    return AttrDict(cfg)


def groups_by_name(opt) -> Dict[str, Dict[str, Any]]:
    return {name: group for name, group in zip(opt.group_names, opt.param_groups)}


def test_heads_get_their_own_groups_lr_and_weight_decay() -> None:
    net = TrunkAndHeads()
    opt = build_optimizer(head_opt_cfg(), net, 8, 4)
    groups = groups_by_name(opt)
    ids = {name: {id(p) for p in g["params"]} for name, g in groups.items()}
    conv, bn = net.trunk[0], net.trunk[1]
    hbn, fc = net.heads[0][0], net.heads[0][1]
    assert ids == {
        "trunk": {id(conv.weight), id(conv.bias)},
        "trunk_no_wd": {id(bn.weight), id(bn.bias)},
        "head": {id(fc.weight), id(fc.bias)},
        "head_no_wd": {id(hbn.weight), id(hbn.bias)},
    }
    assert {n: g["weight_decay"] for n, g in groups.items()} == {
        "trunk": 1e-4, "trunk_no_wd": 0.0, "head": 1e-3, "head_no_wd": 0.0}
    for where, (lr, lr_head) in {0.0: (0.1, 1.0), 0.49: (0.1, 1.0), 0.5: (0.01, 0.5), 0.9: (0.01, 0.5)}.items():
        opt.set_where(where)
        got = {n: g["lr"] for n, g in groups_by_name(opt).items()}
        assert got == pytest.approx({"trunk": lr, "trunk_no_wd": lr, "head": lr_head, "head_no_wd": lr_head}), where
    assert opt.update_interval == "epoch"
    described = opt.describe_groups()
    assert "head: 2 tensors, lr=0.5 (lr_head, per epoch), weight_decay=0.001" in described


def test_only_a_different_weight_decay_keeps_the_trunk_lr() -> None:
    opt = build_optimizer(head_opt_cfg(different_lr=False), TrunkAndHeads(), 8, 4)
    groups = groups_by_name(opt)
    assert groups["head"]["weight_decay"] == 1e-3 and groups["head"]["lr"] == pytest.approx(0.1)
    assert "lr_head" not in opt.schedulers


def test_without_head_settings_the_groups_are_as_before() -> None:
    opt = build_optimizer(head_opt_cfg(different_lr=False, different_wd=False), TrunkAndHeads(), 8, 4)
    assert opt.group_names == ["regularized", "not_regularized"]
    assert [g["weight_decay"] for g in opt.param_groups] == [1e-4, 0.0]


def test_frozen_trunk_leaves_only_head_groups() -> None:
    net = TrunkAndHeads()
    for p in net.trunk.parameters():
        p.requires_grad = False
    opt = build_optimizer(head_opt_cfg(), net, 8, 4)
    assert opt.group_names == ["head", "head_no_wd"] and opt.lr == pytest.approx(1.0)


def test_head_schedule_with_its_own_interval_and_auto_scaling() -> None:
    auto = {"auto_scale": True, "base_value": 0.2, "base_lr_batch_size": 256, "scaling_type": "linear"}
    head = sched(name="cosine", start_value=0.2, end_value=0.0, update_interval="step", auto_lr_scaling=auto)
    opt = build_optimizer(head_opt_cfg(lr_head=head), TrunkAndHeads(), 512, 4)
    assert opt.update_interval == "step" and opt.intervals == {"lr": "epoch", "lr_head": "step"}
    opt.set_where(0.25)  # mid first epoch: the epoch schedule keeps its epoch-start value
    groups = groups_by_name(opt)
    assert groups["trunk"]["lr"] == pytest.approx(0.1)  # lr is not scaled (its auto_scale is off)
    assert groups["head"]["lr"] == pytest.approx(0.4 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    opt.set_where(0.75)
    assert groups_by_name(opt)["trunk"]["lr"] == pytest.approx(0.01)


def test_head_settings_errors() -> None:
    with pytest.raises(UserError, match=r"head_optimizer_params\.weight_decay=-1\.0 must be >= 0"):
        build_optimizer(head_opt_cfg(head_optimizer_params={"use_different_lr": False, "use_different_wd": True,
                                                            "weight_decay": -1.0}), TrunkAndHeads(), 8, 4)
    with pytest.raises(UserError, match=r"param_schedulers\.lr_head\.milestones"):
        build_optimizer(head_opt_cfg(lr_head=sched(values=[0.1, 0.01, 0.001], milestones=[30, 60])),
                        TrunkAndHeads(), 8, 4)


def test_larc_uses_each_groups_lr_and_weight_decay() -> None:
    torch.manual_seed(3)
    net = nn.Module()
    net.w = nn.Parameter(torch.randn(5, 3))
    net.heads = nn.Module()
    net.heads.v = nn.Parameter(torch.randn(4, 2))
    cfg = head_opt_cfg(use_larc=True, momentum=0.0, larc_config={"clip": False, "eps": 1e-8, "trust_coefficient": 0.02})
    opt = build_optimizer(cfg, net, 8, 4)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    grads = {n: torch.randn_like(p) for n, p in net.named_parameters()}
    for n, p in net.named_parameters():
        p.grad = grads[n].clone()
    opt.step()
    for name, lr, wd in (("w", 0.1, 1e-4), ("heads.v", 1.0, 1e-3)):
        p, g = before[name], grads[name]
        ratio = 0.02 * p.norm() / (g.norm() + wd * p.norm() + 1e-8)
        expected = p - lr * (g + wd * p) * ratio
        assert torch.allclose(dict(net.named_parameters())[name].detach(), expected, atol=1e-6), name


def test_state_round_trip_restores_the_head_schedule_and_refuses_other_groups(tmp_path: Path) -> None:
    head = sched(name="cosine", start_value=1.0, end_value=0.0, update_interval="step")
    torch.manual_seed(4)
    net = TrunkAndHeads()
    opt = build_optimizer(head_opt_cfg(lr_head=head), net, 8, 4)
    opt.set_where(0.625)
    path = tmp_path / "opt.torch"
    torch.save(opt.state_dict(), path)
    state = torch.load(path, weights_only=True)
    again = build_optimizer(head_opt_cfg(lr_head=head), TrunkAndHeads(), 8, 4)
    again.load_state_dict(state)
    assert again.where == pytest.approx(0.625)
    assert [g["lr"] for g in again.param_groups] == pytest.approx([g["lr"] for g in opt.param_groups])
    assert groups_by_name(again)["head"]["lr"] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.625)))
    plain = build_optimizer(head_opt_cfg(different_lr=False, different_wd=False), TrunkAndHeads(), 8, 4)
    with pytest.raises(CheckpointError, match="head_optimizer_params"):
        plain.load_state_dict(state)


# ------------------------------------------------------------------- PARAMS_MULTIPLIER


def test_params_multiplier_scales_the_heads_initial_linear_weights() -> None:
    def head(multiplier: float) -> MLPHead:
        torch.manual_seed(5)
        return MLPHead(AttrDict({"HEAD": {"PARAMS_MULTIPLIER": multiplier}}), [8, 6, 3], use_bn=True)

    one, hundred = head(1.0), head(100.0)
    for a, b in zip(one.modules(), hundred.modules()):
        if isinstance(a, nn.Linear):
            assert torch.allclose(b.weight, 100.0 * a.weight)
        elif isinstance(a, nn.BatchNorm1d):
            assert torch.equal(a.weight, b.weight)  # only the Linear layers


# --------------------------------------------------------------- through the real tool


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("simclr")
    proc = run_tool(["config=quick/simclr_digits", f"config.CHECKPOINT.DIR={folder}", "config.OPTIMIZER.num_epochs=1",
                     "config.DATA.TRAIN.DATA_LIMIT=16", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=8"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return folder


def test_linear_eval_with_head_lr_keys_metrics_by_layer(pretrained: Path, tmp_path: Path) -> None:
    proc = run_tool([
        *LINEAR, f"config.CHECKPOINT.DIR={tmp_path}",
        f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={pretrained / 'checkpoint.torch'}",
        # VISSL's quick_eval_in1k_linear_imagefolder style: one meter said, two heads
        "config.METERS.accuracy_list_meter.num_meters=1", "config.METERS.accuracy_list_meter.meter_names=[]",
        "config.OPTIMIZER.num_epochs=2", "config.OPTIMIZER.weight_decay=0.0005",
        "config.OPTIMIZER.param_schedulers.lr.values=[0.01,0.001]",
        "config.OPTIMIZER.param_schedulers.lr.milestones=[1]",
        "config.OPTIMIZER.head_optimizer_params.use_different_lr=true",
        "config.OPTIMIZER.head_optimizer_params.use_different_wd=true",
        "config.OPTIMIZER.head_optimizer_params.weight_decay=0.0001",
        "config.OPTIMIZER.param_schedulers.lr_head.values=[0.2,0.02]",
        "config.OPTIMIZER.param_schedulers.lr_head.milestones=[1]",
        "config.MODEL.HEAD.PARAMS_MULTIPLIER=2.0",
        "config.HOOKS.LOG_PARAM_GROUPS=true",
        "config.HOOKS.BEST_CHECKPOINT.METRIC=test_accuracy_list_meter/top_1/res4",
        "config.DATA.TRAIN.DATA_LIMIT=16", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=8",
        "config.DATA.TEST.DATA_LIMIT=8", "config.DATA.TEST.BATCHSIZE_PER_REPLICA=8",
    ])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "randomly initialised trunk" not in out  # the trunk came from PARAMS_FILE
    for line in out.splitlines():
        if "not acted on" in line:
            assert not any(k in line for k in ("head_optimizer_params", "lr_head", "PARAMS_MULTIPLIER")), line
    # two eval_mlp heads: their Linear weights and biases, then their BatchNorms (no weight decay)
    assert "head: 4 tensors, lr=0.2 (lr_head, per epoch), weight_decay=0.0001" in out, out[-4000:]
    assert "head_no_wd: 4 tensors, lr=0.2 (lr_head, per epoch), weight_decay=0" in out

    records = [json.loads(line) for line in (tmp_path / "metrics.json").read_text().splitlines()]
    tests = [r for r in records if "test_accuracy_list_meter" in r]
    assert len(tests) == 2
    for r in tests:
        assert set(r["test_accuracy_list_meter"]["top_1"]) == {"res5avg", "res4"}
    assert (tmp_path / "model_best.torch").exists()

    rows = [json.loads(line) for line in (tmp_path / "param_groups.json").read_text().splitlines()]
    by_phase = {r["train_phase_idx"]: r["groups"] for r in rows}
    assert set(by_phase) == {0, 1}
    for phase, lr in ((0, 0.2), (1, 0.02)):
        groups = by_phase[phase]  # the trunk is frozen: the heads' groups only (regularized, then BN/none)
        assert [g["lr"] for g in groups] == pytest.approx([lr, lr]), phase
        assert [g["weight_decay"] for g in groups] == pytest.approx([1e-4, 0.0])


def test_a_pool_op_too_large_for_its_layer_is_one_line_before_launch(tmp_path: Path) -> None:
    """VISSL's pool-op maps are sized for 224x224 crops; on 32x32 digits a 6x6 kernel over res4's
    2x2 map cannot run. The check reads one sample for the image size and runs the model on the
    meta device before any process starts: one line naming the map entry, and the checkpoint
    folder is not created."""
    folder = tmp_path / "run"
    r = run_tool(["config=quick/linear_eval_digits", f"config.CHECKPOINT.DIR={folder}",
                  "config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP="
                  "[[res5avg,[Identity,[]]],[res4,[AvgPool2d,[[6,6],1,0]]]]"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1].startswith(
        "error: config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP[1]: AvgPool2d(kernel_size=(6, 6), "
        "stride=1, padding=0) does not fit trunk layer 'res4' of [256, 2, 2] (input images 32x32)"), r.stderr[-2000:]
    assert not folder.exists()


def test_the_pool_op_check_before_launch_covers_every_split() -> None:
    """A 2x2 pool on res4 fits 32x32 TRAIN images (res4 2x2) but not 8x8 TEST ones (res4 1x1): the
    check runs the model on each split's image size, not on the first split's alone."""
    from ssl_engine.config.validate import check_model_runs_on_samples
    from ssl_engine.errors import UserError
    from ssl_engine.models import build_model

    cfg = compose(["config=quick/linear_eval_digits",
                   "config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP="
                   "[[res5avg,[Identity,[]]],[res4,[AvgPool2d,[[2,2],2,0]]]]",
                   "config.MODEL.HEAD.PARAMS=[[eval_mlp,{in_channels:512,dims:[512,10]}],"
                   "[eval_mlp,{in_channels:256,dims:[256,10]}]]"], warn_unused=False)
    with torch.device("meta"):
        model = build_model(cfg.MODEL, cfg.OPTIMIZER)
    train = {"data": [torch.zeros(3, 32, 32)]}
    check_model_runs_on_samples(model, {"TRAIN": train})
    with pytest.raises(UserError, match=r"does not fit trunk layer 'res4' of \[256, 1, 1\] \(input images 8x8\)"):
        check_model_runs_on_samples(model, {"TRAIN": train, "TEST": {"data": [torch.zeros(3, 8, 8)]}})


@pytest.mark.parametrize("op, message", [
    ("[Flatten,[5]]", r"Flatten\(start_dim=5, end_dim=-1\) does not fit trunk layer 'res4' of \[256, 2, 2\].*Dimension out of range"),
    ("[AdaptiveAvgPool2d,[abc]]", r"AdaptiveAvgPool2d\(output_size=abc\) does not fit trunk layer 'res4'"),
    ("[AdaptiveAvgPool2d,[[0,0]]]", r"LINEAR_EVAL_FEAT_POOL_OPS_MAP\[1\]: AdaptiveAvgPool2d\(output_size=\(0, 0\)\) gives trunk "
                                    r"layer 'res4' .*holds no value"),
])
def test_a_pool_op_that_fails_its_layer_in_any_way_is_one_line_before_launch(op: str, message: str) -> None:
    """A pool op fails a layer it does not fit with a ValueError, TypeError or IndexError as well as a
    RuntimeError, or gives features of no value (an output size of 0), which the feature writer
    cannot store: each is the map entry's one line before launch (the same check runs at each step)."""
    from ssl_engine.config.validate import check_model_runs_on_samples
    from ssl_engine.errors import UserError
    from ssl_engine.models import build_model

    cfg = compose(["config=quick/linear_eval_digits",
                   f"config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP=[[res5avg,[Identity,[]]],[res4,{op}]]",
                   "config.MODEL.HEAD.PARAMS=[[eval_mlp,{in_channels:512,dims:[512,10]}],"
                   "[eval_mlp,{in_channels:256,dims:[256,10]}]]"], warn_unused=False)
    with pytest.raises(UserError, match=message):  # an output size of 0 is found when the heads are built
        with torch.device("meta"):
            model = build_model(cfg.MODEL, cfg.OPTIMIZER)
        check_model_runs_on_samples(model, {"TRAIN": {"data": [torch.zeros(3, 32, 32)]}})


def test_a_linear_evaluation_without_weights_warns_that_its_trunk_is_random(caplog) -> None:
    """A frozen trunk with no WEIGHTS_INIT.PARAMS_FILE trains the heads on a random network: a
    baseline on purpose, more often a forgotten key (was: no word)."""
    import logging
    from types import SimpleNamespace

    from ssl_engine.tasks.self_supervision_task import SelfSupervisionTask

    cfg = compose(LINEAR, warn_unused=False)
    task = SimpleNamespace(config=cfg, base_model=build_model(cfg.MODEL, cfg.OPTIMIZER), phases=[{"train": True}])
    with caplog.at_level(logging.WARNING):
        SelfSupervisionTask.init_weights(task)
    assert ("the trunk is frozen (config.MODEL.FEATURE_EVAL_SETTINGS) but config.MODEL.WEIGHTS_INIT.PARAMS_FILE is "
            "empty: the run evaluates a randomly initialised trunk") in caplog.text
    caplog.clear()
    task.phases = [{"train": False}]  # testing heads alone has its own warning (TEST_ONLY)
    SelfSupervisionTask.init_weights(task)
    assert "randomly initialised trunk" not in caplog.text


def test_a_training_run_whose_model_runs_no_head_is_one_line_before_launch(tmp_path: Path) -> None:
    """EXTRACT_TRUNK_FEATURES_ONLY left on in a linear evaluation (say, from an extraction config):
    the model outputs trunk features and runs none of its heads, so nothing the run trains or
    tests is a head (was: a traceback at the first step, cross_entropy's "only batches of spatial
    targets supported", exit 1)."""
    folder = tmp_path / "run"
    proc = run_tool([*LINEAR, f"config.CHECKPOINT.DIR={folder}",
                     "config.MODEL.FEATURE_EVAL_SETTINGS.EXTRACT_TRUNK_FEATURES_ONLY=true",
                     "config.DATA.TRAIN.DATA_LIMIT=16", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=8",
                     "config.DATA.TEST.DATA_LIMIT=8", "config.DATA.TEST.BATCHSIZE_PER_REPLICA=8"])
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    assert err.startswith("error: config.MODEL.FEATURE_EVAL_SETTINGS.EXTRACT_TRUNK_FEATURES_ONLY=true"), err
    assert "run none of the 2 heads of config.MODEL.HEAD.PARAMS" in err and "engine_name=extract_features" in err, err
    assert not folder.exists()
