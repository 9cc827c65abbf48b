"""SwAV: swav_head, swav_loss (Sinkhorn-Knopp, swapped prediction, queue), SwAVHook,
multicrop_collator, the config inference, and runs of the real tool (with exact resume)."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_bitwise_equal, classy_state, run_tool
from ssl_engine.config import compose
from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.data.collators import build_collator
from ssl_engine.errors import ConfigError, UserError
from ssl_engine.hooks import SwAVHook, default_hooks
from ssl_engine.hooks.frozen_params import match_params
from ssl_engine.losses import build_loss, sinkhorn_knopp
from ssl_engine.losses.swav_loss import SwAVLoss
from ssl_engine.models import build_model
from ssl_engine.models.heads.swav_head import SwAVHead

QUICK = "config=quick/swav_synthetic"


# ----------------------------------------------------------------------------- references
def ref_sinkhorn(scores, epsilon, iters):
    """Sinkhorn-Knopp written out plainly, in float64, on one process."""
    q = torch.exp(scores.double() / epsilon).t()  # [K, n]
    q = q / q.sum()
    k, n = q.shape
    for _ in range(iters):
        q = q / q.sum(dim=1, keepdim=True) / k
        q = q / q.sum(dim=0, keepdim=True) / n
    return (q / q.sum(dim=0, keepdim=True)).t()


def ref_swav_loss(score_sets, num_crops, assign, temperature, epsilon, iters, queues=None):
    """The swapped-prediction loss with loops; ``queues[h][i]``: queue scores of set h, assign crop i."""
    total = 0.0
    for h, scores in enumerate(score_sets):
        crops = scores.double().split(scores.shape[0] // num_crops)
        bs = crops[0].shape[0]
        per_set = 0.0
        for i, a in enumerate(assign):
            target = crops[a] if queues is None else torch.cat([crops[a], queues[h][i].double()])
            q = ref_sinkhorn(target, epsilon, iters)[:bs]
            terms = [-(q * torch.log_softmax(crops[p] / temperature, dim=1)).sum(dim=1).mean()
                     for p in range(num_crops) if p != a]
            per_set += sum(terms) / len(terms)
        total += per_set / len(assign)
    return total / len(score_sets)


def head(dims=(16, 12, 8), num_clusters=(5,), **kw):
    torch.manual_seed(0)
    return SwAVHead(AttrDict({"HEAD": {}}), dims=list(dims), num_clusters=list(num_clusters), **kw)


def swav(**kw):
    args = dict(temperature=0.1, crops_for_assign=[0, 1], num_crops=3, num_iters=3, epsilon=0.05,
                num_prototypes=[5], embedding_dim=8)
    args.update(kw)
    return SwAVLoss(**args)


# ----------------------------------------------------------------------------- sinkhorn
def test_sinkhorn_marginals_and_reference():
    torch.manual_seed(1)
    scores = F.normalize(torch.randn(24, 8), dim=1) @ F.normalize(torch.randn(6, 8), dim=1).t()
    q = sinkhorn_knopp(scores, epsilon=0.05, num_iters=200)
    assert q.shape == (24, 6)
    assert torch.allclose(q.sum(dim=1), torch.ones(24), atol=1e-5)  # each sample: a distribution
    assert torch.allclose(q.sum(dim=0), torch.full((6,), 24 / 6), atol=1e-3)  # prototypes used equally
    plain = sinkhorn_knopp(torch.randn(7, 4) * 0, 0.05, 3)
    assert torch.allclose(plain, torch.full((7, 4), 0.25))
    for iters in (0, 1, 3):
        assert torch.allclose(sinkhorn_knopp(scores, 0.05, iters).double(), ref_sinkhorn(scores, 0.05, iters), atol=1e-5)
    # three iterations are far from balanced on these scores: the iterations matter
    assert not torch.allclose(sinkhorn_knopp(scores, 0.05, 3), sinkhorn_knopp(scores, 0.05, 0), atol=1e-3)


def test_sinkhorn_hard_assignment_is_one_hot_of_the_soft_argmax():
    torch.manual_seed(2)
    scores = torch.randn(10, 4)
    soft, hard = sinkhorn_knopp(scores, 0.1, 3), sinkhorn_knopp(scores, 0.1, 3, hard_assignment=True)
    assert torch.equal(hard.sum(dim=1), torch.ones(10)) and set(hard.unique().tolist()) == {0.0, 1.0}
    assert torch.equal(hard.argmax(dim=1), soft.argmax(dim=1))


# ----------------------------------------------------------------------------- the loss
def test_loss_of_uniform_scores_is_log_k():
    """All scores equal: every assignment and prediction is uniform, so the loss is log K."""
    loss = swav(num_crops=2, num_prototypes=[7])(torch.zeros(6, 7))
    assert loss.item() == pytest.approx(math.log(7), abs=1e-6)


@pytest.mark.parametrize("double", [False, True])
def test_loss_matches_a_plain_implementation(double):
    torch.manual_seed(3)
    sets = [torch.randn(12, 5), torch.randn(12, 4)]  # 3 crops of 4 samples, two prototype sets
    emb = F.normalize(torch.randn(12, 8), dim=1)
    loss = swav(num_prototypes=[5, 4], use_double_precision=double)
    got = loss([emb, *sets])
    want = ref_swav_loss(sets, 3, [0, 1], 0.1, 0.05, 3)
    assert got.dtype == torch.float32 and got.item() == pytest.approx(want.item(), rel=1e-5)
    # the head's list kept whole ([[embedding, scores...]]) reads the same
    assert swav(num_prototypes=[5, 4])([[emb, *sets]]).item() == pytest.approx(want.item(), rel=1e-5)
    # crops_for_assign changes the loss: it is read
    other = swav(num_prototypes=[5, 4], crops_for_assign=[2])([emb, *sets])
    assert other.item() == pytest.approx(ref_swav_loss(sets, 3, [2], 0.1, 0.05, 3).item(), rel=1e-5)
    assert abs(other.item() - want.item()) > 1e-3


def test_assignments_carry_no_gradient():
    """Only the predicting crops' softmax gets gradient: with one assign crop, its rows get none."""
    torch.manual_seed(4)
    scores = torch.randn(9, 5, requires_grad=True)
    swav(crops_for_assign=[0])(scores).backward()
    assert torch.count_nonzero(scores.grad[:3]) == 0 and torch.count_nonzero(scores.grad[3:]) > 0


