"""Barlow Twins: barlow_twins_loss (against a plain float64 reference, and over two ranks), the
lars optimizer (against hand-computed steps), ImgPilMultiCropRandomApply, and runs of the real
tool: VISSL's quick_barlow_twins layout, and exact resume of a lars run."""

import json
import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import assert_bitwise_equal, classy_state, run_tool
from ssl_engine.config import compose
from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.data.dataset import sample_seed, seeded_rng
from ssl_engine.data.transforms import ImgPilMultiCropRandomApply, ImgPilRandomSolarize, SSLTransformsWrapper
from ssl_engine.errors import UserError
from ssl_engine.losses import BarlowTwinsLoss, build_loss
from ssl_engine.models import build_model
from ssl_engine.optim import LARS, build_optimizer

QUICK = "config=quick/barlow_twins_synthetic"


# ----------------------------------------------------------------------------- the loss
def reference_loss(emb, lambda_, scale, eps=1e-5):
    """Barlow Twins written out with loops in float64: rows are view 0 of all images, then view 1."""
    z = emb.double()
    n, d = z.shape[0] // 2, z.shape[1]
    views = [z[:n], z[n:]]
    normed = []
    for v in views:
        cols = []
        for k in range(d):
            col = v[:, k]
            mean = sum(col.tolist()) / n
            var = sum((x - mean) ** 2 for x in col.tolist()) / n
            cols.append([(x - mean) / math.sqrt(var + eps) for x in col.tolist()])
        normed.append(cols)  # [d][n]
    total = 0.0
    for i in range(d):
        for j in range(d):
            c = sum(normed[0][i][b] * normed[1][j][b] for b in range(n)) / n
            total += (1 - c) ** 2 if i == j else lambda_ * c ** 2
    return scale * total


@pytest.mark.parametrize("n, d", [(5, 4), (3, 7)])
def test_loss_matches_the_plain_reference(n, d):
    torch.manual_seed(n * d)
    emb = torch.randn(2 * n, d) * torch.rand(d) * 3 + torch.randn(d)
    got = BarlowTwinsLoss(lambda_=0.3, scale_loss=0.5, embedding_dim=d)([emb])
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(reference_loss(emb, 0.3, 0.5), rel=1e-5)
    # lambda_ and scale_loss act
    assert BarlowTwinsLoss(lambda_=0.0, scale_loss=0.5, embedding_dim=d)(emb).item() == pytest.approx(
        reference_loss(emb, 0.0, 0.5), rel=1e-5)
    assert BarlowTwinsLoss(lambda_=0.3, scale_loss=2.0, embedding_dim=d)(emb).item() == pytest.approx(
        4 * got.item(), rel=1e-6)


def test_views_are_standardised_separately_and_order_matters():
    """Each view standardised on its own: shifting and scaling one view's embeddings leaves the loss;
    pairing an image's view 0 with another image's view 1 changes it."""
    torch.manual_seed(1)
    emb = torch.randn(12, 5)
    loss = BarlowTwinsLoss(embedding_dim=5)
    moved = torch.cat([emb[:6] * 3 + 2, emb[6:]])
    assert loss(moved).item() == pytest.approx(loss(emb).item(), rel=1e-4)
    shuffled = torch.cat([emb[:6], emb[6:][torch.tensor([1, 0, 2, 3, 4, 5])]])
    assert abs(loss(shuffled).item() - loss(emb).item()) > 1e-3
    # two identical views of independent dims: c is close to the identity, the loss small
    twins = torch.randn(2000, 3)
    assert BarlowTwinsLoss(embedding_dim=3)(torch.cat([twins, twins])).item() < 1e-3


