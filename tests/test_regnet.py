"""The regnet trunk: classy_vision's RegNet under VISSL's names (conv1, res2..res5, avgpool,
flatten; ``_feature_blocks.*`` state-dict keys), its config checks, and a training run plus an
extraction of two of its layers through the real tool."""

import logging
import re
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
from classy_vision.models import build_model as classy_build_model
from classy_vision.models.regnet import RegNet as ClassyRegNet
from classy_vision.models.regnet import RegNetParams

from conftest import run_tool
from ssl_engine import checkpoint as ck
from ssl_engine.config import compose
from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import UserError
from ssl_engine.features import load_features
from ssl_engine.models import SSLModel, build_model

LAYERS = ["conv1", "res2", "res3", "res4", "res5", "avgpool", "flatten"]
Y400MF = {"depth": 16, "w_0": 48, "w_a": 27.89, "w_m": 2.09, "group_width": 8}  # classy's regnet_y_400mf
TINY = {"depth": 4, "w_0": 16, "w_a": 8.0, "w_m": 2.0, "group_width": 8, "stem_width": 16, "use_se": False}


pytestmark = pytest.mark.usefixtures("one_thread")


def model_config(regnet: Dict[str, Any], heads: List[Any] = (), eval_settings: Dict[str, Any] = None) -> AttrDict:
    return AttrDict({
        "INPUT_TYPE": "rgb",
        "TRUNK": {"NAME": "regnet", "REGNET": dict(regnet)},
        "HEAD": {"PARAMS": list(heads), "BATCHNORM_EPS": 1e-5, "BATCHNORM_MOMENTUM": 0.1},
        "FEATURE_EVAL_SETTINGS": dict(eval_settings or {}),
    })


def build(regnet: Dict[str, Any], **kw: Any) -> SSLModel:
    torch.manual_seed(0)
    return build_model(model_config(regnet, **kw), AttrDict({}))


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.fixture(scope="module")
def y400() -> SSLModel:
    return build({"name": "regnet_y_400mf"})