def test_queue_is_filled_from_the_start_and_used_from_start_iter():
    h = head()
    loss = swav(queue_length=6, queue_start_iter=2)
    loss.bind_model(SimpleNamespace(heads=[h], head_names=["swav_head"]))
    assert loss.local_emb_queue.shape == (2, 6, 8)
    torch.manual_seed(5)
    pushed = []
    for step in range(4):
        out = h(torch.randn(9, 16))  # 3 crops x 3 samples
        emb, scores = out[0].detach(), out[1].detach()
        before = loss.local_emb_queue.clone()
        got = loss([emb, scores]).item()
        if step < 2:
            want = ref_swav_loss([scores], 3, [0, 1], 0.1, 0.05, 3)
        else:
            queued = [before[i] @ h.prototypes0.weight.detach().t() for i in range(2)]
            want = ref_swav_loss([scores], 3, [0, 1], 0.1, 0.05, 3, queues=[queued])
            assert abs(want.item() - ref_swav_loss([scores], 3, [0, 1], 0.1, 0.05, 3).item()) > 1e-4
        assert got == pytest.approx(want.item(), rel=1e-5), step
        pushed.append(emb)
        # newest first: crop a's rows of this step, then the previous step's
        for i, a in enumerate([0, 1]):
            assert torch.equal(loss.local_emb_queue[i, :3], emb[3 * a:3 * a + 3])
            if step:
                assert torch.equal(loss.local_emb_queue[i, 3:], pushed[-2][3 * a:3 * a + 3])
    assert loss.num_iteration == 4


def test_eval_mode_neither_counts_nor_queues():
    loss = swav(queue_length=6)
    loss.bind_model(SimpleNamespace(heads=[head()], head_names=["swav_head"]))
    loss.eval()
    queue = loss.local_emb_queue.clone()
    loss([F.normalize(torch.randn(9, 8), dim=1), torch.randn(9, 5)])
    assert loss.num_iteration == 0 and torch.equal(queue, loss.local_emb_queue)


