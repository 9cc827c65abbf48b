"""Unit tests for ssl_engine.models: trunks, heads, SSLModel modes and the build-time checks."""

from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.nn as nn

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import UserError
from ssl_engine.models import SSLModel, build_model, convert_sync_batchnorm
from ssl_engine.models.model import sync_bn_group_size
from ssl_engine.models.heads import head_bn_kwargs
from ssl_engine.registry import HEADS, TRUNKS


def model_config(
    depth: int = 18,
    heads: Optional[List[Any]] = None,
    width: int = 1,
    trunk: str = "resnet",
    zero_init: bool = False,
    eval_settings: Optional[Dict[str, Any]] = None,
    **extra: Any,
) -> AttrDict:
    cfg: Dict[str, Any] = {
        "INPUT_TYPE": "rgb",
        "TRUNK": {
            "NAME": trunk,
            "RESNETS": {"DEPTH": depth, "WIDTH_MULTIPLIER": width, "ZERO_INIT_RESIDUAL": zero_init},
            "MLP": {"DIMS": [3 * 8 * 8, 32, 16], "USE_BN": True, "USE_RELU": True},
        },
        "HEAD": {"PARAMS": heads or [], "BATCHNORM_EPS": 1e-5, "BATCHNORM_MOMENTUM": 0.1},
        "FEATURE_EVAL_SETTINGS": dict(eval_settings or {}),
    }
    cfg.update(extra)
    return AttrDict(cfg)


def build(cfg: AttrDict) -> SSLModel:
    torch.manual_seed(0)
    return build_model(cfg, AttrDict({}))


pytestmark = pytest.mark.usefixtures("one_thread")


RESNET_LAYERS = ["conv1", "res1", "res2", "res3", "res4", "res5", "res5avg", "flatten"]


@pytest.fixture(scope="module")
def resnet18() -> SSLModel:
    return build(model_config(18))


# ------------------------------------------------------------------ trunks
@pytest.mark.parametrize(
    "depth,channels", [(18, [64, 64, 64, 128, 256, 512]), (50, [64, 64, 256, 512, 1024, 2048])]
)
def test_resnet_feature_shapes_at_32(depth: int, channels: List[int]) -> None:
    trunk = build(model_config(depth)).trunk.eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        feats = trunk(x, RESNET_LAYERS)
    spatial = [16, 8, 8, 4, 2, 1]
    for name, feat, c, s in zip(RESNET_LAYERS, feats, channels, spatial):
        assert tuple(feat.shape) == (2, c, s, s), name
    assert tuple(feats[6].shape) == (2, channels[-1], 1, 1)
    assert tuple(feats[7].shape) == (2, channels[-1])
    dims = trunk.feature_dims()
    assert list(dims) == RESNET_LAYERS
    for name, feat in zip(RESNET_LAYERS, feats):
        assert dims[name] == feat.shape[1], name


def test_resnet_default_output_order_and_8x8(resnet18: SSLModel) -> None:
    trunk = resnet18.trunk.eval()
    with torch.no_grad():
        (default,) = trunk(torch.randn(2, 3, 8, 8))
        res5, res3 = trunk(torch.randn(2, 3, 8, 8), ["res5", "res3"])
    assert tuple(default.shape) == (2, 512)
    assert res5.shape[1] == 512 and res3.shape[1] == 128


def test_one_layer_asked_equals_that_layer_of_a_full_walk_and_stops_there(resnet18: SSLModel) -> None:
    """One layer (every training step's request) takes the trunk's short path: the same tensor as
    when it is asked for among others, and no block after it runs."""
    trunk = resnet18.trunk.eval()
    x = torch.randn(2, 3, 16, 16)
    ran: List[str] = []
    handles = [block.register_forward_hook(lambda m, i, o, name=name: ran.append(name))
               for name, block in trunk._feature_blocks.items()]
    try:
        with torch.no_grad():
            full = dict(zip(RESNET_LAYERS, trunk(x, RESNET_LAYERS)))
            for layer in ("conv1", "res3", "res5", "res5avg", "flatten"):
                ran.clear()
                (one,) = trunk(x, [layer])
                assert torch.equal(one, full[layer]), layer
                assert ran[-1] == trunk._feature_to_block[layer], (layer, ran)
            (default,) = trunk(x)
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(default, full[trunk.default_feature_name])


