"""CUDA paths: AMP float16 with GradScaler through the real tool, resume across devices, NCCL.

Every test here is marked ``gpu`` and is skipped without CUDA (conftest). Run them on a GPU
machine with ``pytest -m gpu``. Tests that need two GPUs say so in their skip reason.
"""

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

from conftest import run_tool

pytestmark = pytest.mark.gpu

# Supervised resnet18 on 512 digits at 32x32: 8 steps per epoch, a test phase after each epoch.
DIGITS = [
    "config=quick/supervised_digits",
    "config.DATA.TRAIN.DATA_LIMIT=512",
    "config.DATA.TEST.DATA_LIMIT=256",
    "config.LOG_FREQUENCY=2",
]


def _metrics(folder: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in (folder / "metrics.json").read_text().splitlines()]


def _checkpoint(path: Path) -> Dict[str, Any]:
    return torch.load(str(path), map_location="cpu", weights_only=False)["classy_state_dict"]


def _ok(proc: Any) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


def _crash_after_the_first_epoch(folder: Path) -> None:
    """Leave ``folder`` as a run killed during its last epoch leaves it: model_phase0 is the newest."""
    (folder / "model_final_checkpoint_phase1.torch").unlink()
    link = folder / "checkpoint.torch"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to("model_phase0.torch")


