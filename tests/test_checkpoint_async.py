"""Checkpoints written in the background (CHECKPOINT.ASYNC_WRITE): the snapshot, the writer
thread, its errors, the waits at the end of a run, and the same files as a synchronous run."""

import copy
import errno
import io
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from conftest import assert_bitwise_equal, run_tool
from ssl_engine import checkpoint as ck
from ssl_engine import distributed as du
from ssl_engine.config import compose
from ssl_engine.engines.run import load_builtin_parts
from ssl_engine.errors import CheckpointError
from ssl_engine.hooks import CheckpointHook, MetricsHook, SSLHook
from ssl_engine.hooks.checkpoint_hook import build_checkpoint, write_checkpoint
from ssl_engine.trainer import SelfSupervisionTrainer

load_builtin_parts()

# 32 train samples in batches of 8 (4 iterations per epoch), an mlp trunk with BatchNorm.
TINY = """# @package _global_
engine_name: train
config:
  LOG_FREQUENCY: 2
  TEST_MODEL: false
  SEED_VALUE: 0
  DATA:
    NUM_DATALOADER_WORKERS: 0
    PIN_MEMORY: false
    TRAIN:
      DATA_SOURCES: [synthetic]
      LABEL_SOURCES: [synthetic]
      DATA_LIMIT: 32
      BATCHSIZE_PER_REPLICA: 8
      SYNTHETIC_IMAGE_SIZE: 8
      SYNTHETIC_NUM_CLASSES: 4
      TRANSFORMS: [{name: ToTensor}]
  METERS:
    names: [accuracy_list_meter]
    accuracy_list_meter: {num_meters: 1, topk_values: [1]}
  MACHINE: {DEVICE: cpu}
  MODEL:
    TRUNK: {NAME: mlp, MLP: {DIMS: [192, 32], USE_BN: true}}
    HEAD: {PARAMS: [[mlp, {dims: [32, 4]}]]}
  LOSS: {name: cross_entropy_multiple_output_single_target}
  OPTIMIZER:
    name: sgd
    num_epochs: 2
    momentum: 0.9
    param_schedulers: {lr: {name: constant, value: 0.1}}
  DISTRIBUTED: {NUM_NODES: 1, NUM_PROC_PER_NODE: 1, BACKEND: gloo}
"""


@pytest.fixture(autouse=True)
def no_write_left_in_flight():
    """Every test starts and ends with the process's writer idle."""
    ck.wait_for_checkpoint_writes()
    yield
    ck.settle_checkpoint_writes()


@pytest.fixture
def cfg(tmp_path: Path):
    yaml = tmp_path / "tiny.yaml"
    yaml.write_text(TINY)

    def make(*overrides: str):
        return compose([f"config={yaml}", f"config.CHECKPOINT.DIR={tmp_path / 'run'}", *overrides])

    return make


def trainer_for(cfg: Any, hooks: List[Any]) -> SelfSupervisionTrainer:
    Path(cfg.CHECKPOINT.DIR).mkdir(parents=True, exist_ok=True)
    du.seed_everything(cfg.SEED_VALUE)
    return SelfSupervisionTrainer(cfg, checkpoint_folder=cfg.CHECKPOINT.DIR, hooks=hooks)


def hooks_of(cfg: Any) -> List[Any]:
    return [MetricsHook(cfg.CHECKPOINT.DIR),
            CheckpointHook(cfg.CHECKPOINT.CHECKPOINT_FREQUENCY, cfg.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY)]