def test_unknown_layer_lists_valid_names(resnet18: SSLModel) -> None:
    with pytest.raises(UserError, match="res5avg"):
        resnet18.trunk(torch.randn(2, 3, 8, 8), ["res6"])


def test_width_multiplier_scales_channels() -> None:
    trunk = build(model_config(18, width=2)).trunk
    dims = trunk.feature_dims()
    assert dims["conv1"] == 128 and dims["res5"] == 1024 and dims["flatten"] == 1024
    with torch.no_grad():
        (out,) = trunk.eval()(torch.randn(2, 3, 8, 8))
    assert tuple(out.shape) == (2, 1024)


def test_zero_init_residual() -> None:
    trunk = build(model_config(18, zero_init=True)).trunk
    last_bns = [b.bn2.weight for stage in ("layer1", "layer4") for b in trunk._feature_blocks[stage]]
    assert all(torch.all(w == 0) for w in last_bns)
    assert torch.all(trunk._feature_blocks["bn1"].weight == 1)
    plain = build(model_config(18)).trunk
    assert torch.all(plain._feature_blocks["layer1"][0].bn2.weight == 1)


def test_gray_input_and_bad_norm() -> None:
    trunk = build(model_config(18, INPUT_TYPE="gray")).trunk.eval()
    with torch.no_grad():
        (out,) = trunk(torch.randn(2, 1, 16, 16))
    assert out.shape == (2, 512)
    cfg = model_config(18)
    cfg.TRUNK.RESNETS.NORM = "GroupNorm"
    with pytest.raises(UserError, match="NORM"):
        build(cfg)
    with pytest.raises(UserError, match="INPUT_TYPE"):
        build(model_config(18, INPUT_TYPE="cmyk"))


@pytest.mark.parametrize("trunk", ["resnet", "regnet"])
def test_bgr_input_reverses_the_channels_of_the_rgb_batch(trunk: str) -> None:
    """VISSL's INPUT_TYPE=bgr (weights trained on BGR input, e.g. its Caffe2-era models) reads the
    transforms' RGB batch with the channels reversed; before, the key was taken and ignored, and
    such weights saw the wrong channel order without a sign of it."""
    extra = {"REGNET": {"name": "regnet_y_400mf"}} if trunk == "regnet" else {}
    rgb_cfg, bgr_cfg = model_config(18, trunk=trunk), model_config(18, trunk=trunk, INPUT_TYPE="bgr")
    rgb_cfg.TRUNK.update(extra)
    bgr_cfg.TRUNK.update(extra)
    rgb, bgr = build(rgb_cfg).eval(), build(bgr_cfg).eval()
    bgr.load_state_dict(rgb.state_dict())
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(bgr(x)[0], rgb(x[:, [2, 1, 0]])[0])
        assert not torch.allclose(bgr(x)[0], rgb(x)[0])


def test_lab_input_takes_the_l_channel_of_a_three_channel_batch() -> None:
    """VISSL's colorization trunks (INPUT_TYPE=lab) get the 3-channel LAB tensor and keep its L
    channel; a one-channel batch is taken as L already."""
    model = build(model_config(18, INPUT_TYPE="lab")).eval()
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(x)[0], model(x[:, :1])[0])
    with pytest.raises(UserError, match=r"config.MODEL.INPUT_TYPE=lab takes images \[N, 3 or 1, H, W\]"):
        model(torch.rand(2, 2, 32, 32))


def test_one_channel_images_for_an_rgb_trunk_name_the_input_type_to_set() -> None:
    model = build(model_config(18)).eval()
    with pytest.raises(UserError, match="INPUT_TYPE=rgb takes images .* set config.MODEL.INPUT_TYPE=gray"):
        model(torch.rand(2, 1, 32, 32))


