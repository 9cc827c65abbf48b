"""Losses, meters, optimizer, lr schedules and LARC (CPU, gloo for the 2-rank checks)."""

import io
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import CheckpointError, UserError
from ssl_engine.gather import gather_with_grad
from ssl_engine.losses import build_loss
from ssl_engine.meters import build_meters
from ssl_engine.optim import SSLOptimizer, build_optimizer, build_param_scheduler, scale_lr_schedule
from ssl_engine.registry import LOSSES, METERS

WORLD = 2
N_PER_RANK = 4  # images per rank; 2 views each
DIM = 16
NUM_CLASSES = 6


# ---------------------------------------------------------------------------- helpers


def simclr_cfg(temperature: float = 0.1) -> AttrDict:
    return AttrDict(
        {
            "name": "simclr_info_nce_loss",
            "simclr_info_nce_loss": {
                "temperature": temperature,
                "buffer_params": {"embedding_dim": DIM, "world_size": 64, "effective_batch_size": 4096},
            },
        }
    )


def reference_nt_xent(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """NT-Xent written out row by row; rows are [view0 of all images; view1 of all images]."""
    z = F.normalize(z.double(), dim=1)
    m = z.shape[0]
    half = m // 2
    losses = []
    for i in range(m):
        pos = (i + half) % m
        sims = [torch.dot(z[i], z[k]) / temperature for k in range(m)]
        denom = sum(torch.exp(sims[k]) for k in range(m) if k != i)
        losses.append(-torch.log(torch.exp(sims[pos]) / denom))
    return torch.stack(losses).mean()


def dist_data():
    """Global data for the 2-rank checks, identical in every process."""
    g = torch.Generator().manual_seed(1234)
    n = WORLD * N_PER_RANK
    view0 = torch.randn(n, DIM, generator=g)
    view1 = view0 + 0.3 * torch.randn(n, DIM, generator=g)
    logits = [torch.randn(n * 2, NUM_CLASSES, generator=g) for _ in range(2)]
    target = torch.randint(0, NUM_CLASSES, (n * 2,), generator=g)
    return view0, view1, logits, target


def accuracy_meter_cfg(names=("res4", "res5"), topk=(1, 3)) -> AttrDict:
    return AttrDict(
        {
            "names": ["accuracy_list_meter"],
            "accuracy_list_meter": {"num_meters": len(names), "topk_values": list(topk), "meter_names": list(names)},
        }
    )


def _dist_worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        view0, view1, logits, target = dist_data()
        sl = slice(rank * N_PER_RANK, (rank + 1) * N_PER_RANK)
        # Local block: view0 of this rank's images, then their view1 (simclr collator order).
        z = torch.cat([view0[sl], view1[sl]]).requires_grad_(True)
        loss = build_loss(simclr_cfg(0.2))(z, None)
        loss.backward()

        gathered = gather_with_grad(torch.full((2, 3), float(rank), requires_grad=True))

        meter = build_meters(accuracy_meter_cfg())[0]
        rows = slice(rank * 2 * N_PER_RANK, (rank + 1) * 2 * N_PER_RANK)
        meter.update([lg[rows] for lg in logits], target[rows])
        local_value = meter.value
        meter.sync_state()
        torch.save(
            {
                "loss": loss.detach(),
                "grad": z.grad,
                "gathered": gathered.detach(),
                "local_value": local_value,
                "synced_value": meter.value,
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    """Run the 2-rank gloo worker once; both the loss and meter tests read its results."""
    tmp = tmp_path_factory.mktemp("dist")
    mp.spawn(_dist_worker, args=(str(tmp / "init"), str(tmp)), nprocs=WORLD, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


# ---------------------------------------------------------------------------- losses


def test_ce_multiple_output_sums_per_output_ce():
    torch.manual_seed(0)
    outputs = [torch.randn(8, 5), torch.randn(8, 5)]
    target = torch.randint(0, 5, (8,))
    cfg = AttrDict({"name": "cross_entropy_multiple_output_single_target",
                    "cross_entropy_multiple_output_single_target": {"temperature": 1.0}})
    loss = build_loss(cfg)
    expected = sum(F.cross_entropy(o, target) for o in outputs)
    assert torch.allclose(loss(outputs, target), expected)
    assert torch.allclose(loss(outputs, [target.view(-1, 1)]), expected)  # list / (B, 1) targets
    assert torch.allclose(loss(outputs[0], target), F.cross_entropy(outputs[0], target))


def test_ce_multiple_output_normalize_temperature_ignore_weight():
    torch.manual_seed(1)
    outputs = [torch.randn(6, 4)]
    target = torch.tensor([0, 1, -1, 3, 2, -1])
    weight = [1.0, 2.0, 0.5, 1.0]
    loss = LOSSES.get("cross_entropy_multiple_output_single_target").from_config(
        AttrDict({"weight": weight, "normalize_output": True, "temperature": 0.5, "ignore_index": -1})
    )
    logits = F.normalize(outputs[0], dim=1) / 0.5
    expected = F.cross_entropy(logits, target, weight=torch.tensor(weight), ignore_index=-1)
    assert torch.allclose(loss(outputs, target), expected)
    # the class weight is a buffer: part of the loss state, and it round trips
    state = loss.get_classy_state()
    assert torch.equal(state["weight"], torch.tensor(weight))
    other = LOSSES.get("cross_entropy_multiple_output_single_target").from_config(AttrDict({"weight": [0.0] * 4}))
    other.set_classy_state(state)
    assert torch.equal(other.weight, torch.tensor(weight))


def test_cross_entropy_loss_default_name():
    torch.manual_seed(2)
    out = torch.randn(5, 3)
    target = torch.tensor([0, 2, -1, 1, 1])
    loss = build_loss(AttrDict({"name": "CrossEntropyLoss", "CrossEntropyLoss": {"ignore_index": -1}}))
    assert torch.allclose(loss([out], target), F.cross_entropy(out, target, ignore_index=-1))
    with pytest.raises(UserError, match="cross_entropy_multiple_output_single_target"):
        loss([out, out], target)


@pytest.mark.parametrize("name", ["CrossEntropyLoss", "cross_entropy_multiple_output_single_target"])
def test_class_losses_say_where_labels_come_from_when_a_batch_has_none(name):
    """A batch without labels (no LABEL_SOURCES: its "label" entry is an empty list) is a
    UserError naming the config key, not a ValueError from inside the loss."""
    loss = build_loss(AttrDict({"name": name, name: {}}))
    assert loss.needs_labels
    with pytest.raises(UserError, match=r"LABEL_SOURCES"):
        loss([torch.randn(4, 3)], [])


def test_unknown_loss_is_user_error():
    with pytest.raises(UserError, match="simclr_info_nce_loss"):
        build_loss(AttrDict({"name": "simclr_info_nce"}))


def test_bad_loss_config_values_are_user_errors():
    with pytest.raises(UserError, match="reduction"):
        build_loss(AttrDict({"name": "cross_entropy_multiple_output_single_target",
                             "cross_entropy_multiple_output_single_target": {"reduction": "avg"}}))
    with pytest.raises(UserError, match="temperature"):
        build_loss(AttrDict({"name": "simclr_info_nce_loss", "simclr_info_nce_loss": {"temperature": 0}}))


def test_simclr_equals_reference_nt_xent():
    torch.manual_seed(3)
    z = torch.randn(10, DIM)
    for temperature in (0.1, 0.5):
        loss = build_loss(simclr_cfg(temperature))([z], None)
        assert torch.allclose(loss.double(), reference_nt_xent(z, temperature), atol=1e-5)


def test_simclr_random_embeddings_high_temperature_is_log_2n_minus_1():
    torch.manual_seed(4)
    z = torch.randn(32, DIM)
    loss = build_loss(simclr_cfg(1e4))(z, None)
    assert abs(loss.item() - math.log(32 - 1)) < 1e-3


def test_simclr_gradient_flows_and_matches_reference():
    torch.manual_seed(5)
    z = torch.randn(8, DIM, requires_grad=True)
    build_loss(simclr_cfg(0.3))(z, None).backward()
    z_ref = z.detach().double().requires_grad_(True)
    reference_nt_xent(z_ref, 0.3).backward()
    assert z.grad is not None and z.grad.abs().sum() > 0
    assert torch.allclose(z.grad.double(), z_ref.grad, atol=1e-5)


def test_simclr_bf16_computes_in_float32():
    torch.manual_seed(6)
    z = torch.randn(16, DIM)
    loss_fn = build_loss(simclr_cfg(0.1))
    ref = loss_fn(z.bfloat16().float(), None)
    out = loss_fn(z.bfloat16(), None)
    assert out.dtype == torch.float32 and torch.allclose(out, ref, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        in_autocast = loss_fn(z.bfloat16(), None)
    assert in_autocast.dtype == torch.float32 and torch.allclose(in_autocast, ref, atol=1e-5)


def test_simclr_two_gloo_ranks_equal_one_rank(two_rank_results):
    view0, view1, _, _ = dist_data()
    z = torch.cat([view0, view1]).requires_grad_(True)
    single = build_loss(simclr_cfg(0.2))(z, None)
    single.backward()
    # each rank's loss is the mean over its own rows; the ranks' mean is the global loss
    rank_losses = torch.stack([r["loss"] for r in two_rank_results])
    assert torch.allclose(rank_losses.mean(), single.detach(), atol=1e-6)
    # backward sums over ranks; DDP's gradient averaging divides by the world size
    n, n_all = N_PER_RANK, WORLD * N_PER_RANK
    for rank, res in enumerate(two_rank_results):
        rows = list(range(rank * n, (rank + 1) * n)) + list(range(n_all + rank * n, n_all + (rank + 1) * n))
        assert torch.allclose(res["grad"] / WORLD, z.grad[rows], atol=1e-6)
        assert torch.equal(res["gathered"], torch.tensor([[0.0] * 3] * 2 + [[1.0] * 3] * 2))


# ---------------------------------------------------------------------------- meters


def test_accuracy_list_meter_percent_topk_and_names():
    meter = build_meters(accuracy_meter_cfg(names=("res4", "res5"), topk=(1, 2)))[0]
    assert meter.name == "accuracy_list_meter"
    target = torch.tensor([0, 1, 2, 0])
    out_a = torch.tensor([[0.9, 0.1, 0.0], [0.8, 0.2, 0.0], [0.1, 0.0, 0.9], [0.0, 0.6, 0.4]])  # top1 2/4
    out_b = torch.tensor([[0.9, 0.1, 0.0], [0.1, 0.8, 0.1], [0.1, 0.0, 0.9], [0.3, 0.6, 0.1]])  # top1 3/4
    meter.update([out_a, out_b], target)
    value = meter.value
    assert value["top_1"] == {"res4": pytest.approx(50.0), "res5": pytest.approx(75.0)}
    assert value["top_2"] == {"res4": pytest.approx(75.0), "res5": pytest.approx(100.0)}
    meter.reset()
    assert meter.value["top_1"] == {"res4": 0.0, "res5": 0.0}


def test_accuracy_list_meter_index_names_and_tensor_output():
    meter = METERS.get("accuracy_list_meter").from_config(AttrDict({"num_meters": 1, "topk_values": [1]}))
    meter.update(torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]), [torch.tensor([0, 1, 1])])
    assert meter.value == {"top_1": {"0": pytest.approx(200.0 / 3, abs=1e-4)}}
    with pytest.raises(UserError, match="num_meters"):
        meter.update([torch.zeros(3, 2), torch.zeros(3, 2)], torch.tensor([0, 1, 1]))
    with pytest.raises(UserError, match="meter_names"):
        METERS.get("accuracy_list_meter").from_config(AttrDict({"num_meters": 2, "meter_names": ["a"]}))


@pytest.mark.parametrize("topk", [(1,), (1, 3)])
def test_accuracy_counts_kept_on_the_device_equal_classys_meter(monkeypatch, topk):
    """The per-batch counts wait in a list and are folded in when read or every FOLD_EVERY
    batches: the value, the synced value and the saved state equal classy_vision's meter for
    class-index targets of shape [B] and [B, 1] and one-hot targets."""
    from classy_vision.meters import AccuracyMeter

    from ssl_engine.meters.topk_list_meter import DeviceAccuracyMeter

    monkeypatch.setattr(DeviceAccuracyMeter, "FOLD_EVERY", 4)
    torch.manual_seed(3)
    ours, classy = DeviceAccuracyMeter(topk=list(topk)), AccuracyMeter(topk=list(topk))
    for i in range(11):  # crosses two folds
        out = torch.randn(6, 5)
        labels = torch.randint(0, 5, (6,))
        target = [labels, labels.reshape(-1, 1), F.one_hot(labels, 5)][i % 3]
        ours.update(out, target)
        classy.update(out, target)
        if i == 5:
            ours.sync_state()
            classy.sync_state()
    assert len(ours._pending) == 1  # folded at 4 and by the sync after 6, then at 4 of the last 5
    assert ours.value == pytest.approx(classy.value)
    assert ours._pending == [] and ours._uncounted == 0
    state, theirs = ours.get_classy_state(), classy.get_classy_state()
    for key in ("total_correct_predictions", "total_sample_count", "curr_correct_predictions_k", "curr_sample_count"):
        assert state[key].dtype == theirs[key].dtype and torch.equal(state[key], theirs[key]), key
    ours.update(torch.randn(6, 5), torch.randint(0, 5, (6,)))
    ours.set_classy_state(theirs)  # a restored state drops what was pending
    assert ours.value == pytest.approx(classy.value)


@pytest.mark.parametrize("name", ["accuracy_list_meter", "precision_at_k_list_meter", "recall_at_k_list_meter"])
def test_topk_beyond_the_number_of_classes_is_a_user_error(name):
    meter = METERS.get(name).from_config(AttrDict({"num_meters": 1, "topk_values": [1, 5]}))
    with pytest.raises(UserError, match=rf"config.METERS.{name}.topk_values=\[1, 5\]: top-5 needs at least 5 classes, "
                                        r"but the model outputs 3"):
        meter.update([torch.randn(4, 3)], torch.tensor([0, 1, 2, 0]))


def test_precision_recall_list_meters():
    cfg = AttrDict({
        "names": ["precision_at_k_list_meter", "recall_at_k_list_meter"],
        "precision_at_k_list_meter": {"num_meters": 1, "topk_values": [1, 2]},
        "recall_at_k_list_meter": {"num_meters": 1, "topk_values": [1, 2]},
    })
    precision, recall = build_meters(cfg)
    out = torch.tensor([[0.9, 0.1, 0.0], [0.2, 0.7, 0.1]])
    target = torch.tensor([[1, 0, 1], [1, 0, 0]])  # multi-label
    for m in (precision, recall):
        m.update([out], target)
    # top1 predictions: 0 (correct), 1 (wrong); top2 adds 1 (wrong) and 0 (correct)
    assert precision.value == {"top_1": {"0": pytest.approx(50.0)}, "top_2": {"0": pytest.approx(50.0)}}
    # 3 true labels in all: 1 found in top1, 2 in top2
    assert recall.value["top_1"]["0"] == pytest.approx(100.0 / 3, abs=1e-4)
    assert recall.value["top_2"]["0"] == pytest.approx(200.0 / 3, abs=1e-4)


def test_build_meters_name_names_and_none():
    assert build_meters(AttrDict({"name": "", "names": []})) == []
    single = build_meters(AttrDict({"name": "accuracy_list_meter", "names": [],
                                    "accuracy_list_meter": {"num_meters": 1, "topk_values": [1]}}))
    assert [m.name for m in single] == ["accuracy_list_meter"]
    with pytest.raises(UserError, match="accuracy_list_meter"):
        build_meters(AttrDict({"names": ["accuracy_meter"]}))


def test_meter_classy_state_round_trip_weights_only():
    torch.manual_seed(7)
    meter = build_meters(accuracy_meter_cfg())[0]
    logits = [torch.randn(10, NUM_CLASSES), torch.randn(10, NUM_CLASSES)]
    target = torch.randint(0, NUM_CLASSES, (10,))
    meter.update(logits, target)
    meter.sync_state()
    meter.update(logits, target)
    buf = io.BytesIO()
    torch.save(meter.get_classy_state(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    fresh = build_meters(accuracy_meter_cfg())[0]
    fresh.set_classy_state(state)
    assert fresh.value == meter.value
    fresh.update(logits, target)
    meter.update(logits, target)
    assert fresh.value == meter.value
    with pytest.raises(CheckpointError):
        build_meters(accuracy_meter_cfg(topk=(1,)))[0].set_classy_state(state)


def test_meter_sync_two_gloo_ranks_equals_union(two_rank_results):
    _, _, logits, target = dist_data()
    single = build_meters(accuracy_meter_cfg())[0]
    single.update(logits, target)
    for res in two_rank_results:
        assert res["synced_value"] == single.value
    assert two_rank_results[0]["local_value"] != single.value  # sync changed something


# ---------------------------------------------------------------------------- schedules


def lr_cfg(**kw) -> AttrDict:
    base = {"name": "constant", "value": 0.1, "update_interval": "epoch",
            "auto_lr_scaling": {"auto_scale": False, "base_value": 0.1, "base_lr_batch_size": 256,
                                "scaling_type": "linear"}}
    base.update(kw)
    return AttrDict(base)


def test_multistep_values_at_where_points():
    sched = build_param_scheduler(lr_cfg(name="multistep", values=[0.1, 0.01, 0.001], milestones=[30, 60]), 90)
    expect = {0.0: 0.1, 29.5 / 90: 0.1, 30 / 90: 0.01, 59.9 / 90: 0.01, 60 / 90: 0.001, 0.999: 0.001}
    for where, value in expect.items():
        assert sched(where) == pytest.approx(value), where


def test_cosine_endpoints_and_step():
    sched = build_param_scheduler(lr_cfg(name="cosine", start_value=0.4, end_value=0.004), 10)
    assert sched(0.0) == pytest.approx(0.4)
    assert sched(0.5) == pytest.approx(0.202)
    assert sched(1.0 - 1e-9) == pytest.approx(0.004)
    step = build_param_scheduler(lr_cfg(name="step", values=[1.0, 0.5]), 10)
    assert (step(0.2), step(0.6)) == (1.0, 0.5)


def test_composite_linear_warmup_then_cosine():
    cfg = lr_cfg(
        name="composite", update_interval="step", lengths=[0.1, 0.9], interval_scaling=["rescaled", "fixed"],
        schedulers=[{"name": "linear", "start_value": 0.0, "end_value": 1.0},
                    {"name": "cosine", "start_value": 1.0, "end_value": 0.0}],
    )
    sched = build_param_scheduler(cfg, 100)
    assert sched(0.0) == pytest.approx(0.0)
    assert sched(0.05) == pytest.approx(0.5)  # rescaled: half way through the warm-up
    cosine = lambda w: 0.5 * (1 + math.cos(math.pi * w))  # noqa: E731
    for where in (0.1, 0.5, 0.9):  # fixed: the cosine sees the global where
        assert sched(where) == pytest.approx(cosine(where))


def test_cosine_warm_restart_half_and_full_waves_as_vissl_computes_them():
    half = build_param_scheduler(lr_cfg(name="cosine_warm_restart", start_value=4.8, end_value=0.0048,
                                        restart_interval_length=0.5, wave_type="half", lr_multiplier=0.5), 10)
    # each half interval falls from its peak to end_value; the peak halves at the restart
    for where, value in {0.0: 4.8, 0.25: 0.0048 + 0.5 * 4.7952, 0.5: 2.4, 0.75: 0.0048 + 0.5 * 2.3952}.items():
        assert half(where) == pytest.approx(value), where
    assert half(0.5 - 1e-9) == pytest.approx(0.0048, abs=1e-6)
    full = build_param_scheduler(lr_cfg(name="cosine_warm_restart", start_value=4.8, end_value=0.0048,
                                        restart_interval_length=0.25, wave_type="full", is_adaptive=True), 10)
    # a whole cosine of period 0.5; adaptive peaks read the plain cosine one interval past each
    # restart (restarts at 0 and 0.25, 0.75): its first peak is already below start_value
    plain = lambda w: 0.0048 + 0.5 * 4.7952 * (1 + math.cos(math.pi * w))  # noqa: E731
    peaks = [plain(0.25), plain(0.5), plain(1.0)]
    assert full(0.0) == pytest.approx(peaks[0])
    assert full(0.25) == pytest.approx(0.0048)                  # the trough, where the second peak takes over
    assert full(0.5) == pytest.approx(peaks[1])
    assert full(0.75) == pytest.approx(0.0048)
    assert full(0.9) == pytest.approx(0.0048 + 0.5 * (peaks[2] - 0.0048) * (1 + math.cos(math.pi * 0.9 / 0.25)))
    # VISSL's integration-test layout: a linear warm-up, then the restarts, in a composite
    warm = build_param_scheduler(lr_cfg(
        name="composite", update_interval="step", lengths=[0.1, 0.9], interval_scaling=["rescaled", "rescaled"],
        schedulers=[{"name": "linear", "start_value": 0.6, "end_value": 4.8},
                    {"name": "cosine_warm_restart", "start_value": 4.8, "end_value": 0.0048, "wave_type": "half",
                     "restart_interval_length": 0.5}]), 10)
    assert warm(0.05) == pytest.approx(2.7) and warm(0.1) == pytest.approx(4.8) and warm(0.55) == pytest.approx(4.8)
    with pytest.raises(UserError, match=r"wave_type='sine' must be one of half, full"):
        build_param_scheduler(lr_cfg(name="cosine_warm_restart", start_value=1.0, end_value=0.0,
                                     restart_interval_length=0.5, wave_type="sine"), 10)
    longer = build_param_scheduler(lr_cfg(name="cosine_warm_restart", start_value=1.0, end_value=0.0,
                                          restart_interval_length=2.0), 10)  # one partial wave, as in VISSL
    assert longer(0.0) == pytest.approx(1.0) and longer(0.999) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.999 / 2)))
    with pytest.raises(UserError, match=r"restart_interval_length=0.0 must be > 0"):
        build_param_scheduler(lr_cfg(name="cosine_warm_restart", start_value=1.0, end_value=0.0,
                                     restart_interval_length=0.0), 10)


def test_schedule_errors_are_user_errors():
    with pytest.raises(UserError, match="cosine"):  # lists the valid names
        build_param_scheduler(lr_cfg(name="cosin"), 10)
    bad = lr_cfg(name="composite", lengths=[0.5, 0.4],
                 schedulers=[{"name": "constant", "value": 1.0}, {"name": "constant", "value": 0.1}])
    with pytest.raises(UserError, match="sum to 1"):
        build_param_scheduler(bad, 10)
    with pytest.raises(UserError, match="milestones"):
        build_param_scheduler(lr_cfg(name="multistep", values=[0.1, 0.01], milestones=[3, 6]), 10)
    with pytest.raises(UserError, match=r"num_epochs=10; raise config\.OPTIMIZER\.num_epochs above 60 or give "
                                         r"milestones below 10"):  # VISSL's milestones on a shorter run: the fix
        build_param_scheduler(lr_cfg(name="multistep", values=[0.1, 0.01, 0.001], milestones=[30, 60]), 10)
    # more milestones than the run has epochs after its first: no milestones below num_epochs would do
    with pytest.raises(UserError, match=r"num_epochs=2 leaves room for 1 milestone\(s\): raise config\.OPTIMIZER\."
                                         r"num_epochs above 60, or give fewer milestones and values \(.*milestones=\[\] "
                                         r"with one value keeps it throughout\)"):
        build_param_scheduler(lr_cfg(name="multistep", values=[0.1, 0.01, 0.001], milestones=[30, 60]), 2)
    with pytest.raises(UserError, match=r"num_epochs=1 leaves no epoch for a milestone"):
        build_param_scheduler(lr_cfg(name="multistep", values=[0.3, 0.03, 0.003], milestones=[120, 160]), 1)
    assert build_param_scheduler(lr_cfg(name="multistep", values=[0.3], milestones=[]), 1)(0.0) == 0.3  # the advice works
    with pytest.raises(UserError, match=r"values has 3 values, but config\.OPTIMIZER\.num_epochs=1 has room for 1"):
        build_param_scheduler(lr_cfg(name="multistep", values=[0.3, 0.03, 0.003], milestones=[0.5, 0.8]), 1)
    # a milestone between two epochs takes effect as the next epoch starts, as in VISSL (classy's
    # scheduler): 1.5 was cut to 1 (the value changed an epoch early)
    four = build_param_scheduler(lr_cfg(name="multistep", values=[0.1, 0.01], milestones=[1.5]), 4)
    assert [four(w) for w in (0.0, 0.25, 0.5, 0.75)] == [0.1, 0.1, 0.01, 0.01]
    three = build_param_scheduler(lr_cfg(name="multistep", values=[0.1, 0.01], milestones=[2.0]), 3)
    assert [three(w) for w in (0.0, 1 / 3, 2 / 3)] == [0.1, 0.1, 0.01]
    for bad in (True, float("nan"), "x"):
        with pytest.raises(UserError, match=r"milestones\[0\]=.* must be a number"):
            build_param_scheduler(lr_cfg(name="multistep", values=[0.1, 0.01], milestones=[bad]), 3)
    # out of order and past the end: the order is what to fix, not num_epochs
    with pytest.raises(UserError, match=r"milestones=\[3, 2\] must be increasing epochs in \(0, 2\) for "
                                         r"config\.OPTIMIZER\.num_epochs=2$"):
        build_param_scheduler(lr_cfg(name="multistep", values=[0.1, 0.01, 0.001], milestones=[3, 2]), 2)
    with pytest.raises(UserError, match=r"increasing epochs in \(0, 10\) for config\.OPTIMIZER\.num_epochs=10$"):
        build_param_scheduler(lr_cfg(name="multistep", values=[0.1, 0.01, 0.001], milestones=[6, 3]), 10)
    with pytest.raises(UserError, match="update_interval"):
        build_optimizer(opt_cfg(param_schedulers={"lr": lr_cfg(update_interval="iter")}), nn.Linear(2, 2), 8, 1)


def test_auto_lr_scaling_follows_vissls_rule_per_schedule_type_and_says_when_it_reshapes(caplog):
    # VISSL (get_scaled_lr_scheduler): multistep values become scaled_lr * gamma**i, gamma = values[1] / values[0];
    # each part of a composite is scaled on its own (a constant part becomes scaled_lr)
    auto = {"auto_scale": True, "base_value": 0.3, "base_lr_batch_size": 256, "scaling_type": "linear"}
    geometric = lr_cfg(name="multistep", values=[0.3, 0.03, 0.003], milestones=[1, 2], auto_lr_scaling=auto)
    with caplog.at_level("WARNING"):
        assert scale_lr_schedule(geometric, 512)["values"] == pytest.approx([0.6, 0.06, 0.006])
    assert "VISSL's rule" not in caplog.text  # the usual config: the same as scaling it as written
    # VISSL rounds the values to 8 decimals: small lrs differ from the written shape only by that
    small = dict(geometric, values=[0.01, 0.001, 0.0001, 0.00001], milestones=[1, 2, 3],
                 auto_lr_scaling=dict(auto, base_value=0.01))
    with caplog.at_level("WARNING"):
        assert scale_lr_schedule(small, 8)["values"] == [0.0003125, 3.125e-05, 3.13e-06, 3.1e-07]
    assert "VISSL's rule" not in caplog.text
    uneven = dict(geometric, values=[0.3, 0.15, 0.003])
    with caplog.at_level("WARNING"):
        assert scale_lr_schedule(uneven, 512)["values"] == pytest.approx([0.6, 0.3, 0.15])
    assert "gives the lr values [0.6, 0.3, 0.15] where scaling the schedule as written gives [0.6, 0.3, 0.006]" \
        in caplog.text
    caplog.clear()
    tail = lr_cfg(name="composite", lengths=[0.5, 0.5], interval_scaling=["rescaled", "fixed"], auto_lr_scaling=auto,
                  schedulers=[{"name": "cosine", "start_value": 0.3, "end_value": 0.003},
                              {"name": "constant", "value": 0.003}])
    with caplog.at_level("WARNING"):
        children = scale_lr_schedule(tail, 512, num_nodes=2)["schedulers"]
    assert (children[0]["start_value"], children[0]["end_value"], children[1]["value"]) == pytest.approx(
        (0.6, 0.006, 0.6))
    assert "[0.6, 0.006, 0.6] where scaling the schedule as written gives [0.6, 0.006, 0.006]" in caplog.text


def test_auto_lr_scaling_linear_and_sqrt():
    auto = {"auto_scale": True, "base_value": 0.3, "base_lr_batch_size": 256, "scaling_type": "linear"}
    cosine = lr_cfg(name="cosine", start_value=0.3, end_value=0.003, auto_lr_scaling=auto)
    scaled = scale_lr_schedule(cosine, 1024)
    assert scaled["start_value"] == pytest.approx(1.2) and scaled["end_value"] == pytest.approx(0.012)
    assert cosine["start_value"] == 0.3  # caller's config untouched

    multistep = lr_cfg(name="multistep", values=[0.1, 0.01], milestones=[5],
                       auto_lr_scaling=dict(auto, base_value=0.1, scaling_type="sqrt"))
    assert scale_lr_schedule(multistep, 1024)["values"] == pytest.approx([0.2, 0.02])

    composite = lr_cfg(
        name="composite", lengths=[0.1, 0.9], interval_scaling=["rescaled", "fixed"], auto_lr_scaling=auto,
        schedulers=[{"name": "linear", "start_value": 0.03, "end_value": 0.3},
                    {"name": "cosine", "start_value": 0.3, "end_value": 0.0}],
    )
    # VISSL's warm-up rule: from the lr of one node's batch to the lr of the global batch
    children = scale_lr_schedule(composite, 512, num_nodes=2)["schedulers"]
    assert (children[0]["start_value"], children[0]["end_value"]) == pytest.approx((0.3, 0.6))
    assert (children[1]["start_value"], children[1]["end_value"]) == pytest.approx((0.6, 0.0))
    # one node: the ramp would start at its end, so the cosine becomes the whole schedule
    single = scale_lr_schedule(composite, 512, num_nodes=1)
    assert single["name"] == "cosine" and "schedulers" not in single
    assert (single["start_value"], single["end_value"]) == pytest.approx((0.6, 0.0))
    assert single["auto_lr_scaling"] == auto
    # a warm-up written to end below the peak ends at the scaled lr too (VISSL sets end_value = scaled_lr),
    # so on one node it is left out as well (it was kept, falling from 0.6 to 0.3, then jumping back to 0.6)
    low = dict(composite, schedulers=[{"name": "linear", "start_value": 0.0, "end_value": 0.15},
                                      {"name": "cosine", "start_value": 0.3, "end_value": 0.0}])
    children = scale_lr_schedule(low, 512, num_nodes=2)["schedulers"]
    assert (children[0]["start_value"], children[0]["end_value"]) == pytest.approx((0.3, 0.6))
    assert scale_lr_schedule(low, 512, num_nodes=1)["name"] == "cosine"
    three = dict(composite, lengths=[0.1, 0.6, 0.3], interval_scaling=["rescaled", "fixed", "fixed"],
                 schedulers=composite["schedulers"] + [{"name": "constant", "value": 0.003}])
    kept = scale_lr_schedule(three, 512)
    assert [c["name"] for c in kept["schedulers"]] == ["cosine", "constant"]
    assert kept["lengths"] == pytest.approx([2 / 3, 1 / 3]) and kept["interval_scaling"] == ["fixed", "fixed"]
    assert build_param_scheduler(kept, 10)(0.0) == pytest.approx(0.6)
    # a falling linear child is a decay, not a warm-up: it keeps its scaled values on any number of nodes
    tail = dict(composite, lengths=[0.9, 0.1], interval_scaling=["rescaled", "rescaled"],
                schedulers=[{"name": "cosine", "start_value": 0.3, "end_value": 0.003},
                            {"name": "linear", "start_value": 0.003, "end_value": 0.0}])
    for nodes in (1, 4):
        children = scale_lr_schedule(tail, 512, num_nodes=nodes)["schedulers"]
        assert (children[1]["start_value"], children[1]["end_value"]) == pytest.approx((0.006, 0.0)), nodes

    # VISSL semantics: base_value is the reference lr; the schedule's peak becomes scaled_lr
    const = lr_cfg(name="constant", value=5.0, auto_lr_scaling=dict(auto, base_value=0.1))
    assert scale_lr_schedule(const, 512)["value"] == pytest.approx(0.2)

    opt = build_optimizer(opt_cfg(param_schedulers={"lr": cosine}), nn.Linear(2, 2), 64, 10)
    assert opt.lr == pytest.approx(0.3 * 64 / 256)
    with pytest.raises(UserError, match="scaling_type"):
        scale_lr_schedule(lr_cfg(auto_lr_scaling=dict(auto, scaling_type="log")), 64)


# ---------------------------------------------------------------------------- optimizer


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)
        self.pos_embed = nn.Parameter(torch.zeros(1, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x)).mean(dim=(2, 3)) + self.pos_embed
        return self.fc(h)


def opt_cfg(**kw) -> AttrDict:
    base = {
        "name": "sgd", "momentum": 0.9, "nesterov": False, "weight_decay": 1e-4, "num_epochs": 10,
        "betas": [0.9, 0.999], "regularize_bn": False, "regularize_bias": True, "non_regularized_parameters": [],
        "use_larc": False, "larc_config": {"clip": False, "eps": "1e-08", "trust_coefficient": 0.001},
        "param_schedulers": {"lr": lr_cfg()},
    }
    base.update(kw)
    return AttrDict(base)


def group_ids(opt: SSLOptimizer):
    return {pg["weight_decay"]: {id(p) for p in pg["params"]} for pg in opt.param_groups}


def test_param_groups_regularize_bn_bias_and_named():
    net = TinyNet()
    groups = group_ids(build_optimizer(opt_cfg(regularize_bn=False, regularize_bias=False,
                                               non_regularized_parameters=["pos_embed"]), net, 8, 1))
    no_wd = {id(p) for p in (net.bn.weight, net.bn.bias, net.conv.bias, net.fc.bias, net.pos_embed)}
    assert groups[0.0] == no_wd
    assert groups[1e-4] == {id(net.conv.weight), id(net.fc.weight)}

    groups = group_ids(build_optimizer(opt_cfg(regularize_bn=True, regularize_bias=True), net, 8, 1))
    assert set(groups) == {1e-4} and len(groups[1e-4]) == 7

    groups = group_ids(build_optimizer(opt_cfg(regularize_bn=False, regularize_bias=True), net, 8, 1))
    assert groups[0.0] == {id(net.bn.weight), id(net.bn.bias)}


def test_single_param_group_puts_weight_decay_on_every_parameter_as_vissl():
    """VISSL's construct_single_param_group_only: one group, OPTIMIZER.weight_decay on norm
    weights and biases too (it was accepted and not acted on: BN and biases trained without)."""
    net = TinyNet()
    opt = build_optimizer(opt_cfg(regularize_bn=False, regularize_bias=False, non_regularized_parameters=["pos_embed"],
                                  construct_single_param_group_only=True), net, 8, 1)
    assert group_ids(opt) == {1e-4: {id(p) for p in net.parameters()}}
    net.conv.weight.requires_grad_(False)  # frozen parameters stay out, as in every group
    opt = build_optimizer(opt_cfg(construct_single_param_group_only=True), net, 8, 1)
    assert group_ids(opt) == {1e-4: {id(p) for p in net.parameters()} - {id(net.conv.weight)}}
    with pytest.raises(UserError, match=r"construct_single_param_group_only=true .*head_optimizer_params.use_different_lr"):
        build_optimizer(opt_cfg(construct_single_param_group_only=True,
                                head_optimizer_params={"use_different_wd": True, "weight_decay": 0.1}), net, 8, 1)


def test_optimizer_config_errors():
    net = nn.Linear(2, 2)
    for bad in (0, -3):
        with pytest.raises(UserError, match=r"config\.OPTIMIZER\.num_epochs"):
            build_optimizer(opt_cfg(num_epochs=bad), net, 8, 1)
    with pytest.raises(UserError, match="sgd"):
        build_optimizer(opt_cfg(name="sgdd"), net, 8, 1)


def test_set_where_and_update_interval():
    cfg = opt_cfg(param_schedulers={"lr": lr_cfg(name="multistep", values=[0.1, 0.01], milestones=[5],
                                                 update_interval="step")})
    opt = build_optimizer(cfg, TinyNet(), 8, 4)
    assert opt.update_interval == "step" and opt.lr == pytest.approx(0.1)
    opt.set_where(0.6)
    assert all(pg["lr"] == pytest.approx(0.01) for pg in opt.param_groups)
    opt.set_where(1.0)  # end of training: left as is
    assert opt.lr == pytest.approx(0.01)


@pytest.mark.parametrize("clip", [False, True])
def test_larc_matches_hand_computed_update(clip):
    torch.manual_seed(8)
    w = nn.Parameter(torch.randn(5, 3))
    grad = torch.randn(5, 3)
    lr, wd, momentum, tc, eps = 0.5, 1e-3, 0.9, 0.02, 1e-8
    cfg = opt_cfg(weight_decay=wd, momentum=momentum, use_larc=True,
                  larc_config={"clip": clip, "eps": "1e-08", "trust_coefficient": tc},
                  param_schedulers={"lr": lr_cfg(value=lr)})
    model = nn.Module()
    model.w = w
    opt = build_optimizer(cfg, model, 8, 1)
    before = w.detach().clone()
    w.grad = grad.clone()
    opt.step()

    p_norm, g_norm = before.norm(), grad.norm()
    ratio = tc * p_norm / (g_norm + wd * p_norm + eps)
    if clip:
        ratio = min(ratio / lr, 1.0)
    # first SGD step: momentum buffer = gradient; weight decay is inside the LARC gradient
    expected = before - lr * (grad + wd * before) * ratio
    assert torch.allclose(w.detach(), expected, atol=1e-7)
    assert opt.param_groups[0]["weight_decay"] == wd  # restored after the step


def _train_steps(opt: SSLOptimizer, net: nn.Module, steps, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for step in steps:
        opt.set_where(step / 20)
        x = torch.randn(4, 3, 5, 5, generator=g)
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("name,use_larc", [("sgd", True), ("adamw", False)])
def test_state_dict_round_trip_gives_identical_next_step(name, use_larc, tmp_path):
    cfg = opt_cfg(name=name, use_larc=use_larc,
                  param_schedulers={"lr": lr_cfg(name="cosine", start_value=0.1, end_value=0.0,
                                                 update_interval="step")})
    torch.manual_seed(9)
    net = TinyNet()
    opt = build_optimizer(cfg, net, 8, 2)
    _train_steps(opt, net, range(3), seed=0)

    path = tmp_path / "opt.torch"
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, path)
    loaded = torch.load(path, weights_only=True)

    _train_steps(opt, net, [3], seed=1)  # the uninterrupted run

    net2 = TinyNet()
    net2.load_state_dict(loaded["model"])
    opt2 = build_optimizer(cfg, net2, 8, 2)
    opt2.load_state_dict(loaded["optimizer"])
    assert opt2.where == pytest.approx(2 / 20) and opt2.lr == pytest.approx(opt.schedulers["lr"](2 / 20))
    _train_steps(opt2, net2, [3], seed=1)
    for a, b in zip(net.parameters(), net2.parameters()):
        assert torch.equal(a, b)


def test_grad_scaler_steps_ssl_optimizer_like_a_plain_step():
    cfg = opt_cfg(use_larc=True)
    torch.manual_seed(10)
    net_a = TinyNet()
    net_b = TinyNet()
    net_b.load_state_dict(net_a.state_dict())
    opt_a, opt_b = build_optimizer(cfg, net_a, 8, 1), build_optimizer(cfg, net_b, 8, 1)
    x = torch.randn(2, 3, 5, 5)
    net_a(x).sum().backward()
    opt_a.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(net_b(x).sum()).backward()
    scaler.step(opt_b)
    scaler.update()
    for a, b in zip(net_a.parameters(), net_b.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("lr, at", [
    ({"name": "constant", "value": -0.1}, "-0.1 at 0%"),
    ({"name": "multistep", "values": [0.1, -0.01], "milestones": [5]}, "-0.01 at 50%"),
    ({"name": "linear", "start_value": 0.1, "end_value": -0.1}, "at 50.1%"),
])
def test_a_schedule_that_goes_below_zero_is_a_user_error(lr, at):
    from ssl_engine.optim import build_lr_scheduler

    with pytest.raises(UserError, match=rf"config\.OPTIMIZER\.param_schedulers\.lr gives the learning rate .*{at} "
                                        r"of training; a learning rate must be >= 0"):
        build_lr_scheduler(lr, 10, 256)


def test_a_schedule_option_the_schedule_does_not_read_is_named(caplog):
    """lr.value=0.5 next to name: cosine trains with the cosine's values: say so, once."""
    import logging

    from ssl_engine.optim import build_lr_scheduler

    with caplog.at_level(logging.WARNING, logger="ssl_engine.optim.schedulers"):
        build_lr_scheduler({"name": "cosine", "start_value": 0.1, "end_value": 0.0, "value": 0.5}, 10, 256)
    assert ("config.OPTIMIZER.param_schedulers.lr: value is not read by the 'cosine' schedule "
            "(it reads start_value, end_value)") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ssl_engine.optim.schedulers"):  # defaults left as they are
        build_lr_scheduler({"name": "cosine", "start_value": 0.1, "end_value": 0.0, "value": 0.1,
                            "values": [0.1, 0.01, 0.001], "milestones": [30, 60]}, 10, 256)
    assert "not read" not in caplog.text


def test_simclr_embedding_dim_is_checked_against_the_head_before_launch_and_the_embeddings(tmp_path):
    """VISSL asserts buffer_params.embedding_dim against the embeddings; here a head of another
    size is one line before any process starts, and the loss names the key at the first step."""
    from conftest import run_tool

    loss = build_loss(AttrDict({"name": "simclr_info_nce_loss",
                                "simclr_info_nce_loss": {"temperature": 0.1, "buffer_params": {"embedding_dim": 8}}}))
    with pytest.raises(UserError, match=r"buffer_params\.embedding_dim=8 does not match the embeddings of shape "
                                        r"\(4, 5\)"):
        loss(torch.randn(4, 5))
    assert torch.isfinite(loss(torch.randn(4, 8)))
    r = run_tool(["config=quick/simclr_synthetic", f"config.CHECKPOINT.DIR={tmp_path}",
                  "config.LOSS.simclr_info_nce_loss.buffer_params.embedding_dim=256"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1].startswith(
        "error: config.LOSS.simclr_info_nce_loss.buffer_params.embedding_dim=256 does not match the embedding size "
        "dims[-1]=64 of "), r.stderr[-2000:]
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_optimizer_state_of_other_shapes_or_no_mapping_is_a_checkpoint_error():
    model = nn.Linear(4, 2)
    opt = SSLOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), {"lr": lambda where: 0.1})
    state = opt.state_dict()
    bad = {**state, "optimizer": {**state["optimizer"], "state": {0: {"momentum_buffer": torch.zeros(3)}}}}
    with pytest.raises(CheckpointError, match=r"momentum_buffer of parameter 0 has shape \[3\], the parameter \[2, 4\]"):
        opt.load_state_dict(bad)
    with pytest.raises(CheckpointError, match="optimizer state is a int, not a mapping"):
        opt.load_state_dict({**state, "optimizer": {**state["optimizer"], "state": 5}})


@pytest.mark.parametrize("name,views", [("simclr_info_nce_loss", 2), ("multicrop_simclr_info_nce_loss", 4),
                                        ("barlow_twins_loss", 2)])
def test_losses_that_compare_the_images_of_a_step_refuse_a_step_of_one_before_launch(name, views):
    from ssl_engine.config.validate import check_loss_batch

    loss = LOSSES.get(name)(**({"num_crops": views} if "multicrop" in name else
                               {"embedding_dim": 8} if "barlow" in name else {}))
    x = torch.randn(views, 8, requires_grad=True)  # one image: its views only
    loss(x).backward()
    assert float(x.grad.abs().sum()) == 0.0  # why: nothing to compare it with, no gradient
    assert loss.min_global_batch == 2
    cfg = AttrDict({"LOSS": {"name": name}, "DATA": {"TRAIN": {"BATCHSIZE_PER_REPLICA": 1, "DROP_LAST": True}}})
    with pytest.raises(UserError, match=rf"config.LOSS.name={name} .*TRAIN.BATCHSIZE_PER_REPLICA=1 x 1 rank\(s\) gives 1"):
        check_loss_batch(cfg, loss, None, 1)
    assert check_loss_batch(cfg, loss, None, 2) is None  # 2 ranks: steps of 2 images
    # a loss that takes any batch (cross entropy) is not concerned
    assert check_loss_batch(AttrDict({"LOSS": {"name": "cross_entropy_multiple_output_single_target"},
                                      "DATA": cfg.DATA}), build_loss(AttrDict({"name": "cross_entropy_multiple_output_single_target"})),
                            None, 1) is None


def test_the_test_batch_label_check_refuses_only_a_batch_whose_loss_would_be_nan():
    """Before launch, a TEST batch (read in order) of only ignored labels is refused: with 'mean'
    its loss is NaN and stops the run. Scattered -1 labels, the batches of 2 ranks (strided: each
    batch holds a labelled sample), a 'sum' reduction (0 for such a batch) or HOOKS.CHECK_NAN off
    (no stop) are not refused. The message lists the batch's samples."""
    import numpy as np

    from ssl_engine.config.compose import compose
    from ssl_engine.config.validate import ConfigError
    from ssl_engine.data.sampler import StatefulDistributedSampler
    from ssl_engine.models.label_range import check_ordered_batches_labelled

    class Labelled:
        label_type, transforms = "standard", None

        def __init__(self, labels):
            self.label_arrays = [np.array(labels)]

        def get_labels(self, source=0):
            return self.label_arrays[source]

    cfg = compose(["config=quick/supervised_digits"], warn_unused=False)
    mean, total = (LOSSES.get("cross_entropy_multiple_output_single_target")(reduction=r) for r in ("mean", "sum"))

    def check(labels, world=1, loss=mean, config=cfg):
        sampler = StatefulDistributedSampler(len(labels), world, 0, shuffle=False, batch_size=2)
        check_ordered_batches_labelled(config, "TEST", Labelled(labels), sampler, loss)

    check([0, -1, 1, -1, 2, -1])  # scattered: every batch of 2 holds a labelled sample
    check([-1, -1, 0, 1, 2, 3], world=2)  # rank 0 reads 0, 2 | 4; rank 1 reads 1, 3 | 5
    with pytest.raises(ConfigError, match=r"config.DATA.TEST: batch 2 \(samples 2, 3 of the TEST data, read in order\) "
                                          r"holds only the label -1 .*would average over no sample \(NaN\)"):
        check([0, 1, -1, -1, 2, 3])
    with pytest.raises(ConfigError, match=r"rank 1's batch 1 \(samples 1, 3 of the TEST data"):
        check([0, -1, 2, -1, 4, 5], world=2)
    check([0, 1, -1, -1, 2, 3], loss=total)
    check([0, 1, -1, -1, 2, 3], config=compose(["config=quick/supervised_digits", "config.HOOKS.CHECK_NAN=false"],
                                               warn_unused=False))


def test_step_with_fixed_gamma_and_polynomial_take_their_options_from_a_yaml_file(tmp_path):
    """The options of classy's step_with_fixed_gamma and polynomial schedules are config keys, so a
    VISSL yaml that uses one composes, and the schedule is classy's for those values."""
    from ssl_engine.config.compose import compose
    from ssl_engine.optim import build_lr_scheduler

    yaml = tmp_path / "fixed_gamma.yaml"
    yaml.write_text("# @package _global_\nconfig:\n  OPTIMIZER:\n    num_epochs: 6\n"
                    "    head_optimizer_params: {use_different_lr: true}\n    param_schedulers:\n"
                    "      lr: {name: step_with_fixed_gamma, base_value: 0.4, gamma: 0.5, num_decays: 2, "
                    "update_interval: step}\n"
                    "      lr_head: {name: polynomial, base_value: 0.2, power: 2.0}\n")
    cfg = compose([f"config={yaml}"])
    lr, interval = build_lr_scheduler(cfg.OPTIMIZER.param_schedulers.lr, 6, 256)
    assert interval == "step"
    assert [lr(w) for w in (0.0, 0.3, 1 / 3, 0.6, 2 / 3, 0.99)] == [0.4, 0.4, 0.2, 0.2, 0.1, 0.1]
    head, _ = build_lr_scheduler(cfg.OPTIMIZER.param_schedulers.lr_head, 6, 256)
    assert head(0.5) == pytest.approx(0.2 * 0.5 ** 2)
    lr_cfg_missing = dict(cfg.OPTIMIZER.param_schedulers.lr, gamma=None)
    with pytest.raises(UserError, match=r"lr\.gamma is required for the 'step_with_fixed_gamma' schedule"):
        build_lr_scheduler(lr_cfg_missing, 6, 256)


def test_inverse_sqrt_schedule_as_vissl_computes_it():
    """VISSL's inverse_sqrt: start_value * sqrt(warmup_interval_length / where), after a linear
    warm-up in VISSL's composite layout; auto scaling sets its start_value to the scaled lr."""
    from ssl_engine.optim import build_lr_scheduler

    sched = build_param_scheduler(lr_cfg(name="inverse_sqrt", start_value=0.4, warmup_interval_length=0.25), 10)
    assert sched(0.0) == pytest.approx(0.2)  # start_value * sqrt(0.25)
    assert sched(0.25) == pytest.approx(0.4) and sched(0.64) == pytest.approx(0.4 * math.sqrt(0.25 / 0.64))
    warm = build_param_scheduler(lr_cfg(
        name="composite", lengths=[0.25, 0.75], interval_scaling=["rescaled", "fixed"],
        schedulers=[{"name": "linear", "start_value": 0.0, "end_value": 0.4},
                    {"name": "inverse_sqrt", "start_value": 0.4, "warmup_interval_length": 0.25}]), 10)
    assert warm(0.125) == pytest.approx(0.2) and warm(0.25) == pytest.approx(0.4) and warm(0.81) == pytest.approx(
        0.4 * math.sqrt(0.25 / 0.81))
    scaled, _ = build_lr_scheduler(dict(lr_cfg(name="inverse_sqrt", start_value=0.4, warmup_interval_length=0.25),
                                        auto_lr_scaling={"auto_scale": True, "base_value": 0.1,
                                                         "base_lr_batch_size": 256}), 10, 512)
    assert scaled(0.25) == pytest.approx(0.2)  # 0.1 * 512 / 256
    with pytest.raises(UserError, match=r"lr\.warmup_interval_length is required for the 'inverse_sqrt' schedule"):
        build_param_scheduler(lr_cfg(name="inverse_sqrt", start_value=0.4), 10)


def test_a_composite_child_option_its_schedule_does_not_read_is_a_user_error():
    """A composite's child is written in full, so an option its schedule does not read (a typo,
    or one of another schedule) is one line naming it and what the schedule reads."""
    def composite(child):
        return lr_cfg(name="composite", lengths=[0.5, 0.5], update_interval="step",
                      schedulers=[{"name": "constant", "value": 0.1}, child])

    with pytest.raises(UserError, match=r"^config\.OPTIMIZER\.param_schedulers\.lr\.schedulers\[1\]: end_vlaue is not "
                                        r"an option of the 'cosine' schedule \(it reads start_value, end_value\)$"):
        build_param_scheduler(composite({"name": "cosine", "start_value": 0.1, "end_value": 0.0, "end_vlaue": 0.001}),
                              10)
    with pytest.raises(UserError, match=r"schedulers\[1\]: value, milestones are not options of the 'step' schedule"):
        build_param_scheduler(composite({"name": "step", "values": [0.1, 0.01], "value": 1.0, "milestones": [5]}), 10)
    # with auto scaling too, which reads every child first (an entry that is no mapping was a traceback)
    from ssl_engine.optim import build_lr_scheduler

    auto = {"auto_scale": True, "base_value": 0.1, "base_lr_batch_size": 256, "scaling_type": "linear"}
    with pytest.raises(UserError, match=r"^config\.OPTIMIZER\.param_schedulers\.lr\.schedulers\[1\]=0\.2 must be a "
                                        r"schedule: a mapping with a name and its options$"):
        build_lr_scheduler(dict(composite(0.2), auto_lr_scaling=auto), 10, 512)
    with pytest.raises(UserError, match=r"schedulers\[1\]: foo is not an option of the 'constant' schedule"):
        build_lr_scheduler(dict(composite({"name": "constant", "value": 0.1, "foo": 1}), auto_lr_scaling=auto), 10, 512)
    # the keys classy reads on any schedule are taken
    ok = build_param_scheduler(composite({"name": "cosine", "start_value": 0.1, "end_value": 0.0,
                                          "update_interval": "step", "num_epochs": 10}), 10)
    assert ok(0.75) == pytest.approx(0.05)
