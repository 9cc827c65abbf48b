"""MoCo: moco_loss (queue of keys), MoCoHook (momentum encoder) and moco_collator, VISSL's names."""

import copy
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import assert_bitwise_equal, classy_state, run_tool
from ssl_engine.data.collators import moco_collator
from ssl_engine.errors import UserError
from ssl_engine.hooks import MoCoHook
from ssl_engine.losses import MoCoLoss

QUICK = "config=quick/moco_synthetic"


def test_loss_is_cross_entropy_of_the_key_against_the_queue_and_the_keys_enter_the_queue():
    torch.manual_seed(0)
    loss = MoCoLoss(embedding_dim=4, queue_size=6, temperature=0.5)
    queue = loss.queue.clone()
    query, key = torch.randn(3, 4), F.normalize(torch.randn(3, 4), dim=1)
    loss.key = key
    value = loss([query])
    q = F.normalize(query.double(), dim=1)
    expect = 0.0
    for i in range(3):  # -log softmax of the positive among [positive, queue] / T, row by row
        logits = torch.cat([(q[i] * key[i].double()).sum().view(1), q[i] @ queue.double()]) / 0.5
        expect -= (logits[0] - torch.logsumexp(logits, 0)).item()
    assert value.item() == pytest.approx(expect / 3, rel=1e-5)
    # the keys replaced the oldest 3 columns and the pointer moved on; the rest is untouched
    assert torch.equal(loss.queue[:, :3], key.t()) and torch.equal(loss.queue[:, 3:], queue[:, 3:])
    assert int(loss.queue_ptr) == 3
    loss.key = key.flip(0)
    loss([query])
    assert int(loss.queue_ptr) == 0 and torch.equal(loss.queue[:, 3:], key.flip(0).t())
    assert loss.key is None  # used once


def test_a_step_that_would_reach_past_the_queue_end_is_one_user_error():
    """Keys of 4, then a short step of 2 (a last batch of an epoch; 8 % 2 == 0), then 4 again: the
    queue position 6 leaves room for 2. Python API runs have no pre-launch check; was: a
    RuntimeError traceback from the queue's slice ("expanded size of the tensor (2) must match")."""
    loss = MoCoLoss(embedding_dim=2, queue_size=8)
    for n in (4, 2):
        loss.key = F.normalize(torch.randn(n, 2), dim=1)
        loss(torch.randn(n, 2))
    loss.key = F.normalize(torch.randn(4, 2), dim=1)
    with pytest.raises(UserError, match=r"queue_size=8: this step's 4 keys, at queue position 6, reach past the "
                                        r"queue's end: .* set config.DATA.TRAIN.DROP_LAST=true"):
        loss(torch.randn(4, 2))


def test_the_queue_position_follows_a_loaded_state_and_a_gpu_step_does_not_wait_to_read_it():
    """The step keeps the queue position as a host int (reading the buffer on a GPU waited for
    every kernel queued before it, at every step); a loaded state still sets where the keys go."""
    loss = MoCoLoss(embedding_dim=2, queue_size=8)
    for _ in range(3):
        loss.key = F.normalize(torch.randn(2, 2), dim=1)
        loss(torch.randn(2, 2))
    assert int(loss.queue_ptr) == 6
    state = copy.deepcopy(loss.state_dict())
    state["queue_ptr"][0] = 2
    loss.load_state_dict(state)
    key = F.normalize(torch.randn(2, 2), dim=1)
    loss.key = key
    loss(torch.randn(2, 2))
    assert torch.equal(loss.queue[:, 2:4], key.t()) and int(loss.queue_ptr) == 4
    if torch.cuda.is_available():
        gpu = MoCoLoss(embedding_dim=2, queue_size=8).cuda()
        gpu.key = F.normalize(torch.randn(2, 2, device="cuda"), dim=1)
        gpu(torch.randn(2, 2, device="cuda"))  # the first step reads the buffer once
        gpu.key = F.normalize(torch.randn(2, 2, device="cuda"), dim=1)
        torch.cuda.set_sync_debug_mode("error")
        try:
            gpu(torch.randn(2, 2, device="cuda"))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert int(gpu.queue_ptr) == 4