def vissl_keys(classy_state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """classy_vision RegNet keys renamed as VISSL's regnet trunk holds them: the stem is
    ``_feature_blocks.conv1``, stage ``trunk_output.block<i>`` is ``_feature_blocks.res<i+1>``."""
    out = {}
    for k, v in classy_state.items():
        if k.startswith("stem."):
            out["_feature_blocks.conv1." + k[len("stem."):]] = v
        else:
            m = re.match(r"trunk_output\.block(\d+)\.(.*)$", k)
            assert m, k
            out[f"_feature_blocks.res{int(m.group(1)) + 1}.{m.group(2)}"] = v
    return out


# ------------------------------------------------------------------ building
def test_preset_params_layers_and_shapes_at_32(y400: SSLModel) -> None:
    trunk = y400.trunk.eval()
    assert n_params(trunk) == 3_903_144  # RegNetY-400MF without its 1000-class fc (4.34M with it)
    assert n_params(trunk) == n_params(classy_build_model({"name": "regnet_y_400mf"}))
    assert trunk.feature_names() == LAYERS
    with torch.no_grad():
        feats = trunk(torch.randn(2, 3, 32, 32), LAYERS)
    shapes = [(32, 16), (48, 8), (104, 4), (208, 2), (440, 1)]
    for name, feat, (c, s) in zip(LAYERS, feats, shapes):
        assert tuple(feat.shape) == (2, c, s, s), name
    assert tuple(feats[5].shape) == (2, 440, 1, 1) and tuple(feats[6].shape) == (2, 440)
    assert trunk.feature_dims() == {"conv1": 32, "res2": 48, "res3": 104, "res4": 208, "res5": 440,
                                    "avgpool": 440, "flatten": 440}
    assert trunk.vector_layers() == {"avgpool", "flatten"}
    with torch.no_grad():  # the default output is flatten, as VISSL's trunk gives
        assert tuple(trunk(torch.randn(2, 3, 32, 32))[0].shape) == (2, 440)


def test_explicit_parameters_build_the_same_network_as_the_preset(y400: SSLModel) -> None:
    explicit = build(Y400MF).trunk
    assert n_params(explicit) == 3_903_144
    assert {k: v.shape for k, v in explicit.state_dict().items()} == {k: v.shape for k, v in y400.trunk.state_dict().items()}
    # a VISSL yaml writes 1e-5 without a dot, which yaml reads as a string
    tiny = build({**TINY, "bn_epsilon": "1e-5", "bn_momentum": 0.2}).trunk.eval()
    assert n_params(tiny) == n_params(ClassyRegNet(RegNetParams(**{k: v for k, v in TINY.items()})))
    assert tiny.feature_names() == ["conv1", "res2", "res3", "avgpool", "flatten"]  # widths 16, 32, 32, 32: 2 stages
    bn = tiny._feature_blocks["conv1"].stem[1]
    assert bn.eps == 1e-5 and bn.momentum == 0.2
    with torch.no_grad():
        feats = tiny(torch.randn(2, 3, 32, 32), ["res2", "res3", "flatten"])
    assert [tuple(f.shape) for f in feats] == [(2, 16, 8, 8), (2, 32, 4, 4), (2, 32)]


def test_older_trunk_params_layout_and_command_line_without_plus() -> None:
    cfg = compose(["config.MODEL.TRUNK.NAME=regnet", "config.MODEL.TRUNK.REGNET.name=regnet_y_400mf"])
    assert cfg.MODEL.TRUNK.REGNET == {"name": "regnet_y_400mf"}
    cfg = compose(["config.MODEL.TRUNK.NAME=regnet", "config.MODEL.TRUNK.TRUNK_PARAMS.REGNET.depth=16",
                   *(f"config.MODEL.TRUNK.TRUNK_PARAMS.REGNET.{k}={v}" for k, v in Y400MF.items() if k != "depth")])
    assert cfg.MODEL.TRUNK.REGNET == Y400MF
    assert n_params(build_model(cfg.MODEL, cfg.OPTIMIZER).trunk) == 3_903_144


def test_a_vissl_yaml_with_trunk_params_composes(tmp_path: Path) -> None:
    """VISSL's pretrain/swav/models/regnet*.yaml write the options under TRUNK_PARAMS.REGNET."""
    path = tmp_path / "regnet_yaml.yaml"
    path.write_text("# @package _global_\nconfig:\n  MODEL:\n    TRUNK:\n      NAME: regnet\n      TRUNK_PARAMS:\n"
                    "        REGNET:\n          name: regnet_y_400mf\n    HEAD:\n      PARAMS: [[mlp, {dims: [440, 10]}]]\n")
    cfg = compose([f"config={path}"])
    assert cfg.MODEL.TRUNK.REGNET == {"name": "regnet_y_400mf"}
    assert build_model(cfg.MODEL, cfg.OPTIMIZER).output_sizes() == [10]


@pytest.mark.parametrize("regnet,must", [
    ({"name": "regnet_y_400m"}, ["MODEL.TRUNK.REGNET.name='regnet_y_400m'", "did you mean regnet_y_400mf", "regnet_y_16gf"]),
    ({}, ["MODEL.TRUNK.REGNET is empty", "regnet_y_400mf"]),
    ({"depth": 16, "w_0": 48}, ["MODEL.TRUNK.REGNET needs w_a, w_m, group_width"]),
    ({**Y400MF, "w_0": 50}, ["MODEL.TRUNK.REGNET.w_0=50", "multiple of 8"]),
    ({**Y400MF, "w_m": 1.0}, ["MODEL.TRUNK.REGNET.w_m=1.0", "> 1"]),
    ({**Y400MF, "stem_typ": "res_stem_in"}, ["MODEL.TRUNK.REGNET.stem_typ", "did you mean stem_type"]),
    ({**Y400MF, "activation": "gelu"}, ["MODEL.TRUNK.REGNET.activation='gelu'", "relu, silu"]),
    ({**Y400MF, "use_se": "yes"}, ["MODEL.TRUNK.REGNET.use_se='yes'"]),
    ({**Y400MF, "bottleneck_multiplier": 0.01}, ["MODEL.TRUNK.REGNET=", "does not give a valid network"]),
    ({"name": "anynet", "depths": [1], "widths": [8, 16], "group_widths": [8, 8], "bottleneck_multipliers": [1, 1],
      "strides": [2, 2]}, ["one entry per stage", "depths: 1, widths: 2"]),
])
def test_bad_settings_name_the_key(regnet: Dict[str, Any], must: List[str]) -> None:
    with pytest.raises(UserError) as info:
        build(regnet)
    msg = str(info.value)
    assert "\n" not in msg
    for text in must:
        assert text in msg, msg


def test_keys_beside_a_preset_are_ignored_with_a_warning(caplog) -> None:
    """As in VISSL, a preset name builds the preset; what else the section holds is named, not applied."""
    with caplog.at_level(logging.WARNING, logger="ssl_engine.models.trunks.regnet"):
        trunk = build({"name": "regnet_y_400mf", "bn_epsilon": 0.001, "depth": 3}).trunk
    assert n_params(trunk) == 3_903_144 and trunk._feature_blocks["conv1"].stem[1].eps == 1e-5
    assert "bn_epsilon, depth ignored beside the preset name 'regnet_y_400mf'" in caplog.text


def test_gray_input_is_refused_and_anynet_builds() -> None:
    cfg = model_config({"name": "regnet_y_400mf"})
    cfg["INPUT_TYPE"] = "gray"
    with pytest.raises(UserError, match="MODEL.INPUT_TYPE='gray' is not supported by the regnet trunk"):
        build_model(cfg, AttrDict({}))
    anynet = build({"name": "anynet", "depths": [1, 1], "widths": [16, 24], "group_widths": [8, 8],
                    "bottleneck_multipliers": [1.0, 1.0], "strides": [2, 2], "stem_width": 8}).trunk
    assert anynet.feature_dims() == {"conv1": 8, "res2": 16, "res3": 24, "avgpool": 24, "flatten": 24}


# ------------------------------------------------------------------ heads and features
def test_heads_are_checked_against_the_trunk_output_size() -> None:
    model = build({"name": "regnet_y_400mf"}, heads=[["mlp", {"dims": [440, 10]}]])
    assert model.output_sizes() == [10]
    with pytest.raises(UserError, match=r"dims\[0\]=512 .* layer 'flatten' gives 440 features; set dims\[0\] to 440"):
        build({"name": "regnet_y_400mf"}, heads=[["mlp", {"dims": [512, 10]}]])
    # VISSL's linear-eval yaml for regnet (benchmark/linear_image_classification/.../regnet*.yaml), scaled down
    fe = {"EVAL_MODE_ON": True, "FREEZE_TRUNK_ONLY": True, "LINEAR_EVAL_FEAT_POOL_OPS_MAP": [
        ["res4", ["AdaptiveAvgPool2d", [[2, 2]]]], ["res5", ["AdaptiveAvgPool2d", [[1, 1]]]], ["avgpool", ["Identity", []]]]}
    heads = [["eval_mlp", {"in_channels": 208, "dims": [832, 10]}], ["eval_mlp", {"in_channels": 440, "dims": [440, 10]}],
             ["mlp", {"dims": [440, 10]}]]
    model = build({"name": "regnet_y_400mf"}, heads=heads, eval_settings=fe)
    assert model.output_sizes() == [10, 10, 10]
    with torch.no_grad():
        assert [tuple(o.shape) for o in model.eval()(torch.randn(2, 3, 32, 32))] == [(2, 10)] * 3
    bad = [["eval_mlp", {"in_channels": 256, "dims": [1024, 10]}], *heads[1:]]
    with pytest.raises(UserError, match="in_channels=256 but trunk 'regnet' layer 'res4' has 208 channels"):
        build({"name": "regnet_y_400mf"}, heads=bad, eval_settings=fe)


def test_feature_extraction_path_gives_named_pooled_layers() -> None:
    fe = {"EVAL_MODE_ON": True, "FREEZE_TRUNK_AND_HEAD": True, "EXTRACT_TRUNK_FEATURES_ONLY": True,
          "LINEAR_EVAL_FEAT_POOL_OPS_MAP": [["conv1", ["AdaptiveAvgPool2d", [[1, 1]]]],
                                            ["res4", ["AdaptiveAvgPool2d", [[2, 2]]]], ["avgpool", ["Identity", []]]]}
    model = build({"name": "regnet_y_400mf"}, eval_settings=fe).eval()
    feats = model.extract_features(torch.randn(3, 3, 32, 32))
    assert {k: tuple(v.shape) for k, v in feats.items()} == {"conv1": (3, 32), "res4": (3, 832), "avgpool": (3, 440)}
    with pytest.raises(UserError, match="valid layers: conv1, res2, res3, res4, res5, avgpool, flatten"):
        build({"name": "regnet_y_400mf"}, eval_settings={**fe, "LINEAR_EVAL_FEAT_POOL_OPS_MAP": [["res5avg", ["Identity", []]]]})


# ------------------------------------------------------------------ VISSL's state-dict layout
def test_state_dict_keys_are_vissls(y400: SSLModel) -> None:
    own = y400.trunk.state_dict()
    for key in [  # as a VISSL regnet_y checkpoint's classy_state_dict.base_model.model.trunk holds them
        "_feature_blocks.conv1.stem.0.weight",
        "_feature_blocks.conv1.stem.1.running_var",
        "_feature_blocks.res2.block1-0.proj.weight",
        "_feature_blocks.res2.block1-0.bn.weight",
        "_feature_blocks.res2.block1-0.f.a.0.weight",
        "_feature_blocks.res2.block1-0.f.b.0.weight",
        "_feature_blocks.res2.block1-0.f.se.excitation.0.weight",
        "_feature_blocks.res2.block1-0.f.se.excitation.2.bias",
        "_feature_blocks.res2.block1-0.f.c.weight",
        "_feature_blocks.res2.block1-0.f.final_bn.num_batches_tracked",
        "_feature_blocks.res3.block2-2.f.b.1.running_mean",
        "_feature_blocks.res5.block4-5.f.final_bn.weight",
    ]:
        assert key in own, key
    assert not any(k.startswith(("_feature_blocks.avgpool", "_feature_blocks.flatten")) for k in own)
    # exactly the keys (and shapes) of classy_vision's network under VISSL's wrapper names
    torch.manual_seed(0)
    expected = vissl_keys(classy_build_model({"name": "regnet_y_400mf"}).state_dict())
    assert list(own) == list(expected)
    assert all(own[k].shape == v.shape for k, v in expected.items())


def test_a_vissl_regnet_checkpoint_loads_through_weights_init(tmp_path: Path) -> None:
    torch.manual_seed(1)
    trunk = vissl_keys(classy_build_model({"name": "regnet_y_400mf"}).state_dict())
    torch.save({"classy_state_dict": {"base_model": {"model": {"trunk": trunk, "heads": {}}, "meta": {}}}},
               str(tmp_path / "vissl_regnet.torch"))
    cfg = compose(["config.MACHINE.DEVICE=cpu", "config.MODEL.TRUNK.NAME=regnet",
                   "config.MODEL.TRUNK.REGNET.name=regnet_y_400mf", "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[440,10]}]]",
                   f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={tmp_path / 'vissl_regnet.torch'}"])
    model = build_model(cfg.MODEL, cfg.OPTIMIZER)
    report = ck.init_model_from_weights(model, cfg.MODEL)
    assert not report["unexpected"] and not report["shape_mismatch"]
    assert not [k for k in report["missing"] if k.startswith("trunk.")]
    own = model.trunk.state_dict()
    assert all(torch.equal(own[k], v) for k, v in trunk.items() if not k.endswith("num_batches_tracked"))


# ------------------------------------------------------------------ through the real tool
def tool(args: List[str]):
    proc = run_tool(args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


REGNET = ["config.MODEL.TRUNK.NAME=regnet", "config.MODEL.TRUNK.REGNET.name=regnet_y_400mf"]


def test_train_then_extract_two_regnet_layers(tmp_path: Path) -> None:
    run, out = tmp_path / "run", tmp_path / "features"
    tool(["config=quick/supervised_digits", f"config.CHECKPOINT.DIR={run}", *REGNET,
          "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[440,10]}]]", "config.OPTIMIZER.num_epochs=1",
          "config.DATA.TRAIN.DATA_LIMIT=16", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4",
          "config.DATA.TEST.DATA_LIMIT=8", "config.DATA.TEST.BATCHSIZE_PER_REPLICA=4"])
    saved = ck.load_checkpoint(run / "checkpoint.torch")
    trunk = saved["classy_state_dict"]["base_model"]["model"]["trunk"]
    assert "_feature_blocks.res5.block4-5.f.final_bn.weight" in trunk
    proc = tool(["config=extract/simclr_digits_trunk", f"config.CHECKPOINT.DIR={run}", *REGNET,
                 "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[440,10]}]]", f"config.EXTRACT_FEATURES.OUTPUT_DIR={out}",
                 "config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP="
                 "[[res4,[AdaptiveAvgPool2d,[[2,2]]]],[avgpool,[Identity,[]]]]",
                 "config.EXTRACT_FEATURES.SPLITS=[TRAIN]", "config.DATA.TRAIN.DATA_LIMIT=10",
                 "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4"])
    assert "train res4: 10 samples, features [10, 832]" in proc.stdout, proc.stdout[-3000:]
    assert np.load(out / "rank0_chunk0_train_res4_features.npy").shape == (10, 832)
    assert np.load(out / "rank0_chunk0_train_avgpool_features.npy").shape == (10, 440)
    feats = load_features(out, "train", "avgpool")
    np.testing.assert_array_equal(feats["inds"], np.arange(10))
    assert np.isfinite(feats["features"]).all()


def test_bad_preset_name_exits_2_with_one_line(tmp_path: Path) -> None:
    proc = run_tool(["config=quick/supervised_digits", f"config.CHECKPOINT.DIR={tmp_path}",
                     "config.MODEL.TRUNK.NAME=regnet", "config.MODEL.TRUNK.REGNET.name=regnet_y_400",
                     "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[440,10]}]]"])
    err = proc.stderr.strip()
    assert proc.returncode == 2, err[-3000:]
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    assert "MODEL.TRUNK.REGNET.name='regnet_y_400'" in lines[0] and "regnet_y_400mf" in lines[0]
    assert not (tmp_path / "checkpoint.torch").exists()


def test_a_deeper_regnets_file_stops_the_run_naming_its_extra_blocks(tmp_path: Path) -> None:
    """A RegNet of the same widths and more blocks per stage (blocks named ``block3-6``, not
    numbered as ResNet's ``layer1.2``) fits every weight the model has: it loaded, with the extra
    blocks as "unexpected" at INFO, into a model that then trained as another network."""
    deeper = build(dict(TINY, depth=9))  # the stages of depth 7, with more blocks and the same widths
    torch.save({"model_state_dict": deeper.state_dict()}, str(tmp_path / "deeper.torch"))
    cfg = compose(["config.MACHINE.DEVICE=cpu", "config.MODEL.TRUNK.NAME=regnet", "config.MODEL.HEAD.PARAMS=[]",
                   f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={tmp_path / 'deeper.torch'}"], warn_unused=False)
    cfg.MODEL.TRUNK.REGNET = AttrDict(dict(TINY, depth=7))
    with pytest.raises(UserError, match=r"deeper.torch: \d+ of its weights belong to numbered blocks this model does not "
                                        r"have \(e\.g\. trunk\._feature_blocks\.res\d\.block\d-\d+\..*deeper network"):
        ck.init_model_from_weights(build(dict(TINY, depth=7)), cfg.MODEL)
    same = build(dict(TINY, depth=7))  # the same depth's file loads
    torch.save({"model_state_dict": same.state_dict()}, str(tmp_path / "same.torch"))
    cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE = str(tmp_path / "same.torch")
    assert not ck.init_model_from_weights(build(dict(TINY, depth=7)), cfg.MODEL)["unexpected"]


def test_a_regnet_file_with_a_whole_extra_stage_stops_the_run(tmp_path: Path) -> None:
    """A file with a stage past the model's last (``res5`` next to ``res2``-``res4``, as a deeper
    RegNet of other widths has) fits every weight the model has; the extra stage was only
    "unexpected" at INFO. A stem's single ``conv1`` is no series: a file's ``conv2`` is not a stage."""
    model = build(dict(TINY, depth=7))
    state = model.state_dict()
    last = "trunk._feature_blocks.res4."
    extra = {"trunk._feature_blocks.res5." + k[len(last):]: v for k, v in state.items() if k.startswith(last)}
    torch.save({"model_state_dict": {**state, **extra}}, str(tmp_path / "stage.torch"))
    cfg = compose(["config.MACHINE.DEVICE=cpu", "config.MODEL.TRUNK.NAME=regnet", "config.MODEL.HEAD.PARAMS=[]",
                   f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={tmp_path / 'stage.torch'}"], warn_unused=False)
    cfg.MODEL.TRUNK.REGNET = AttrDict(dict(TINY, depth=7))
    counted = [k for k in extra if not k.endswith("num_batches_tracked")]  # skipped by default (SKIP_LAYERS)
    with pytest.raises(UserError, match=rf"stage.torch: {len(counted)} of its weights belong to numbered blocks this model "
                                        r"does not have \(e\.g\. trunk\._feature_blocks\.res5\..*deeper network"):
        ck.init_model_from_weights(build(dict(TINY, depth=7)), cfg.MODEL)
    stem = "trunk._feature_blocks.conv1."
    other = {"trunk._feature_blocks.conv2." + k[len(stem):]: v for k, v in state.items() if k.startswith(stem)}
    torch.save({"model_state_dict": {**state, **other}}, str(tmp_path / "stem.torch"))
    cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE = str(tmp_path / "stem.torch")
    report = ck.init_model_from_weights(build(dict(TINY, depth=7)), cfg.MODEL)
    assert sorted(report["unexpected"]) == sorted(k for k in other if not k.endswith("num_batches_tracked"))