def test_queue_and_step_count_go_through_state_dict():
    h = head()
    a = swav(queue_length=6, queue_start_iter=1)
    a.bind_model(SimpleNamespace(heads=[h], head_names=["swav_head"]))
    torch.manual_seed(6)
    batches = [[F.normalize(torch.randn(9, 8), dim=1), torch.randn(9, 5)] for _ in range(3)]
    a(batches[0])
    a(batches[1])
    b = swav(queue_length=6, queue_start_iter=1)
    b.bind_model(SimpleNamespace(heads=[h], head_names=["swav_head"]))
    state = a.state_dict()
    assert state["_extra_state"] == {"num_iteration": 2}
    b.load_state_dict(state)
    assert b.num_iteration == 2 and torch.equal(a(batches[2]), b(batches[2]))
    # a queue of another shape (another world size) is not used: the run's own queue stays
    c = swav(queue_length=3)
    kept = c.local_emb_queue.clone()
    c.load_state_dict(state)
    assert torch.equal(c.local_emb_queue, kept) and c.num_iteration == 2


def test_loss_errors_name_the_key():
    with pytest.raises(UserError, match=r"config\.LOSS\.swav_loss\.crops_for_assign=\[0, 3\] names crop 3.*num_crops=3"):
        swav(crops_for_assign=[0, 3])
    with pytest.raises(UserError, match=r"config\.LOSS\.swav_loss\.num_crops=1"):
        swav(num_crops=1, crops_for_assign=[0])
    with pytest.raises(UserError, match=r"swav_loss got 10 rows.*config\.LOSS\.swav_loss\.num_crops=3"):
        swav()(torch.randn(10, 5))
    with pytest.raises(UserError, match=r"config\.LOSS\.swav_loss\.num_prototypes\[0\]=5 does not match"):
        swav()(torch.randn(9, 6))
    with pytest.raises(UserError, match=r"config\.LOSS\.swav_loss\.embedding_dim=8 does not match"):
        swav()([torch.randn(9, 7), torch.randn(9, 5)])
    model = SimpleNamespace(heads=[head(num_clusters=[6])], head_names=["swav_head"])
    with pytest.raises(UserError, match=r"num_prototypes=\[5\] does not match num_clusters=\[6\]"):
        swav().check_model(model)
    with pytest.raises(UserError, match=r"embedding_dim=8 does not match the embedding size dims\[-1\]=4"):
        swav().check_model(SimpleNamespace(heads=[head(dims=[16, 4])], head_names=["swav_head"]))
    with pytest.raises(UserError, match=r"needs a swav_head as the last entry.*mlp"):
        swav().check_model(SimpleNamespace(heads=[torch.nn.Linear(2, 2)], head_names=["mlp"]))


# ----------------------------------------------------------------------------- head and hook
def test_swav_head_outputs_and_names():
    h = head(dims=[16, 12, 8], num_clusters=[5, 3], use_bn=True)
    out = h(torch.randn(4, 16, 1, 1))
    assert [tuple(o.shape) for o in out] == [(4, 8), (4, 5), (4, 3)]
    assert torch.allclose(out[0].norm(dim=1), torch.ones(4), atol=1e-6)
    assert torch.allclose(out[1], out[0] @ h.prototypes0.weight.t())
    names = [n for n, _ in h.named_parameters()]
    assert names == ["projection_head.0.weight", "projection_head.0.bias", "projection_head.1.weight",
                     "projection_head.1.bias", "projection_head.3.weight", "projection_head.3.bias",
                     "prototypes0.weight", "prototypes1.weight"]
    assert h.prototypes0.bias is None
    assert [tuple(o.shape) for o in head(return_embeddings=False)(torch.randn(2, 16))] == [(2, 5)]
    unnormed = head(normalize_feats=False)(torch.randn(4, 16))[0]
    assert not torch.allclose(unnormed.norm(dim=1), torch.ones(4), atol=1e-3)


def test_model_with_swav_head_gives_its_outputs_and_vissl_param_names():
    cfg = compose([QUICK, "config.MODEL.TRUNK.RESNETS.DEPTH=18"])
    model = build_model(cfg.MODEL).eval()
    torch.manual_seed(7)
    big, small = torch.randn(2, 3, 32, 32), torch.randn(2, 3, 16, 16)
    out = model([big, big.flip(3), small, small.flip(3)])  # crops 0..3 of 2 samples
    assert [tuple(o.shape) for o in out] == [(8, 32), (8, 20)]
    alone = model([small])
    assert torch.allclose(out[1][4:6], alone[1], atol=1e-5)  # rows are crop-major
    # VISSL's TEMP_FROZEN_PARAMS_ITER_MAP name (seen through DDP) finds the prototypes
    found = match_params(model, "module.heads.0.prototypes0.weight")
    assert [n for n, _ in found] == ["heads.0.prototypes0.weight"]
    # and as FairScale's FSDP shows them (VISSL's quick_swav_2crops lists both names)
    fsdp = "_fsdp_wrapped_module.heads.0._fsdp_wrapped_module._fpw_module.prototypes0._fsdp_wrapped_module.weight"
    assert [n for n, _ in match_params(model, fsdp)] == ["heads.0.prototypes0.weight"]