def gate_writer(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The background writer waits for the returned event before it writes anything."""
    gate = threading.Event()
    real = ck.save_checkpoint

    def gated(*args: Any, **kwargs: Any) -> Path:
        assert gate.wait(60), "the test never opened the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(ck, "save_checkpoint", gated)
    return gate


def small_ckpt(value: float) -> Dict[str, Any]:
    return {"phase_idx": 0, "train_phase_idx": 0, "iteration": int(value), "iteration_num": int(value),
            "type": "iteration", "classy_state_dict": {"phase_idx": 0, "base_model": {"w": torch.full((3,), float(value))}}}


# ------------------------------------------------------------------------------------------------
# the snapshot


def test_snapshot_is_a_faithful_copy_that_later_updates_do_not_reach():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    base = torch.arange(10.0)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "views": [base[:4], base[4:], base],
             "param": torch.nn.Parameter(torch.ones(2)), "meta": {"list": [1, 2], "pair": (3, "x")}}
    before = io.BytesIO()
    torch.save(state, before)

    snap = ck.snapshot_state(state).ready()
    after = io.BytesIO()
    torch.save(snap, after)
    assert after.getvalue() == before.getvalue()  # torch.save writes exactly the same file
    assert snap["views"][0].untyped_storage().data_ptr() == snap["views"][2].untyped_storage().data_ptr()
    assert type(snap["model"]) is type(state["model"]) and isinstance(snap["param"], torch.nn.Parameter)

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        base.mul_(3.0)
    state["meta"]["list"].append(3)
    opt.step()
    torch.save(snap, after := io.BytesIO())
    assert after.getvalue() == before.getvalue()


def test_a_queued_checkpoint_holds_the_state_of_the_save_call(cfg, monkeypatch):
    c = cfg("config.CHECKPOINT.ASYNC_WRITE=true")
    task = trainer_for(c, hooks_of(c)).setup()

    def sgd_step() -> None:  # updates the parameters and the momentum buffers in place
        for p in task.base_model.parameters():
            p.grad = torch.ones_like(p)
        task.optimizer.step()

    sgd_step()
    gate = gate_writer(monkeypatch)
    expected = copy.deepcopy(build_checkpoint(task, "iteration")["classy_state_dict"])

    write_checkpoint(task, "model_iteration1.torch", "iteration")
    assert ck.checkpoint_write_in_flight()  # the call returned before the file was written
    sgd_step()  # training goes on: parameters, optimizer state and counters change
    task.iteration += 5
    changed = [k for k, v in task.base_model.state_dict().items() if v.is_floating_point()]
    assert changed and not torch.equal(task.base_model.state_dict()[changed[0]],
                                       expected["base_model"]["model"]["trunk"][changed[0].split(".", 1)[1]])
    gate.set()
    ck.wait_for_checkpoint_writes()

    saved = ck.load_checkpoint(Path(c.CHECKPOINT.DIR) / "model_iteration1.torch")["classy_state_dict"]
    for key in ("base_model", "optimizer", "loss", "meters", "rng", "iteration", "phase_idx"):
        assert_bitwise_equal(saved[key], expected[key], key)
    assert os.readlink(Path(c.CHECKPOINT.DIR) / ck.POINTER) == "model_iteration1.torch"


@pytest.mark.gpu
def test_snapshot_of_cuda_tensors_is_taken_before_later_kernels_change_them():
    device = torch.device("cuda")
    state = {"w": torch.randn(1024, 1024, device=device), "b": torch.arange(10.0, device=device)}
    expected = {k: v.cpu() for k, v in state.items()}
    snap = ck.snapshot_state(state)
    state["w"].mul_(2.0).add_(1.0)  # queued on the same stream, after the copies
    state["b"].zero_()
    copied = snap.ready()
    assert all(t.device.type == "cpu" for t in copied.values())
    assert torch.equal(copied["w"], expected["w"]) and torch.equal(copied["b"], expected["b"])


# ------------------------------------------------------------------------------------------------
# errors of the writer


class _TempFile:
    """The checkpoint's temporary file, with ``on_write`` run before each write."""

    def __init__(self, f: Any, on_write: Any) -> None:
        self._f, self._on_write = f, on_write

    def write(self, data: Any) -> int:
        self._on_write()
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> "_TempFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()


def patch_temp_files(monkeypatch: Any, on_write: Any) -> None:
    """Route the writes of every checkpoint temporary file through ``on_write``."""
    def fake_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = open(file, mode, *args, **kwargs)
        return _TempFile(f, on_write) if ".tmp." in os.path.basename(str(file)) and "w" in mode else f

    monkeypatch.setattr(ck, "open", fake_open, raising=False)


def disk_full() -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_background_write_stops_the_next_save_with_the_user_error(tmp_path, monkeypatch):
    ck.save_checkpoint(tmp_path, "model_iteration2.torch", small_ckpt(2))
    patch_temp_files(monkeypatch, disk_full)
    ck.save_checkpoint_async(tmp_path, "model_iteration4.torch", small_ckpt(4))  # returns: the error comes later
    with pytest.raises(CheckpointError) as err:
        ck.save_checkpoint_async(tmp_path, "model_iteration6.torch", small_ckpt(6))
    assert str(err.value) == (f"cannot write model_iteration4.torch in {tmp_path}: the disk is full; "
                              f"the previous files there are intact")
    monkeypatch.undo()
    assert not ck.checkpoint_write_in_flight()  # raised once; model_iteration6 was never queued
    ck.wait_for_checkpoint_writes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.torch", "model_iteration2.torch"]
    assert ck.load_checkpoint(tmp_path / ck.POINTER)["iteration"] == 2


def test_a_failed_background_write_is_raised_by_the_wait_at_the_end_of_the_run(cfg, tmp_path, monkeypatch):
    c = cfg()
    hook = CheckpointHook()
    task = trainer_for(c, [hook]).setup()
    patch_temp_files(monkeypatch, disk_full)
    write_checkpoint(task, "model_phase0.torch", "phase")
    with pytest.raises(CheckpointError) as err:
        hook.on_end(task)
    assert str(err.value).startswith(f"cannot write model_phase0.torch in {c.CHECKPOINT.DIR}: the disk is full")
    monkeypatch.undo()
    assert not [p.name for p in Path(c.CHECKPOINT.DIR).iterdir() if p.name.endswith(".torch")]
    ck.wait_for_checkpoint_writes()  # the error is raised once


def test_a_second_ctrl_c_abandons_the_write_in_flight(tmp_path, monkeypatch, caplog):
    ck.save_checkpoint(tmp_path, "model_iteration2.torch", small_ckpt(2))
    started, gate = threading.Event(), threading.Event()

    def slow_write() -> None:
        started.set()
        gate.wait(60)

    patch_temp_files(monkeypatch, slow_write)
    ck.save_checkpoint_async(tmp_path, "model_iteration4.torch", small_ckpt(4))
    assert started.wait(60)

    def interrupted() -> None:  # what a Ctrl-C during the wait of on_exception raises
        threading.Timer(0.2, gate.set).start()
        raise KeyboardInterrupt

    monkeypatch.setattr(ck._WRITER, "wait", interrupted)
    with caplog.at_level(logging.WARNING):
        ck.settle_checkpoint_writes()
    monkeypatch.undo()
    assert not ck.checkpoint_write_in_flight()
    assert "abandoned the write of model_iteration4.torch" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.torch", "model_iteration2.torch"]


# ------------------------------------------------------------------------------------------------
# the waits of a run


class InFlightAfterSave(SSLHook):
    """Records, after each step's checkpoint, whether its write was still in flight."""

    priority = 95

    def __init__(self) -> None:
        super().__init__()
        self.seen: List[bool] = []

    def on_step(self, task: Any) -> None:
        self.seen.append(ck.checkpoint_write_in_flight())


def test_train_returns_with_every_checkpoint_and_the_pointer_on_disk(cfg, monkeypatch):
    c = cfg("config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=1", "config.CHECKPOINT.KEEP_LAST=2")
    real = ck.save_checkpoint

    def slow(*args: Any, **kwargs: Any) -> Path:
        time.sleep(0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(ck, "save_checkpoint", slow)
    probe = InFlightAfterSave()
    trainer_for(c, hooks_of(c) + [probe]).train()
    assert not ck.checkpoint_write_in_flight()
    assert any(probe.seen), "no checkpoint was written in the background"
    folder = Path(c.CHECKPOINT.DIR)
    assert os.readlink(folder / ck.POINTER) == "model_final_checkpoint_phase1.torch"
    assert sorted(p.name for p in ck.list_checkpoints(folder)) == [
        "model_final_checkpoint_phase1.torch", "model_iteration7.torch", "model_iteration8.torch"]
    assert ck.load_checkpoint(folder / ck.POINTER)["iteration"] == 8
    assert not [p.name for p in folder.iterdir() if ".tmp." in p.name]


def test_on_end_waits_for_the_write_in_flight(cfg, monkeypatch):
    c = cfg()
    hook = CheckpointHook()
    task = trainer_for(c, [hook]).setup()
    gate = gate_writer(monkeypatch)
    write_checkpoint(task, "model_phase0.torch", "phase")
    threading.Timer(0.3, gate.set).start()
    hook.on_end(task)
    assert not ck.checkpoint_write_in_flight()
    assert os.readlink(Path(c.CHECKPOINT.DIR) / ck.POINTER) == "model_phase0.torch"


def test_async_write_false_and_other_ranks_write_nothing_in_the_background(cfg, monkeypatch):
    c = cfg("config.CHECKPOINT.ASYNC_WRITE=false")
    task = trainer_for(c, [CheckpointHook()]).setup()
    write_checkpoint(task, "model_phase0.torch", "phase")
    assert not ck.checkpoint_write_in_flight()  # on disk when the call returns
    assert os.readlink(Path(c.CHECKPOINT.DIR) / ck.POINTER) == "model_phase0.torch"
    task.config.CHECKPOINT.ASYNC_WRITE = True
    monkeypatch.setattr(du, "is_primary", lambda: False)  # a rank other than 0 builds the state only
    write_checkpoint(task, "model_phase1.torch", "phase")
    assert not ck.checkpoint_write_in_flight() and not (Path(c.CHECKPOINT.DIR) / "model_phase1.torch").exists()


# ------------------------------------------------------------------------------------------------
# through the tool: the same files with and without the background writer


RUN = [
    "config=quick/supervised_digits",
    "config.DATA.TRAIN.DATA_LIMIT=48",
    "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=16",
    "config.DATA.TEST.DATA_LIMIT=32",
    "config.DATA.TEST.BATCHSIZE_PER_REPLICA=16",
    "config.MODEL.TRUNK.NAME=mlp",
    "config.MODEL.TRUNK.MLP.DIMS=[3072,16]",
    "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[16,10]}]]",
    "config.OPTIMIZER.num_epochs=3",
    "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=2",
    "config.CHECKPOINT.KEEP_LAST=3",
    "config.HOOKS.BEST_CHECKPOINT.METRIC=test_loss",
    "config.HOOKS.BEST_CHECKPOINT.MODE=min",
]


@pytest.mark.slow
def test_async_and_synchronous_runs_write_the_same_checkpoints(tmp_path):
    folders = {}
    for flag in ("true", "false"):
        folder = tmp_path / f"async_{flag}"
        r = run_tool(RUN + [f"config.CHECKPOINT.DIR={folder}", f"config.CHECKPOINT.ASYNC_WRITE={flag}"])
        assert r.returncode == 0, r.stderr[-3000:]
        folders[flag] = folder
    names = {flag: sorted(p.name for p in f.glob("*.torch")) for flag, f in folders.items()}
    assert names["true"] == names["false"] and "model_best.torch" in names["true"], names
    assert os.readlink(folders["true"] / ck.POINTER) == os.readlink(folders["false"] / ck.POINTER)
    for name in names["true"]:
        assert_bitwise_equal(ck.load_checkpoint(folders["true"] / name), ck.load_checkpoint(folders["false"] / name), name)


def test_one_writer_thread_serves_every_checkpoint(tmp_path: Path) -> None:
    """Starting a thread per checkpoint cost the training thread milliseconds at each phase end:
    successive background writes run on the same thread, and that thread is a daemon (an idle
    writer never keeps the process alive)."""
    writers: List[threading.Thread] = []
    state = {"w": torch.arange(4.0)}
    for i in range(3):
        ck.save_checkpoint_async(tmp_path, f"model_phase{i}.torch", {"classy_state_dict": state},
                                 on_saved=lambda _path: writers.append(threading.current_thread()))
    ck.wait_for_checkpoint_writes()
    assert len(writers) == 3 and len({id(t) for t in writers}) == 1  # the list keeps them: ids are not reused
    assert writers[0] is not threading.main_thread() and writers[0].daemon
    assert (tmp_path / "model_phase2.torch").is_file()


def test_a_write_in_flight_when_the_process_ends_is_finished_first(tmp_path: Path) -> None:
    """The writer thread is a daemon, so the interpreter would kill it at exit: the exit hook
    waits for the write in flight, and the file is there after the process has ended."""
    import subprocess
    import sys

    script = (
        "import time, torch\n"
        "from ssl_engine import checkpoint as ck\n"
        "real = ck._torch_save_to\n"
        "def slow(*a, **k):\n"
        "    time.sleep(1.0)\n"
        "    return real(*a, **k)\n"
        "ck._torch_save_to = slow\n"
        f"ck.save_checkpoint_async({str(tmp_path)!r}, 'model_phase0.torch', {{'classy_state_dict': {{'w': torch.ones(3)}}}})\n"
        "print('leaving', flush=True)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "leaving" in r.stdout, r.stderr[-2000:]
    assert torch.load(tmp_path / "model_phase0.torch")["classy_state_dict"]["w"].tolist() == [1.0, 1.0, 1.0]
    assert (tmp_path / "checkpoint.torch").exists()
