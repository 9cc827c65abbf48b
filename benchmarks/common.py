"""What every workload shares: result rows, step clocks, in-memory data, engine runs.

A workload measures the engine and a hand-written PyTorch loop doing the same work, in the
same process, interleaved, and reports ratios. Both sides record ``time.perf_counter()`` at
the end of every iteration (the engine through :class:`StepClock`, a hook that runs after all
others at ``on_step``; the plain loop inline), so that per-iteration times and phase changes are
read off the same kind of timestamps.
"""

import contextlib
import copy
import functools
import logging
import os
import platform
import resource
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]

# (phase_idx, train, perf_counter at the end of the iteration)
Step = Tuple[int, bool, float]


# ----------------------------------------------------------------------------- results


@dataclass
class Row:
    """One line of the results table.

    ``value`` is the engine's figure, ``reference`` the plain loop's (when there is one) and
    ``ratio`` engine / plain. ``target`` is the issue's target in words ("<= 1.05x"), and
    ``status`` PASS, FAIL, SKIP or '' for an informational row.
    """

    workload: str
    metric: str
    value: Optional[float]
    unit: str
    reference: Optional[float] = None
    ratio: Optional[float] = None
    target: str = ""
    status: str = ""
    note: str = ""
    extra: Dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def at_most(value: Optional[float], limit: float) -> str:
    """PASS when ``value <= limit``, FAIL otherwise (or when there is no value)."""
    if value is None or not np.isfinite(value):
        return "FAIL"
    return "PASS" if value <= limit else "FAIL"


def at_least(value: Optional[float], limit: float) -> str:
    if value is None or not np.isfinite(value):
        return "FAIL"
    return "PASS" if value >= limit else "FAIL"


def median(values: Sequence[float]) -> float:
    values = [v for v in values if v is not None and np.isfinite(v)]
    return float(statistics.median(values)) if values else float("nan")


def median_ratio(pairs: Sequence[Tuple[float, float]]) -> float:
    """The median of a/b over pairs measured side by side (robust to load that drifts between repeats)."""
    return median([a / b for a, b in pairs if b])


def rotate(items: Sequence[Any], k: int) -> List[Any]:
    """``items`` started at position ``k``: each repeat runs the variants in a different order."""
    k %= max(1, len(items))
    return list(items[k:]) + list(items[:k])


# ----------------------------------------------------------------------------- step clocks


def iteration_times(steps: Sequence[Step], train: bool = True, warmup: int = 5) -> List[float]:
    """Seconds between consecutive iterations of the same phase, for train (or test) phases.

    The first ``warmup`` intervals of the run's first phase of that kind are left out (allocator,
    autograd and cache warm-up); the first iteration of every phase has no interval (it starts
    after the phase change, measured by :func:`phase_changes`).
    """
    out: List[float] = []
    by_phase: Dict[int, List[float]] = {}
    for phase, is_train, t in steps:
        if is_train == train:
            by_phase.setdefault(phase, []).append(t)
    for i, phase in enumerate(sorted(by_phase)):
        times = by_phase[phase]
        deltas = [b - a for a, b in zip(times, times[1:])]
        out.extend(deltas[warmup:] if i == 0 else deltas)
    return out


def phase_changes(steps: Sequence[Step]) -> List[Dict[str, Any]]:
    """Every phase change: the time from the last iteration of a phase to the first of the next.

    ``gap`` is the raw interval; ``excess`` subtracts one typical iteration of the new phase
    (the median interval of that kind of phase in the same run), which leaves what the phase
    change itself cost: phase-end hooks, meter sync, new iterator, first batch wait.
    """
    typical = {kind: median(iteration_times(steps, kind, warmup=0)) for kind in (True, False)}
    first: Dict[int, Step] = {}
    last: Dict[int, Step] = {}
    for s in steps:
        first.setdefault(s[0], s)
        last[s[0]] = s
    phases = sorted(first)
    out = []
    for a, b in zip(phases, phases[1:]):
        gap = first[b][2] - last[a][2]
        kind = first[b][1]
        step = typical[kind] if np.isfinite(typical[kind]) else 0.0
        out.append({"from": "train" if last[a][1] else "test", "to": "train" if kind else "test",
                    "gap": gap, "excess": gap - step})
    return out


