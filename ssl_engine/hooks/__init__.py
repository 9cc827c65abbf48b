"""Hooks: one concern per file; default_hooks(cfg) builds the list a run uses."""

from pathlib import Path
from typing import Any, List

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.hooks.base import EVENTS, Priority, SSLHook, order_hooks, parse_priority
from ssl_engine.hooks.best_checkpoint import BestCheckpointer
from ssl_engine.hooks.callback_hook import CallbackHook
from ssl_engine.hooks.checkpoint_hook import CheckpointHook
from ssl_engine.hooks.ema import EMAModelHook
from ssl_engine.hooks.eval_hook import EvalHook
from ssl_engine.hooks.frozen_params import TempFrozenParamsHook
from ssl_engine.hooks.iteration_timer import IterationTimer
from ssl_engine.hooks.memory_stats import TorchMemoryStatsHook
from ssl_engine.hooks.metrics_hook import MetricsHook
from ssl_engine.hooks.model_complexity import ModelComplexityHook
from ssl_engine.hooks.nan_check import NaNCheckHook
from ssl_engine.hooks.param_groups import ParamGroupsHook
from ssl_engine.hooks.perf_stats import PerfStatsHook
from ssl_engine.hooks.periodic_writer import ConsoleWriter, JsonLinesWriter, PeriodicWriterHook, Writer
from ssl_engine.hooks.precise_bn import PreciseBNHook
from ssl_engine.hooks.profiler import TorchProfilerHook, profiling_folder
from ssl_engine.hooks.progress_bar import ProgressBarHook, progress_bar_wanted
from ssl_engine.hooks.moco_hook import MoCoHook
from ssl_engine.hooks.swav_hooks import SwAVHook
from ssl_engine.hooks.tensorboard import TensorboardParamsHook, TensorboardWriter, tensorboard_dir
from ssl_engine.registry import HOOKS


def custom_hooks(cfg: AttrDict) -> List[Any]:
    """HOOKS.CUSTOM: registered hooks named in yaml, with an optional priority and params."""
    out = []
    for i, entry in enumerate(cfg.HOOKS.CUSTOM):
        cls = HOOKS.get(entry["name"])
        params = dict(entry.get("params") or {})
        try:
            hook = cls(**params)
        except TypeError as e:
            from ssl_engine.errors import UserError

            raise UserError(f"config.HOOKS.CUSTOM hook {entry['name']!r}: bad params {params}: {e}") from None
        if "priority" in entry and entry["priority"] is not None:
            hook.priority = parse_priority(entry["priority"], f"config.HOOKS.CUSTOM[{i}].priority")
        out.append(hook)
    return out


