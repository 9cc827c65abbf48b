#!/usr/bin/env python
"""Where the engine's time goes: cProfile of a benchmark workload, per iteration.

    python benchmarks/profile_engine.py iteration [--case tiny|overhead] [--hooks default|none]
    python benchmarks/profile_engine.py phases
    python benchmarks/profile_engine.py steps [--case tiny|overhead] [--hooks default|none]
    python benchmarks/profile_engine.py startup
    python benchmarks/profile_engine.py gpu-syncs [--hooks default|none]

- ``iteration``: one W-tiny engine run under cProfile; the functions with the most own time,
  in microseconds per iteration (cProfile inflates Python-heavy code, so read the ranking, not
  the absolute figures), then the same summed per ssl_engine source file.
- ``phases``: the W-phases engine run with each part of a phase change timed (phase-end hooks,
  meter sync, advance_phase / new data iterator), next to the step clock's phase-change figure.
- ``steps``: the engine's train step against the plain loop's, interleaved in blocks of 100
  steps in one process (50 rounds), with a second plain loop as the control: the figure that
  moves when a change to the step moves it. Separate runs on a noisy machine differ by more
  than the overhead itself; interleaving cancels the drift, and the control's difference to
  the plain loop is the noise floor (a few microseconds).
- ``startup``: the wall and CPU seconds of each startup stage (compose, torch, torchvision,
  built-in parts, pre-launch checks, the rank's setup, the first iteration), the startup
  command under cProfile (cumulative time of the engine's functions) and the import time per
  top-level package.
- ``gpu-syncs`` (CUDA): the W-resnet50-gpu engine run with torch's CUDA sync debug mode on
  after the warm-up: every place a train step makes the CPU wait for the GPU (``.item()``,
  ``.tolist()``, a device-to-host copy, ``torch.cuda.synchronize``), with its count per
  iteration, then the run's median iteration time and loader wait. A GPU loop is fastest when
  the CPU queues work ahead of the GPU; each sync per step drains that queue. Waits on a CUDA
  event (``Event.synchronize``, as the loss check's read does) are not reported by torch's
  sync debug mode, so they are not in the list.
"""