def test_extracting_heads_of_a_swav_model_gives_the_embedding():
    """VISSL's extraction saves a multi-output head's first output (the embedding) as 'heads'."""
    cfg = compose([QUICK, "config.MODEL.TRUNK.RESNETS.DEPTH=18"])
    model = build_model(cfg.MODEL).eval()
    x = torch.randn(3, 3, 32, 32)
    feats = model.extract_features(x)
    assert list(feats) == ["heads"] and isinstance(feats["heads"], torch.Tensor)
    assert tuple(feats["heads"].shape) == (3, 32)
    assert torch.allclose(feats["heads"], model(x)[0], atol=1e-6)


def test_swav_hook_normalizes_prototypes_at_start_and_after_updates():
    cfg = compose([QUICK])
    assert any(isinstance(h, SwAVHook) for h in default_hooks(cfg))
    assert not any(isinstance(h, SwAVHook) for h in default_hooks(compose(["config=quick/simclr_synthetic"])))
    model = build_model(cfg.MODEL)
    loss = build_loss(cfg.LOSS)
    w = model.heads[0].prototypes0.weight
    assert not torch.allclose(w.norm(dim=1), torch.ones(20), atol=1e-3)
    hook = SwAVHook(normalize_last_layer=True)
    resumed = SimpleNamespace(base_model=model, loss=loss, iteration=5)
    hook.on_start(resumed)  # a resumed run's weights are left as they were saved
    assert not torch.allclose(w.norm(dim=1), torch.ones(20), atol=1e-3)
    assert len(loss._prototypes) == 1 and loss._prototypes[0] is model.heads[0].prototypes0
    hook.on_start(SimpleNamespace(base_model=model, loss=loss, iteration=0))
    assert torch.allclose(w.norm(dim=1), torch.ones(20), atol=1e-6)
    with torch.no_grad():
        w.mul_(3.0)
    hook.on_update(resumed)
    assert torch.allclose(w.norm(dim=1), torch.ones(20), atol=1e-6)
    off = SwAVHook(normalize_last_layer=False)
    off.on_start(SimpleNamespace(base_model=model, loss=loss, iteration=0))
    with torch.no_grad():
        w.mul_(3.0)
    off.on_update(resumed)
    assert torch.allclose(w.norm(dim=1), torch.full((20,), 3.0), atol=1e-5)


# ----------------------------------------------------------------------------- collator
def test_multicrop_collator_is_crop_major():
    def sample(i):
        crops = [torch.full((3, 4, 4), 10 * i + c) for c in range(2)] + [torch.full((3, 2, 2), 10 * i + c) for c in (2, 3)]
        return {"data": crops, "label": [i] * 4, "data_valid": [1] * 4, "data_idx": [100 + i] * 4}

    out = build_collator("multicrop_collator")([sample(0), sample(1), sample(2)])
    crops = out["data"][0]
    assert [tuple(c.shape) for c in crops] == [(3, 3, 4, 4), (3, 3, 4, 4), (3, 3, 2, 2), (3, 3, 2, 2)]
    assert [[int(c[i, 0, 0, 0]) for i in range(3)] for c in crops] == [[0, 10, 20], [1, 11, 21], [2, 12, 22], [3, 13, 23]]
    assert out["label"][0].tolist() == [0, 1, 2] * 4
    assert out["data_idx"][0].tolist() == [100, 101, 102] * 4 and out["data_valid"][0].tolist() == [1] * 12
    one_label = [{**sample(i), "label": [i]} for i in range(2)]  # a single label is repeated per crop
    assert build_collator("multicrop_collator")(one_label)["label"][0].tolist() == [0, 1] * 4
    with pytest.raises(UserError, match="create_multidimensional_tensor"):
        build_collator("multicrop_collator", {"create_multidimensional_tensor": True})([sample(0)])