def default_hooks(cfg: AttrDict, custom: bool = True) -> List[Any]:
    """The hooks a training run uses, from the config (README.md's Hooks section lists them with their keys).

    Building them has no side effect (files are opened at the run's start), so the tool builds
    them once before launch to check their settings (``custom=False``: HOOKS.CUSTOM hooks are
    user code, only their params are checked there)."""
    H = cfg.HOOKS
    folder = Path(cfg.CHECKPOINT.DIR)
    writers: List[Any] = [ConsoleWriter(), JsonLinesWriter(folder / "stdout.json")]
    phase_writers: List[Any] = []
    tb = None
    if H.TENSORBOARD_SETUP.USE_TENSORBOARD:
        tb = TensorboardWriter(tensorboard_dir(cfg), flush_secs=int(60 * H.TENSORBOARD_SETUP.FLUSH_EVERY_N_MIN))
        writers.append(tb)
        phase_writers.append(tb)
    hooks: List[Any] = [
        PeriodicWriterHook(cfg.LOG_FREQUENCY, writers),
        MetricsHook(str(folder), phase_writers),
        CheckpointHook(cfg.CHECKPOINT.CHECKPOINT_FREQUENCY, cfg.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY),
    ]
    if tb is not None and (H.TENSORBOARD_SETUP.LOG_PARAMS or H.TENSORBOARD_SETUP.LOG_PARAMS_GRADIENTS):
        hooks.append(TensorboardParamsHook(tb, H.TENSORBOARD_SETUP.LOG_PARAMS_EVERY_N_ITERS,
                                           params=H.TENSORBOARD_SETUP.LOG_PARAMS,
                                           gradients=H.TENSORBOARD_SETUP.LOG_PARAMS_GRADIENTS))
    if H.ITERATION_TIMER.USE_TIMER:
        hooks.append(IterationTimer(H.ITERATION_TIMER.WARMUP_ITERATIONS))
    if H.PROGRESS_BAR and progress_bar_wanted():
        hooks.append(ProgressBarHook(log_frequency=cfg.LOG_FREQUENCY))
    if H.LOG_PARAM_GROUPS:
        hooks.append(ParamGroupsHook(str(folder), flush_every=cfg.LOG_FREQUENCY))
    if H.BEST_CHECKPOINT.METRIC:
        hooks.append(BestCheckpointer(H.BEST_CHECKPOINT.METRIC, H.BEST_CHECKPOINT.MODE))
    if H.PRECISE_BN.USE_PRECISE_BN:
        hooks.append(PreciseBNHook(H.PRECISE_BN.NUM_ITERATIONS, H.PRECISE_BN.EVERY_N_PHASES))
    ema = H.EMA_MODEL
    if ema.SAVE_EMA_MODEL or ema.ENABLE_EMA_METERS:
        hooks.append(EMAModelHook(ema.DECAY, ema.UPDATE_ITER, ema.WARMUP_ITERATIONS, ema.ENABLE_EMA_METERS, ema.EMA_DEVICE))
    if H.MODEL_COMPLEXITY.COMPUTE_COMPLEXITY:
        hooks.append(ModelComplexityHook(H.MODEL_COMPLEXITY.INPUT_SHAPE))
    if H.PERF_STATS.MONITOR_PERF_STATS:
        hooks.append(PerfStatsHook(H.PERF_STATS.PERF_STAT_FREQUENCY))
    prof = cfg.PROFILING
    if prof.RUNTIME_PROFILING.USE_PROFILER:
        hooks.append(TorchProfilerHook(
            str(profiling_folder(cfg)), prof.START_ITERATION, prof.WARMUP_ITERATIONS, prof.NUM_ITERATIONS,
            ranks=list(prof.PROFILED_RANKS), profile_cpu=prof.RUNTIME_PROFILING.PROFILE_CPU,
            profile_gpu=prof.RUNTIME_PROFILING.PROFILE_GPU,
            profile_memory=prof.MEMORY_PROFILING.TRACK_BY_LAYER_MEMORY,
            stop_after=prof.STOP_TRAINING_AFTER_PROFILING,
        ))
    mem = H.MEMORY_SUMMARY
    if cfg.MACHINE.DEVICE == "gpu" and (mem.PRINT_MEMORY_SUMMARY or mem.LOG_EVERY_N_ITERS > 0 or mem.DUMP_MEMORY_ON_EXCEPTION):
        hooks.append(TorchMemoryStatsHook(True, mem.LOG_EVERY_N_ITERS, mem.LOG_ITERATION_NUM,
                                          mem.PRINT_MEMORY_SUMMARY, mem.DUMP_MEMORY_ON_EXCEPTION))
    if cfg.LOSS.name == "moco_loss":  # shuffled BN across ranks unless BN is synchronised (as VISSL)
        hooks.append(MoCoHook(cfg.LOSS.moco_loss.momentum, shuffle_batch=not cfg.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN))
    if cfg.LOSS.name == "swav_loss":
        hooks.append(SwAVHook(cfg.LOSS.swav_loss.normalize_last_layer))
    if cfg.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP:
        hooks.append(TempFrozenParamsHook(cfg.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP))
    if custom:
        hooks += custom_hooks(cfg)
    return order_hooks(hooks)


__all__ = [
    "EVENTS", "Priority", "SSLHook", "order_hooks", "parse_priority", "default_hooks", "custom_hooks",
    "BestCheckpointer", "CallbackHook", "CheckpointHook", "EMAModelHook", "EvalHook", "IterationTimer",
    "MetricsHook", "MoCoHook", "ModelComplexityHook", "NaNCheckHook", "ParamGroupsHook", "PerfStatsHook", "PeriodicWriterHook",
    "PreciseBNHook", "ProgressBarHook", "SwAVHook", "TempFrozenParamsHook", "TensorboardParamsHook", "TensorboardWriter",
    "TorchMemoryStatsHook", "TorchProfilerHook", "ConsoleWriter", "JsonLinesWriter", "Writer",
]