@functools.lru_cache(maxsize=None)
def step_clock_class() -> type:
    """The StepClock hook class (built on first use, so that importing this module, as loader
    workers do to unpickle a data source, does not import the engine's hooks)."""
    from ssl_engine.hooks.base import SSLHook

    class StepClock(SSLHook):
        """Records (phase_idx, train, perf_counter) after every other on_step hook."""

        priority = 100  # after every other hook: the timestamp closes the whole iteration

        def __init__(self, steps: Optional[List[Step]] = None) -> None:
            super().__init__()
            self.steps: List[Step] = [] if steps is None else steps

        def on_step(self, task: Any) -> None:
            self.steps.append((task.phase_idx, task.train, time.perf_counter()))

        def get_classy_state(self) -> Dict[str, Any]:
            return {}

        def set_classy_state(self, state: Dict[str, Any]) -> None:
            pass

    return StepClock


def make_step_clock(steps: Optional[List[Step]] = None) -> Any:
    """A new StepClock hook, recording into ``steps`` (a new list when None)."""
    return step_clock_class()(steps)


# ----------------------------------------------------------------------------- paired runs


class Baton:
    """Two loops in two threads taking turns, one iteration each (sides 0 and 1).

    A side that finished (or failed) never makes the other wait again.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._turn = 0
        self._done = [False, False]

    def wait_turn(self, side: int) -> None:
        """Block until it is ``side``'s turn, or the other side is done."""
        with self._cond:
            self._cond.wait_for(lambda: self._turn == side or self._done[1 - side])

    def hand_over(self, side: int) -> None:
        """``side`` finished an iteration: the other side runs one, then ``side`` goes on."""
        with self._cond:
            if self._done[1 - side]:
                return
            self._turn = 1 - side
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._turn == side or self._done[1 - side])

    def finish(self, side: int) -> None:
        with self._cond:
            self._done[side] = True
            self._turn = 1 - side
            self._cond.notify_all()


