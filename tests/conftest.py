"""Shared test helpers: run the real tool in a subprocess, as a user would."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOL = str(REPO / "tools" / "run_distributed_engines.py")


def tool_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    env.pop("SSL_ENGINE_DEBUG", None)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SSL_ENGINE_SPAWNED"):
        env.pop(k, None)
    env.update(extra or {})
    return env


def run_tool(args: List[str], env: Optional[Dict[str, str]] = None, timeout: float = 300,
             script: str = TOOL) -> subprocess.CompletedProcess:
    """Run tools/run_distributed_engines.py (or another tool) with ``args``; capture output."""
    return subprocess.run(
        [sys.executable, script, *args], cwd=str(REPO), env=tool_env(env), capture_output=True, text=True,
        timeout=timeout,
    )


# the tests that take longest (30-140 s each on 2 cores), run first: under pytest-xdist a long test
# that starts last keeps one worker busy while the others have nothing left to do. Only tests
# without a module-scoped fixture that runs the tool: taken out of their module's order, such a
# fixture would be built once more for them
_LONGEST = (
    "test_engine.py::test_supervised_digits_reaches_90_percent",
    "test_slurm.py::test_local_jobs_complete_and_a_preempted_job_resumes_exactly",
    "test_distributed.py::test_ranks_and_workers_run_under_a_temp_dir_too_long_for_sockets",
    "test_resume.py::test_a_preemption_signal_to_the_process_group_checkpoints_with_forkserver_ranks",
    "test_features.py::test_knn_compares_class_folders_by_name_when_the_test_folder_lacks_a_class",
    "test_checkpoint.py::test_a_named_checkpoint_whose_bytes_changed_is_one_line_and_never_loaded",
    "test_engine.py::test_vissl_simclr_config_runs_on_two_cpu_processes",
)


def pytest_collection_modifyitems(config, items):
    """The longest tests first (_LONGEST); tests marked gpu need CUDA: skipped with a reason
    where there is none."""
    import torch

    rank = {name: i for i, name in enumerate(_LONGEST)}
    first = lambda item: rank.get(item.nodeid.split("/")[-1].split("[")[0], len(rank))  # noqa: E731
    items.sort(key=first)  # stable: the others keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def free_port() -> int:
    """A TCP port nobody listens on right now, for a test that names RUN_ID=host:port itself."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_left(marker: str, wait_s: float = 10.0) -> List[int]:
    """Pids still holding ``marker`` after waiting up to ``wait_s`` for them to end."""
    deadline = time.monotonic() + wait_s
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    return processes_with(marker)


def processes_with(marker: str) -> List[int]:
    """Pids whose environment holds ``marker`` (every process a run started inherits it)."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                if marker.encode() in Path(f"/proc/{d}/environ").read_bytes():
                    found.append(int(d))
            except OSError:
                continue
    return found


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tests share 2 cores with each other: keep torch to one thread in-process too."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def assert_bitwise_equal(a: Any, b: Any, where: str = "") -> None:
    """Bitwise equality of two loaded checkpoints (tensors, containers, values)."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"tensor differs at {where}"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"keys differ at {where}: {set(a) ^ set(b)}"
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"length differs at {where}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"value differs at {where}: {a!r} vs {b!r}"


def classy_state(path: Any) -> Dict[str, Any]:
    """The ``classy_state_dict`` of a checkpoint file, loaded on the CPU as the engine loads it."""
    import torch

    return torch.load(str(path), map_location="cpu", weights_only=True)["classy_state_dict"]


@pytest.fixture
def one_thread():
    """Tiny CPU models run faster on one torch thread than on oversubscribed ones; restored afterwards.
    Modules use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