def test_mlp_trunk() -> None:
    model = build(model_config(trunk="mlp", heads=[["mlp", {"dims": [16, 4]}]]))
    assert model.trunk.feature_dims() == {"fc1": 32, "fc2": 16}
    (out,) = model(torch.randn(3, 3, 8, 8))
    assert out.shape == (3, 4)
    with pytest.raises(UserError, match="DIMS"):
        model(torch.randn(3, 3, 4, 4))


def test_unknown_trunk_lists_known_names() -> None:
    with pytest.raises(UserError) as info:
        build(model_config(trunk="resnett"))
    msg = str(info.value)
    assert "resnet" in msg and "mlp" in msg and "MODEL.TRUNK.NAME" in msg


# ------------------------------------------------------------------ heads
def test_mlp_head_chaining_and_shapes() -> None:
    heads = [
        ["mlp", {"dims": [16, 64, 32], "use_bn": True, "use_relu": True}],
        ["mlp", {"dims": [32, 8]}],
    ]
    model = build(model_config(trunk="mlp", heads=heads)).train()
    first = model.heads[0].clf
    assert [type(m) for m in first] == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]
    outputs = model(torch.randn(4, 3, 8, 8))
    assert len(outputs) == 1 and outputs[0].shape == (4, 8)
    outputs = model([torch.randn(4, 3, 8, 8)])
    assert outputs[0].shape == (4, 8)
    no_skip = HEADS.get("mlp")(model_config(), dims=[8, 4], use_relu=True, skip_last_layer_relu_bn=False)
    assert isinstance(no_skip.clf[-1], nn.ReLU)
    assert no_skip(torch.randn(2, 8, 1, 1)).shape == (2, 4)
    nested = build(model_config(trunk="mlp", heads=[[["mlp", {"dims": [16, 32]}], ["mlp", {"dims": [32, 4]}]]]))
    assert nested.head_names == ["mlp->mlp"] and nested(torch.randn(2, 3, 8, 8))[0].shape == (2, 4)
    with pytest.raises(UserError, match="PARAMS\\[1\\].*input dim 30.*32"):
        build(model_config(trunk="mlp", heads=[heads[0], ["mlp", {"dims": [30, 8]}]]))


def test_multi_crop_list_input() -> None:
    model = build(model_config(18, heads=[["mlp", {"dims": [512, 16]}]])).eval()
    crops = [torch.randn(2, 3, 32, 32), torch.randn(2, 3, 32, 32), torch.randn(2, 3, 16, 16)]
    with torch.no_grad():
        (out,) = model(crops)
    assert out.shape == (6, 16)


def test_head_dim_mismatch_names_both_numbers() -> None:
    with pytest.raises(UserError) as info:
        build(model_config(18, heads=[["mlp", {"dims": [2048, 128]}]]))
    msg = str(info.value)
    assert "MODEL.HEAD.PARAMS" in msg and "2048" in msg and "512" in msg and "flatten" in msg


def test_bad_head_params() -> None:
    with pytest.raises(UserError, match="dimz"):
        build(model_config(trunk="mlp", heads=[["mlp", {"dimz": [16, 10]}]]))
    with pytest.raises(UserError, match="known"):
        build(model_config(trunk="mlp", heads=[["nope", {}]]))


def test_batchnorm_eps_string_parsed() -> None:
    cfg = model_config(trunk="mlp", heads=[["mlp", {"dims": [16, 64, 8], "use_bn": True}]])
    cfg.HEAD.BATCHNORM_EPS = "1e-5"
    cfg.HEAD.BATCHNORM_MOMENTUM = "0.2"
    assert head_bn_kwargs(cfg) == {"eps": 1e-5, "momentum": 0.2}
    bn = build(cfg).heads[0].clf[1]
    assert isinstance(bn, nn.BatchNorm1d) and bn.eps == 1e-5 and bn.momentum == 0.2
    cfg.HEAD.BATCHNORM_EPS = "tiny"
    with pytest.raises(UserError, match="BATCHNORM_EPS"):
        build(cfg)