class PairedSteps(list):
    """A step record (list of ``(phase_idx, train, t)``) that hands the baton over at every
    ``append``, the call every step clock makes at the end of an iteration.

    The time spent waiting for the other loop is taken out: ``t`` is recorded on a clock that
    stops while the other side runs, so the interval between two consecutive entries is the
    time from this loop getting its turn back to the end of its next iteration.
    """

    def __init__(self, baton: Baton, side: int, clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__()
        self.baton, self.side, self.clock = baton, side, clock
        self.paused = 0.0

    def append(self, step: Step) -> None:  # type: ignore[override]
        phase, train, t = step
        super().append((phase, train, t - self.paused))
        self.baton.hand_over(self.side)
        self.paused += self.clock() - t


def run_paired(first: Callable[[List[Step]], Dict[str, Any]],
               second: Callable[[List[Step]], Dict[str, Any]]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Run two loops in turns, one iteration each (``first`` starts), each recording into the
    step list it is given; returns both results.

    Both loops then see the same machine, iteration by iteration: a slow spell of the machine,
    which lasts longer than a whole run, slows both alike. Both run in threads of their own, so
    that neither is the process's main thread, pinned to one CPU (only one runs at a time, so
    neither loses anything). Two identical plain W-tiny loops paired this way read ratios of
    0.984-1.022 over 8 pairs; unpinned (2-core virtual machine: the threads may then run on
    different vCPUs), 0.89-1.13; as separate runs, the same loop's medians ranged 3.31-4.60 ms.
    """
    baton = Baton()
    lists = (PairedSteps(baton, 0), PairedSteps(baton, 1))
    outs: List[Dict[str, Any]] = [{}, {}]

    def run(side: int, loop: Callable[[List[Step]], Dict[str, Any]]) -> None:
        baton.wait_turn(side)
        try:
            outs[side]["result"] = loop(lists[side])
        except BaseException as e:  # re-raised by the caller's thread
            outs[side]["error"] = e
        finally:
            baton.finish(side)

    saved = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if saved:
        os.sched_setaffinity(0, {min(saved)})  # this thread's; the loops' threads inherit it
    threads = [threading.Thread(target=run, args=(side, loop), name=f"bench-paired-{side}", daemon=True)
               for side, loop in enumerate((first, second))]
    start_error: Optional[BaseException] = None
    try:
        for side, t in enumerate(threads):
            try:
                t.start()
            except BaseException as e:  # e.g. no thread can be started: the other side must not wait for it
                baton.finish(side)
                start_error = e
                break
        for t in threads:
            if t.ident is not None:
                t.join()
    finally:
        if saved:
            restore_affinity(saved)
    if start_error is not None:
        raise start_error
    for out in outs:
        if "error" in out:
            raise out["error"]
    return outs[0]["result"], outs[1]["result"]


def restore_affinity(mask: Any) -> None:
    """Give every thread of this process, and of every process below it, the CPUs of ``mask``
    (the CPUs the caller had before the pair).

    A thread or process started during a paired run inherits its one CPU and keeps it (the
    engine's checkpoint writer thread lives as long as the process; a fork server started then
    would hand the CPU down to every later loader worker): left so, the later workloads'
    background writes and workers would all share one CPU.
    """
    if not os.path.isdir("/proc/self/task"):
        os.sched_setaffinity(0, mask)
        return
    pending, seen = ["self"], set()
    while pending:
        pid = pending.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # a process that has just ended
            continue
        for tid in tids:
            if tid in seen:
                continue
            seen.add(tid)
            try:
                os.sched_setaffinity(int(tid), mask)
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    pending.extend(f.read().split())
            except OSError:  # a thread or process that has just ended
                pass


# ----------------------------------------------------------------------------- data


_MEMORY: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}


def random_data(n: int, shape: Sequence[int], classes: int, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``n`` random float32 samples of ``shape`` and int64 labels in [0, classes)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g)


def set_memory_data(split: str, x: torch.Tensor, y: torch.Tensor) -> None:
    """The tensors the ``bench_memory`` data source serves for ``split`` (TRAIN / TEST)."""
    _MEMORY[split] = (x, y)


class MemorySource:
    """Data source ``bench_memory``: sample i is ``x[i]``, a tensor already in memory (no transforms needed).

    The engine's dataset, sampler and collator run unchanged around it, so the engine does the
    per-sample work a plain ``DataLoader(TensorDataset(x, y))`` does, plus its own.
    """

    def __init__(self, cfg: Any, path: str, split: str, source_index: int) -> None:
        self.x, self.y = _MEMORY[split]

    def __len__(self) -> int:
        return len(self.x)

    def get(self, idx: int) -> torch.Tensor:
        return self.x[idx]

    def get_batch(self, indices: np.ndarray) -> torch.Tensor:
        # the engine reads a whole batch with one call (no transforms, default collator)
        return self.x[torch.from_numpy(indices)]

    def labels(self) -> np.ndarray:
        # a copy: sending the dataset to loader workers moves the tensor's storage to shared
        # memory, which would leave a numpy view of the old storage dangling
        return self.y.numpy().copy()


_POOL_SIZE = 256


def pool_sample(pool: torch.Tensor, idx: int) -> torch.Tensor:
    return pool[idx % len(pool)]


class GeneratedSource:
    """Data source ``bench_generated``: ``DATA_LIMIT`` samples drawn from a pool of 256 random images.

    Memory does not grow with the number of samples, so peak RSS measures what extraction
    itself keeps, not the data set.
    """

    def __init__(self, cfg: Any, path: str, split: str, source_index: int) -> None:
        self.length = int(cfg.DATA[split].DATA_LIMIT)
        shape = list(cfg.DATA[split].get("SYNTHETIC_IMAGE_SIZE", 32) for _ in range(2))
        self.pool, _ = random_data(_POOL_SIZE, [3] + shape, 10, seed=1)

    def __len__(self) -> int:
        return self.length

    def get(self, idx: int) -> torch.Tensor:
        return pool_sample(self.pool, idx)

    def get_batch(self, indices: np.ndarray) -> torch.Tensor:
        return self.pool[torch.from_numpy(indices % len(self.pool))]

    def labels(self) -> np.ndarray:
        return np.arange(self.length, dtype=np.int64) % 10


def register_sources() -> None:
    """Register the benchmark's data sources (idempotent) and every built-in part of the engine."""
    from ssl_engine.engines.run import load_builtin_parts
    from ssl_engine.registry import DATA_SOURCES

    load_builtin_parts()
    for name, cls in (("bench_memory", MemorySource), ("bench_generated", GeneratedSource)):
        if name not in DATA_SOURCES:
            DATA_SOURCES.register(name)(cls)


# ----------------------------------------------------------------------------- engine runs


def sgd_overrides(momentum: float, weight_decay: Optional[float] = 0.0, epochs: int = 1) -> List[str]:
    """SGD at a constant lr of 0.1 for ``epochs`` (``weight_decay=None`` keeps the config's default)."""
    out = ["config.OPTIMIZER.name=sgd", f"config.OPTIMIZER.momentum={momentum}"]
    if weight_decay is not None:
        out.append(f"config.OPTIMIZER.weight_decay={weight_decay}")
    return out + [
        f"config.OPTIMIZER.num_epochs={epochs}",
        "config.OPTIMIZER.param_schedulers.lr.name=constant",
        "config.OPTIMIZER.param_schedulers.lr.value=0.1",
    ]


def memory_train_overrides(batch: int) -> List[str]:
    """One process on the CPU training on the ``bench_memory`` source, no loader workers, no test phase."""
    return [
        "config.MACHINE.DEVICE=cpu",
        "config.DATA.NUM_DATALOADER_WORKERS=0",
        "config.DATA.PIN_MEMORY=false",
        "config.DATA.TRAIN.DATA_SOURCES=[bench_memory]",
        "config.DATA.TRAIN.LABEL_SOURCES=[bench_memory]",
        f"config.DATA.TRAIN.BATCHSIZE_PER_REPLICA={batch}",
        "config.TEST_MODEL=false",
    ]


def compose_config(overrides: Sequence[str]) -> Any:
    """The engine's config for ``overrides`` (composed and validated once, copied per run)."""
    from ssl_engine.config import compose

    register_sources()
    return compose(list(overrides), warn_unused=False)


def with_folder(cfg: Any, folder: str) -> Any:
    """A copy of ``cfg`` whose CHECKPOINT.DIR is ``folder``."""
    from ssl_engine.config.attr_dict import AttrDict

    out = AttrDict(copy.deepcopy(cfg.to_dict()))
    out.CHECKPOINT.DIR = str(folder)
    return out


@contextlib.contextmanager
def engine_logging(folder: str) -> Iterator[None]:
    """The engine's logging of a real run (rank 0: log.txt in the folder), minus the console.

    Leaves the root logger as it found it.
    """
    from ssl_engine.logger import setup_logging

    root = logging.getLogger()
    saved_level, saved_handlers = root.level, list(root.handlers)
    for h in saved_handlers:  # e.g. a basicConfig handler that classy_vision's logging.info() installed
        root.removeHandler(h)
    setup_logging(0, folder, False)
    for h in list(root.handlers):
        if not isinstance(h, logging.FileHandler):
            root.removeHandler(h)
    try:
        yield
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
            h.close()
        for h in saved_handlers:
            root.addHandler(h)
        root.setLevel(saved_level)


def engine_train(cfg: Any, default_hooks: bool, folder: Optional[str] = None,
                 extra_hooks: Sequence[Any] = (), steps: Optional[List[Step]] = None) -> Dict[str, Any]:
    """Train ``cfg`` in this process with SelfSupervisionTrainer; the step clock's record and timings.

    ``default_hooks=False`` is the engine with no hooks (only the step clock and ``extra_hooks``,
    which profilers use to look inside a run); the step clock records into ``steps`` when given
    (a :class:`PairedSteps`). Returns
    ``{"steps": [...], "seconds": wall time of construction + train(), "task": task}``.
    """
    from ssl_engine.hooks import default_hooks as build_default_hooks
    from ssl_engine.trainer import SelfSupervisionTrainer

    own = folder is None
    folder = folder or tempfile.mkdtemp(prefix="bench_engine_")
    run_cfg = with_folder(cfg, folder)
    clock = make_step_clock(steps)
    try:
        with engine_logging(folder):
            torch.manual_seed(run_cfg.SEED_VALUE)
            t0 = time.perf_counter()
            hooks = (build_default_hooks(run_cfg) if default_hooks else []) + list(extra_hooks) + [clock]
            trainer = SelfSupervisionTrainer(run_cfg, checkpoint_folder=folder, hooks=hooks)
            task = trainer.train()
            seconds = time.perf_counter() - t0
        close_loaders(task)
    finally:
        if own:
            remove_tree(folder)
    return {"steps": clock.steps, "seconds": seconds, "task": task}


def close_loaders(task: Any) -> None:
    """Stop the persistent loader workers of a finished task now (not at garbage collection)."""
    task.data_iterator = None
    for loader in getattr(task, "dataloaders", {}).values():
        it = getattr(loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        loader._iterator = None


def remove_tree(folder: str) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


# ----------------------------------------------------------------------------- the machine


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB.

    Read from VmHWM in /proc/self/status: ``ru_maxrss`` would do on most systems, but Linux
    carries it over an exec, so a child started by a big parent reports the parent's peak.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def current_rss_mb() -> float:
    """This process's resident set size now, in MiB."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return float("nan")


def machine_info() -> Dict[str, Any]:
    """What the figures were measured on: CPU, cores, load, library versions, GPU if any."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gb = float("nan")
    info: Dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": round(mem_gb, 1),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info