# ----------------------------------------------------------------------------- config
def test_vissl_inference_of_crops_prototypes_dim_and_queue():
    sw = compose([QUICK]).LOSS.swav_loss
    assert (sw.num_crops, sw.num_prototypes, sw.embedding_dim) == (4, [20], 32)
    assert (sw.queue.queue_length, sw.queue.local_queue_length) == (16, 16)
    # 4.0 crops are the 4 the transform makes (num_crops was left at 2: views paired wrongly)
    assert compose([QUICK, "config.DATA.TRAIN.TRANSFORMS.0.total_num_crops=4.0"]).LOSS.swav_loss.num_crops == 4
    sw = compose([QUICK, "config.LOSS.swav_loss.queue.queue_length=18", "config.DISTRIBUTED.NUM_PROC_PER_NODE=2"]).LOSS.swav_loss
    assert (sw.queue.queue_length, sw.queue.local_queue_length) == (16, 8)  # a multiple of the global batch 8
    # a value set on purpose that contradicts its source is an error naming both
    with pytest.raises(ConfigError, match=r"config\.LOSS\.swav_loss\.num_prototypes=\[30\] contradicts "
                                          r"config\.MODEL\.HEAD\.PARAMS\[0\]\.num_clusters=\[20\]"):
        compose([QUICK, "config.LOSS.swav_loss.num_prototypes=[30]"])
    with pytest.raises(ConfigError, match=r"num_crops=6 contradicts config\.DATA\.TRAIN\.TRANSFORMS\[0\] "
                                          r"\(ImgPilToMultiCrop\)\.total_num_crops=4"):
        compose([QUICK, "config.LOSS.swav_loss.num_crops=6"])
    with pytest.raises(ConfigError, match=r"embedding_dim=64 contradicts"):
        compose([QUICK, "config.LOSS.swav_loss.embedding_dim=64"])


def test_every_vissl_swav_loss_key_is_accepted_and_not_called_unused(caplog):
    """VISSL 0.1.6's swav_loss keys (vissl_schema_keys.txt), each set to a value of its own."""
    import logging

    overrides = ["temperature=0.2", "use_double_precision=true", "normalize_last_layer=false", "num_iters=5",
                 "epsilon=0.03", "num_crops=4", "crops_for_assign=[0]", "num_prototypes=[20]",
                 "temp_hard_assignment_iters=2", "embedding_dim=32", "queue.queue_length=8",
                 "queue.start_iter=3", "queue.local_queue_length=99"]
    with caplog.at_level(logging.WARNING):
        cfg = compose([QUICK] + [f"config.LOSS.swav_loss.{o}" for o in overrides])
    assert "not acted on" not in caplog.text, caplog.text
    loss = build_loss(cfg.LOSS)
    assert (loss.temperature, loss.use_double_precision, loss.normalize_last_layer, loss.num_iters, loss.epsilon,
            loss.crops_for_assign, loss.temp_hard_assignment_iters, loss.queue_start_iter,
            loss.local_queue_length) == (0.2, True, False, 5, 0.03, [0], 2, 3, 8)
    compose([QUICK, "config.LOSS.swav_loss.output_dir=/tmp/x"])  # [compat]: accepted


def test_a_bad_swav_config_stops_before_launch_with_one_line(tmp_path):
    r = run_tool([QUICK, f"config.CHECKPOINT.DIR={tmp_path / 'a'}", "config.LOSS.swav_loss.crops_for_assign=[0,4]"])
    assert r.returncode == 2, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: config.LOSS.swav_loss.crops_for_assign=[0, 4] names crop 4") and "Traceback" not in r.stderr
    assert not (tmp_path / "a" / "checkpoint.torch").exists()


# ----------------------------------------------------------------------------- the real tool
SMALL = ["config.DATA.TRAIN.DATA_LIMIT=16", "config.LOSS.swav_loss.queue.start_iter=2",
         "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=3"]  # 4 steps per epoch, 2 epochs, queue from step 2


def _metrics(folder):
    return [json.loads(line) for line in (Path(folder) / "metrics.json").read_text().splitlines()]


@pytest.fixture(scope="module")
def swav_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("swav") / "straight"
    r = run_tool([QUICK, f"config.CHECKPOINT.DIR={folder}", *SMALL])
    assert r.returncode == 0, r.stderr[-3000:]
    return folder


