"""Startup: wall time from launching the tool to the first training iteration.

Runs ``tools/run_distributed_engines.py config=quick/simclr_synthetic`` (one epoch, a fresh
checkpoint folder) in a subprocess, as a user would, with ``benchmarks/startup_hook.py`` as a
user module whose hook stamps the wall clock at on_start, at the first phase start and at the
end of the first iteration. The figure is the time from just before the process is launched to
the end of the first training iteration (median of the repeats).

Reference points: ``python -c "import torch, torchvision"`` in a fresh process (the floor no
engine on this stack can beat: most of torchvision's import is ``torch._dynamo``, which
torch.optim's Optimizer imports anyway, so any training run pays it), and one more run under
``python -X importtime``, whose import tree is summed per top-level package to show what
startup spends importing.
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Tuple

from benchmarks.common import REPO, Row, at_most, median

WORKLOAD = "Startup"
CONFIG = "quick/simclr_synthetic"
TARGET_S = 5.0


def tool_command(folder: str) -> List[str]:
    return [
        "tools/run_distributed_engines.py",
        f"config={CONFIG}",
        f"config.CHECKPOINT.DIR={folder}",
        "config.OPTIMIZER.num_epochs=1",
        f"config.USER_MODULES=[{REPO / 'benchmarks' / 'startup_hook.py'}]",
        "config.HOOKS.CUSTOM=[{name: BenchStartupClock}]",
    ]


def env() -> Dict[str, str]:
    out = dict(os.environ, PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SSL_ENGINE_SPAWNED"):
        out.pop(k, None)
    return out


def launch_once(python_flags: Tuple[str, ...] = (), timeout: float = 600) -> Dict[str, Any]:
    """One run of the tool, stopped (SIGKILL) once its first iteration is stamped.

    Returns the seconds from launch to each stamped event, and the process's stderr.
    """
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as folder:
        stamps = os.path.join(folder, "stamps.jsonl")
        err_path = os.path.join(folder, "stderr.txt")
        e = env()
        e["BENCH_STARTUP_FILE"] = stamps
        with open(err_path, "w") as err:
            t0 = time.time()
            proc = subprocess.Popen([sys.executable, *python_flags, *tool_command(os.path.join(folder, "run"))],
                                    cwd=str(REPO), env=e, stdout=subprocess.DEVNULL, stderr=err, text=True,
                                    start_new_session=True)  # its own group: loader workers are stopped with it
            events = _wait_for_first_step(proc, stamps, t0, timeout)
        with open(err_path) as f:
            stderr = f.read()
        if "first_step_end" not in events:
            raise RuntimeError(f"the startup run ended ({proc.returncode}) before its first iteration:\n{stderr[-3000:]}")
    return {"events": events, "stderr": stderr}


def _read_stamps(path: str, t0: float) -> Dict[str, float]:
    events: Dict[str, float] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    d = json.loads(line)
                    events[d["event"]] = d["time"] - t0
    return events


def _wait_for_first_step(proc: "subprocess.Popen[str]", stamps: str, t0: float, timeout: float) -> Dict[str, float]:
    """Poll the stamp file until the first iteration is stamped or the process ends; then stop it."""
    events: Dict[str, float] = {}
    try:
        while time.time() - t0 < timeout:
            events = _read_stamps(stamps, t0)
            if "first_step_end" in events or proc.poll() is not None:
                break
            time.sleep(0.05)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # our own child and its workers; the rest of the run is not measured
        except ProcessLookupError:
            pass
        proc.wait()
    return _read_stamps(stamps, t0) or events


def import_floor() -> float:
    """Seconds for a fresh interpreter to import torch and torchvision and exit."""
    t0 = time.time()
    subprocess.run([sys.executable, "-c", "import torch, torchvision"], env=env(), check=True, capture_output=True)
    return time.time() - t0


_IMPORT_LINE = re.compile(r"^import time:\s+(\d+)\s+\|\s+(\d+)\s+\|\s*(\S+)")


def import_breakdown(stderr: str, top: int = 12) -> List[Tuple[str, float]]:
    """Import seconds per top-level package (the sum of its modules' own import time, whoever
    imported them), largest first, from ``-X importtime`` output."""
    per: Dict[str, float] = {}
    for line in stderr.splitlines():
        m = _IMPORT_LINE.match(line)
        if not m:
            continue
        key = m.group(3).split(".")[0]
        per[key] = per.get(key, 0.0) + int(m.group(1)) / 1e6
    return sorted(per.items(), key=lambda kv: -kv[1])[:top]


def run(repeats: int = 2, **_: Any) -> List[Row]:
    runs = [launch_once() for _ in range(repeats)]
    floor = median([import_floor() for _ in range(repeats)])
    first_step = median([r["events"].get("first_step_end", float("nan")) for r in runs])
    on_start = median([r["events"].get("on_start", float("nan")) for r in runs])
    timed = launch_once(("-X", "importtime"))
    breakdown = import_breakdown(timed["stderr"])
    imports_total = sum(s for _, s in import_breakdown(timed["stderr"], top=10_000))
    return [
        Row(WORKLOAD, f"{CONFIG}: launch to end of first iteration", first_step, "s", floor, first_step / floor,
            f"< {TARGET_S:.0f} s", at_most(first_step, TARGET_S - 1e-9),
            note="reference: python -c 'import torch, torchvision'",
            extra={"runs": [r["events"] for r in runs]}),
        Row(WORKLOAD, f"{CONFIG}: launch to on_start (model, data, hooks built)", on_start, "s"),
        Row(WORKLOAD, "imports under -X importtime (all top-level packages)", imports_total, "s",
            note=", ".join(f"{k} {v:.2f}" for k, v in breakdown[:8]),
            extra={"breakdown_s": breakdown, "events_under_importtime": timed["events"]}),
    ]