# ------------------------------------------------------------------ linear eval / freezing
POOL_MAP = [["res5avg", ["Identity", []]], ["res4", ["AdaptiveAvgPool2d", [[2, 2]]]]]
EVAL_HEADS = [
    ["eval_mlp", {"in_channels": 512, "dims": [512, 10]}],
    ["eval_mlp", {"in_channels": 256, "dims": [1024, 10]}],
]


def linear_eval_model(**settings: Any) -> SSLModel:
    fe = {"EVAL_MODE_ON": True, "FREEZE_TRUNK_ONLY": True, "LINEAR_EVAL_FEAT_POOL_OPS_MAP": POOL_MAP}
    fe.update(settings)
    return build(model_config(18, heads=EVAL_HEADS, eval_settings=fe))


def test_linear_eval_one_output_per_layer() -> None:
    model = linear_eval_model().train()
    x = torch.randn(4, 3, 32, 32)
    outputs = model(x)
    assert [tuple(o.shape) for o in outputs] == [(4, 10), (4, 10)]
    feats = model.extract_features(x)
    assert list(feats) == ["res5avg", "res4"]
    assert feats["res5avg"].shape == (4, 512) and feats["res4"].shape == (4, 1024)
    unflat = linear_eval_model(SHOULD_FLATTEN_FEATS=False).extract_features(x)
    assert unflat["res4"].shape == (4, 256, 2, 2) and unflat["res5avg"].shape == (4, 512, 1, 1)


def test_output_heads_name_the_stage_behind_each_output() -> None:
    """The key and class count of the head stage that produces each model output (what a label is
    checked against): the last stage of a chain in training, one head per layer in linear eval."""
    chain = [[["mlp", {"dims": [16, 8]}], ["mlp", {"dims": [8, 5]}]]]
    assert build(model_config(trunk="mlp", heads=chain)).output_heads() == [("config.MODEL.HEAD.PARAMS[0][1] (mlp)", 5)]
    two = [["mlp", {"dims": [16, 8]}], ["mlp", {"dims": [8, 3]}]]
    assert build(model_config(trunk="mlp", heads=two)).output_heads() == [("config.MODEL.HEAD.PARAMS[1] (mlp)", 3)]
    assert linear_eval_model().output_heads() == [("config.MODEL.HEAD.PARAMS[0] (eval_mlp)", 10),
                                                  ("config.MODEL.HEAD.PARAMS[1] (eval_mlp)", 10)]
    assert build(model_config(trunk="mlp")).output_heads() == []