def test_amp_float16_trains_with_a_grad_scaler_and_resumes_its_state(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    args = [*DIGITS, "config.MACHINE.DEVICE=gpu", "config.MODEL.AMP_PARAMS.USE_AMP=true",
            f"config.CHECKPOINT.DIR={folder}", "config.OPTIMIZER.num_epochs=2"]
    _ok(run_tool(args))
    first = _checkpoint(folder / "model_phase0.torch")
    scaler = first["amp"]
    assert scaler and scaler["scale"] > 0 and "_growth_tracker" in scaler, f"no GradScaler state saved: {scaler}"
    # autocast computes in float16, the weights the optimizer updates stay float32
    dtypes = {v.dtype for v in first["base_model"]["model"]["trunk"].values() if v.is_floating_point()}
    assert dtypes == {torch.float32}
    assert all(r["train_loss"] == r["train_loss"] for r in _metrics(folder) if "train_loss" in r)  # no NaN
    accuracy = [r["test_accuracy_list_meter"]["top_1"]["0"] for r in _metrics(folder) if "test_accuracy_list_meter" in r]
    assert len(accuracy) == 2 and all(0.0 <= a <= 100.0 for a in accuracy), accuracy
    whole = _checkpoint(folder / "model_final_checkpoint_phase1.torch")["amp"]

    # killed during epoch 2: the resumed run must continue with the saved scaler, not a new one
    _crash_after_the_first_epoch(folder)
    again = run_tool(args)
    _ok(again)
    assert "resum" in (again.stdout + again.stderr).lower()
    resumed = _checkpoint(folder / "model_final_checkpoint_phase1.torch")
    assert resumed["iteration"] == 2 * first["iteration"]
    assert (resumed["amp"]["scale"], resumed["amp"]["_growth_tracker"]) == (whole["scale"], whole["_growth_tracker"]), (
        f"scaler after the resumed epoch {resumed['amp']} differs from the uninterrupted run's {whole} "
        f"(saved after epoch 1: {scaler})"
    )


def test_the_grad_scaler_skips_an_overflowing_step_and_lowers_the_scale(tmp_path: Path) -> None:
    from ssl_engine.config.compose import compose
    from ssl_engine.hooks.callback_hook import CallbackHook
    from ssl_engine.trainer import SelfSupervisionTrainer

    cfg = compose([*DIGITS, "config.MACHINE.DEVICE=gpu", "config.MODEL.AMP_PARAMS.USE_AMP=true",
                   "config.OPTIMIZER.num_epochs=1", "config.TEST_MODEL=false", f"config.CHECKPOINT.DIR={tmp_path}"])
    seen: Dict[str, Any] = {}

    def before(task: Any) -> None:
        if task.iteration == 3:  # 2**100: every scaled float16 gradient overflows
            task.grad_scaler.update(2.0**100)
            seen["params"] = [p.detach().clone() for p in task.base_model.parameters()]

    def after(task: Any) -> None:
        if "params" in seen and "scale" not in seen:
            seen["scale"] = task.grad_scaler.get_scale()
            seen["same"] = all(torch.equal(a, b) for a, b in zip(seen["params"], task.base_model.parameters()))

    trainer = SelfSupervisionTrainer(cfg, checkpoint_folder=str(tmp_path),
                                     hooks=[CallbackHook(on_forward=before, on_update=after)])
    task = trainer.train()
    assert task.grad_scaler is not None and task.amp_dtype == torch.float16
    assert seen["same"], "the optimizer stepped on inf gradients: the step must go through GradScaler.step"
    assert seen["scale"] == 2.0**99, "an overflow halves the scale"
    assert all(torch.isfinite(p).all() for p in task.base_model.parameters())


def test_the_deferred_loss_check_waits_for_its_own_loss_on_a_busy_gpu() -> None:
    """The flag is read one step late from pinned memory: the read must wait for the copy
    even when the GPU is still busy with earlier work (a tiny training model never is)."""
    from types import SimpleNamespace

    from ssl_engine.errors import NonFiniteLossError
    from ssl_engine.train_steps.standard_train_step import check_finite_loss, confirm_finite_loss

    task = SimpleNamespace(pending_loss_check=None, last_model_output=None, last_batch=None, iteration=5,
                           phase_idx=0, phase_type="train", local_iteration_num=5)
    check_finite_loss(task, torch.ones((), device="cuda"))
    confirm_finite_loss(task)  # the pinned flag now holds True
    torch.cuda._sleep(1_000_000_000)  # the GPU spins for a while before the NaN is computed
    check_finite_loss(task, torch.zeros((), device="cuda") / torch.zeros((), device="cuda"))
    with pytest.raises(NonFiniteLossError, match="the loss is nan at iteration 5"):
        confirm_finite_loss(task)


def test_a_gpu_checkpoint_resumes_on_the_cpu(tmp_path: Path) -> None:
    """Train on a GPU node, continue on a laptop: the checkpoint carries CUDA RNG and optimizer state."""
    folder = tmp_path / "run"
    args = [*DIGITS, f"config.CHECKPOINT.DIR={folder}", "config.OPTIMIZER.num_epochs=2"]
    _ok(run_tool([*args, "config.MACHINE.DEVICE=gpu"]))
    _crash_after_the_first_epoch(folder)
    proc = run_tool([*args, "config.MACHINE.DEVICE=cpu"])
    _ok(proc)
    assert "resum" in (proc.stdout + proc.stderr).lower()
    last = _checkpoint(folder / "model_final_checkpoint_phase1.torch")
    assert last["iteration"] == 16  # 512 samples / 64 per batch x 2 epochs
    assert all(not v.is_cuda for v in last["base_model"]["model"]["trunk"].values())


def test_nccl_gather_with_grad_and_cpu_collectives_in_one_group(tmp_path: Path, monkeypatch: Any) -> None:
    """The group a GPU rank joins: CUDA tensors over NCCL, CPU tensors (preemption vote, loss
    sums) over gloo. One rank is all one GPU allows; the two-GPU run is the test below."""
    from ssl_engine import gather
    from ssl_engine.distributed import RankInfo, destroy_process_group, init_process_group

    info = RankInfo(rank=0, local_rank=0, world_size=1, backend="nccl", init_method=f"file://{tmp_path / 'rdzv'}")
    # the engine skips the group for one process; joining it anyway shows what a GPU rank gets
    monkeypatch.setattr(info, "world_size", 2)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: _join_alone(kw))
    init_process_group(info, 1)
    try:
        assert "nccl" in str(dist.get_backend()) and "gloo" in str(dist.get_backend())
        collectives: List[str] = []
        for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_gather", "all_reduce"):
            real = getattr(dist, name)
            monkeypatch.setattr(gather.dist, name, lambda *a, _n=name, _f=real, **k: collectives.append(_n) or _f(*a, **k))
        x = torch.randn(4, 3, device="cuda", requires_grad=True)
        out = gather._GatherWithGrad.apply(x, None)
        assert out.is_cuda and torch.equal(out, x)
        (out * 2).sum().backward()
        assert torch.equal(x.grad, torch.full_like(x, 2.0))
        assert collectives == ["all_gather_into_tensor", "reduce_scatter_tensor"], (
            f"CUDA tensors must take the single-tensor NCCL collectives, took {collectives}"
        )
        cpu = torch.tensor([1.0, 2.0])
        dist.all_reduce(cpu)  # raises on an NCCL-only group
        assert cpu.tolist() == [1.0, 2.0]
    finally:
        destroy_process_group()