import argparse
import cProfile
import functools
import io
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def profile_iteration(case_name: str, hooks: str, top: int) -> None:
    from benchmarks import w_tiny
    from benchmarks.common import iteration_times, median

    case = w_tiny.CASES[case_name]
    data = w_tiny.make_data(case)
    cfg = w_tiny.compose_config(w_tiny.engine_overrides(case))
    variant = "engine_default_hooks" if hooks == "default" else "engine_no_hooks"
    w_tiny.run_variant(variant, case, data, cfg)  # warm-up run
    prof = cProfile.Profile()
    prof.enable()
    out = w_tiny.run_variant(variant, case, data, cfg)
    prof.disable()
    n = len(out["steps"])
    print(f"{case_name} case, {hooks} hooks: {n} iterations, median train iteration "
          f"{median(iteration_times(out['steps'])) * 1e6:.0f} us under the profiler\n")
    stats = pstats.Stats(prof)
    rows = []
    per_file: Dict[str, float] = {}
    for (path, line, func), (cc, nc, tt, ct, callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append((tt, ct, nc, f"{short(path)}:{line}({func})"))
        if "ssl_engine" in path:
            per_file[short(path)] = per_file.get(short(path), 0.0) + tt
    rows.sort(reverse=True)
    print(f"{'own us/it':>10} {'cum us/it':>10} {'calls/it':>9}  function")
    for tt, ct, nc, name in rows[:top]:
        print(f"{tt / n * 1e6:10.1f} {ct / n * 1e6:10.1f} {nc / n:9.1f}  {name}")
    print(f"\nown time per ssl_engine file (us / iteration):")
    for path, tt in sorted(per_file.items(), key=lambda kv: -kv[1])[:15]:
        print(f"{tt / n * 1e6:10.1f}  {path}")


def profile_steps(case_name: str, hooks: str, rounds: int = 50, block: int = 100) -> None:
    import statistics

    import torch
    import torch.nn.functional as F

    from benchmarks import plain, w_tiny
    from benchmarks.common import close_loaders, engine_logging, remove_tree, with_folder
    from ssl_engine.hooks import default_hooks
    from ssl_engine.trainer import SelfSupervisionTrainer

    case = w_tiny.CASES[case_name]
    data = w_tiny.make_data(case)
    folder = tempfile.mkdtemp(prefix="bench_steps_")
    cfg = with_folder(w_tiny.compose_config(w_tiny.engine_overrides(case)), folder)
    with engine_logging(folder):
        trainer = SelfSupervisionTrainer(cfg, checkpoint_folder=folder,
                                         hooks=default_hooks(cfg) if hooks == "default" else [])
        task = trainer.setup()
        task.on_start()
        task.advance_phase()
        task.on_phase_start()

        def engine_step() -> None:
            try:
                task.train_step_fn(task)
            except StopIteration:  # the train phase's data is used up: start it again
                task.data_iterator = iter(task.dataloaders["TRAIN"])
                return
            task.run_hooks("on_step")

        def plain_loop() -> Any:
            model = w_tiny.plain_model(case)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            loader = plain.tensor_loader(*data["train"], case["batch"], shuffle=True)
            state = {"it": iter(loader), "correct": torch.zeros((), dtype=torch.int64), "loss": torch.zeros(())}

            def step() -> None:
                try:
                    x, y = next(state["it"])
                except StopIteration:
                    state["it"] = iter(loader)
                    x, y = next(state["it"])
                out = model(x)
                loss = F.cross_entropy(out, y)
                state["correct"] += (out.detach().argmax(1) == y).sum()
                state["loss"] += loss.detach()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            return step

        variants = {"plain loop": plain_loop(), "engine": engine_step, "plain loop (control)": plain_loop()}
        per_step: Dict[str, List[float]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name, step in variants.items():
                for _ in range(10):  # back into this variant's code and data
                    step()
                t0 = time.perf_counter()
                for _ in range(block):
                    step()
                per_step[name].append((time.perf_counter() - t0) / block * 1e6)
    close_loaders(task)
    remove_tree(folder)
    base = per_step["plain loop"]
    print(f"{case_name} case, {hooks} hooks: {rounds} rounds of {block} steps per variant, interleaved\n")
    print(f"{'variant':<22} {'us / step':>10} {'minus plain loop':>17}")
    for name, values in per_step.items():
        diff = statistics.median(a - b for a, b in zip(values, base))
        print(f"{name:<22} {statistics.median(values):10.1f} {diff:17.1f}")


def short(path: str) -> str:
    for marker in ("site-packages/", "/work/main/", "lib/python3"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def profile_phases() -> None:
    import multiprocessing as mp

    mp.set_forkserver_preload(["torch", "ssl_engine.data", "benchmarks.common"])
    from benchmarks import common, w_phases
    from benchmarks.w_tiny import engine_overrides
    from ssl_engine.tasks.self_supervision_task import SelfSupervisionTask

    spent: Dict[str, List[float]] = {}

    def timed(name: str) -> None:
        fn = getattr(SelfSupervisionTask, name)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent.setdefault(name, []).append(time.perf_counter() - t0)

        setattr(SelfSupervisionTask, name, wrapper)

    for name in ("on_phase_end", "sync_meters", "advance_phase", "recreate_data_iterator", "on_phase_start"):
        timed(name)
    case = w_phases.CASE
    n_train, n_test = case["batch"] * case["train_iters"], case["batch"] * case["test_iters"]
    common.set_memory_data("TRAIN", *common.random_data(n_train, case["shape"], case["classes"], 0))
    common.set_memory_data("TEST", *common.random_data(n_test, case["shape"], case["classes"], 1))
    cfg = common.compose_config(engine_overrides(case, workers=w_phases.WORKERS))
    common.engine_train(cfg, default_hooks=False)  # starts the forkserver
    for hooks in (False, True):
        spent.clear()
        out = common.engine_train(cfg, default_hooks=hooks)
        changes = common.phase_changes(out["steps"])
        print(f"{'default' if hooks else 'no'} hooks: phase change median {common.median([c['excess'] for c in changes]) * 1e3:.1f} ms "
              f"(raw gap {common.median([c['gap'] for c in changes]) * 1e3:.1f} ms; typical train iteration "
              f"{common.median(common.iteration_times(out['steps'], True, 0)) * 1e3:.1f} ms, test "
              f"{common.median(common.iteration_times(out['steps'], False, 0)) * 1e3:.1f} ms)")
        for name, values in spent.items():
            print(f"    {name:24s} median {common.median(values) * 1e3:7.2f} ms   max {max(values) * 1e3:8.1f} ms   "
                  f"({len(values)} calls)")
        print("    the rest of the raw gap is the wait for the new phase's first batch")


# Runs the tool's steps (ssl_engine.cli.main, unrolled) in a fresh interpreter with a clock
# between them; torch and torchvision are imported on their own so that their share shows.
# The tool itself composes in a forked child while it imports torch (forked_compose); here the
# stages run one after another, so that each one's own cost shows.
_STAGES_DRIVER = r"""
import json, os, sys, time
T0 = float(sys.argv[1])
marks = []
def mark(name):
    marks.append((name, time.time() - T0, time.process_time()))
from ssl_engine import cli
from ssl_engine.config import compose
from ssl_engine.logger import setup_logging
mark("python start + ssl_engine.cli import")
cli.quiet_dependency_warnings()
setup_logging(0, None)
cfg = compose(sys.argv[2:])
mark("compose the config (yaml, omegaconf, hydra)")
import torch
mark("import torch")
import torchvision
mark("import torchvision (mostly torch._dynamo)")
from ssl_engine.config.validate import check_data_paths, check_registered_names
from ssl_engine.engines.run import load_builtin_parts
from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.registry import HOOKS
from ssl_engine.user_modules import import_user_modules
load_builtin_parts()
import_user_modules(cfg.USER_MODULES)

@HOOKS.register("StageClock")
class StageClock(SSLHook):
    priority = Priority.VERY_HIGH
    def on_start(self, task):
        mark("rank: build task, model, data, hooks (to on_start)")
    def on_step(self, task):
        mark("first training iteration")
        print("STAGES " + json.dumps(marks), flush=True)
        os._exit(0)
    def get_classy_state(self):
        return {}
    def set_classy_state(self, state):
        pass

check_registered_names(cfg)
check_data_paths(cfg)
mark("built-in parts (classy_vision, ...), user modules, name checks")
cli.check_before_launch(cfg, 0)
mark("pre-launch checks (parts built on the meta device)")
from ssl_engine.launch import launch
launch(cfg)
"""


def startup_stages(repeats: int) -> None:
    """Wall and CPU seconds of each startup stage (median of ``repeats`` fresh processes)."""
    import json

    from benchmarks import startup
    from benchmarks.common import median

    runs: List[List[Any]] = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="bench_stages_") as folder:
            overrides = [a for a in startup.tool_command(os.path.join(folder, "run"))[1:]
                         if not a.startswith(("config.USER_MODULES", "config.HOOKS.CUSTOM"))]
            t0 = time.time()
            proc = subprocess.run([sys.executable, "-c", _STAGES_DRIVER, repr(t0), *overrides,
                                   "config.HOOKS.CUSTOM=[{name: StageClock}]"],
                                  cwd=str(REPO), env=startup.env(), capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("STAGES ")]
            if not line:
                raise RuntimeError(f"the stages run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            runs.append(json.loads(line[0][len("STAGES "):]))
    print(f"startup stages, median of {repeats} run(s): seconds of wall / of CPU (this process, all threads);\n"
          f"one after another here (the tool composes in a forked child while it imports torch)")
    prev_w = prev_c = [0.0] * repeats
    for i, (name, _, _) in enumerate(runs[0]):
        w = [r[i][1] - p for r, p in zip(runs, prev_w)]
        c = [r[i][2] - p for r, p in zip(runs, prev_c)]
        prev_w, prev_c = [r[i][1] for r in runs], [r[i][2] for r in runs]
        print(f"  {median(w):6.2f} {median(c):6.2f}  {name}")
    total_w, total_c = median([r[-1][1] for r in runs]), median([r[-1][2] for r in runs])
    print(f"  {total_w:6.2f} {total_c:6.2f}  total: launch to the end of the first iteration\n")


def profile_startup(top: int, repeats: int = 3) -> None:
    from benchmarks import startup

    startup_stages(repeats)
    with tempfile.TemporaryDirectory(prefix="bench_prof_") as folder:
        out = os.path.join(folder, "startup.prof")
        cmd = [sys.executable, "-m", "cProfile", "-o", out, *startup.tool_command(os.path.join(folder, "run"))]
        subprocess.run(cmd, cwd=str(REPO), env=startup.env(), check=True, capture_output=True)
        s = io.StringIO()
        pstats.Stats(out, stream=s).sort_stats("cumulative").print_stats(r"ssl_engine|hydra/compose", top)
        print(s.getvalue())
    timed = startup.launch_once(("-X", "importtime"))
    print("import seconds per top-level package (own time of its modules):")
    for name, sec in startup.import_breakdown(timed["stderr"], top=15):
        print(f"  {sec:6.2f}  {name}")
    print(f"events (s after launch): {timed['events']}")


def gpu_syncs(hooks: str, iters: int = 40, warmup: int = 10) -> None:
    import collections
    import traceback
    import warnings

    import torch

    from benchmarks import w_resnet50_gpu
    from benchmarks.common import compose_config, engine_train
    from ssl_engine.hooks import SSLHook

    if not torch.cuda.is_available():
        sys.exit("gpu-syncs needs a CUDA GPU")
    os.environ.setdefault("BENCH_GPU_ITERS", str(iters))
    s = w_resnet50_gpu.settings()
    sites: Dict[str, int] = collections.Counter()
    counted = {"steps": 0}
    data_wait: List[float] = []

    class SyncCensus(SSLHook):
        """Turns the sync debug mode on after the warm-up steps and off at the end."""

        def on_step(self, task: Any) -> None:
            if task.iteration == warmup:
                torch.cuda.set_sync_debug_mode("warn")
            elif task.iteration > warmup:
                counted["steps"] += 1
                data_wait.append(task.last_data_time)

        def on_end(self, task: Any) -> None:
            torch.cuda.set_sync_debug_mode(0)

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchronizing" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename and "warnings" not in f.filename]
        where = " <- ".join(f"{short(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))
        sites[where] += 1

    old = warnings.showwarning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            out = engine_train(compose_config(w_resnet50_gpu.overrides(s)), default_hooks=hooks == "default",
                               extra_hooks=[SyncCensus()])
    finally:
        warnings.showwarning = old
        torch.cuda.set_sync_debug_mode(0)
    n = max(counted["steps"], 1)
    print(f"CUDA syncs in {counted['steps']} train iterations after {warmup} warm-up ({hooks} hooks), per iteration:")
    for where, count in sorted(sites.items(), key=lambda kv: -kv[1]):
        print(f"  {count / n:6.2f}  {where}")
    if not sites:
        print("  none")
    from benchmarks.common import iteration_times, median

    print(f"median iteration {1e3 * median(iteration_times(out['steps'], True, warmup=warmup)):.2f} ms, "
          f"of which waiting for the loader {1e3 * median(data_wait):.2f} ms (debug mode on: syncs warn)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("iteration", "steps", "phases", "startup", "gpu-syncs"))
    parser.add_argument("--case", choices=("tiny", "overhead"), default="tiny")
    parser.add_argument("--hooks", choices=("default", "none"), default="default")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="startup: fresh processes for the stage timings")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.what == "iteration":
        profile_iteration(args.case, args.hooks, args.top)
    elif args.what == "steps":
        profile_steps(args.case, args.hooks)
    elif args.what == "phases":
        profile_phases()
    elif args.what == "gpu-syncs":
        gpu_syncs(args.hooks)
    else:
        profile_startup(args.top, args.repeats)


if __name__ == "__main__":
    main()