def test_swav_trains_through_the_tool(swav_run):
    losses = [m["train_loss"] for m in _metrics(swav_run)]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses) and losses[1] < losses[0], losses
    ck = classy_state(swav_run / "checkpoint.torch")
    w = ck["base_model"]["model"]["heads"]["0.prototypes0.weight"]
    assert w.shape == (20, 32) and torch.allclose(w.norm(dim=1), torch.ones(20), atol=1e-5)
    assert ck["loss"]["_extra_state"] == {"num_iteration": 8}
    assert ck["loss"]["local_emb_queue"].shape == (2, 16, 32)
    # the queue holds this run's embeddings (unit norm), not its random initial values
    assert torch.allclose(ck["loss"]["local_emb_queue"].norm(dim=2), torch.ones(2, 16), atol=1e-5)
    assert "local_emb_queue" in ck["loss"]


def test_swav_resumed_from_a_mid_phase_checkpoint_equals_the_straight_run(swav_run, tmp_path):
    """Resuming at step 3 (queue in use since step 2) gives the straight run's model, queue and losses."""
    resumed = tmp_path / "resumed"
    r = run_tool([QUICK, f"config.CHECKPOINT.DIR={resumed}", *SMALL,
                  f"config.CHECKPOINT.RESUME_FROM={swav_run / 'model_iteration3.torch'}"])
    assert r.returncode == 0, r.stderr[-3000:]

    def state(folder):
        ck = classy_state(folder / "model_final_checkpoint_phase1.torch")
        return {"model": ck["base_model"], "loss": ck["loss"], "optimizer": ck["optimizer"]}

    assert_bitwise_equal(state(swav_run), state(resumed))
    assert [m["train_loss"] for m in _metrics(swav_run)] == [m["train_loss"] for m in _metrics(resumed)]


# ----------------------------------------------------------------------------- two ranks
def _two_rank_worker(rank, init_file, scores, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        half = scores.shape[0] // 2
        out[rank] = sinkhorn_knopp(scores[rank * half:(rank + 1) * half], 0.05, 3)
    finally:
        dist.destroy_process_group()


def test_sinkhorn_over_two_ranks_equals_one_process_over_the_global_batch(tmp_path):
    import torch.multiprocessing as mp

    torch.manual_seed(8)
    scores = torch.randn(16, 5)
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_two_rank_worker, args=(str(tmp_path / "init"), scores, out), nprocs=2)
    together = torch.cat([out[0], out[1]])
    assert torch.allclose(together, sinkhorn_knopp(scores, 0.05, 3), atol=1e-6)
    # each rank alone would balance its own half: not the same
    assert not torch.allclose(together, torch.cat([sinkhorn_knopp(s, 0.05, 3) for s in scores.split(8)]), atol=1e-4)


def test_two_ranks_resume_each_ranks_queue(tmp_path):
    """Each rank keeps its own queue: a 2-rank run resumed mid-phase gives the straight 2-rank run."""
    two = [*SMALL, "config.DISTRIBUTED.NUM_PROC_PER_NODE=2", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=2",
           "config.OPTIMIZER.num_epochs=1"]  # 4 steps, queue of 8 per rank from step 2
    straight = tmp_path / "straight"
    r = run_tool([QUICK, f"config.CHECKPOINT.DIR={straight}", *two])
    assert r.returncode == 0, r.stderr[-3000:]
    ck = classy_state(straight / "model_iteration3.torch")
    queues = [s["loss"]["local_emb_queue"] for s in ck["rank_states"]]
    assert [tuple(q.shape) for q in queues] == [(2, 8, 32), (2, 8, 32)] and not torch.equal(queues[0], queues[1])
    resumed = tmp_path / "resumed"
    r = run_tool([QUICK, f"config.CHECKPOINT.DIR={resumed}", *two,
                  f"config.CHECKPOINT.RESUME_FROM={straight / 'model_iteration3.torch'}"])
    assert r.returncode == 0, r.stderr[-3000:]

    def final(folder):
        ck = classy_state(folder / "model_final_checkpoint_phase0.torch")
        return {"model": ck["base_model"], "ranks": [s["loss"] for s in ck["rank_states"]]}

    assert_bitwise_equal(final(straight), final(resumed))
    assert _metrics(straight)[0]["train_loss"] == _metrics(resumed)[0]["train_loss"]