def test_output_sizes_are_what_forward_returns_and_what_the_meters_check() -> None:
    """output_sizes (from the config, no forward: what the pre-launch check gives the meters) has
    one entry per forward output with its class count, or None where the config does not say; a
    top-k meter raises the same line from it as from its first update on the real outputs."""
    from ssl_engine.meters import build_meters, check_meters_fit_model

    x = torch.randn(2, 3, 8, 8)
    chain = [[["mlp", {"dims": [16, 8]}], ["mlp", {"dims": [8, 5]}]]]
    two = [["mlp", {"dims": [16, 8]}], ["mlp", {"dims": [8, 3]}]]
    mlp_fe = {"EVAL_MODE_ON": True, "LINEAR_EVAL_FEAT_POOL_OPS_MAP": [["fc1", ["Identity", []]], ["fc2", ["Identity", []]]]}
    per_layer = [["mlp", {"dims": [32, 4]}], ["mlp", {"dims": [16, 6]}]]
    cases = [
        (model_config(trunk="mlp", heads=chain), [5]),
        (model_config(trunk="mlp", heads=two), [3]),
        (model_config(trunk="mlp", heads=per_layer, eval_settings=mlp_fe), [4, 6]),
        (model_config(trunk="mlp"), [None]),  # trunk features: their number only
        (model_config(trunk="mlp", heads=per_layer, eval_settings=dict(mlp_fe, EXTRACT_TRUNK_FEATURES_ONLY=True)),
         [None, None]),
    ]
    for cfg, sizes in cases:
        model = build(cfg).eval()
        assert model.output_sizes() == sizes
        with torch.no_grad():
            outputs = model(x)
        assert len(outputs) == len(sizes)
        assert [int(o.shape[1]) for o, n in zip(outputs, sizes) if n is not None] == [n for n in sizes if n is not None]
        with torch.device("meta"):
            assert build(cfg).output_sizes() == sizes
    model = build(model_config(trunk="mlp", heads=per_layer, eval_settings=mlp_fe)).eval()
    with torch.no_grad():
        outputs = model(x)
    target = torch.zeros(2, dtype=torch.long)
    for meters_cfg in ({"num_meters": 1, "topk_values": [1]}, {"num_meters": 2, "topk_values": [1, 5]}):
        meter = build_meters(AttrDict({"names": ["accuracy_list_meter"], "accuracy_list_meter": meters_cfg}))[0]
        with pytest.raises(UserError) as before_launch:
            check_meters_fit_model([meter], model)
        with pytest.raises(UserError) as at_update:
            meter.update(outputs, target)
        assert str(before_launch.value) == str(at_update.value)
    fits = build_meters(AttrDict({"names": ["accuracy_list_meter"],
                                  "accuracy_list_meter": {"num_meters": 2, "topk_values": [1, 4]}}))
    check_meters_fit_model(fits, model)
    fits[0].update(outputs, target)


def test_linear_eval_checks() -> None:
    bad = [EVAL_HEADS[0], ["eval_mlp", {"in_channels": 256, "dims": [256, 10]}]]
    fe = {"EVAL_MODE_ON": True, "LINEAR_EVAL_FEAT_POOL_OPS_MAP": POOL_MAP}
    with pytest.raises(UserError, match="1024"):
        build(model_config(18, heads=bad, eval_settings=fe))
    # the remaining checks do not depend on the trunk: use the cheap mlp trunk
    fe_mlp = dict(fe, LINEAR_EVAL_FEAT_POOL_OPS_MAP=[["fc1", ["Identity", []]], ["fc2", ["Identity", []]]])
    heads_mlp = [["eval_mlp", {"in_channels": 32, "dims": [32, 10]}]]
    with pytest.raises(UserError, match="one head per mapped layer"):
        build(model_config(trunk="mlp", heads=heads_mlp, eval_settings=fe_mlp))
    with pytest.raises(UserError, match="in_channels=8.*16"):
        build(model_config(trunk="mlp", heads=[heads_mlp[0], ["eval_mlp", {"in_channels": 8, "dims": [8, 10]}]],
                           eval_settings=fe_mlp))
    fe_bad_op = dict(fe, LINEAR_EVAL_FEAT_POOL_OPS_MAP=[["fc1", ["AdaptiveAvgPool", [1]]]])
    with pytest.raises(UserError, match="AdaptiveAvgPool"):
        build(model_config(trunk="mlp", heads=heads_mlp, eval_settings=fe_bad_op))
    fe_bad_layer = dict(fe, LINEAR_EVAL_FEAT_POOL_OPS_MAP=[["fc9", ["Identity", []]]])
    with pytest.raises(UserError, match="fc9"):
        build(model_config(trunk="mlp", heads=heads_mlp, eval_settings=fe_bad_layer))


def test_frozen_trunk_no_grad_and_bn_stats_fixed() -> None:
    model = linear_eval_model()
    assert model.trunk_frozen and not model.heads_frozen
    model.train()
    assert not model.trunk.training and model.heads.training
    bn = model.trunk._feature_blocks["bn1"]
    before = bn.running_mean.clone()
    loss = sum(o.sum() for o in model(torch.randn(4, 3, 32, 32)))
    loss.backward()
    assert torch.equal(bn.running_mean, before)
    assert all(not p.requires_grad and p.grad is None for p in model.trunk.parameters())
    assert all(p.grad is not None for p in model.heads.parameters())
    assert model.heads[0].channel_bn.num_batches_tracked.item() == 1