def test_loss_under_autocast_is_float32_and_gradients_flow():
    torch.manual_seed(2)
    emb = torch.randn(8, 6, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = BarlowTwinsLoss(embedding_dim=6)(emb.bfloat16())
    assert out.dtype == torch.float32
    out.backward()
    assert emb.grad is not None and emb.grad.abs().sum() > 0


def test_loss_errors_name_the_key():
    with pytest.raises(UserError, match=r"config\.LOSS\.barlow_twins_loss\.embedding_dim=8 does not match the "
                                        r"embeddings of shape \(6, 5\)"):
        BarlowTwinsLoss(embedding_dim=8)(torch.randn(6, 5))
    with pytest.raises(UserError, match=r"two views per image.*got 5 rows"):
        BarlowTwinsLoss(embedding_dim=4)(torch.randn(5, 4))
    with pytest.raises(UserError, match=r"barlow_twins_loss\.scale_loss=0 must be a number > 0"):
        BarlowTwinsLoss(scale_loss=0)
    with pytest.raises(UserError, match=r"barlow_twins_loss\.lambda_=-1 must be a number >= 0"):
        BarlowTwinsLoss(lambda_=-1)
    with pytest.raises(UserError, match=r"expects one head output"):
        BarlowTwinsLoss(embedding_dim=4)([torch.randn(4, 4), torch.randn(4, 4)])
    cfg = compose([QUICK])
    model = build_model(cfg.MODEL)
    BarlowTwinsLoss(embedding_dim=64).check_model(model)
    with pytest.raises(UserError, match=r"embedding_dim=32 does not match the embedding size dims\[-1\]=64 of "
                                        r"config\.MODEL\.HEAD\.PARAMS\[1\] \(mlp\)"):
        BarlowTwinsLoss(embedding_dim=32).check_model(model)


def test_config_keys_act():
    loss = build_loss(compose([QUICK, "config.LOSS.barlow_twins_loss.lambda_=0.1",
                               "config.LOSS.barlow_twins_loss.scale_loss=2.0"]).LOSS)
    assert (loss.lambda_, loss.scale_loss, loss.embedding_dim) == (0.1, 2.0, 64)


def test_a_wrong_embedding_dim_stops_before_launch_with_one_line(tmp_path):
    r = run_tool([QUICK, f"config.CHECKPOINT.DIR={tmp_path / 'a'}", "config.LOSS.barlow_twins_loss.embedding_dim=128"])
    assert r.returncode == 2, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: config.LOSS.barlow_twins_loss.embedding_dim=128 does not match") and "Traceback" not in r.stderr
    assert not (tmp_path / "a" / "checkpoint.torch").exists()


def test_one_image_per_step_stops_before_launch_and_a_last_batch_of_one_is_warned_of(tmp_path):
    # one image standardised over itself is all zeros: a constant loss and no gradient
    x = torch.randn(2, 16, requires_grad=True)
    BarlowTwinsLoss(embedding_dim=16)(x).backward()
    assert float(x.grad.abs().sum()) == 0.0
    r = run_tool([QUICK, f"config.CHECKPOINT.DIR={tmp_path / 'a'}", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=1"])
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        "error: config.LOSS.name=barlow_twins_loss compares the images of a step with each other and needs at least 2 "
        "per step; config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=1 x 1 rank(s) gives 1, whose loss has no gradient: raise "
        "BATCHSIZE_PER_REPLICA"]
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").glob("*.torch"))
    # 2 ranks of 1 image each make steps of 2: accepted (checked here without launching them)
    from ssl_engine.config.validate import check_loss_batch
    from ssl_engine.data import build_dataloader, build_dataset

    cfg = compose([QUICK, "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=2", "config.DATA.TRAIN.DROP_LAST=false",
                   "config.DATA.TRAIN.DATA_LIMIT=5"])
    loss = build_loss(cfg.LOSS)
    loader = build_dataloader(build_dataset(cfg, "TRAIN"), cfg, "TRAIN", 0, 1, "cpu", check_cpus=False)
    assert "the last batch of each epoch holds 1 image(s), which barlow_twins_loss gives no gradient" in \
        check_loss_batch(cfg, loss, loader, 1)
    assert check_loss_batch(cfg, loss, loader, 2) is None  # a last step of 1 image on each of 2 ranks: 2 images
    cfg.DATA.TRAIN.DROP_LAST = True
    assert check_loss_batch(cfg, loss, loader, 1) is None


# ----------------------------------------------------------------------------- two ranks
def _two_rank_worker(rank, init_file, x, weight, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        n = x.shape[0] // 2  # images in the global batch
        half = n // 2
        mine = torch.cat([x[rank * half:(rank + 1) * half], x[n + rank * half:n + (rank + 1) * half]])
        w = weight.clone().requires_grad_(True)
        loss = BarlowTwinsLoss(lambda_=0.2, scale_loss=0.7, embedding_dim=w.shape[0])(mine @ w.t())
        loss.backward()
        grad = w.grad.clone()
        dist.all_reduce(grad)  # what DDP does: the mean of the ranks' parameter gradients
        out[rank] = (loss.detach(), grad / 2, w.grad.clone())
    finally:
        dist.destroy_process_group()


def test_two_ranks_give_the_loss_and_gradients_of_one_process_over_the_global_batch(tmp_path):
    import torch.multiprocessing as mp

    torch.manual_seed(3)
    x = torch.randn(16, 6)  # 8 images: view 0 of all, then view 1; each rank gets 4 images
    weight = torch.randn(5, 6)
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_two_rank_worker, args=(str(tmp_path / "init"), x, weight, out), nprocs=2)
    w = weight.clone().requires_grad_(True)
    loss = BarlowTwinsLoss(lambda_=0.2, scale_loss=0.7, embedding_dim=5)(x @ w.t())
    loss.backward()
    for rank in (0, 1):
        rank_loss, ddp_grad, own_grad = out[rank]
        assert rank_loss.item() == pytest.approx(loss.item(), rel=1e-5)
        assert torch.allclose(ddp_grad, w.grad, rtol=1e-4, atol=1e-6)
    # each rank's own gradient is not the answer: only their mean is
    assert not torch.allclose(out[0][2], w.grad, rtol=1e-2)


# ----------------------------------------------------------------------------- lars
def _lars_steps(param, grads, **kw):
    p = torch.nn.Parameter(param.clone())
    opt = LARS([{"params": [p], "weight_decay": kw.pop("weight_decay", 0.0)}], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt


def test_lars_step_equals_the_hand_computed_update():
    w = torch.tensor([[3.0, 4.0]])  # ||w|| = 5
    g = torch.tensor([[0.6, -0.8]])  # ||g|| = 1
    # wd 0: ratio eta * 5 / 1; first step mu = d
    p, _ = _lars_steps(w, [g], lr=2.0, momentum=0.9, eta=0.01)
    assert torch.allclose(p, w - 2.0 * (0.01 * 5 / 1) * g)
    # with weight decay: d = g + wd w = [0.9, -0.4], ||d|| = sqrt(0.97)
    d = g + 0.1 * w
    p, _ = _lars_steps(w, [g], lr=2.0, momentum=0.9, eta=0.01, weight_decay=0.1)
    assert torch.allclose(p, w - 2.0 * (0.01 * 5 / math.sqrt(0.97)) * d)
    # two steps: momentum accumulates the scaled updates
    g2 = torch.tensor([[1.0, 1.0]])
    p, opt = _lars_steps(w, [g, g2], lr=1.0, momentum=0.5, eta=0.01)
    d1 = 0.01 * 5 * g
    w1 = w - d1
    d2 = 0.01 * w1.norm() / g2.norm() * g2
    assert torch.allclose(p, w1 - (0.5 * d1 + d2))
    assert torch.allclose(opt.state[next(iter(opt.state))]["mu"], 0.5 * d1 + d2)


def test_lars_excludes_one_d_params_from_the_trust_ratio_only_when_asked():
    b = torch.tensor([3.0, 4.0])
    g = torch.tensor([0.6, -0.8])
    d = g + 0.1 * b  # the group's weight decay applies either way (regularize_bias decides it)
    excluded, _ = _lars_steps(b, [g], lr=0.5, momentum=0.9, eta=0.01, weight_decay=0.1, exclude_bias_and_norm=True)
    assert torch.allclose(excluded, b - 0.5 * d)
    scaled, _ = _lars_steps(b, [g], lr=0.5, momentum=0.9, eta=0.01, weight_decay=0.1, exclude_bias_and_norm=False)
    assert torch.allclose(scaled, b - 0.5 * (0.01 * 5 / d.norm()) * d)
    # a 2-d weight keeps its trust ratio with exclude_bias_and_norm
    w = b.view(1, 2)
    kept, _ = _lars_steps(w, [g.view(1, 2)], lr=0.5, momentum=0.9, eta=0.01, exclude_bias_and_norm=True)
    assert torch.allclose(kept, w - 0.5 * (0.01 * 5 / 1) * g.view(1, 2))
    # zero parameter or zero gradient: ratio 1
    zero, _ = _lars_steps(torch.zeros(1, 2), [g.view(1, 2)], lr=0.5, momentum=0.9, eta=0.01)
    assert torch.allclose(zero, -0.5 * g.view(1, 2))


def test_lars_from_config_with_param_groups_and_state_round_trip(tmp_path):
    cfg = compose([QUICK, "config.OPTIMIZER.eta=0.02"])
    model = build_model(cfg.MODEL)
    opt = build_optimizer(cfg.OPTIMIZER, model, global_batch_size=16, num_iters_per_epoch=4)
    inner = opt.optimizer
    assert isinstance(inner, LARS)
    assert {g["eta"] for g in inner.param_groups} == {0.02} and all(g["exclude_bias_and_norm"] for g in inner.param_groups)
    assert sorted(g["weight_decay"] for g in inner.param_groups) == [0.0, 1.5e-6]  # bn and biases: no decay
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    path = tmp_path / "opt.torch"
    torch.save(opt.state_dict(), path)
    state = torch.load(path, weights_only=True)
    other = build_optimizer(cfg.OPTIMIZER, build_model(cfg.MODEL), global_batch_size=16, num_iters_per_epoch=4)
    other.load_state_dict(state)
    assert_bitwise_equal(other.state_dict(), opt.state_dict())
    with pytest.raises(UserError, match=r"config\.OPTIMIZER\.use_larc=true with config\.OPTIMIZER\.name=lars"):
        build_optimizer(compose([QUICK, "config.OPTIMIZER.use_larc=true"]).OPTIMIZER, model, 16, 4)
    with pytest.raises(UserError, match=r"config\.OPTIMIZER\.eta=0\.0 must be > 0"):
        build_optimizer(compose([QUICK, "config.OPTIMIZER.eta=0.0"]).OPTIMIZER, model, 16, 4)


# ----------------------------------------------------------------------------- the transform
class _Mark:
    """A transform that records that it ran (a different image each time: the colour)."""

    def __call__(self, img):
        return Image.new("RGB", img.size, (255, 0, int(torch.randint(256, ()).item())))


def _views():
    return [Image.new("RGB", (4, 4), (0, 0, 0)), Image.new("RGB", (4, 4), (0, 0, 1))]


def _marked(views):
    return [v.getpixel((0, 0))[0] == 255 for v in views]


def test_multicrop_random_apply_per_view_probabilities():
    t = ImgPilMultiCropRandomApply([_Mark()], prob=[0.0, 1.0])
    for s in range(50):
        torch.manual_seed(s)
        assert _marked(t(_views())) == [False, True]
    t = ImgPilMultiCropRandomApply([_Mark()], prob=[1.0, 0.3])
    hits = 0
    for s in range(400):
        torch.manual_seed(s)
        first, second = _marked(t(_views()))
        assert first
        hits += second
    assert 80 < hits < 160, hits  # about 120 of 400


def test_multicrop_random_apply_is_a_function_of_the_sample_seed():
    """Through the transform pipeline as the dataset runs it: same (seed, epoch, index), same views."""
    specs = [{"name": "ImgReplicatePil", "num_times": 2},
             {"name": "ImgPilMultiCropRandomApply", "prob": [0.5, 0.5],
              "transforms": [{"name": "ImgPilGaussianBlur", "p": 1.0, "radius_min": 0.1, "radius_max": 2.0}]},
             {"name": "ImgPilMultiCropRandomApply", "prob": [0.0, 0.5],
              "transforms": [{"name": "ImgPilRandomSolarize", "p": 1.0}]},
             {"name": "ToTensor"}]
    wrapper = SSLTransformsWrapper(specs)
    torch.manual_seed(0)
    img = Image.fromarray((torch.rand(16, 16, 3) * 255).byte().numpy())

    def run(epoch, idx):
        with seeded_rng(sample_seed(0, epoch, idx)):
            return wrapper({"data": [img], "label": [0], "data_idx": [idx], "data_valid": [1]})["data"]

    first, again = run(0, 3), run(0, 3)
    assert len(first) == 2 and all(torch.equal(a, b) for a, b in zip(first, again))
    outcomes = {tuple(round(float(v.sum()), 3) for v in run(e, i)) for e in range(3) for i in range(8)}
    assert len(outcomes) > 1  # different samples draw differently


def test_multicrop_random_apply_errors_name_the_entry():
    wrapper = SSLTransformsWrapper([{"name": "ImgPilMultiCropRandomApply", "prob": [1.0, 1.0, 1.0],
                                     "transforms": [{"name": "ImgPilRandomSolarize", "p": 1.0}]}],
                                   "config.DATA.TRAIN.TRANSFORMS")
    img = Image.new("RGB", (4, 4))
    with pytest.raises(UserError, match=r"config\.DATA\.TRAIN\.TRANSFORMS\[0\] \(ImgPilMultiCropRandomApply\): "
                                        r"prob=\[1\.0, 1\.0, 1\.0\] gives 3 probabilities but the sample has 2 views"):
        wrapper({"data": [img, img]})
    with pytest.raises(UserError, match=r"TRANSFORMS\[0\].*prob must be a list of probabilities"):
        SSLTransformsWrapper([{"name": "ImgPilMultiCropRandomApply", "prob": [1.5],
                               "transforms": [{"name": "ToTensor"}]}], "config.DATA.TRAIN.TRANSFORMS")


def test_random_solarize_reads_vissl_key_p():
    assert ImgPilRandomSolarize(p=1.0).prob == 1.0 and ImgPilRandomSolarize().prob == 0.66
    assert ImgPilRandomSolarize(prob=0.3).prob == 0.3


def test_random_solarize_draws_its_threshold_from_0_to_256_as_vissl():
    """VISSL's ImgPilRandomSolarize solarizes at a threshold drawn from the integers 0..256 per
    image, not at a fixed 128: a pixel of 200 is inverted when the threshold is <= 200 (201 of 257)."""
    img = Image.new("RGB", (2, 2), (200, 60, 255))
    t = ImgPilRandomSolarize(p=1.0)
    outcomes = {}
    for s in range(2000):
        torch.manual_seed(s)
        px = t(img).getpixel((0, 0))
        outcomes[px] = outcomes.get(px, 0) + 1
    # thresholds <= 60 invert all three, 61..200 the first and third, 201..255 the third, 256 none
    assert set(outcomes) <= {(55, 195, 0), (55, 60, 0), (200, 60, 0), (200, 60, 255)}, outcomes
    assert 0.72 < (outcomes.get((55, 195, 0), 0) + outcomes.get((55, 60, 0), 0)) / 2000 < 0.84, outcomes
    assert outcomes.get((200, 60, 0), 0) > 300 and outcomes.get((55, 195, 0), 0) > 350, outcomes
    torch.manual_seed(0)
    assert ImgPilRandomSolarize(p=1.0, threshold=128)(img).getpixel((0, 0)) == (55, 60, 0)
    with pytest.raises(ValueError, match="threshold"):
        ImgPilRandomSolarize(threshold=300)


# ----------------------------------------------------------------------------- the real tool
# VISSL 0.1.6's configs/config/test/integration_test/quick_barlow_twins.yaml, as written there
VISSL_QUICK_BARLOW_TWINS = """# @package _global_
config:
  VERBOSE: False
  LOG_FREQUENCY: 1
  TEST_ONLY: False
  TEST_MODEL: False
  SEED_VALUE: 0
  MULTI_PROCESSING_METHOD: forkserver
  HOOKS:
    PERF_STATS:
      MONITOR_PERF_STATS: True
      PERF_STAT_FREQUENCY: 10
      ROLLING_BTIME_FREQ: 5
  DATA:
    NUM_DATALOADER_WORKERS: 5
    TRAIN:
      DATA_SOURCES: [disk_filelist]
      DATASET_NAMES: [imagenet1k_filelist]
      BATCHSIZE_PER_REPLICA: 32
      LABEL_TYPE: sample_index    # just an implementation detail. Label isn't used
      TRANSFORMS:
        - name: ImgReplicatePil
          num_times: 2
        - name: RandomResizedCrop
          size: 224
        - name: RandomHorizontalFlip
          p: 0.5
        - name: ImgPilColorDistortion
          strength: 0.5
        - name: ImgPilMultiCropRandomApply
          transforms:
            - name: ImgPilGaussianBlur
              p: 1.0
              radius_min: 0.1
              radius_max: 2.0
          prob: [1.0, 0.1]
        - name: ImgPilMultiCropRandomApply
          transforms:
            - name: ImgPilRandomSolarize
              p: 1.0
          prob: [0.0, 0.2]
        - name: ToTensor
        - name: Normalize
          mean: [0.485, 0.456, 0.406]
          std: [0.229, 0.224, 0.225]
      COLLATE_FUNCTION: simclr_collator
      MMAP_MODE: True
      COPY_TO_LOCAL_DISK: False
      DATA_LIMIT: 500
      DROP_LAST: True
      COPY_DESTINATION_DIR: "/tmp/imagenet1k"
  TRAINER:
    TRAIN_STEP_NAME: standard_train_step
  METERS:
    name: ""
  MODEL:
    TRUNK:
      NAME: resnet
      RESNETS:
        DEPTH: 50
    HEAD:
      # Reduced MLP size to limit memory footprint
      PARAMS: [
        ["mlp", {"dims": [2048, 128], "use_relu": True, "use_bn": True, "use_bias": False, "skip_last_layer_relu_bn": False}],
      ]
    SYNC_BN_CONFIG:
      CONVERT_BN_TO_SYNC_BN: True
      SYNC_BN_TYPE: pytorch
    AMP_PARAMS:
      USE_AMP: False
  LOSS:
      name: barlow_twins_loss
      barlow_twins_loss:
        lambda_: 0.0051
        scale_loss: 0.024
        embedding_dim: 128
  OPTIMIZER:
      name: lars
      weight_decay: 0.0000015
      momentum: 0.9
      exclude_bias_and_norm: True
      num_epochs: 2
      regularize_bn: False
      regularize_bias: False
      param_schedulers:
        lr:
          auto_lr_scaling:
            auto_scale: true
            base_value: 0.2
            base_lr_batch_size: 256
          name: composite
          schedulers:
            - name: linear
              start_value: 0.0
              end_value: 0.2 # Automatically rescaled if needed
            - name: cosine
              start_value: 0.2 # Automatically rescaled if needed
              end_value: 0.002 # Automatically rescaled if needed
          update_interval: step
          interval_scaling: [rescaled, fixed]
          lengths: [0.1, 0.9]                 # 100ep
  DISTRIBUTED:
    BACKEND: nccl
    NUM_NODES: 1
    NUM_PROC_PER_NODE: 1
    INIT_METHOD: tcp
    RUN_ID: auto
  MACHINE:
    DEVICE: gpu
  CHECKPOINT:
    DIR: "."
    AUTO_RESUME: True
    CHECKPOINT_FREQUENCY: 1
    OVERWRITE_EXISTING: true
"""


def _metrics(folder):
    return [json.loads(line) for line in (Path(folder) / "metrics.json").read_text().splitlines()]


def test_vissl_quick_barlow_twins_runs_through_the_tool(tmp_path):
    """VISSL's yaml unchanged but for what a CPU test needs: synthetic data, 32px, resnet18, batch 4."""
    small = (VISSL_QUICK_BARLOW_TWINS.replace("size: 224", "size: 32").replace("DEPTH: 50", "DEPTH: 18")
             .replace("[2048, 128]", "[512, 128]"))
    yaml = tmp_path / "quick_barlow_twins.yaml"
    yaml.write_text(small)
    r = run_tool([f"config={yaml}", f"config.CHECKPOINT.DIR={tmp_path / 'run'}",
                  "config.DATA.TRAIN.DATA_SOURCES=[synthetic]", "config.DATA.TRAIN.DATA_LIMIT=8",
                  "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4", "config.DATA.NUM_DATALOADER_WORKERS=0",
                  "config.MACHINE.DEVICE=cpu", "config.DISTRIBUTED.BACKEND=gloo"])
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [m["train_loss"] for m in _metrics(tmp_path / "run")]
    assert len(losses) == 2 and all(math.isfinite(v) and v > 0 for v in losses) and losses[0] != losses[1], losses
    saved = (tmp_path / "run" / "train_config.yaml").read_text()
    assert "exclude_bias_and_norm: true" in saved
    ck = torch.load(str(tmp_path / "run" / "checkpoint.torch"), map_location="cpu", weights_only=True)
    groups = ck["classy_state_dict"]["optimizer"]["optimizer"]["param_groups"]
    assert all(g["exclude_bias_and_norm"] and g["eta"] == 0.001 for g in groups)
    assert ck["classy_state_dict"]["optimizer"]["optimizer"]["state"]  # the momentum buffers


SMALL = ["config.DATA.TRAIN.DATA_LIMIT=8", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4",
         "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=1"]  # 2 steps per epoch, 2 epochs


def test_lars_run_resumed_from_a_mid_phase_checkpoint_equals_the_straight_run(tmp_path):
    straight = tmp_path / "straight"
    r = run_tool([QUICK, f"config.CHECKPOINT.DIR={straight}", *SMALL])
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [m["train_loss"] for m in _metrics(straight)]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses), losses
    resumed = tmp_path / "resumed"
    r = run_tool([QUICK, f"config.CHECKPOINT.DIR={resumed}", *SMALL,
                  f"config.CHECKPOINT.RESUME_FROM={straight / 'model_iteration3.torch'}"])
    assert r.returncode == 0, r.stderr[-3000:]

    def state(folder):
        ck = classy_state(folder / "model_final_checkpoint_phase1.torch")
        return {"model": ck["base_model"], "optimizer": ck["optimizer"]}

    assert_bitwise_equal(state(straight), state(resumed))
    # the resumed folder holds the phase it finished: its loss (averaged over the whole phase) is the same
    assert _metrics(resumed)[-1] == _metrics(straight)[-1]
