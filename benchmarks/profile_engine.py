#!/usr/bin/env python
"""Where the engine's time goes: cProfile of a benchmark workload, per iteration.

    python benchmarks/profile_engine.py iteration [--case tiny|overhead] [--hooks default|none]
    python benchmarks/profile_engine.py phases
    python benchmarks/profile_engine.py startup

- ``iteration``: one W-tiny engine run under cProfile; the functions with the most own time,
  in microseconds per iteration (cProfile inflates Python-heavy code, so read the ranking, not
  the absolute figures), then the same summed per ssl_engine source file.
- ``phases``: the W-phases engine run with each part of a phase change timed (phase-end hooks,
  meter sync, advance_phase / new data iterator), next to the step clock's phase-change figure.
- ``startup``: the startup command under cProfile (cumulative time of the engine's functions)
  and the import time per top-level package.
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


def profile_startup(top: int) -> None:
    from benchmarks import startup

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("iteration", "phases", "startup"))
    parser.add_argument("--case", choices=("tiny", "overhead"), default="tiny")
    parser.add_argument("--hooks", choices=("default", "none"), default="default")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.what == "iteration":
        profile_iteration(args.case, args.hooks, args.top)
    elif args.what == "phases":
        profile_phases()
    else:
        profile_startup(args.top)


if __name__ == "__main__":
    main()