def test_eval_mode_leaves_the_queue_alone_and_missing_keys_are_explained():
    loss = MoCoLoss(embedding_dim=4, queue_size=6).eval()
    before = loss.queue.clone()
    loss.key = F.normalize(torch.randn(3, 4), dim=1)
    loss(torch.randn(3, 4))
    assert torch.equal(loss.queue, before) and int(loss.queue_ptr) == 0
    with pytest.raises(UserError, match="moco_loss has no keys: they come from the MoCoHook"):
        loss(torch.randn(3, 4))
    with pytest.raises(UserError, match=r"embedding_dim=4 does not match the head's output of shape \(3, 5\)"):
        loss(torch.randn(3, 5))


def test_queue_size_must_be_a_multiple_of_the_global_batch():
    loss = MoCoLoss(embedding_dim=2, queue_size=5)
    loss.key = F.normalize(torch.randn(2, 2), dim=1)
    with pytest.raises(UserError, match=r"queue_size=5 must be a multiple of the global batch \(2 keys"):
        loss(torch.randn(2, 2))


def test_checkpoint_state_waits_for_the_encoder():
    a = MoCoLoss(embedding_dim=2, queue_size=4)
    a.attach_encoder(nn.Linear(3, 2))
    a.queue_ptr[0] = 2
    state = copy.deepcopy(a.state_dict())
    assert {"queue", "queue_ptr", "moco_encoder.weight", "moco_encoder.bias"} <= set(state)
    b = MoCoLoss(embedding_dim=2, queue_size=4)
    b.load_state_dict(state)  # a resumed run: the hook attaches the encoder later
    b.attach_encoder(nn.Linear(3, 2))
    assert_bitwise_equal(dict(b.state_dict()), dict(state))
    assert not any(p.requires_grad for p in b.moco_encoder.parameters())


def test_hook_moves_the_encoder_towards_the_model_then_encodes_the_momentum_view():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 4))
    loss = MoCoLoss(embedding_dim=4, queue_size=8)
    task = SimpleNamespace(loss=loss, base_model=model, train=True, last_batch=None)
    hook = MoCoHook(momentum=0.75)
    hook.on_start(task)
    with torch.no_grad():
        model[1].weight.add_(1.0)
    start = loss.moco_encoder[1].weight.clone()
    view1 = torch.randn(2, 3, 2, 2)
    task.last_batch = {"data": [torch.randn(2, 3, 2, 2)], "data_momentum": [view1]}
    hook.on_forward(task)
    assert torch.allclose(loss.moco_encoder[1].weight, 0.75 * start + 0.25 * model[1].weight)
    assert torch.allclose(loss.key, F.normalize(loss.moco_encoder(view1), dim=1))
    task.train = False  # a test phase: keys, but no update
    frozen = loss.moco_encoder[1].weight.clone()
    hook.on_forward(task)
    assert torch.equal(loss.moco_encoder[1].weight, frozen)
    task.last_batch = {"data": [view1]}
    with pytest.raises(UserError, match="moco_collator"):
        hook.on_forward(task)


def test_collator_splits_the_two_views():
    samples = [{"data": [torch.full((1, 2, 2), float(i)), torch.full((1, 2, 2), 10.0 + i)], "label": [i, i],
                "data_valid": [1, 1], "data_idx": [i, i]} for i in range(3)]
    out = moco_collator(samples)
    assert out["data"][0][:, 0, 0, 0].tolist() == [0, 1, 2]
    assert out["data_momentum"][0][:, 0, 0, 0].tolist() == [10, 11, 12]
    assert out["label"][0].tolist() == [0, 1, 2] and out["data_idx"][0].tolist() == [0, 1, 2]
    with pytest.raises(UserError, match="moco_collator needs exactly 2 views per sample, got 1"):
        moco_collator([{"data": [torch.zeros(1, 2, 2)], "label": [0], "data_valid": [1], "data_idx": [0]}])