def test_accuracy_counts_are_all_reduced_on_the_cpu_whatever_rank_saw_samples(monkeypatch: Any) -> None:
    """A rank that saw no test sample (a split smaller than the world) keeps its counts on the
    CPU while the others' are on their GPU; on the engine's nccl + gloo group those would enter
    different collectives and wait until the timeout. Every rank reduces on the CPU."""
    from classy_vision.meters import accuracy_meter

    from ssl_engine.meters.topk_list_meter import DeviceAccuracyMeter

    devices: List[str] = []
    monkeypatch.setattr(accuracy_meter, "all_reduce_sum", lambda t: devices.append(t.device.type) or t)
    busy, idle = DeviceAccuracyMeter(topk=[1, 2]), DeviceAccuracyMeter(topk=[1, 2])
    busy.update(torch.tensor([[0.9, 0.1, 0.0], [0.2, 0.7, 0.1]], device="cuda"), torch.tensor([0, 2], device="cuda"))
    for meter in (busy, idle):
        meter.sync_state()
    assert devices == ["cpu"] * 4, devices
    assert busy.value == {"top_1": 0.5, "top_2": 0.5}
    busy.update(torch.tensor([[0.1, 0.9, 0.0]], device="cuda"), torch.tensor([1], device="cuda"))  # back on the GPU
    assert busy._curr_correct_predictions_k.is_cuda and busy.value["top_1"] == pytest.approx(2 / 3)


def _join_alone(kwargs: Dict[str, Any]) -> None:
    """torch's init_process_group with the engine's arguments, but a group of this process alone."""
    from torch.distributed import distributed_c10d

    kwargs = dict(kwargs, world_size=1, rank=0)
    distributed_c10d.init_process_group(**kwargs)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL refuses two ranks on one GPU)")
def test_two_gpu_ranks_train_over_nccl_through_the_tool(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    _ok(run_tool([*DIGITS, "config.MACHINE.DEVICE=gpu", "config.DISTRIBUTED.NUM_PROC_PER_NODE=2",
                  "config.MODEL.AMP_PARAMS.USE_AMP=true", "config.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN=true",
                  f"config.CHECKPOINT.DIR={folder}", "config.OPTIMIZER.num_epochs=1"]))
    last = _checkpoint(folder / "model_final_checkpoint_phase0.torch")
    assert last["world_size"] == 2 and last["iteration"] == 4  # 512 samples / (64 per rank x 2 ranks)
    # SimCLR gathers every rank's embeddings (gather_with_grad) over NCCL
    simclr = tmp_path / "simclr"
    _ok(run_tool(["config=quick/simclr_digits", "config.MACHINE.DEVICE=gpu", "config.DISTRIBUTED.NUM_PROC_PER_NODE=2",
                  "config.DATA.TRAIN.DATA_LIMIT=256", "config.OPTIMIZER.num_epochs=1", f"config.CHECKPOINT.DIR={simclr}"]))
    assert all(r["train_loss"] == r["train_loss"] for r in _metrics(simclr) if "train_loss" in r)
