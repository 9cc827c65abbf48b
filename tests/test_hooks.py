"""Tests of the hook library (ssl_engine/hooks): one test (or a few) per hook that fails if the
hook stops doing its job, in-process against a small real task, plus end-to-end runs of the
tool for resume and for two ranks."""

import io
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch

from conftest import run_tool
from ssl_engine import distributed as du
from ssl_engine.config import compose
from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.engines.run import load_builtin_parts
from ssl_engine.errors import NonFiniteLossError, UserError
from ssl_engine.hooks import (
    BestCheckpointer,
    CallbackHook,
    CheckpointHook,
    EMAModelHook,
    EvalHook,
    IterationTimer,
    MetricsHook,
    ModelComplexityHook,
    NaNCheckHook,
    ParamGroupsHook,
    PerfStatsHook,
    PreciseBNHook,
    Priority,
    ProgressBarHook,
    SSLHook,
    TempFrozenParamsHook,
    TorchMemoryStatsHook,
    TorchProfilerHook,
    custom_hooks,
    default_hooks,
    order_hooks,
    parse_priority,
)
from ssl_engine.hooks.metrics_hook import read_metrics
from ssl_engine.hooks.progress_bar import progress_bar_wanted
from ssl_engine.hooks.tensorboard import read_scalars
from ssl_engine.trainer import SelfSupervisionTrainer

load_builtin_parts()

# 64 train samples in batches of 16 (4 iterations per epoch), 32 test samples (2 batches);
# an mlp trunk with BatchNorm on 8x8 synthetic images.
TINY = """# @package _global_
engine_name: train
config:
  LOG_FREQUENCY: 2
  TEST_MODEL: true
  SEED_VALUE: 0
  MULTI_PROCESSING_METHOD: fork
  DATA:
    NUM_DATALOADER_WORKERS: 0
    PIN_MEMORY: false
    TRAIN:
      DATA_SOURCES: [synthetic]
      LABEL_SOURCES: [synthetic]
      DATA_LIMIT: 64
      BATCHSIZE_PER_REPLICA: 16
      SYNTHETIC_IMAGE_SIZE: 8
      SYNTHETIC_NUM_CLASSES: 4
      TRANSFORMS: [{name: ToTensor}]
    TEST:
      DATA_SOURCES: [synthetic]
      LABEL_SOURCES: [synthetic]
      DATA_LIMIT: 32
      BATCHSIZE_PER_REPLICA: 16
      SYNTHETIC_IMAGE_SIZE: 8
      SYNTHETIC_NUM_CLASSES: 4
      TRANSFORMS: [{name: ToTensor}]
  METERS:
    names: [accuracy_list_meter]
    accuracy_list_meter: {num_meters: 1, topk_values: [1]}
  MACHINE: {DEVICE: cpu}
  MODEL:
    TRUNK:
      NAME: mlp
      MLP: {DIMS: [192, 32], USE_BN: true, USE_RELU: true}
    HEAD:
      PARAMS: [[mlp, {dims: [32, 4]}]]
  LOSS: {name: cross_entropy_multiple_output_single_target}
  OPTIMIZER:
    name: sgd
    num_epochs: 2
    momentum: 0.9
    weight_decay: 0.001
    param_schedulers: {lr: {name: cosine, start_value: 0.1, end_value: 0.001, update_interval: step}}
  DISTRIBUTED: {NUM_NODES: 1, NUM_PROC_PER_NODE: 1, BACKEND: gloo}
  CHECKPOINT: {DIR: .}
"""
TRAIN_ITERS_PER_EPOCH = 4
TEST_ITERS = 2


@pytest.fixture(scope="module")
def tiny_yaml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("cfg") / "tiny.yaml"
    p.write_text(TINY)
    return p


def make_cfg(tiny_yaml: Path, folder: Path, *overrides: str) -> AttrDict:
    return compose([f"config={tiny_yaml}", f"config.CHECKPOINT.DIR={folder}", *overrides])


def base_hooks(cfg: AttrDict) -> List[Any]:
    """The hooks every run needs to behave like the tool's (metrics + checkpoints), no extras."""
    return [MetricsHook(cfg.CHECKPOINT.DIR), CheckpointHook(cfg.CHECKPOINT.CHECKPOINT_FREQUENCY,
                                                         cfg.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY)]


def train(cfg: AttrDict, hooks: List[Any], checkpoint_path: Optional[str] = None) -> Any:
    """Run the trainer in this process with exactly ``hooks``; returns the task."""
    Path(cfg.CHECKPOINT.DIR).mkdir(parents=True, exist_ok=True)
    du.seed_everything(cfg.SEED_VALUE)
    trainer = SelfSupervisionTrainer(cfg, checkpoint_path=checkpoint_path, checkpoint_folder=cfg.CHECKPOINT.DIR,
                                     hooks=hooks)
    return trainer.train()


def setup_task(cfg: AttrDict, hooks: List[Any]) -> Any:
    """A prepared task (model, data, optimizer, hooks installed) that has not trained."""
    Path(cfg.CHECKPOINT.DIR).mkdir(parents=True, exist_ok=True)
    du.seed_everything(cfg.SEED_VALUE)
    trainer = SelfSupervisionTrainer(cfg, checkpoint_folder=cfg.CHECKPOINT.DIR, hooks=hooks)
    return trainer.setup()


def metrics(folder: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in (Path(folder) / "metrics.json").read_text().splitlines()]


def clone_state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Recorder(SSLHook):
    """Appends (name, event, iteration) to a shared list at the given events."""

    def __init__(self, name: str, log: List[Any], priority: int, events: List[str]) -> None:
        super().__init__()
        self.name, self.log, self.priority, self._events = name, log, priority, events

    def events_used(self) -> List[str]:
        return self._events

    def on_step(self, task: Any) -> None:
        self.log.append((self.name, "on_step", task.iteration))

    def on_phase_end(self, task: Any) -> None:
        self.log.append((self.name, "on_phase_end", task.phase_idx))


CALLS: List[str] = []


def record_start(task: Any) -> None:
    """A callable named from yaml in test_custom_hooks_from_yaml."""
    CALLS.append(f"start@{task.iteration}")


# ------------------------------------------------------------------ ordering, table, custom hooks


def test_priority_order_honoured_in_a_run(tiny_yaml: Path, tmp_path: Path, caplog: Any) -> None:
    cfg = make_cfg(tiny_yaml, tmp_path / "run", "config.OPTIMIZER.num_epochs=1", "config.TEST_MODEL=false")
    log: List[Any] = []
    hooks = [
        Recorder("low", log, Priority.LOW, ["on_step"]),
        Recorder("first_normal", log, Priority.NORMAL, ["on_step"]),
        Recorder("int5", log, 5, ["on_step"]),
        Recorder("second_normal", log, Priority.NORMAL, ["on_step", "on_phase_end"]),
        Recorder("high", log, Priority.HIGH, ["on_step"]),
    ]
    with caplog.at_level(logging.INFO):
        task = train(cfg, base_hooks(cfg) + hooks)
    steps = [name for name, ev, it in log if ev == "on_step" and it == 1]
    assert steps == ["int5", "high", "first_normal", "second_normal", "low"]
    assert sum(1 for _, ev, _ in log if ev == "on_step") == 5 * TRAIN_ITERS_PER_EPOCH
    # an event a hook does not use is never called for it
    assert [n for n, ev, _ in log if ev == "on_phase_end"] == ["second_normal"]
    # rank 0 logs the event table in run order, with priorities
    table = task.hook_table()
    assert "hooks by event" in caplog.text and table in caplog.text
    row = next(line for line in table.splitlines() if line.strip().startswith("on_step"))
    assert row.index("Recorder(5)") < row.index("Recorder(30)") < row.index("Recorder(50)") < row.index("Recorder(70)")
    assert row.index("Recorder(70)") < row.index("CheckpointHook(90)")


def test_parse_priority_and_order_hooks() -> None:
    assert parse_priority("very_high") == 10 and parse_priority("LOW") == 70 and parse_priority(42) == 42
    for bad in ("urgent", 101, -1, True, 3.5):
        with pytest.raises(UserError):
            parse_priority(bad)
    a, b, c = CallbackHook(priority="LOW"), CallbackHook(priority=0), CallbackHook()
    d = CallbackHook()  # ties keep registration order
    assert order_hooks([a, c, b, d]) == [b, c, d, a]