# ----------------------------------------------------------------------------- the real tool
SMALL = ["config.DATA.TRAIN.DATA_LIMIT=16", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4",
         "config.LOSS.moco_loss.queue_size=8", "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=3",
         "config.MODEL.TRUNK.NAME=mlp", "config.MODEL.TRUNK.MLP.DIMS=[3072,32]",
         "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[32,16]}]]", "config.LOSS.moco_loss.embedding_dim=16"]


def _final(folder):
    ck = classy_state(Path(folder) / "model_final_checkpoint_phase1.torch")
    return {"model": ck["base_model"], "loss": ck["loss"], "optimizer": ck["optimizer"]}


def test_moco_trains_and_resumes_exactly_through_the_tool(tmp_path):
    """A MoCo run keeps encoder and queue in its checkpoints; resumed at step 3 of 8 it ends
    with the straight run's model, momentum encoder, queue and losses."""
    straight = tmp_path / "straight"
    r = run_tool([QUICK, f"config.CHECKPOINT.DIR={straight}", *SMALL])
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [json.loads(x)["train_loss"] for x in (straight / "metrics.json").read_text().splitlines()]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    state = _final(straight)
    model_w = state["model"]["model"]["trunk"]
    encoder_w = {k: v for k, v in state["loss"].items() if k.startswith("moco_encoder.")}
    assert encoder_w and int(state["loss"]["queue_ptr"]) == 0  # 8 steps x 4 keys into a queue of 8
    # the encoder trails the model: close to it, not equal
    wq = next(v for k, v in model_w.items() if k.endswith("weight"))
    wk = next(v for k, v in encoder_w.items() if "trunk" in k and k.endswith("weight"))
    assert wq.shape == wk.shape and not torch.equal(wq, wk)
    assert torch.allclose(state["loss"]["queue"].norm(dim=0), torch.ones(8), atol=1e-5)
    resumed = tmp_path / "resumed"
    r = run_tool([QUICK, f"config.CHECKPOINT.DIR={resumed}", *SMALL,
                  f"config.CHECKPOINT.RESUME_FROM={straight / 'model_iteration3.torch'}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert_bitwise_equal(_final(straight), _final(resumed))


def test_two_ranks_share_one_queue_and_shuffle_the_key_batch(tmp_path):
    """2 gloo ranks x 2 images: keys gathered from both ranks enter the queue (4 per step), with
    the key batch shuffled across ranks (no SyncBatchNorm)."""
    folder = tmp_path / "two"
    r = run_tool([QUICK, f"config.CHECKPOINT.DIR={folder}", *SMALL, "config.DISTRIBUTED.NUM_PROC_PER_NODE=2",
                  "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=2", "config.OPTIMIZER.num_epochs=1",
                  "config.LOSS.moco_loss.queue_size=12"])
    assert r.returncode == 0, r.stderr[-3000:]
    ck = classy_state(folder / "model_final_checkpoint_phase0.torch")
    assert int(ck["loss"]["queue_ptr"]) == (4 * 4) % 12  # 4 steps of 4 gathered keys


def _straight_and_resumed(tmp_path, args, checkpoint):
    """(folder of a run of ``args``, folder of the same run resumed from its ``checkpoint``)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    r = run_tool([*args, f"config.CHECKPOINT.DIR={straight}"])
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_tool([*args, f"config.CHECKPOINT.DIR={resumed}", f"config.CHECKPOINT.RESUME_FROM={straight / checkpoint}"])
    assert r.returncode == 0, r.stderr[-3000:]
    return straight, resumed


def test_two_ranks_test_with_the_encoder_statistics_a_checkpoint_holds(tmp_path):
    """A test phase runs the momentum encoder on its running BatchNorm statistics, which each
    rank's training moved with its own keys; every rank tests with rank 0's, those a checkpoint
    holds, so a run resumed after its first train phase logs the uninterrupted run's test losses. Was:
    2.34595 against 2.34147 in the first test phase (rank 1 tested with its own statistics)."""
    test = ("+config.DATA.TEST={DATA_SOURCES:[synthetic],LABEL_TYPE:sample_index,DATA_LIMIT:8,BATCHSIZE_PER_REPLICA:4,"
            "COLLATE_FUNCTION:moco_collator,TRANSFORMS:[{name:ImgReplicatePil,num_times:2},{name:ToTensor}]}")
    args = [QUICK, *SMALL, "config.MODEL.TRUNK.MLP.USE_BN=true", "config.TEST_MODEL=true", test,
            "config.DISTRIBUTED.NUM_PROC_PER_NODE=2", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=2"]
    straight, resumed = _straight_and_resumed(tmp_path, args, "model_phase0.torch")
    tests = [[json.loads(x)["test_loss"] for x in (folder / "metrics.json").read_text().splitlines() if "test_loss" in x]
             for folder in (straight, resumed)]
    assert len(tests[0]) == 2 and tests[0] == tests[1]  # the checkpoint precedes the first test phase


@pytest.mark.parametrize("extra, line", [
    # 2 ranks, 19 images each after padding: batches of 4, 4, 4, 4 and a last one of 3 (6 keys)
    (["config.DISTRIBUTED.NUM_PROC_PER_NODE=2", "config.DATA.TRAIN.DATA_LIMIT=37", "config.DATA.TRAIN.DROP_LAST=false"],
     "config.LOSS.moco_loss.queue_size=8 must be a multiple of the keys of every step, but the last step of each "
     "epoch holds 6 (3 per rank x 2 ranks, what is left of the data after the full batches): set "
     "config.DATA.TRAIN.DROP_LAST=true to leave it out"),
    # 18 images: batches of 4, 4, 4, 4 and a last one of 2, which divides the queue of 8 but leaves
    # its pointer at 2: the next epoch's second step (keys 6..10) reached past its end
    (["config.DATA.TRAIN.DATA_LIMIT=18", "config.DATA.TRAIN.DROP_LAST=false"],
     "config.LOSS.moco_loss.queue_size=8 takes the keys of whole steps of 4 from the start of the queue, but the "
     "last step of each epoch holds 2 (2 per rank x 1 rank, what is left of the data after the full batches): "
     "after it the next epoch's steps would reach past the queue's end; set config.DATA.TRAIN.DROP_LAST=true"),
    (["config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=3"],
     "config.LOSS.moco_loss.queue_size=8 must be a multiple of the global batch (3 keys per step: "
     "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=3 x 1 rank), as in VISSL"),
])
def test_a_step_whose_keys_do_not_fit_the_queue_is_refused_before_launch(tmp_path, extra, line):
    """Was: the short last batch of an epoch (DROP_LAST false) failed at the end of the first
    epoch, after its training, blaming "BATCHSIZE_PER_REPLICA x ranks" (4 x 2 = 8 divides the
    queue; the step had 6 keys); a global batch that does not divide failed at the first step."""
    folder = tmp_path / "run"
    r = run_tool([QUICK, f"config.CHECKPOINT.DIR={folder}", *SMALL, "config.OPTIMIZER.num_epochs=1", *extra])
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stderr.strip().startswith(f"error: {line}"), r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1 and not folder.exists(), r.stderr[-2000:]


def test_two_ranks_resume_exactly_while_the_initial_queue_is_still_in_use(tmp_path):
    """Resumed at step 3 of 4 (12 of the queue's 16 keys replaced): the same final state as the
    straight run (each rank drew its own initial queue; a checkpoint gives every rank rank 0's)."""
    args = [QUICK, *SMALL, "config.DISTRIBUTED.NUM_PROC_PER_NODE=2", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=2",
            "config.LOSS.moco_loss.queue_size=16"]
    straight, resumed = _straight_and_resumed(tmp_path, args, "model_iteration3.torch")
    assert_bitwise_equal(_final(straight), _final(resumed))