def test_freeze_trunk_and_head() -> None:
    model = build(
        model_config(18, heads=[["mlp", {"dims": [512, 16]}]],
                     eval_settings={"EVAL_MODE_ON": True, "FREEZE_TRUNK_AND_HEAD": True})
    )
    model.train()
    assert model.trunk_frozen and model.heads_frozen
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.trunk.training and not model.heads.training


@pytest.mark.parametrize("key", ["FREEZE_TRUNK_ONLY", "FREEZE_TRUNK_AND_HEAD"])
def test_freeze_settings_without_eval_mode_freeze_nothing_as_in_vissl(key: str, caplog) -> None:
    """VISSL freezes only when EVAL_MODE_ON is true: without it its full fine-tuning trains the
    whole model, BatchNorm statistics included (was: the trunk frozen and in eval mode)."""
    with caplog.at_level("WARNING", logger="ssl_engine.models.model"):
        model = build(model_config(18, heads=[["mlp", {"dims": [512, 16]}]], eval_settings={key: True}))
    model.train()
    assert not model.trunk_frozen and not model.heads_frozen
    assert all(p.requires_grad for p in model.parameters())
    assert model.trunk.training and model.heads.training
    said = [r.getMessage() for r in caplog.records]
    assert any(f"config.MODEL.FEATURE_EVAL_SETTINGS.{key}=true freezes nothing without" in m and "EVAL_MODE_ON=true"
               in m for m in said), said


def test_extract_features_modes(resnet18: SSLModel) -> None:
    x = torch.randn(2, 3, 32, 32)
    small = torch.randn(2, 3, 8, 8)
    with_head = build(model_config(trunk="mlp", heads=[["mlp", {"dims": [16, 4]}]])).eval()
    assert {k: tuple(v.shape) for k, v in with_head.extract_features(small).items()} == {"heads": (2, 4)}
    trunk_only = build(
        model_config(trunk="mlp", heads=[["mlp", {"dims": [16, 4]}]], eval_settings={"EXTRACT_TRUNK_FEATURES_ONLY": True})
    ).eval()
    assert {k: tuple(v.shape) for k, v in trunk_only.extract_features(small).items()} == {"fc2": (2, 16)}
    # no heads: the trunk's output under VISSL's name for the model's output (tools that read "heads" find it)
    assert {k: tuple(v.shape) for k, v in resnet18.eval().extract_features(x).items()} == {"heads": (2, 512)}
    no_heads_trunk_only = build(model_config(eval_settings={"EXTRACT_TRUNK_FEATURES_ONLY": True})).eval()
    assert {k: tuple(v.shape) for k, v in no_heads_trunk_only.extract_features(x).items()} == {"flatten": (2, 512)}


def test_state_roundtrip_and_sync_bn_noop(resnet18: SSLModel) -> None:
    state = resnet18.get_classy_state()
    assert "_feature_blocks.conv1.weight" in state["model"]["trunk"]
    resnet18.set_classy_state(state)
    assert convert_sync_batchnorm(resnet18, AttrDict({"CONVERT_BN_TO_SYNC_BN": False})) is resnet18
    model = build(model_config(trunk="mlp", heads=[["mlp", {"dims": [16, 4], "use_bn": True}]]))
    converted = convert_sync_batchnorm(model, AttrDict({"CONVERT_BN_TO_SYNC_BN": True, "GROUP_SIZE": -1}))
    assert any(isinstance(m, nn.SyncBatchNorm) for m in converted.modules())
    # VISSL configs name apex's SyncBN: it runs as torch's
    converted = convert_sync_batchnorm(model, AttrDict({"CONVERT_BN_TO_SYNC_BN": True, "SYNC_BN_TYPE": "apex"}))
    assert any(isinstance(m, nn.SyncBatchNorm) for m in converted.modules())
    with pytest.raises(UserError, match="SYNC_BN_TYPE"):
        convert_sync_batchnorm(model, AttrDict({"CONVERT_BN_TO_SYNC_BN": True, "SYNC_BN_TYPE": "other"}))