def test_custom_hooks_from_yaml(tiny_yaml: Path, tmp_path: Path) -> None:
    CALLS.clear()
    entry = f"{{name: CallbackHook, priority: VERY_HIGH, params: {{on_start: '{__name__}:record_start'}}}}"
    cfg = make_cfg(tiny_yaml, tmp_path / "run", f"config.HOOKS.CUSTOM=[{entry}]", "config.OPTIMIZER.num_epochs=1")
    hooks = custom_hooks(cfg)
    assert len(hooks) == 1 and hooks[0].priority == Priority.VERY_HIGH and hooks[0].events_used() == ["on_start"]
    train(cfg, base_hooks(cfg) + hooks)
    assert CALLS == ["start@0"]
    bad = make_cfg(tiny_yaml, tmp_path / "run2", "config.HOOKS.CUSTOM=[{name: EMAModelHook, params: {nope: 1}}]")
    with pytest.raises(UserError, match="EMAModelHook.*bad params"):
        custom_hooks(bad)
    with pytest.raises(UserError, match="unknown hook 'EMAHook'"):
        custom_hooks(make_cfg(tiny_yaml, tmp_path / "run3", "config.HOOKS.CUSTOM=[{name: EMAHook}]"))


def test_default_hooks_follow_the_config(tiny_yaml: Path, tmp_path: Path) -> None:
    names = lambda cfg: [type(h).__name__ for h in default_hooks(cfg)]  # noqa: E731
    plain = names(make_cfg(tiny_yaml, tmp_path))
    assert {"PeriodicWriterHook", "MetricsHook", "CheckpointHook", "IterationTimer"} <= set(plain)
    assert "NaNCheckHook" not in plain  # the train step checks the loss; the per-output check is opt-in
    assert "ProgressBarHook" not in plain  # pytest's stdout is not a terminal
    assert "TorchMemoryStatsHook" not in plain  # a CPU run
    full = names(make_cfg(
        tiny_yaml, tmp_path, "config.HOOKS.TENSORBOARD_SETUP.USE_TENSORBOARD=true", "config.HOOKS.LOG_PARAM_GROUPS=true",
        "config.HOOKS.BEST_CHECKPOINT.METRIC=test_loss", "config.HOOKS.PRECISE_BN.USE_PRECISE_BN=true",
        "config.HOOKS.EMA_MODEL.SAVE_EMA_MODEL=true", "config.HOOKS.MODEL_COMPLEXITY.COMPUTE_COMPLEXITY=true",
        "config.HOOKS.PERF_STATS.MONITOR_PERF_STATS=true", "config.PROFILING.RUNTIME_PROFILING.USE_PROFILER=true",
        "config.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP=[[heads,2]]", "config.HOOKS.CHECK_NAN=false",
        "config.HOOKS.ITERATION_TIMER.USE_TIMER=false",
    ))
    assert {"TensorboardParamsHook", "ParamGroupsHook", "BestCheckpointer", "PreciseBNHook", "EMAModelHook",
            "ModelComplexityHook", "PerfStatsHook", "TorchProfilerHook", "TempFrozenParamsHook"} <= set(full)
    assert "NaNCheckHook" not in full and "IterationTimer" not in full


# ------------------------------------------------------------------ CallbackHook, IterationTimer


def test_callback_hook_calls_only_given_events(tiny_yaml: Path, tmp_path: Path) -> None:
    seen: Dict[str, int] = {}

    def count(event: str) -> Any:
        return lambda task: seen.__setitem__(event, seen.get(event, 0) + 1)

    hook = CallbackHook(on_step=count("on_step"), on_phase_end=count("on_phase_end"), on_update=count("on_update"))
    assert hook.events_used() == ["on_update", "on_step", "on_phase_end"]
    cfg = make_cfg(tiny_yaml, tmp_path / "run")
    task = train(cfg, base_hooks(cfg) + [hook])
    assert seen == {"on_step": 2 * (TRAIN_ITERS_PER_EPOCH + TEST_ITERS), "on_phase_end": 4,
                    "on_update": 2 * TRAIN_ITERS_PER_EPOCH}
    assert hook.on_step not in task._hook_calls["on_forward"]
    with pytest.raises(UserError, match="unknown event on_stpe"):
        CallbackHook(on_stpe=print)
    with pytest.raises(UserError, match="no 'nope'"):
        CallbackHook(on_step="math:nope")
    assert CallbackHook(on_step="math.floor")._callbacks["on_step"] is math.floor


def test_iteration_timer(tiny_yaml: Path, tmp_path: Path, caplog: Any) -> None:
    cfg = make_cfg(tiny_yaml, tmp_path / "run")
    timer = IterationTimer(warmup_iters=3)
    with caplog.at_level(logging.INFO):
        task = train(cfg, base_hooks(cfg) + [timer])
    total = 2 * TRAIN_ITERS_PER_EPOCH
    assert timer.timed_iters == total - 3 and timer.timed_seconds > 0
    assert f"{total - 3} iterations in" in caplog.text and "s / it" in caplog.text
    assert "in hooks" in caplog.text
    # the task timed every hook because the timer asked for it
    assert task.hook_seconds["CheckpointHook"] > 0 and task.hook_seconds["MetricsHook"] > 0
    summary = timer.summary(task)
    assert summary["hook_seconds"] == pytest.approx(sum(v for k, v in task.hook_seconds.items() if k != "IterationTimer"))


def test_hook_timing_counts_every_call_also_of_hooks_that_work_every_n_steps(tiny_yaml: Path, tmp_path: Path) -> None:
    """The timer's hook seconds hold every call: a hook that takes 2 ms on every step and one that
    takes 20 ms on every 3rd iteration (like a log line every LOG_FREQUENCY) are both counted."""
    every = 3

    class SlowStep(SSLHook):
        def on_step(self, task: Any) -> None:
            time.sleep(0.002)

    class SlowEveryThird(SSLHook):
        def on_step(self, task: Any) -> None:
            if task.train and task.iteration % every == 0:
                time.sleep(0.02)

    cfg = make_cfg(tiny_yaml, tmp_path / "run")
    task = train(cfg, base_hooks(cfg) + [IterationTimer(), SlowStep(), SlowEveryThird()])
    steps = 2 * (TRAIN_ITERS_PER_EPOCH + TEST_ITERS)
    slow = (2 * TRAIN_ITERS_PER_EPOCH) // every
    assert slow >= 1
    assert steps * 0.002 <= task.hook_seconds["SlowStep"] <= steps * 0.002 * 5
    assert slow * 0.02 <= task.hook_seconds["SlowEveryThird"] <= slow * 0.02 * 5


def test_hooks_are_not_timed_without_the_timer(tiny_yaml: Path, tmp_path: Path) -> None:
    cfg = make_cfg(tiny_yaml, tmp_path / "run", "config.OPTIMIZER.num_epochs=1", "config.TEST_MODEL=false")
    task = train(cfg, base_hooks(cfg))
    assert not task._time_hooks and all(v == 0.0 for v in task.hook_seconds.values())


# ------------------------------------------------------------------ writers: TensorBoard, param groups


