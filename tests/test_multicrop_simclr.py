"""multicrop_simclr_info_nce_loss: SimCLR's loss over C crops per image (VISSL's name and keys)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import run_tool
from ssl_engine.config import compose
from ssl_engine.errors import UserError
from ssl_engine.losses import MultiCropSimclrInfoNCELoss, SimclrInfoNCELoss


def reference_loss(emb: torch.Tensor, crops: int, temperature: float) -> float:
    """The loss written out row by row: for each row and each other crop of its image, -log of
    exp(positive) over exp(positive) + the sum over the rows of other images."""
    z = F.normalize(emb.double(), dim=1)
    rows = z.shape[0]
    n = rows // crops
    sim = (z @ z.t() / temperature).exp()
    total, count = 0.0, 0
    for r in range(rows):
        image, crop = r % n, r // n
        neg = sum(sim[r, q].item() for q in range(rows) if q % n != image)
        for d in range(1, crops):
            pos = sim[r, ((crop + d) % crops) * n + image].item()
            total -= math.log(pos / (pos + neg))
            count += 1
    return total / count


@pytest.mark.parametrize("crops, n", [(2, 5), (3, 4), (6, 3)])
def test_loss_matches_the_row_by_row_reference(crops, n):
    torch.manual_seed(crops)
    emb = torch.randn(crops * n, 16)
    loss = MultiCropSimclrInfoNCELoss(temperature=0.2, num_crops=crops)(emb)
    assert loss.item() == pytest.approx(reference_loss(emb, crops, 0.2), rel=1e-5)


def test_two_crops_is_simclr_and_gradients_flow():
    torch.manual_seed(0)
    emb = torch.randn(8, 6, requires_grad=True)
    loss = MultiCropSimclrInfoNCELoss(temperature=0.5, num_crops=2)([emb])
    assert loss.item() == pytest.approx(SimclrInfoNCELoss(temperature=0.5)([emb]).item(), rel=1e-6)
    loss.backward()
    assert emb.grad is not None and emb.grad.abs().sum() > 0


def test_crop_order_matters():
    """Positives are the same image's other crops in crop-major order: shuffling rows changes the loss."""
    torch.manual_seed(1)
    emb = torch.randn(12, 8)
    loss = MultiCropSimclrInfoNCELoss(num_crops=3)
    assert loss(emb).item() != pytest.approx(loss(emb[torch.randperm(12)]).item(), rel=1e-3)


def test_bad_settings_and_shapes_are_user_errors():
    with pytest.raises(UserError, match=r"multicrop_simclr_info_nce_loss.num_crops=1 must be an integer >= 2"):
        MultiCropSimclrInfoNCELoss(num_crops=1)
    with pytest.raises(UserError, match=r"temperature=0 must be a number > 0"):
        MultiCropSimclrInfoNCELoss(temperature=0)
    with pytest.raises(UserError, match=r"shape \(10, 4\), which is not config.LOSS.multicrop_simclr_info_nce_loss"
                                        r".num_crops=3 crops"):
        MultiCropSimclrInfoNCELoss(num_crops=3)(torch.randn(10, 4))
    with pytest.raises(UserError, match=r"expects one head output"):
        MultiCropSimclrInfoNCELoss()([torch.randn(4, 2), torch.randn(4, 2)])


MULTICROP = [
    "config=quick/simclr_synthetic",
    "config.OPTIMIZER.num_epochs=1",
    "config.DATA.TRAIN.DATA_LIMIT=16",
    "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4",
    "config.DATA.TRAIN.COLLATE_FUNCTION=multicrop_collator",
    "config.DATA.TRAIN.TRANSFORMS=[{name: ImgPilToMultiCrop, total_num_crops: 3, size_crops: [32, 16], "
    "num_crops: [2, 1], crop_scales: [[0.5, 1], [0.1, 0.5]]}, {name: ToTensor}]",
    "config.MODEL.TRUNK.RESNETS.DEPTH=18",
    "config.LOSS.name=multicrop_simclr_info_nce_loss",
    "config.LOSS.multicrop_simclr_info_nce_loss.temperature=0.2",
]


def test_vissl_style_multicrop_run_through_the_tool(tmp_path):
    """Two 32px crops and one 16px crop per image: num_crops is taken from the transform, the
    run trains and logs a finite loss."""
    r = run_tool([*MULTICROP, f"config.CHECKPOINT.DIR={tmp_path}"])
    assert r.returncode == 0, r.stderr[-3000:]
    saved = (tmp_path / "train_config.yaml").read_text()
    assert "num_crops: 3" in saved
    lines = [json.loads(x) for x in (tmp_path / "metrics.json").read_text().splitlines()]
    assert len(lines) == 1 and math.isfinite(lines[0]["train_loss"]) and lines[0]["train_loss"] > 0


def test_num_crops_that_contradicts_the_transform_is_refused(tmp_path):
    r = run_tool([*MULTICROP, f"config.CHECKPOINT.DIR={tmp_path}",
                  "config.LOSS.multicrop_simclr_info_nce_loss.num_crops=4"])
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: config.LOSS.multicrop_simclr_info_nce_loss.num_crops=4 contradicts "
        "config.DATA.TRAIN.TRANSFORMS[0] (ImgPilToMultiCrop).total_num_crops=3; make them equal, or leave "
        "config.LOSS.multicrop_simclr_info_nce_loss.num_crops out to take it from there"
    ]
    assert not (tmp_path / "log.txt").exists()


def test_inference_keeps_an_agreeing_value_and_needs_the_loss_named():
    cfg = compose([*MULTICROP, "config.LOSS.multicrop_simclr_info_nce_loss.num_crops=3"])
    assert cfg.LOSS.multicrop_simclr_info_nce_loss.num_crops == 3
    other = compose([*MULTICROP[:-2]])  # simclr_info_nce_loss: the multicrop section is left alone
    assert other.LOSS.multicrop_simclr_info_nce_loss.num_crops == 2