@pytest.mark.parametrize(
    "group_size, world, per_node, expected",
    [(-1, 16, 8, 8), (-1, 4, 8, 4), (0, 16, 8, 16), (4, 16, 8, 4), (32, 16, 8, 16), (-1, 2, 2, 2)],
)
def test_sync_bn_group_size_reads_group_size_as_vissl(group_size: int, world: int, per_node: int, expected: int) -> None:
    # VISSL: 0 = one group of all ranks, -1 (default) = the ranks of one machine, N = N ranks
    assert sync_bn_group_size(group_size, world, per_node) == expected


def test_registries_hold_builtins() -> None:
    assert {"resnet", "mlp"} <= set(TRUNKS.names())
    assert {"mlp", "eval_mlp"} <= set(HEADS.names())


class _PlainTrunk(nn.Module):
    """A user trunk with only the required interface (no feature_dims): checks are skipped."""

    def __init__(self, model_config: AttrDict, model_name: str) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * 4 * 4, 6)

    def forward(self, x: torch.Tensor, out_feat_keys: Optional[List[str]] = None) -> List[torch.Tensor]:
        return [self.fc(x.flatten(1))]


def test_user_trunk_without_feature_dims() -> None:
    if "test_plain_trunk" not in TRUNKS:
        TRUNKS.register("test_plain_trunk")(_PlainTrunk)
    model = build(model_config(trunk="test_plain_trunk", heads=[["mlp", {"dims": [6, 2]}]]))
    assert model(torch.randn(2, 3, 4, 4))[0].shape == (2, 2)
    assert model.extract_features(torch.randn(2, 3, 4, 4))["heads"].shape == (2, 2)


def test_head_input_size_unknown_before_the_run_is_named_at_the_first_forward() -> None:
    """A trunk that does not report its sizes: the first forward names the head's key and both
    sizes instead of a matrix-multiply shape error."""
    if "test_plain_trunk" not in TRUNKS:
        TRUNKS.register("test_plain_trunk")(_PlainTrunk)
    model = build(model_config(trunk="test_plain_trunk", heads=[["mlp", {"dims": [16, 8]}], ["mlp", {"dims": [8, 2]}]]))
    with pytest.raises(UserError, match=r"^config\.MODEL\.HEAD\.PARAMS\[0\] \(mlp\) has dims\[0\]=16 but its input has 6 "
                                        r"features per sample \(shape \[2, 6\]\); set dims\[0\] to 6$"):
        model(torch.randn(2, 3, 4, 4))


def test_eval_mlp_input_size_that_depends_on_the_image_size_is_named_at_the_first_forward() -> None:
    """res5 unpooled has 512 x H/32 x W/32 features: the config cannot say how many, the forward can."""
    fe = {"EVAL_MODE_ON": True, "FREEZE_TRUNK_ONLY": True, "LINEAR_EVAL_FEAT_POOL_OPS_MAP": [["res5", ["Identity", []]]]}
    model = build(model_config(18, heads=[["eval_mlp", {"in_channels": 512, "dims": [512, 10]}]], eval_settings=fe))
    assert model(torch.randn(2, 3, 32, 32))[0].shape == (2, 10)  # res5 is 1 x 1 at 32 x 32
    with pytest.raises(UserError, match=r"^config\.MODEL\.HEAD\.PARAMS\[0\] \(eval_mlp\) has dims\[0\]=512 but its input has "
                                        r"2048 features per sample \(shape \[2, 512, 2, 2\]\); set dims\[0\] to 2048$"):
        model(torch.randn(2, 3, 64, 64))