def test_tensorboard_events_read_back(tiny_yaml: Path, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = tmp_path / "run"
    cfg = make_cfg(tiny_yaml, folder, "config.HOOKS.TENSORBOARD_SETUP.USE_TENSORBOARD=true",
                   "config.HOOKS.TENSORBOARD_SETUP.LOG_PARAMS_EVERY_N_ITERS=4", "config.HOOKS.LOG_PARAM_GROUPS=true",
                   "config.HOOKS.ITERATION_TIMER.USE_TIMER=false", "config.HOOKS.CHECK_NAN=false")
    train(cfg, default_hooks(cfg))
    tb = folder / "tb_logs"
    files = list(tb.glob("events.out.tfevents.*"))
    assert len(files) == 1
    scalars = read_scalars(tb)
    # every LOG_FREQUENCY=2 iterations, and iteration 1 and every 5th up to 100 (VISSL's rule)
    assert [s for s, _ in scalars["Training/loss"]] == [1, 2, 4, 5, 6, 8]
    for key in ("lr", "data_time", "batch_time", "samples_per_sec", "peak_mem_mb", "avg_loss"):
        assert len(scalars[f"Training/{key}"]) == 6, key
    stdout = [json.loads(line) for line in (folder / "stdout.json").read_text().splitlines()]
    assert [v for _, v in scalars["Training/loss"]] == pytest.approx([r["loss"] for r in stdout], rel=1e-6)
    # per-phase values equal metrics.json's
    records = metrics(folder)
    test_acc = [r["test_accuracy_list_meter"]["top_1"]["0"] for r in records if "test_loss" in r]
    assert [v for _, v in scalars["Phase/test_accuracy_list_meter/top_1/0"]] == pytest.approx(test_acc)
    assert [s for s, _ in scalars["Phase/train_loss"]] == [4, 8]
    assert [s for s, _ in scalars["ParamGroups/0/lr"]] == list(range(8))
    acc = EventAccumulator(str(files[0]), size_guidance={"histograms": 0})
    acc.Reload()
    hist = acc.Tags()["histograms"]
    assert any(t.startswith("Parameters/trunk") for t in hist) and any(t.startswith("Gradients/heads") for t in hist)
    assert [e.step for e in acc.Histograms(next(t for t in hist if t.startswith("Parameters/")))] == [0, 4]


def test_param_groups_every_iteration_and_resume_truncation(tiny_yaml: Path, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    cfg = make_cfg(tiny_yaml, folder)
    hook = ParamGroupsHook(flush_every=3)
    task = train(cfg, base_hooks(cfg) + [hook])
    rows = [json.loads(line) for line in (folder / "param_groups.json").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(8))
    sched = task.optimizer.schedulers["lr"]
    for r in rows:
        assert r["groups"][0]["lr"] == pytest.approx(sched(r["iteration"] / task.max_iteration))
        assert r["groups"][0]["weight_decay"] == pytest.approx(0.001) and r["groups"][0]["momentum"] == 0.9
        assert r["groups"][1]["weight_decay"] == 0.0  # the not-regularized group
    # a run resumed at iteration 5 drops the lines it will write again
    task.iteration = 5
    hook.on_start(task)
    rows = [json.loads(line) for line in (folder / "param_groups.json").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3, 4]


# ------------------------------------------------------------------ progress bar


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal(tiny_yaml: Path, tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert progress_bar_wanted(FakeTerminal())
    assert not progress_bar_wanted(io.StringIO())
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    assert not progress_bar_wanted(FakeTerminal())
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("CI", "true")
    assert not progress_bar_wanted(FakeTerminal())

    stream = FakeTerminal()
    bar = ProgressBarHook(stream=stream, log_frequency=2)
    positions: List[Any] = []
    probe = CallbackHook(priority=Priority.HIGH,
                         on_phase_end=lambda t: positions.append((bar.bar.n, bar.bar.total, bar.bar.postfix)))
    cfg = make_cfg(tiny_yaml, tmp_path / "run", "config.OPTIMIZER.num_epochs=1")
    train(cfg, base_hooks(cfg) + [bar, probe])
    assert [p[:2] for p in positions] == [(TRAIN_ITERS_PER_EPOCH, TRAIN_ITERS_PER_EPOCH), (TEST_ITERS, TEST_ITERS)]
    assert all(p[2] and p[2].startswith("loss=") for p in positions)  # the loss shown every log_frequency steps
    out = stream.getvalue()
    assert "train phase 0" in out and "test phase 1" in out
    assert bar.bar is None  # closed at the phase end


# ------------------------------------------------------------------ BestCheckpointer


def scripted_best(tmp_path: Path, tiny_yaml: Path, mode: str, values: List[float]) -> List[Optional[float]]:
    """Feed ``values`` as the test metric of successive phases; return model_best's value after each."""
    cfg = make_cfg(tiny_yaml, tmp_path / mode)
    metrics_hook = MetricsHook(str(tmp_path / mode))
    best = BestCheckpointer("test_score/top_1", mode)
    task = setup_task(cfg, [metrics_hook, best])
    task.train = False
    path = tmp_path / mode / "model_best.torch"
    seen = []
    for i, v in enumerate(values):
        task.phase_idx, task.iteration = i, 10 * i
        metrics_hook.last_record = {"phase_idx": i, "iteration": 10 * i, "test_score": {"top_1": v}}
        best.on_phase_end(task)
        seen.append(torch.load(path, weights_only=True)["best_metric"]["value"] if path.exists() else None)
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["best_metric"]["iteration"] == ckpt["iteration"] == best.state.best_iteration
    assert ckpt["classy_state_dict"]["hooks"]["BestCheckpointer"]["best_value"] == seen[-1]
    assert not (tmp_path / mode / "checkpoint.torch").exists()  # never what a run resumes from
    return seen


def test_best_checkpointer_keeps_the_best_of_a_scripted_sequence(tiny_yaml: Path, tmp_path: Path) -> None:
    nan, inf = float("nan"), float("inf")
    assert scripted_best(tmp_path, tiny_yaml, "max", [nan, 0.5, 0.4, inf, 0.7, 0.7, -inf, 0.6, 0.9]) == \
        [None, 0.5, 0.5, 0.5, 0.7, 0.7, 0.7, 0.7, 0.9]
    assert scripted_best(tmp_path, tiny_yaml, "min", [3.0, nan, 4.0, 2.5, -inf, 2.5, 1.0]) == \
        [3.0, 3.0, 3.0, 2.5, 2.5, 2.5, 1.0]


def test_best_checkpointer_errors_and_state() -> None:
    with pytest.raises(UserError, match="MODE='best'"):
        BestCheckpointer("test_loss", "best")
    with pytest.raises(UserError, match="train_ or test_"):
        BestCheckpointer("accuracy", "max")
    b = BestCheckpointer("test_loss", "min")
    b.set_classy_state({"metric": "test_loss", "mode": "min", "best_value": 0.25, "best_iteration": 8,
                        "best_phase_idx": 3})
    assert b.get_classy_state()["best_value"] == 0.25 and b.is_better(0.2) and not b.is_better(0.3)


def test_best_checkpointer_in_a_run(tiny_yaml: Path, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    cfg = make_cfg(tiny_yaml, folder)
    best = BestCheckpointer("test_accuracy_list_meter.top_1.0", "max")
    train(cfg, base_hooks(cfg) + [best])
    accs = [(r["test_accuracy_list_meter"]["top_1"]["0"], r["iteration"]) for r in metrics(folder) if "test_loss" in r]
    top = max(a for a, _ in accs)
    first_top_iteration = next(it for a, it in accs if a == top)
    ckpt = torch.load(folder / "model_best.torch", weights_only=True)
    assert ckpt["best_metric"]["value"] == top and ckpt["best_metric"]["iteration"] == first_top_iteration
    assert ckpt["type"] == "best" and "base_model" in ckpt["classy_state_dict"]
    # a metric that is not in the record stops the run with the keys that exist
    bad = BestCheckpointer("test_acuracy_list_meter/top_1/0", "max")
    cfg2 = make_cfg(tiny_yaml, tmp_path / "run2", "config.OPTIMIZER.num_epochs=1")
    with pytest.raises(UserError, match="did you mean 'test_accuracy_list_meter/top_1/0'"):
        train(cfg2, base_hooks(cfg2) + [bad])


# ------------------------------------------------------------------ EvalHook


def test_eval_hook_schedule_and_records(tiny_yaml: Path, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    calls: List[Any] = []

    def evaluate(task: Any) -> Dict[str, Any]:
        task.base_model.eval()  # a careless eval function; the hook restores the mode
        calls.append(task.iteration)
        w = sum(float(p.detach().sum()) for p in task.base_model.parameters())
        return {"weight_sum": w, "nested": {"it": task.iteration}}

    hook = EvalHook(evaluate, every_n_iters=3, every_n_phases=0)
    modes: List[bool] = []
    probe = CallbackHook(priority=Priority.VERY_LOW + 5, on_step=lambda t: modes.append(t.base_model.training))
    cfg = make_cfg(tiny_yaml, folder)
    task = train(cfg, base_hooks(cfg) + [hook, probe])
    assert calls == [3, 6, 8]  # every 3 iterations and once at the end
    assert all(modes[i] for i in range(TRAIN_ITERS_PER_EPOCH))  # train mode restored after the eval at iteration 3
    lines = [json.loads(line) for line in (folder / "eval_metrics.json").read_text().splitlines()]
    assert [entry["iteration"] for entry in lines] == [3, 6, 8] and lines[-1]["nested/it"] == 8
    final_w = sum(float(p.detach().sum()) for p in task.base_model.parameters())
    assert lines[-1]["weight_sum"] == pytest.approx(final_w)
    ckpt = torch.load(folder / "model_final_checkpoint_phase1.torch", weights_only=True)
    assert ckpt["classy_state_dict"]["hooks"]["EvalHook"]["history"] == lines  # recorded before the checkpoint
    by_phase = EvalHook(lambda t: {"x": 1}, every_n_phases=1, at_end=False)
    cfg2 = make_cfg(tiny_yaml, tmp_path / "run2")
    train(cfg2, base_hooks(cfg2) + [by_phase])
    assert [e["iteration"] for e in by_phase.history] == [4, 8]
    with pytest.raises(TypeError, match="dict of numbers"):
        EvalHook(lambda t: 3.0).evaluate(task)


# ------------------------------------------------------------------ PreciseBN


def bn_of(task: Any) -> torch.nn.BatchNorm1d:
    return next(m for m in task.base_model.modules() if isinstance(m, torch.nn.BatchNorm1d))


def test_precise_bn_recomputes_running_stats(tiny_yaml: Path, tmp_path: Path) -> None:
    cfg = make_cfg(tiny_yaml, tmp_path / "run")
    hook = PreciseBNHook(num_iters=3)
    task = setup_task(cfg, [hook])
    bn = bn_of(task)
    inputs: List[torch.Tensor] = []
    handle = bn.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach().clone()))
    bn.running_mean.fill_(5.0)
    bn.running_var.fill_(7.0)
    task.train, task.train_phase_idx = True, 0
    task.base_model.eval()
    rng = torch.get_rng_state()
    hook.update(task)
    handle.remove()
    assert len(inputs) == 3  # NUM_ITERATIONS batches
    expected_mean = torch.stack([x.mean(0) for x in inputs]).mean(0)
    assert torch.allclose(bn.running_mean, expected_mean, atol=1e-5)
    batch_second = torch.stack([(x.double() ** 2).mean(0) for x in inputs]).mean(0)
    assert torch.allclose(bn.running_var.double(), batch_second - expected_mean.double() ** 2, rtol=0.1, atol=1e-3)
    assert bn.momentum == 0.1 and not task.base_model.training  # mode and momentum restored
    assert torch.equal(torch.get_rng_state(), rng)  # the run's random stream is untouched


def test_precise_bn_runs_before_the_checkpoint(tiny_yaml: Path, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    cfg = make_cfg(tiny_yaml, folder, "config.OPTIMIZER.num_epochs=3", "config.TEST_MODEL=false")
    before: List[torch.Tensor] = []
    after: List[torch.Tensor] = []
    grab = lambda out: lambda t: out.append(bn_of(t).running_mean.clone() if t.train else None)  # noqa: E731
    hooks = base_hooks(cfg) + [
        PreciseBNHook(num_iters=2, every_n_phases=2),
        CallbackHook(priority=Priority.NORMAL - 5, on_phase_end=grab(before)),
        CallbackHook(priority=Priority.VERY_LOW + 5, on_phase_end=grab(after)),
    ]
    train(cfg, hooks)
    # every 2nd train phase and the last: phases 1 and 2 changed, phase 0 untouched
    assert torch.equal(before[0], after[0])
    assert not torch.equal(before[1], after[1]) and not torch.equal(before[2], after[2])
    for phase, name in ((1, "model_phase1.torch"), (2, "model_final_checkpoint_phase2.torch")):
        trunk = torch.load(folder / name, weights_only=True)["classy_state_dict"]["base_model"]["model"]["trunk"]
        bn_mean = next(v for k, v in trunk.items() if k.endswith("running_mean"))
        assert torch.equal(bn_mean, after[phase])  # the checkpoint holds the precise statistics


# ------------------------------------------------------------------ EMA


def test_ema_equals_a_hand_computed_ema(tiny_yaml: Path, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    cfg = make_cfg(tiny_yaml, folder)
    ema = EMAModelHook(decay=0.8, every_n_iters=2, warmup_iters=2)
    snapshots: List[Any] = []
    start: Dict[str, torch.Tensor] = {}
    hooks = base_hooks(cfg) + [
        ema,
        CallbackHook(on_start=lambda t: start.update(clone_state(t.base_model))),
        CallbackHook(on_update=lambda t: snapshots.append((t.iteration + 1, clone_state(t.base_model)))),
    ]
    task = train(cfg, hooks)
    expected = {k: v.double() for k, v in start.items()}
    k = 0
    for done, weights in snapshots:
        if done % 2:
            continue
        d = 0.8 * min(1.0, k / 2)
        for name, w in weights.items():
            expected[name] = w.double() if not w.is_floating_point() else d * expected[name] + (1 - d) * w.double()
        k += 1
    assert ema.num_updates == k == TRAIN_ITERS_PER_EPOCH  # 8 iterations, every 2nd
    got = ema.ema_model.state_dict()
    for name, value in expected.items():
        assert torch.allclose(got[name].double(), value, rtol=1e-5, atol=1e-6), name
    assert any("running_mean" in n for n in got)  # BN statistics are averaged too
    final = torch.load(folder / "model_final_checkpoint_phase1.torch", weights_only=True)
    state = final["classy_state_dict"]["hooks"]["EMAModelHook"]
    assert state["num_updates"] == k
    for name, value in got.items():
        assert torch.equal(state["ema_model"][name], value), name
    assert not any(torch.equal(got[n], v) for n, v in clone_state(task.base_model).items() if "weight" in n)


def test_ema_meters_in_test_phases(tiny_yaml: Path, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    cfg = make_cfg(tiny_yaml, folder)
    train(cfg, base_hooks(cfg) + [EMAModelHook(decay=0.0, eval_test_phases=True)])  # decay 0: EMA == model
    tests = [r for r in metrics(folder) if "test_loss" in r]
    assert len(tests) == 2
    for r in tests:
        assert r["test_ema_accuracy_list_meter"] == r["test_accuracy_list_meter"]
    folder2 = tmp_path / "run2"
    cfg2 = make_cfg(tiny_yaml, folder2, "config.OPTIMIZER.num_epochs=1")
    train(cfg2, base_hooks(cfg2) + [EMAModelHook(decay=1.0, eval_test_phases=True)])  # decay 1: the initial model
    r = [r for r in metrics(folder2) if "test_loss" in r][0]
    assert "test_ema_accuracy_list_meter" in r and "train_ema_accuracy_list_meter" not in metrics(folder2)[0]


def test_ema_decay_is_checked() -> None:
    with pytest.raises(UserError, match="DECAY"):
        EMAModelHook(decay=1.5)
    with pytest.raises(UserError, match="EMA_DEVICE"):
        EMAModelHook(device="tpu")


# ------------------------------------------------------------------ model complexity, perf stats, profiler, memory


def test_model_complexity_counts(tiny_yaml: Path, tmp_path: Path, caplog: Any) -> None:
    cfg = make_cfg(tiny_yaml, tmp_path / "run")
    hook = ModelComplexityHook([3, 8, 8])
    task = setup_task(cfg, [hook])
    task.base_model.train()
    with caplog.at_level(logging.INFO):
        hook.on_start(task)
    r = hook.result
    assert r["params"] == sum(p.numel() for p in task.base_model.parameters())
    assert r["trainable_params"] == r["params"]
    assert r["flops_by_module"]["heads"] == 32 * 4  # one Linear 32 -> 4: 128 multiply-adds
    assert r["flops"] >= 192 * 32 + 32 * 4
    assert task.base_model.training  # mode restored
    assert "GFLOPs" in caplog.text
    wrong = ModelComplexityHook([3, 16, 16])  # the mlp trunk takes 3x8x8
    with caplog.at_level(logging.WARNING):
        wrong.on_start(task)
    assert "flops" not in wrong.result and "INPUT_SHAPE" in caplog.text


def test_perf_stats_breakdown(tiny_yaml: Path, tmp_path: Path) -> None:
    import time

    folder = tmp_path / "run"
    cfg = make_cfg(tiny_yaml, folder)
    slow_backward = CallbackHook(on_backward=lambda t: time.sleep(0.02))  # runs before the hook's mark
    train(cfg, base_hooks(cfg) + [PerfStatsHook(frequency=2), slow_backward])
    recs = metrics(folder)
    tr = [r["train_perf_stats"] for r in recs if "train_loss" in r]
    te = [r["test_perf_stats"] for r in recs if "test_loss" in r]
    assert len(tr) == 2 and len(te) == 2
    for s in tr:
        assert s["iterations"] == TRAIN_ITERS_PER_EPOCH
        assert s["backward_ms"] >= 20.0  # the sleep lands in the backward part
        assert s["forward_ms"] > 0 and s["step_ms"] > 0 and s["data_ms"] > 0
    for s in te:
        assert s["iterations"] == TEST_ITERS and s["backward_ms"] == 0 and s["step_ms"] == 0 and s["forward_ms"] > 0


def test_perf_stats_of_a_phase_resumed_after_a_crash_cover_the_whole_phase(tiny_yaml: Path, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    cfg = make_cfg(tiny_yaml, folder, "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=6", "config.CHECKPOINT.ASYNC_WRITE=false")

    def crash(task: Any) -> None:
        if task.iteration == 7:  # a crash after the iteration checkpoint of phase 1's 2nd iteration
            raise RuntimeError("crash")

    with pytest.raises(RuntimeError, match="crash"):
        train(cfg, base_hooks(cfg) + [PerfStatsHook(), CallbackHook(on_step=crash)])
    assert (folder / "model_iteration6.torch").exists()
    train(cfg, base_hooks(cfg) + [PerfStatsHook()], checkpoint_path=str(folder / "model_iteration6.torch"))
    train_stats = [r["train_perf_stats"] for r in metrics(folder) if "train_loss" in r]
    # was 2 for the resumed phase: only the iterations after the restart were counted
    assert [s["iterations"] for s in train_stats] == [TRAIN_ITERS_PER_EPOCH, TRAIN_ITERS_PER_EPOCH]
    assert all(s["forward_ms"] > 0 for s in train_stats)


def test_torch_profiler_writes_traces(tiny_yaml: Path, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    cfg = make_cfg(tiny_yaml, folder, "config.OPTIMIZER.num_epochs=1", "config.TEST_MODEL=false")
    out = folder / "profiling"
    hook = TorchProfilerHook(str(out), start_iteration=1, warmup_iterations=1, num_iterations=1)
    train(cfg, base_hooks(cfg) + [hook])
    assert hook.done and hook.profiler is None
    trace = json.loads((out / "chrome_trace_rank0.json").read_text())
    assert any("aten::" in str(e.get("name", "")) for e in trace["traceEvents"])
    assert len(list((out / "tb").glob("rank0.*.pt.trace.json"))) == 1
    assert "Name" in (out / "summary_rank0.txt").read_text()
    # a run resumed past the window does not profile again
    again = TorchProfilerHook(str(out), start_iteration=1, warmup_iterations=1, num_iterations=1)
    task = setup_task(cfg, [again])
    task.iteration = 3
    again.on_start(task)
    assert again.profiler is None


def test_memory_stats_is_a_no_op_on_cpu(tiny_yaml: Path, tmp_path: Path) -> None:
    hook = TorchMemoryStatsHook(use_cuda=True, log_every_n_iters=1)
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: see test_memory_stats_on_gpu")
    assert hook.events_used() == []
    cfg = make_cfg(tiny_yaml, tmp_path / "run")
    task = setup_task(cfg, [hook])
    assert all(getattr(fn, "__self__", None) is not hook for fns in task._hook_calls.values() for fn in fns)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_memory_stats_and_perf_stats_on_gpu(tiny_yaml: Path, tmp_path: Path, caplog: Any) -> None:
    folder = tmp_path / "run"
    cfg = make_cfg(tiny_yaml, folder, "config.MACHINE.DEVICE=gpu")
    mem = TorchMemoryStatsHook(use_cuda=True, log_every_n_iters=2, summary_iteration=3, dump_on_exception=True)
    with caplog.at_level(logging.INFO):
        train(cfg, base_hooks(cfg) + [mem, PerfStatsHook(frequency=2)])
    assert "CUDA memory at iteration 2" in caplog.text and "CUDA memory summary at iteration 3" in caplog.text
    assert "after the last phase" in caplog.text
    stats = [r["train_perf_stats"] for r in metrics(folder) if "train_loss" in r]
    assert all(s["forward_ms"] > 0 and s["backward_ms"] > 0 for s in stats)


# ------------------------------------------------------------------ NaN checks, frozen params


def test_nan_in_the_model_output_stops_the_run(tiny_yaml: Path, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    cfg = make_cfg(tiny_yaml, folder, "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=2")

    def poison(task: Any) -> None:
        if task.iteration == 2:  # after the update of iteration index 2, before the next forward
            weight = next(p for n, p in task.base_model.named_parameters() if n.startswith("heads") and p.ndim == 2)
            with torch.no_grad():
                weight[0, 0] = float("nan")

    with pytest.raises(NonFiniteLossError) as err:
        train(cfg, base_hooks(cfg) + [NaNCheckHook(), CallbackHook(on_update=poison)])
    msg = str(err.value)
    assert "model output" in msg and "iteration 3" in msg and "phase 0" in msg and "the input data is finite" in msg
    names = sorted(p.name for p in folder.glob("model_*.torch"))
    assert names == ["model_iteration2.torch"]  # the last good checkpoint is the newest one


@pytest.mark.parametrize("deferred,device", [(False, "cpu"), (True, "cpu"), pytest.param(True, "gpu", marks=pytest.mark.gpu)],
                         ids=["read-at-once", "read-one-step-late", "cuda-pinned-flag"])
def test_check_nan_alone_stops_on_a_nan_loss_and_names_the_output(
    tiny_yaml: Path, tmp_path: Path, deferred: bool, device: str
) -> None:
    """HOOKS.CHECK_NAN without NaNCheckHook: the train step's loss check stops the run. Read one
    step late (what a GPU run does) it must still stop before a checkpoint of the bad state."""
    folder = tmp_path / "run"
    cfg = make_cfg(tiny_yaml, folder, "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=2", f"config.MACHINE.DEVICE={device}")

    def poison(task: Any) -> None:
        task.defer_loss_check = deferred
        if task.iteration == 2:  # after the update of iteration index 2: the next loss is NaN
            weight = next(p for n, p in task.base_model.named_parameters() if n.startswith("heads") and p.ndim == 2)
            with torch.no_grad():
                weight[0, 0] = float("nan")

    with pytest.raises(NonFiniteLossError) as err:
        train(cfg, base_hooks(cfg) + [CallbackHook(on_update=poison)])
    msg = str(err.value)
    assert "the loss is nan at iteration 3" in msg and "phase 0" in msg
    assert "model output" in msg and "the input data is finite" in msg
    names = sorted(p.name for p in folder.glob("model_*.torch"))
    assert names == ["model_iteration2.torch"]  # iteration 4's checkpoint would hold the NaN update


def test_nan_check_names_bad_inputs() -> None:
    from types import SimpleNamespace

    bad = torch.ones(2, 3)
    bad[0, 1] = float("inf")
    task = SimpleNamespace(last_model_output=[torch.full((2, 4), float("nan"))], last_batch={"data": [bad]},
                           iteration=7, phase_idx=2, phase_type="test", local_iteration_num=1)
    with pytest.raises(NonFiniteLossError, match=r"input data \(shape \[2, 3\]\): 0 NaN, 1 inf.*model output"):
        NaNCheckHook().on_forward(task)
    task.last_model_output = [torch.zeros(2, 4)]
    NaNCheckHook().on_forward(task)  # finite outputs: nothing happens


def test_temp_frozen_params(tiny_yaml: Path, tmp_path: Path) -> None:
    cfg = make_cfg(tiny_yaml, tmp_path / "run", "config.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP=[[heads.0,3]]")
    hooks = [h for h in default_hooks(cfg) if isinstance(h, TempFrozenParamsHook)]
    assert len(hooks) == 1
    states: List[Dict[str, torch.Tensor]] = []
    start: Dict[str, torch.Tensor] = {}
    train(cfg, base_hooks(cfg) + hooks + [
        CallbackHook(on_start=lambda t: start.update(clone_state(t.base_model))),
        CallbackHook(on_update=lambda t: states.append(clone_state(t.base_model))),
    ])
    head = [k for k in start if k.startswith("heads.0")]
    trunk = [k for k in start if k.startswith("trunk") and "weight" in k]
    assert head and trunk
    for it, s in enumerate(states):
        frozen = it < 3
        assert all(torch.equal(s[k], start[k]) for k in head) == frozen, it  # no step, decay or momentum
        assert not any(torch.equal(s[k], start[k]) for k in trunk)
    bad = TempFrozenParamsHook([["heads.O", 2]])
    task = setup_task(make_cfg(tiny_yaml, tmp_path / "run2"), [])
    with pytest.raises(UserError, match="did you mean"):
        bad.on_start(task)
    with pytest.raises(UserError, match="TEMP_FROZEN_PARAMS_ITER_MAP entry"):
        TempFrozenParamsHook([["heads", -1]])
    # VISSL's configs name parameters as DistributedDataParallel shows them: module.heads.0...
    from ssl_engine.hooks.frozen_params import match_params

    head_params = [n for n, _ in match_params(task.base_model, "heads.0")]
    assert head_params and [n for n, _ in match_params(task.base_model, "module.heads.0")] == head_params
    assert match_params(task.base_model, "module.nothing") == []


# ------------------------------------------------------------------ end to end through the tool

USER_MODULE = '''
def evaluate(task):
    return {"weight_sum": float(sum(p.detach().double().sum() for p in task.base_model.parameters()))}
'''


def tool_args(tiny_yaml: Path, folder: Path, *extra: str) -> List[str]:
    return [f"config={tiny_yaml}", f"config.CHECKPOINT.DIR={folder}", *extra]


UNLOADABLE_STATE_HOOK = '''
from ssl_engine.hooks import SSLHook
from ssl_engine.registry import HOOKS


class Counter:
    def __init__(self):
        self.n = 0


@HOOKS.register("KeepsAnObject")
class KeepsAnObject(SSLHook):
    def __init__(self):
        super().__init__()
        self.counter = Counter()

    def on_step(self, task):
        self.counter.n += 1

    def get_classy_state(self):
        return {"counter": self.counter}

    def set_classy_state(self, state):
        self.counter = state["counter"]
'''


def test_a_hook_state_no_checkpoint_can_load_is_one_line_and_no_checkpoint(tiny_yaml: Path, tmp_path: Path) -> None:
    """A hook whose state holds an object of the user's class: its checkpoints were written and
    the run exited 0, and every resume refused them all (loading would run code). It is one line
    naming the hook, where it is defined and the value, exit 2, and no checkpoint is written."""
    (tmp_path / "state_hook_mod.py").write_text(UNLOADABLE_STATE_HOOK)
    folder = tmp_path / "run"
    r = run_tool(tool_args(tiny_yaml, folder, f"config.USER_MODULES=[{tmp_path / 'state_hook_mod.py'}]",
                           "config.HOOKS.CUSTOM=[{name: KeepsAnObject}]"))
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    assert err == (f"error: hook 'KeepsAnObject' ({tmp_path / 'state_hook_mod.py'} line 11) get_classy_state() holds a "
                   "Counter at ['counter']; a part's state goes into checkpoints, which load without running code: "
                   "give tensors, numbers, strings, numeric numpy arrays and lists, tuples and dicts of them"), err
    assert not list(folder.glob("*.torch"))


def test_a_hook_that_saves_its_state_but_cannot_restore_it_is_refused_before_launch(tiny_yaml: Path,
                                                                                    tmp_path: Path) -> None:
    """get_classy_state without set_classy_state: the base class's setter kept the checkpoint's
    state apart from the hook's attributes, so a resumed run silently started the hook over."""
    (tmp_path / "half_state_mod.py").write_text(
        "from ssl_engine.hooks import SSLHook\nfrom ssl_engine.registry import HOOKS\n\n\n"
        "@HOOKS.register('SavesOnly')\nclass SavesOnly(SSLHook):\n    steps = 0\n\n"
        "    def on_step(self, task):\n        self.steps += 1\n\n"
        "    def get_classy_state(self):\n        return {'steps': self.steps}\n")
    folder = tmp_path / "run"
    r = run_tool(tool_args(tiny_yaml, folder, f"config.USER_MODULES=[{tmp_path / 'half_state_mod.py'}]",
                           "config.HOOKS.CUSTOM=[{name: SavesOnly}]"))
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    assert err == (f"error: config.HOOKS.CUSTOM[0] hook 'SavesOnly' ({tmp_path / 'half_state_mod.py'} line 5) defines "
                   "get_classy_state but not set_classy_state: its state would be saved in checkpoints but not "
                   "restored on resume; define both"), err
    assert not folder.exists()


@pytest.mark.slow
def test_hook_state_survives_resume(tiny_yaml: Path, tmp_path: Path) -> None:
    """A run resumed from the checkpoint of its second train phase (a crash before the last test
    phase) ends with the same hook state and metrics as the uninterrupted run."""
    (tmp_path / "hook_user_mod.py").write_text(USER_MODULE)
    extra = [
        f"config.USER_MODULES=[{tmp_path / 'hook_user_mod.py'}]",
        "config.HOOKS.CUSTOM=[{name: EvalHook, params: {eval_function: 'hook_user_mod:evaluate', every_n_iters: 3}}]",
        "config.HOOKS.EMA_MODEL.ENABLE_EMA_METERS=true", "config.HOOKS.EMA_MODEL.DECAY=0.7",
        "config.HOOKS.BEST_CHECKPOINT.METRIC=test_loss", "config.HOOKS.BEST_CHECKPOINT.MODE=max",
        "config.HOOKS.TENSORBOARD_SETUP.USE_TENSORBOARD=true",
    ]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    r = run_tool(tool_args(tiny_yaml, full, *extra))
    assert r.returncode == 0, r.stderr[-3000:]
    resumed.mkdir()
    (resumed / "model_phase1.torch").write_bytes((full / "model_phase1.torch").read_bytes())
    r = run_tool(tool_args(tiny_yaml, resumed, *extra))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout + r.stderr
    a = torch.load(full / "model_final_checkpoint_phase1.torch", weights_only=True)["classy_state_dict"]["hooks"]
    b = torch.load(resumed / "model_final_checkpoint_phase1.torch", weights_only=True)["classy_state_dict"]["hooks"]
    # the EMA is not updated after the last train phase: the resumed run has it only from the checkpoint
    assert a["EMAModelHook"]["num_updates"] == b["EMAModelHook"]["num_updates"] == 2 * TRAIN_ITERS_PER_EPOCH
    for name, value in a["EMAModelHook"]["ema_model"].items():
        assert torch.equal(value, b["EMAModelHook"]["ema_model"][name]), name
    # test_loss falls, so with MODE max the best is the first test phase, seen only before the resume
    assert a["BestCheckpointer"]["best_phase_idx"] == 1
    assert a["BestCheckpointer"] == b["BestCheckpointer"]
    assert not (resumed / "model_best.torch").exists()  # no better value after the resume
    # evaluations at iterations 3 and 6 ran before the resume, the final one after
    assert [e["iteration"] for e in b["EvalHook"]["history"]] == [3, 6, 8]
    assert a["EvalHook"]["history"] == b["EvalHook"]["history"]
    assert len((resumed / "eval_metrics.json").read_text().splitlines()) == 3
    ma = [json.loads(x) for x in (full / "metrics.json").read_text().splitlines()]
    mb = [json.loads(x) for x in (resumed / "metrics.json").read_text().splitlines()]
    assert ma[3:] == mb  # the last test phase, EMA meters included, as in the uninterrupted run


@pytest.mark.slow
def test_hooks_with_two_ranks(tiny_yaml: Path, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    r = run_tool(tool_args(
        tiny_yaml, folder, "config.DISTRIBUTED.NUM_PROC_PER_NODE=2", "config.OPTIMIZER.num_epochs=1",
        "config.HOOKS.EMA_MODEL.ENABLE_EMA_METERS=true", "config.HOOKS.PRECISE_BN.USE_PRECISE_BN=true",
        "config.HOOKS.BEST_CHECKPOINT.METRIC=test_ema_accuracy_list_meter/top_1/0",
        "config.HOOKS.PERF_STATS.MONITOR_PERF_STATS=true", "config.HOOKS.TENSORBOARD_SETUP.USE_TENSORBOARD=true",
        "config.HOOKS.LOG_PARAM_GROUPS=true",
    ), timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = metrics(folder)
    assert "train_perf_stats" in recs[0] and "test_ema_accuracy_list_meter" in recs[1]
    best = torch.load(folder / "model_best.torch", weights_only=True)["best_metric"]
    assert best["value"] == recs[1]["test_ema_accuracy_list_meter"]["top_1"]["0"]
    ckpt = torch.load(folder / "model_final_checkpoint_phase0.torch", weights_only=True)
    assert ckpt["classy_state_dict"]["hooks"]["EMAModelHook"]["num_updates"] == 2  # 64 samples / (16 x 2 ranks)
    assert len(list((folder / "tb_logs").glob("events.out.tfevents.*"))) == 1  # rank 0 only
    assert len((folder / "param_groups.json").read_text().splitlines()) == 2


# ------------------------------------------------------------------ next phase's data started early


def _phase_batches(tiny_yaml: Path, folder: Path, workers: int, touch_train_loader: bool) -> List[List[List[int]]]:
    """data_idx of every batch, per phase; optionally a phase-end hook that reads the train loader."""
    cfg = make_cfg(tiny_yaml, folder, f"config.DATA.NUM_DATALOADER_WORKERS={workers}", "config.OPTIMIZER.num_epochs=3")
    phases: List[List[List[int]]] = []

    def read_two_train_batches(task: Any) -> None:  # what PreciseBN does at a train phase end
        loader = task.dataloaders["TRAIN"]
        loader.sampler.set_epoch(7)
        for i, _ in enumerate(loader):
            if i == 1:
                break

    hooks = base_hooks(cfg) + [CallbackHook(
        on_phase_start=lambda task: phases.append([]),
        on_step=lambda task: phases[-1].append(task.last_batch["data_idx"][0].tolist()),
    )]
    if touch_train_loader:
        hooks.append(CallbackHook(on_phase_end=read_two_train_batches))
    train(cfg, hooks)
    return phases


@pytest.mark.parametrize("touch_train_loader", [False, True], ids=["plain", "a-hook-reads-the-train-loader"])
def test_prefetched_next_phase_serves_the_same_batches(tiny_yaml: Path, tmp_path: Path, touch_train_loader: bool) -> None:
    """With loader workers the next phase's iterator starts before the phase-end hooks; the
    batches must be exactly those of a run without workers, also when a hook uses the loader."""
    reference = _phase_batches(tiny_yaml, tmp_path / "w0", 0, touch_train_loader)
    with_workers = _phase_batches(tiny_yaml, tmp_path / "w2", 2, touch_train_loader)
    assert len(reference) == 6 and [len(p) for p in reference] == [4, 2] * 3
    assert with_workers == reference
    assert reference[0] != reference[2]  # epochs are shuffled differently: the comparison means something


# ------------------------------------------------------------------ metrics.json appends


def test_metrics_file_drops_lines_of_phases_the_run_will_redo(tmp_path: Path) -> None:
    """A crashed attempt may have written lines past the checkpoint and half a line: on start
    only the phases before the first one this run does are kept."""
    from types import SimpleNamespace

    path = tmp_path / "metrics.json"
    path.write_text("".join(json.dumps({"phase_idx": i, "train_loss": float(i)}) + "\n" for i in range(4)) + '{"phase_idx": 4, "tr')
    hook = MetricsHook(str(tmp_path))
    hook.on_start(SimpleNamespace(phase_idx=1, _resume_in_phase=False))  # phases 0 and 1 done, 2 is next
    assert [r["phase_idx"] for r in read_metrics(path)] == [0, 1] and path.read_text().endswith("\n")
    hook.on_start(SimpleNamespace(phase_idx=1, _resume_in_phase=True))  # resuming inside phase 1: redo it
    assert [r["phase_idx"] for r in read_metrics(path)] == [0]
    before = path.stat().st_mtime_ns
    hook.on_start(SimpleNamespace(phase_idx=0, _resume_in_phase=False))  # nothing to drop: not rewritten
    assert path.stat().st_mtime_ns == before


def test_damaged_metrics_lines_are_left_out_with_a_warning_and_the_file_kept_aside(tmp_path: Path, caplog) -> None:
    from types import SimpleNamespace

    path = tmp_path / "metrics.json"
    lines = [json.dumps({"phase_idx": i, "train_loss": float(i)}) + "\n" for i in range(3)]
    # a line cut inside, a line of garbage, and json that is not a phase record (was: kept)
    damaged = lines[0][:-4] + "\x00\n" + lines[1] + "garbage\n" + '{"foo": 1}\n' + lines[2]
    path.write_text(damaged)
    with caplog.at_level(logging.WARNING):
        MetricsHook(str(tmp_path)).on_start(SimpleNamespace(phase_idx=2, _resume_in_phase=False))
    assert [r["phase_idx"] for r in read_metrics(path)] == [1, 2]
    assert all("foo" not in r for r in read_metrics(path))
    # was: dropped without a word; now named, and nothing is lost
    assert "3 line(s) are not phase records and are left out; the file as it was is kept as " \
           "metrics.json.unreadable" in caplog.text
    assert (tmp_path / "metrics.json.unreadable").read_text() == damaged
    path.write_text(damaged)  # a second time: the earlier copy stays, the new one gets the next name
    MetricsHook(str(tmp_path)).on_start(SimpleNamespace(phase_idx=2, _resume_in_phase=False))
    assert (tmp_path / "metrics.json.unreadable.1").read_text() == damaged


def test_records_are_kept_by_what_they_are_not_by_their_phase_index() -> None:
    """The checkpoint's own (train_phase_idx, phase type, complete) decides, whatever phase_idx a
    record carries: a run with other test phases numbers its phases otherwise."""
    from types import SimpleNamespace

    from ssl_engine.hooks.resume_point import done_before_resume, record_position

    def rec(k, kind, phase_idx, **extra):
        return {"phase_idx": phase_idx, "train_phase_idx": k, f"{kind}_loss": 1.0, **extra}

    assert record_position(rec(3, "test", 9)) == (3, 1)
    assert record_position({"phase_type": "train", "train_phase_idx": 2, "loss": 1.0}) == (2, 0)
    assert record_position({"phase_idx": 1, "train_loss": 1.0}) is None  # falls back to phase_idx
    # finished after the test of train phase 1 (its phase 3); here that test is gone and train phase 1 is phase 2
    done = done_before_resume(SimpleNamespace(phase_idx=2, _resume_in_phase=False, resume_point=(1, False, True),
                                              checkpoint_local_iteration=2, local_iteration_num=0))
    assert [done(r) for r in (rec(0, "train", 0), rec(0, "test", 1), rec(1, "train", 2), rec(1, "test", 3),
                              rec(2, "train", 3))] == [True, True, True, True, False]
    # stopped inside train phase 1 after 3 steps: its stats up to step 3 stay, its phase-end line goes
    done = done_before_resume(SimpleNamespace(phase_idx=2, _resume_in_phase=True, resume_point=(1, True, False),
                                              checkpoint_local_iteration=3, local_iteration_num=3))
    stats = [{"phase_type": "train", "phase_idx": 9, "train_phase_idx": 1, "local_iteration": i} for i in (2, 3, 4)]
    assert [done(r) for r in stats] == [True, True, False]
    assert [done(r) for r in (rec(0, "test", 1), rec(1, "train", 2), {"note": "someone else's"})] == [True, False, True]
    # from scratch: nothing of ours is done
    done = done_before_resume(SimpleNamespace(phase_idx=-1, _resume_in_phase=False, local_iteration_num=0))
    assert not done(rec(0, "train", 0)) and not done({"phase_idx": 0, "train_loss": 1.0})


def test_tensorboard_hides_the_events_a_resumed_run_redoes(tmp_path: Path) -> None:
    """A killed run logged iterations 2..10; its checkpoint holds 6: the rerun's events for 8 and
    10 replace the killed run's (purge_step), and TensorBoard shows each step once."""
    import time

    from ssl_engine.hooks.tensorboard import TensorboardWriter, read_scalars

    def run(steps, value, resume_at=None):
        w = TensorboardWriter(tmp_path / "tb")
        if resume_at is not None:
            w.rewind(lambda stats: True, resume_at)
        for step in steps:
            w.write({"phase_type": "train", "iteration": step, "loss": value})
        w.close()
        time.sleep(1.1)  # event file names carry the second they were opened in

    run([2, 4, 6, 8, 10], 1.0)
    run([8, 10], 2.0, resume_at=6)
    assert read_scalars(tmp_path / "tb")["Training/loss"] == [(2, 1.0), (4, 1.0), (6, 1.0), (8, 2.0), (10, 2.0)]


def test_stdout_json_drops_the_iterations_a_resumed_run_redoes(tmp_path: Path) -> None:
    """Lines past the checkpoint (and half a line) go at start; lines before it stay, byte for byte."""
    from types import SimpleNamespace

    from ssl_engine.hooks import JsonLinesWriter
    from ssl_engine.hooks.periodic_writer import logged_before

    def line(phase, local):
        return json.dumps({"phase_idx": phase, "local_iteration": local, "iteration": 10 * phase + local}) + "\n"

    before = line(0, 1) + line(0, 2) + '{"note": "a line of someone else"}\n' + line(1, 1) + line(2, 1) + line(2, 2)
    path = tmp_path / "stdout.json"
    path.write_text(before + line(2, 3) + line(2, 4) + line(3, 1) + '{"phase_idx": 3, "lo')

    def start(phase_idx, in_phase, local_iteration_num):
        w = JsonLinesWriter(path)
        w.start()
        w.rewind(logged_before(SimpleNamespace(phase_idx=phase_idx, _resume_in_phase=in_phase,
                                               local_iteration_num=local_iteration_num)))
        w.write({"phase_idx": phase_idx, "local_iteration": local_iteration_num + 1})
        w.close()
        return path.read_text().splitlines(keepends=True)

    lines = start(2, True, 2)  # resumed inside phase 2 after its 2nd step: steps 3, 4 and phase 3 go
    assert "".join(lines[:-1]) == before and json.loads(lines[-1]) == {"phase_idx": 2, "local_iteration": 3}
    assert len(start(1, False, 0)) == 5  # phase 1 done: phase 2 runs again
    assert len(start(-1, False, 0)) == 4  # no checkpoint: only the foreign line (and what is before it) stays


def test_stdout_json_lines_that_are_not_records_at_its_end_are_kept_aside(tmp_path: Path, caplog) -> None:
    """Text appended to stdout.json (not json, or json that is not an iteration record) hid the lines past
    the checkpoint behind it: they stayed, and the resumed run logged those iterations twice. The
    foreign lines go to stdout.json.unreadable with a warning; the stale records are dropped."""
    from types import SimpleNamespace

    from ssl_engine.hooks import JsonLinesWriter
    from ssl_engine.hooks.periodic_writer import logged_before

    def line(phase, local):
        return json.dumps({"phase_idx": phase, "local_iteration": local, "iteration": 10 * phase + local}) + "\n"

    before = line(0, 1) + line(0, 2)
    path = tmp_path / "stdout.json"
    (tmp_path / "stdout.json.unreadable").write_text("an older one\n")
    # a json object that is no iteration record ({"a": 1}, last) hid the foreign lines before it too
    path.write_text(before + line(1, 1) + "garbage \x00 text\n" + line(1, 2) + "[1, 2]\n\n" + '{"a": 1}\n')
    w = JsonLinesWriter(path)
    w.start()
    with caplog.at_level("WARNING"):
        w.rewind(logged_before(SimpleNamespace(phase_idx=0, _resume_in_phase=False, local_iteration_num=0)))
    w.close()
    assert path.read_text() == before
    assert (tmp_path / "stdout.json.unreadable.1").read_text() == 'garbage \x00 text\n[1, 2]\n{"a": 1}\n'
    assert (tmp_path / "stdout.json.unreadable").read_text() == "an older one\n"
    assert "stdout.json: 3 line(s) at its end are not iteration records and are left out; they are kept as " \
           "stdout.json.unreadable.1" in caplog.text


def test_metrics_line_cut_short_is_undone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ssl_engine.hooks import metrics_hook

    path = tmp_path / "metrics.json"
    metrics_hook.append_line(path, '{"phase_idx": 0}\n')
    real_write = os.write
    monkeypatch.setattr(metrics_hook.os, "write", lambda fd, data: real_write(fd, data[:5]))
    with pytest.raises(OSError, match="only 5 of"):
        metrics_hook.append_line(path, '{"phase_idx": 1}\n')
    assert path.read_text() == '{"phase_idx": 0}\n'


@pytest.mark.parametrize("async_write", [True, False])
def test_each_checkpoint_is_durable_only_after_the_metrics_lines_it_covers(
    tiny_yaml: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_write: bool
) -> None:
    """metrics.json is not synced per line; each checkpoint syncs it before its own rename, so a
    checkpoint that survives a machine crash never stands for a phase whose line did not."""
    folder = tmp_path / "run"
    cfg = make_cfg(tiny_yaml, folder, "config.OPTIMIZER.num_epochs=3", f"config.CHECKPOINT.ASYNC_WRITE={async_write}")
    metrics_path = str(folder / "metrics.json")
    synced: List[str] = []  # the text of metrics.json at each of its syncs
    renamed: List[tuple] = []  # (checkpoint name, metrics text synced before its rename)
    real_fdatasync, real_replace = os.fdatasync, os.replace

    def fdatasync(fd: int) -> None:
        real_fdatasync(fd)
        if os.readlink(f"/proc/self/fd/{fd}") == metrics_path:
            synced.append(Path(metrics_path).read_text())

    def replace(src: Any, dst: Any) -> None:
        real_replace(src, dst)
        if Path(dst).name.startswith("model_"):
            renamed.append((Path(dst).name, synced[-1] if synced else ""))

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "replace", replace)
    train(cfg, base_hooks(cfg))

    records = metrics(folder)
    assert [(r["train_phase_idx"], "train_loss" in r) for r in records] == [
        (0, True), (0, False), (1, True), (1, False), (2, True), (2, False)]
    assert [name for name, _ in renamed] == ["model_phase0.torch", "model_phase1.torch", "model_phase2.torch",
                                             "model_final_checkpoint_phase2.torch"]
    for name, text in renamed:
        lines = [json.loads(line) for line in text.splitlines()]
        covered = 2 if "final" in name else int(name[len("model_phase"):-len(".torch")])
        assert any(r["train_phase_idx"] == covered and "train_loss" in r for r in lines), (name, text)
    assert renamed[-1][1] == (folder / "metrics.json").read_text()  # the final checkpoint covers every line
    assert len(synced) == 5  # one per checkpoint and one at the run's end


def test_deferred_sum_reads_the_weighted_sum_before_and_after_folding(monkeypatch):
    from ssl_engine.hooks.deferred_sum import DeferredSum

    values = [torch.tensor(v) for v in (0.5, 1.25, -2.0, 3.0, 0.125)]
    weights = [1.0, 2.0, 0.5, 3.0, 1.0]
    expected = sum(float(v) * w for v, w in zip(values, weights))
    monkeypatch.setattr(DeferredSum, "FOLD_EVERY", 2)  # folds into one tensor after every second add
    for fold_every in (2, 1024):
        DeferredSum.FOLD_EVERY = fold_every
        s = DeferredSum()
        assert s.total() == 0.0 and math.isnan(s.mean())
        for v, w in zip(values, weights):
            s.add(v, w)
        assert s.total() == pytest.approx(expected, abs=1e-12)
        assert s.mean() == pytest.approx(expected / sum(weights), abs=1e-12)
        s.clear()
        s.add(torch.tensor([4.0]))
        assert s.total() == 4.0


def test_the_log_lines_peak_memory_is_the_process_peak_rss_also_of_other_threads() -> None:
    """peak_mem_mb on the CPU is the process's peak RSS (the kernel's VmHWM), counting memory that
    another thread holds: the log line reads it through the calling thread's rusage, which
    Linux fills with the whole process's peak."""
    import threading

    from ssl_engine.hooks.periodic_writer import peak_memory_mb

    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs Linux's /proc")

    def status_mb(key: str) -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024.0

    assert peak_memory_mb(torch.device("cpu")) == pytest.approx(status_mb("VmHWM"), abs=2.0)
    rss_before = status_mb("VmRSS")
    held, release = threading.Event(), threading.Event()

    def hold_a_block() -> None:
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, every page written
        held.set()
        release.wait(30)
        del block

    worker = threading.Thread(target=hold_a_block)
    worker.start()
    try:
        assert held.wait(30)
        rss_now = status_mb("VmRSS")
        assert rss_now >= rss_before + 60  # the other thread's block is resident
        peak = peak_memory_mb(torch.device("cpu"))
        assert peak >= rss_now - 1.0
        assert peak == pytest.approx(status_mb("VmHWM"), abs=2.0)
    finally:
        release.set()
        worker.join()


def test_stdout_json_writer_appends_whole_lines_and_reopens_after_close(tmp_path):
    import pickle

    from ssl_engine.hooks import JsonLinesWriter

    path = tmp_path / "stdout.json"
    w = JsonLinesWriter(path)
    assert not path.exists()  # created with its first line
    w.write({"iteration": 1, "loss": 0.5})
    w.write({"iteration": 2, "loss": 0.25})
    w.close()
    copy = pickle.loads(pickle.dumps(w))
    w.write({"iteration": 3, "loss": 0.125})
    copy.write({"iteration": 4, "loss": 0.0625})
    w.close()
    copy.close()
    assert [json.loads(x)["iteration"] for x in path.read_text().splitlines()] == [1, 2, 3, 4]
    # a line a killed run left half written is cut off when the next run starts
    with open(path, "a") as f:
        f.write('{"iteration": 5, "lo')
    again = JsonLinesWriter(path)
    again.start()
    again.close()
    assert path.read_text().endswith('"loss": 0.0625}\n')
    bare = tmp_path / "no_newline_at_all.json"
    bare.write_text('{"iteration": 1')
    cut = JsonLinesWriter(bare)
    cut.start()
    cut.close()
    assert bare.read_text() == ""


def test_a_nan_loss_from_a_batch_of_ignored_labels_is_explained():
    """Cross entropy's mean over a batch whose every label is the ignore_index (-1) is NaN: the
    message says so, instead of only "the model output is finite"."""
    from ssl_engine.hooks.nan_check import diagnose

    output = [torch.randn(4, 3)]
    batch = {"data": [torch.randn(4, 2)], "label": [torch.full((4,), -1)]}
    loss = torch.nn.functional.cross_entropy(output[0], batch["label"][0], ignore_index=-1)
    assert torch.isnan(loss)
    msg = diagnose(output, batch)
    assert "every label of the batch is negative (-1), the label a loss ignores (ignore_index)" in msg
    batch["label"] = [torch.tensor([-1, 2, -1, -1])]  # one counted sample: not this cause
    assert "every label" not in diagnose(output, batch)
