"""Faults during a run, untrusted files, and the checkpoint-folder lock, through the real tool.

- a disk that fills up while a checkpoint is written (a patched file write raises ENOSPC
  mid-file) leaves the previous checkpoint and the checkpoint.torch pointer loadable, and stops
  the run with one line naming the folder;
- a non-finite loss stops the run naming iteration and phase, with no checkpoint of that state;
- an image that cannot be decoded is skipped (and named) or fatal, per ON_CORRUPT_IMAGE; the
  fatal error raised in a dataloader worker of a spawned rank comes out as one line;
- Ctrl-C ends the run with exit code 130, no partial files, no lock, no leftover process;
- a second run on a folder in use is refused naming the owner's pid and host; a stale lock
  (dead pid on this host) is taken over;
- a pickle payload planted in a checkpoint folder is never run; file names are built from
  integers and fixed words.
"""

import errno
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, TOOL, run_tool, tool_env
from ssl_engine import checkpoint as ck
from ssl_engine.errors import CheckpointError, FolderLockedError
from ssl_engine.lock import LOCK_NAME, FolderLock, check_folder_free

BASE = [
    "config=quick/supervised_digits",
    "config.TEST_MODEL=false",
    "config.DATA.TRAIN.DATA_LIMIT=32",
    "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=16",
    "config.MODEL.TRUNK.NAME=mlp",
    "config.MODEL.TRUNK.MLP.DIMS=[3072,16]",
    "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[16,10]}]]",
]


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    err = proc.stderr.strip()
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"exit {proc.returncode}, stderr:\n{err[-4000:]}"
    assert "Traceback" not in err
    return lines[0]


def temp_files(folder: Path) -> list:
    return [p.name for p in folder.iterdir() if ".tmp." in p.name or p.name.endswith(".takeover")]


def write_module(folder: Path, name: str, body: str) -> Path:
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return path


# ------------------------------------------------------------------------------------------------
# disk full


FULL_DISK = '''\
    """The disk fills up while model_phase1.torch is written: its temporary file takes 4 KiB,
    then every write raises ENOSPC, as a real full disk does in the middle of torch.save."""
    import errno
    import io
    import os

    from ssl_engine import checkpoint

    _real_open = open


    class _FillsUp(io.FileIO):
        def write(self, data):
            if self.tell() + memoryview(data).nbytes > 4096:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write(data)


    def _open(file, mode="r", *args, **kwargs):
        if os.path.basename(str(file)).startswith(".model_phase1.torch.tmp") and "w" in mode:
            return _FillsUp(file, "w")
        return _real_open(file, mode, *args, **kwargs)


    checkpoint.open = _open  # the name atomic_write looks up
'''


def test_disk_full_mid_checkpoint_keeps_the_previous_one_and_names_the_folder(tmp_path):
    module = write_module(tmp_path, "full_disk", FULL_DISK)
    run = tmp_path / "run"
    proc = run_tool(BASE + [f"config.CHECKPOINT.DIR={run}", "config.OPTIMIZER.num_epochs=3",
                            f"config.USER_MODULES=[{module}]"])
    assert proc.returncode == 2, proc.stderr[-4000:]
    line = one_error_line(proc)
    assert str(run) in line and "model_phase1.torch" in line and "disk is full" in line, line
    assert os.readlink(run / ck.POINTER) == "model_phase0.torch"
    data = ck.load_checkpoint(run / ck.POINTER)
    assert data["train_phase_idx"] == 0 and ck.is_engine_checkpoint(data)
    assert not (run / "model_phase1.torch").exists()
    assert temp_files(run) == [] and not (run / LOCK_NAME).exists()


LOCK_DISK_FULL = '''\
    """The disk is full when the run writes its folder's lock file: the file is made (O_CREAT
    takes no block), its record cannot be written."""
    import errno
    import os

    from ssl_engine import lock

    _real_write = os.write


    class _Os:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def write(fd, data):
            if os.readlink(f"/proc/self/fd/{fd}").endswith((".lock", ".lock.takeover")):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return _real_write(fd, data)


    lock.os = _Os()  # only the lock module's writes
'''


@pytest.mark.parametrize("engine", ["train", "extract_features"])
@pytest.mark.parametrize("stale", [False, True])
def test_a_full_disk_when_the_lock_file_is_written_is_one_line_and_leaves_no_empty_lock(tmp_path, engine, stale):
    """The lock file's record cannot be written (ENOSPC): the OSError was a traceback (exit 1) and
    left an empty train.lock / extract.lock in the folder, which the next run waited on and took
    over with a warning; now one line naming the file, exit 2, and no lock file left. The same for
    the guard file of the takeover of a stale lock (a run killed on that disk): the stale lock is
    left for the next run to take over, and the guard is removed."""
    module = write_module(tmp_path, "lock_disk_full", LOCK_DISK_FULL)
    run = tmp_path / "run"
    name = "train.lock" if engine == "train" else "extract.lock"
    old = ""
    if stale:
        run.mkdir()
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        old = json.dumps({"pid": dead.pid, "host": socket.gethostname(), "start_ticks": 1, "token": "old"})
        (run / name).write_text(old)
    proc = run_tool(BASE + [f"config.CHECKPOINT.DIR={run}", f"config.USER_MODULES=[{module}]",
                            f"engine_name={engine}"])
    assert proc.returncode == 2, proc.stderr[-4000:]
    if stale:
        assert one_error_line(proc) == (
            f"error: cannot write {run / (name + '.takeover')} (to take over the stale lock {name}): No space left on "
            f"device; free space there (or use another folder) and rerun")
        assert (run / name).read_text() == old
    else:
        assert one_error_line(proc) == (f"error: cannot write the lock file {run / name}: No space left on device; "
                                        f"free space there (or use another folder) and rerun")
        assert not (run / name).exists()
    assert temp_files(run) == []


class _FullDisk:
    """A file whose writes and flushes fail as on a full disk."""

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    flush = close = lambda self: self.write(b"")


def test_a_log_file_that_cannot_be_written_is_one_warning_not_a_traceback_per_record(tmp_path, capsys):
    """log.txt on a full disk: logging printed '--- Logging error ---' and a traceback on stderr for
    every record of the run (a full disk at extraction or training start); now one warning names
    the file, the records still reach the console, and the file is written no more."""
    from ssl_engine.logger import setup_logging

    root = logging.getLogger()
    level = root.level
    try:
        setup_logging(0, str(tmp_path))
        handler = next(h for h in root.handlers if isinstance(h, logging.FileHandler) and getattr(h, "_ssl_engine", False))
        handler.stream = _FullDisk()
        for i in range(3):
            logging.getLogger("ssl_engine.test").info("record %d", i)
        captured = capsys.readouterr()
    finally:
        for h in root.handlers:
            if isinstance(h, logging.FileHandler) and getattr(h, "_ssl_engine", False):
                h.stream = None  # nothing left to close
        setup_logging(0, None)  # the handlers of this test go
        root.setLevel(level)
    assert "Traceback" not in captured.err and "Logging error" not in captured.err, captured.err
    warnings = [ln for ln in captured.out.splitlines() if ln.startswith("W ")]
    assert len(warnings) == 1 and warnings[0].endswith(
        f"cannot write {tmp_path / 'log.txt'}: No space left on device; the log goes on on the console only"), captured.out
    assert [ln.split("] ")[1] for ln in captured.out.splitlines() if ln.startswith("I ")] == [
        "record 0", "record 1", "record 2"]


JSON_DISK_FULL = '''\
    """The disk fills up while a line of {target} is appended: after {after} lines, the next write
    to it takes half the line (a short write, when {short}), every later one raises ENOSPC."""
    import errno
    import os

    from ssl_engine.hooks import metrics_hook, param_groups, periodic_writer

    _real_write = os.write
    _writes = []


    class _Os:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def write(fd, data):
            if os.readlink(f"/proc/self/fd/{{fd}}").endswith("{target}") and {after} < len(_writes) + 1:
                _writes.append(fd)
                if len(_writes) == {after} + 1 and {short}:
                    return _real_write(fd, bytes(data)[: len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if os.readlink(f"/proc/self/fd/{{fd}}").endswith("{target}"):
                _writes.append(fd)
            return _real_write(fd, data)


    metrics_hook.os = periodic_writer.os = param_groups.os = _Os()  # only these hooks' writes
'''


@pytest.mark.parametrize("target,after,short", [("stdout.json", 0, True), ("stdout.json", 1, True),
                                               ("stdout.json", 1, False), ("metrics.json", 0, False),
                                               ("param_groups.json", 0, True), ("param_groups.json", 0, False)])
def test_a_full_disk_while_a_json_line_is_appended_is_one_line_and_leaves_no_half_line(tmp_path, target, after, short):
    """stdout.json / metrics.json on a disk that fills up: the OSError of os.write names no file, so
    it was a traceback (exit 1) instead of the one line of a file-system error, and stdout.json kept
    the half line a short write left. Now one line naming the file (exit 2); the file holds whole lines."""
    module = write_module(tmp_path, "json_disk_full", JSON_DISK_FULL.format(target=target, after=after, short=short))
    run = tmp_path / "run"
    proc = run_tool(BASE + [f"config.CHECKPOINT.DIR={run}", f"config.USER_MODULES=[{module}]",
                            "config.LOG_FREQUENCY=1", "config.HOOKS.LOG_PARAM_GROUPS=true"])
    assert proc.returncode == 2, proc.stderr[-4000:]
    line = one_error_line(proc)
    assert line.startswith(f"error: cannot use {run / target}: ") and line.endswith("; free some space"), line
    text = (run / target).read_text()
    assert text.count("\n") == after and text.endswith("\n" if after else ""), text
    assert all(json.loads(ln)["train_phase_idx"] == 0 for ln in text.splitlines())
    assert temp_files(run) == [] and not (run / LOCK_NAME).exists()


TB_DISK_FULL = '''\
    """The disk is full when TensorBoard's event file is written (its writer thread writes it)."""
    import errno
    import os

    from tensorboard.compat.tensorflow_stub.io import gfile


    def _write(self, filename, file_content, mode):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


    gfile.LocalFileSystem._write = _write
'''


@pytest.mark.parametrize("histograms", [False, True])
def test_a_full_disk_under_tensorboard_is_one_line_naming_its_folder(tmp_path, histograms):
    """TensorBoard's event file on a full disk: its writer thread printed the OSError's traceback,
    the SummaryWriter raised it again (naming no file) as a traceback, exit 1, and closing the
    writer on the way out raised it a third time over the run's own error. Now one line naming the
    events folder, exit 2."""
    module = write_module(tmp_path, "tb_disk_full", TB_DISK_FULL)
    run = tmp_path / "run"
    proc = run_tool(BASE + [f"config.CHECKPOINT.DIR={run}", f"config.USER_MODULES=[{module}]",
                            "config.HOOKS.TENSORBOARD_SETUP.USE_TENSORBOARD=true", "config.LOG_FREQUENCY=1",
                            f"config.HOOKS.TENSORBOARD_SETUP.LOG_PARAMS={histograms}"])
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert one_error_line(proc) == f"error: cannot use {run / 'tb_logs'}: No space left on device; free some space"
    assert temp_files(run) == [] and not (run / LOCK_NAME).exists()


# ------------------------------------------------------------------------------------------------
# non-finite loss


NAN_LOSS = '''\
    """A cross-entropy loss that returns NaN from its third call on."""
    import torch
    from classy_vision.losses import ClassyLoss

    from ssl_engine.registry import LOSSES


    @LOSSES.register("nan_from_third_step")
    class NanFromThirdStep(ClassyLoss):
        def __init__(self):
            super().__init__()
            self.calls = 0

        @classmethod
        def from_config(cls, config):
            return cls()

        def forward(self, output, target):
            output = output[0] if isinstance(output, (list, tuple)) else output
            target = target[0] if isinstance(target, (list, tuple)) else target
            self.calls += 1
            loss = torch.nn.functional.cross_entropy(output, target)
            return loss * float("nan") if self.calls >= 3 else loss
'''


def run_until_nan(tmp_path: Path, *extra: str) -> tuple:
    """3 epochs with a loss that turns NaN at its third call; (run folder, the one error line)."""
    module = write_module(tmp_path, "nan_loss", NAN_LOSS)
    run = tmp_path / "run"
    proc = run_tool(BASE + [f"config.CHECKPOINT.DIR={run}", "config.OPTIMIZER.num_epochs=3",
                            "config.LOSS.name=nan_from_third_step", f"config.USER_MODULES=[{module}]", *extra])
    assert proc.returncode == 1, proc.stderr[-4000:]
    return run, one_error_line(proc)


def test_non_finite_loss_stops_naming_iteration_and_phase_without_checkpointing_it(tmp_path):
    run, line = run_until_nan(tmp_path, "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=1")
    # two iterations per phase: the third step is iteration 2, the first of phase 1
    assert "iteration 2" in line and "phase 1" in line and "train" in line, line
    names = sorted(p.name for p in ck.list_checkpoints(run))
    assert names == ["model_iteration1.torch", "model_iteration2.torch", "model_phase0.torch"]
    path, data = ck.newest_good_checkpoint(run)
    assert data["iteration"] == 2 and torch.isfinite(
        next(iter(data["classy_state_dict"]["base_model"]["model"]["trunk"].values()))).all()
    assert temp_files(run) == [] and not (run / LOCK_NAME).exists()


def test_non_finite_loss_in_a_spawned_rank_is_one_line_with_the_rank(tmp_path):
    run, line = run_until_nan(tmp_path, "config.DISTRIBUTED.NUM_PROC_PER_NODE=2")
    # 16 samples and one iteration per rank and phase: the third step is the first of phase 2
    assert line.startswith("error: rank ") and "the loss is nan at iteration 2 (phase 2, train" in line, line
    assert sorted(p.name for p in ck.list_checkpoints(run)) == ["model_phase0.torch", "model_phase1.torch"]


# ------------------------------------------------------------------------------------------------
# corrupt images


@pytest.fixture
def images_with_a_corrupt_one(tmp_path) -> Path:
    import numpy as np
    from PIL import Image

    root = tmp_path / "images"
    rng = np.random.RandomState(0)
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for i in range(4):
            Image.fromarray(rng.randint(0, 255, (8, 8, 3), dtype=np.uint8)).save(root / cls / f"{i}.png")
    (root / "a" / "2.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    return root


def _folder_data(images: Path, mode: str) -> list:
    return ["config.DATA.TRAIN.DATA_SOURCES=[disk_folder]", f"config.DATA.TRAIN.DATA_PATHS=[{images}]",
            "config.DATA.TRAIN.LABEL_SOURCES=[disk_folder]", "config.DATA.TRAIN.DATA_LIMIT=-1",
            "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=2", f"config.DATA.TRAIN.ON_CORRUPT_IMAGE={mode}"]


def test_corrupt_image_is_skipped_and_named(tmp_path, images_with_a_corrupt_one):
    run = tmp_path / "run"
    proc = run_tool(BASE + _folder_data(images_with_a_corrupt_one, "skip")
                    + [f"config.CHECKPOINT.DIR={run}", "config.OPTIMIZER.num_epochs=1"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    bad = str(images_with_a_corrupt_one / "a" / "2.png")
    log = (run / "log.txt").read_text()
    assert f"skipping unreadable TRAIN image '{bad}'" in log
    assert ck.final_checkpoint(run) is not None


def test_corrupt_image_is_fatal_in_one_line_from_a_worker_of_a_spawned_rank(tmp_path, images_with_a_corrupt_one):
    run = tmp_path / "run"
    proc = run_tool(BASE + _folder_data(images_with_a_corrupt_one, "error")
                    + [f"config.CHECKPOINT.DIR={run}", "config.OPTIMIZER.num_epochs=1",
                       "config.DISTRIBUTED.NUM_PROC_PER_NODE=2", "config.DATA.NUM_DATALOADER_WORKERS=1"])
    assert proc.returncode == 2, proc.stderr[-4000:]
    line = one_error_line(proc)
    bad = str(images_with_a_corrupt_one / "a" / "2.png")
    assert f"TRAIN image '{bad}' cannot be read" in line and "ON_CORRUPT_IMAGE=skip" in line, line
    assert "Caught" not in line and "DataLoader worker" not in line
    assert ck.list_checkpoints(run) == [] and temp_files(run) == [] and not (run / LOCK_NAME).exists()


# ------------------------------------------------------------------------------------------------
# Ctrl-C, and a second run on a folder in use


SLOW_STEPS = '''\
    """A hook that makes each step take a while and says when training has begun."""
    import time
    from pathlib import Path

    from ssl_engine.hooks.base import SSLHook
    from ssl_engine.registry import HOOKS


    @HOOKS.register("SlowSteps")
    class SlowSteps(SSLHook):
        def __init__(self, marker):
            super().__init__()
            self.marker = Path(marker)

        def on_step(self, task):
            self.marker.touch()
            time.sleep(0.2)
'''


def _group_is_gone(pgid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _sigint_as_in_a_terminal() -> None:
    """A command typed in a terminal starts with SIGINT at its default. pytest itself may run
    with SIGINT ignored (a shell script starts background jobs that way, and CI runners do),
    and a child that inherits the ignore rightly lets Ctrl-C pass: reset it in the child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_second_run_on_a_busy_folder_is_refused_and_ctrl_c_stops_cleanly(tmp_path):
    module = write_module(tmp_path, "slow_steps", SLOW_STEPS)
    run = tmp_path / "run"
    marker = tmp_path / "training_started"
    first = subprocess.Popen(
        [sys.executable, TOOL, *BASE, f"config.CHECKPOINT.DIR={run}", "config.OPTIMIZER.num_epochs=20000",
         "config.DATA.NUM_DATALOADER_WORKERS=2", f"config.USER_MODULES=[{module}]",
         f"config.HOOKS.CUSTOM=[{{name:SlowSteps,params:{{marker:{marker}}}}}]"],
        cwd=str(REPO), env=tool_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=_sigint_as_in_a_terminal,
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), f"training did not start: {first.poll()} {first.stderr.read()[-3000:] if first.poll() is not None else ''}"
        owner = json.loads((run / LOCK_NAME).read_text())
        assert owner["pid"] == first.pid and owner["host"] == socket.gethostname()

        second = run_tool(BASE + [f"config.CHECKPOINT.DIR={run}", "config.OPTIMIZER.num_epochs=20000"])
        assert second.returncode == 2, second.stderr[-3000:]
        line = one_error_line(second)
        assert f"pid {first.pid} on host {socket.gethostname()}" in line and str(run / LOCK_NAME) in line, line

        os.killpg(first.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert first.returncode == 130, f"stderr: {err[-3000:]}\nstdout: {out[-3000:]}"
    assert "interrupted" in err and "Traceback" not in err, err[-4000:]
    assert _group_is_gone(first.pid), "processes of the interrupted run are still alive"
    assert temp_files(run) == [] and not (run / LOCK_NAME).exists()
    found = ck.newest_good_checkpoint(run)
    assert found is not None  # what was written before Ctrl-C still loads


def test_stale_lock_is_taken_over_and_a_planted_payload_never_runs(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "start_ticks": 1,
                                             "started": "2000-01-01 00:00:00", "token": "old"}))
    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"phase_idx": 3, "classy_state_dict": {"base_model": Payload()}}, run / "model_phase3.torch")
    proc = run_tool(BASE + [f"config.CHECKPOINT.DIR={run}", "config.OPTIMIZER.num_epochs=1"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = (run / "log.txt").read_text()
    assert f"taking over the stale lock of checkpoint folder {run}" in log and f"pid {dead.pid}" in log
    assert "skipping checkpoint model_phase3.torch" in log
    assert not marker.exists()
    assert not (run / LOCK_NAME).exists() and ck.final_checkpoint(run) is not None


# ------------------------------------------------------------------------------------------------
# the lock itself, across processes


HOLD = "from ssl_engine.lock import FolderLock; import sys, time; l = FolderLock(sys.argv[1]); l.acquire(); print('held', flush=True); time.sleep(60)"

RACE = textwrap.dedent("""\
    import sys, time
    from ssl_engine.errors import FolderLockedError
    from ssl_engine.lock import FolderLock
    while time.time() < float(sys.argv[2]):
        pass
    lock = FolderLock(sys.argv[1])
    try:
        lock.acquire()
        print("got", flush=True)
        time.sleep(8)
        lock.release()
    except FolderLockedError as e:
        print("refused", e, flush=True)
""")


def test_lock_held_by_a_live_process_is_refused_naming_it(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env=tool_env())
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderLockedError, match=f"pid {holder.pid} on host {socket.gethostname()}"):
            check_folder_free(tmp_path)
        with pytest.raises(FolderLockedError, match="in use by another training run"):
            FolderLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    # killed without releasing: the lock is stale now, and taken over
    lock = FolderLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.parametrize("guard", ["dead_owner", "empty"])
def test_a_takeover_guard_left_by_a_killed_process_does_not_block_the_folder(tmp_path, caplog, guard):
    """A process killed while it deleted a stale lock leaves its takeover guard: the next run takes
    the folder over at once when the guard's owner is dead (an empty guard, killed before it wrote
    its owner, after a few seconds), with one warning; it was 10 s of retries, ~200 warnings and
    "other runs keep taking it" (exit 2), for a folder nobody held."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = {"pid": dead.pid, "host": socket.gethostname(), "start_ticks": 1, "token": "old"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(stale))
    guard_file = tmp_path / (LOCK_NAME + ".takeover")
    guard_file.write_text(json.dumps(stale) if guard == "dead_owner" else "")
    if guard == "empty":
        old = time.time() - 6
        os.utime(guard_file, (old, old))
    caplog.set_level(logging.WARNING, logger="ssl_engine.lock")
    t0 = time.monotonic()
    with FolderLock(tmp_path) as held:
        assert held.held and json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert time.monotonic() - t0 < 5.0
    assert [r.getMessage() for r in caplog.records].count(
        f"taking over the stale lock of checkpoint folder {tmp_path}: its owner (pid {dead.pid} on host "
        f"{socket.gethostname()}) no longer runs") == 1
    assert not guard_file.exists() and not (tmp_path / LOCK_NAME).exists()


def test_two_processes_racing_for_one_folder_get_it_once(tmp_path):
    start = str(time.time() + 4.0)
    procs = [subprocess.Popen([sys.executable, "-c", RACE, str(tmp_path), start], stdout=subprocess.PIPE, text=True,
                              env=tool_env()) for _ in range(3)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert sorted(o.split()[0] for o in outs) == ["got", "refused", "refused"], outs
    assert not (tmp_path / LOCK_NAME).exists()


def test_lock_from_another_host_is_refused_unless_it_is_this_slurm_job(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 4242, "host": "some-other-node", "slurm_job_id": "77",
                                                  "token": "theirs"}))
    with pytest.raises(FolderLockedError, match=r"pid 4242 on host some-other-node.*delete .*train\.lock"):
        FolderLock(tmp_path).acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # this job, requeued on another node: its old lock is stale
    lock = FolderLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.record["token"]
    lock.release()


def test_reused_pid_and_garbled_lock_are_stale_and_release_never_removes_anothers_lock(tmp_path):
    # our parent runs, but started at another time than the lock says: its pid was reused
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(),
                                                  "start_ticks": -5, "token": "old"}))
    lock = FolderLock(tmp_path)
    lock.acquire()
    # someone else's lock replaced ours (e.g. by hand): release leaves it alone
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "x", "token": "someone"}))
    lock.release()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == "someone"
    # a garbled lock file older than a few seconds is taken over
    (tmp_path / LOCK_NAME).write_text("{not json")
    old = time.time() - 60
    os.utime(tmp_path / LOCK_NAME, (old, old))
    with FolderLock(tmp_path) as held:
        assert held.held
    assert not (tmp_path / LOCK_NAME).exists()


# ------------------------------------------------------------------------------------------------
# names of written files


def test_checkpoint_names_are_built_from_integers_only():
    assert ck.phase_checkpoint_name(3) == "model_phase3.torch"
    assert ck.iteration_checkpoint_name(120) == "model_iteration120.torch"
    assert ck.final_checkpoint_name(9) == "model_final_checkpoint_phase9.torch"
    for trick in ("../../etc/passwd", "1/../x", "1; rm"):
        for make in (ck.phase_checkpoint_name, ck.iteration_checkpoint_name, ck.final_checkpoint_name):
            with pytest.raises((ValueError, TypeError)):
                make(trick)


def test_feature_layer_names_in_a_config_cannot_leave_the_folder():
    from ssl_engine.config import compose
    from ssl_engine.engines.run import load_builtin_parts
    from ssl_engine.errors import UserError
    from ssl_engine.models import build_model

    load_builtin_parts()
    cfg = compose(["config=quick/linear_eval_digits",
                   "config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP="
                   "[[../../outside,[Identity,[]]],[res4,[AdaptiveAvgPool2d,[[2,2]]]]]"])
    with pytest.raises(UserError, match="unknown trunk layer '../../outside'"):
        build_model(cfg.MODEL, cfg.OPTIMIZER)


# ------------------------------------------------------------------------------------------------
# malformed files in a run folder


@pytest.fixture(scope="module")
def interrupted_run(tmp_path_factory) -> Path:
    """A 2-epoch run cut back to what a kill during phase 2 leaves: model_phase0.torch newest."""
    run = tmp_path_factory.mktemp("interrupted") / "run"
    proc = run_tool(BASE + [f"config.CHECKPOINT.DIR={run}", "config.OPTIMIZER.num_epochs=2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for p in run.glob("model_*.torch"):
        if p.name != "model_phase0.torch":
            p.unlink()
    (run / ck.POINTER).unlink()
    (run / ck.POINTER).symlink_to("model_phase0.torch")
    (run / "metrics.json").write_text((run / "metrics.json").read_text().splitlines()[0] + "\n")
    return run


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst, symlinks=True)
    return dst


def _resume(run: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_tool(BASE + [f"config.CHECKPOINT.DIR={run}", "config.OPTIMIZER.num_epochs=2", *extra])


@pytest.mark.parametrize("garbage", [b"", b"\x80\x02", bytes(range(256)) * 3])
def test_an_unreadable_newer_checkpoint_is_skipped(interrupted_run, tmp_path, garbage):
    run = _copy_run(interrupted_run, tmp_path / "run")
    (run / "model_iteration99.torch").write_bytes(garbage)  # newest by name and age, unreadable
    (run / ck.POINTER).unlink()  # so that the folder's files are searched, newest first
    proc = _resume(run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipping checkpoint model_iteration99.torch" in proc.stdout + proc.stderr
    assert "resumed from" in proc.stdout and (run / "model_final_checkpoint_phase1.torch").exists()


def test_a_looping_pointer_and_broken_log_files_are_repaired_on_resume(interrupted_run, tmp_path):
    run = _copy_run(interrupted_run, tmp_path / "run")
    (run / ck.POINTER).unlink()
    (run / ck.POINTER).symlink_to(ck.POINTER)  # a link to itself
    with open(run / "metrics.json", "a") as f:
        f.write('null\n{"phase_idx": "two", "train_loss": 1.0}\n{"phase_idx": 5, "train_lo')
    with open(run / "stdout.json", "a") as f:
        f.write('{"iteration": 3, "lo')  # a line cut short by the kill
    proc = _resume(run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    phases = [json.loads(l)["phase_idx"] for l in (run / "metrics.json").read_text().splitlines()]
    assert phases == [0, 1]  # two train phases (no test phases in BASE)
    lines = (run / "stdout.json").read_text().splitlines()
    assert all(isinstance(json.loads(l), dict) for l in lines)


def test_a_checkpoint_of_another_model_is_one_line(interrupted_run, tmp_path):
    run = _copy_run(interrupted_run, tmp_path / "run")
    proc = _resume(run, "config.MODEL.TRUNK.MLP.DIMS=[3072,8]", "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[8,10]}]]")
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert "model_phase0.torch" in line and "do not fit this model" in line and "CHECKPOINT.DIR" in line, line
    # the tensors that differ, file against model (was torch's text cut off mid-phrase after 300 characters)
    assert "tensor(s) of another shape: trunk." in line and "in the file, [8, 3072] in this model" in line, line


@pytest.mark.parametrize("part, value", [("rng", {"not": "a list"}), ("loss", [1, 2])])
def test_a_checkpoint_whose_training_state_was_changed_is_one_line(interrupted_run, tmp_path, part, value):
    """A checkpoint re-saved with a part of its state replaced (the RNG states, the loss's state)
    was a KeyError / TypeError traceback on resume: one line naming the file and the way on."""
    run = _copy_run(interrupted_run, tmp_path / "run")
    path = run / "model_phase0.torch"
    data = torch.load(str(path), map_location="cpu", weights_only=True)
    data["classy_state_dict"][part] = value
    torch.save(data, str(path))
    proc = _resume(run)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = one_error_line(proc)
    assert line.startswith(f"error: cannot resume from {path}: its training state does not fit this run (") and \
        "config.MODEL.WEIGHTS_INIT.PARAMS_FILE" in line, line


def test_metrics_json_that_is_a_folder_is_one_line(interrupted_run, tmp_path):
    run = _copy_run(interrupted_run, tmp_path / "run")
    (run / "metrics.json").unlink()
    (run / "metrics.json").mkdir()
    proc = _resume(run)
    assert proc.returncode == 2
    assert "metrics.json is not a file" in one_error_line(proc)


# ------------------------------------------------------------------------------------------------
# a failing run with loader workers


FAILING_LOSS = '''\
    """A loss whose first call fails as a bug would (not a user error): a traceback and exit 1."""
    from classy_vision.losses import ClassyLoss

    from ssl_engine.registry import LOSSES


    @LOSSES.register("fails_at_first_step")
    class FailsAtFirstStep(ClassyLoss):
        @classmethod
        def from_config(cls, config):
            return cls()

        def forward(self, output, target):
            raise RuntimeError("a bug in the loss")
'''


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_run_that_fails_with_loader_workers_running_exits(tmp_path, start_method):
    """A traceback keeps the run's objects alive until the interpreter exits, where
    multiprocessing terminates its daemon children with SIGTERM, which loader workers ignore (a
    preemption signal to the whole job must not kill them), then waits for them: the run must
    stop its workers itself, or the process never exits."""
    module = write_module(tmp_path, "failing_loss", FAILING_LOSS)
    run = tmp_path / "run"
    try:
        proc = run_tool(BASE + [f"config.CHECKPOINT.DIR={run}", "config.OPTIMIZER.num_epochs=1",
                                "config.DATA.NUM_DATALOADER_WORKERS=1", f"config.MULTI_PROCESSING_METHOD={start_method}",
                                f"config.USER_MODULES=[{module}]", "config.LOSS.name=fails_at_first_step"],
                        timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail("the failed run did not exit within 150 s (it waited for its loader workers)")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "RuntimeError: a bug in the loss" in proc.stderr


def test_an_error_raised_while_ctrl_c_unwinds_is_reported_as_the_interrupt(capsys, monkeypatch):
    """Ctrl-C can land inside library code that then fails on its way out (a thread pool's
    submit released its lock twice: RuntimeError during the KeyboardInterrupt): that is an
    interrupted run, exit 130, not a crash; an error without an interrupt behind it is raised."""
    from ssl_engine.cli import INTERRUPTED_EXIT_CODE, run_command

    monkeypatch.delenv("SSL_ENGINE_DEBUG", raising=False)

    def interrupted_then_broken(cfg, node_id):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("release unlocked lock")

    def broken(cfg, node_id):
        raise RuntimeError("a bug")

    assert run_command(["config=quick/simclr_synthetic"], interrupted_then_broken) == INTERRUPTED_EXIT_CODE
    assert capsys.readouterr().err.strip().splitlines()[-1] == "interrupted"
    with pytest.raises(RuntimeError, match="a bug"):
        run_command(["config=quick/simclr_synthetic"], broken)


UNPICKLABLE_COLLATOR = '''\
    """A collator that puts a lambda in the batch: a loader worker cannot send it to its rank."""
    from ssl_engine.data.collators import default_collate
    from ssl_engine.registry import COLLATORS


    @COLLATORS.register("with_a_lambda")
    def with_a_lambda(samples):
        batch = default_collate(samples)
        batch["note"] = lambda: 0
        return batch
'''


@pytest.mark.parametrize("ranks,workers", [(1, 3), (2, 1)])
def test_a_batch_a_worker_cannot_send_stops_the_run_naming_why(tmp_path, ranks, workers):
    """multiprocessing's queue thread drops a batch that fails to pickle after printing a
    traceback, and the rank waited for it forever; now the worker ends and the run stops in
    seconds with the worker's line naming the value, as a user error: one line, exit code 2."""
    module = write_module(tmp_path, "unpicklable_collator", UNPICKLABLE_COLLATOR)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    try:
        proc = run_tool(BASE + [f"config.CHECKPOINT.DIR={tmp_path / 'run'}", "config.OPTIMIZER.num_epochs=1",
                                f"config.DATA.NUM_DATALOADER_WORKERS={workers}", f"config.USER_MODULES=[{module}]",
                                "config.DATA.TRAIN.COLLATE_FUNCTION=with_a_lambda",
                                f"config.DISTRIBUTED.NUM_PROC_PER_NODE={ranks}"], env={"TMPDIR": str(tmpdir)},
                        timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail("the run waited for a batch its loader worker had dropped")
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert re.match(r"error: rank [01]: loader worker \(pid " if ranks == 2 else r"error: loader worker \(pid ", last)
    assert "cannot send a batch to its rank" in last
    assert "with_a_lambda.<locals>.<lambda>" in last and "must pickle" in last
    assert "Traceback" not in proc.stderr and "exited unexpectedly" not in proc.stderr
    assert not list(tmpdir.glob("ssl_engine_unsent_batch_*"))  # every worker's line: read, or removed
    assert not list(tmpdir.glob("pymp-*"))  # the ended workers' multiprocessing folders are removed too


@pytest.mark.slow
def test_ranks_and_workers_started_fresh_print_only_the_error_line(tmp_path):
    """Spawned or forkserver ranks, their loader workers and multiprocessing's resource tracker
    are new interpreters: without the launcher's warning filters (PYTHONWARNINGS) each printed
    torchvision's and torch's deprecation notices, and the tracker its leaked-semaphore count
    after the error, burying the one line (15 stderr lines with 2 ranks, 51 with 8)."""
    from PIL import Image

    for cls in ("a", "b"):
        (tmp_path / "data" / cls).mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (32, 32), (30 * i, 90 if cls == "a" else 10, 0)).save(tmp_path / "data" / cls / f"{i}.png")
    (tmp_path / "data" / "b" / "fake.png").write_bytes(b"not an image")
    proc = run_tool(BASE + [f"config.CHECKPOINT.DIR={tmp_path / 'run'}", "config.OPTIMIZER.num_epochs=1",
                            "config.MULTI_PROCESSING_METHOD=forkserver", "config.DISTRIBUTED.NUM_PROC_PER_NODE=2",
                            "config.DATA.NUM_DATALOADER_WORKERS=0", "config.DATA.TRAIN.DATA_SOURCES=[disk_folder]",
                            "config.DATA.TRAIN.LABEL_SOURCES=[disk_folder]", f"config.DATA.TRAIN.DATA_PATHS=[{tmp_path / 'data'}]",
                            "config.DATA.TRAIN.ON_CORRUPT_IMAGE=error", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=13",
                            "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[16,2]}]]", "config.METERS.accuracy_list_meter.topk_values=[1]"],
                   env={"PYTHONWARNINGS": ""}, timeout=300)  # as a user runs it (the tests' default hides warnings)
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert "fake.png" in line and "ON_CORRUPT_IMAGE" in line


@pytest.mark.parametrize("name", ["stdout.json", "train.lock", "log.txt"])
def test_a_folder_where_the_run_writes_a_file_is_one_line(tmp_path, name):
    """A folder named like a file the run writes in CHECKPOINT.DIR stopped it with an
    IsADirectoryError traceback (exit 1); it is the user's to move: one line, exit 2."""
    run = tmp_path / "run"
    (run / name).mkdir(parents=True)
    proc = run_tool(BASE + [f"config.CHECKPOINT.DIR={run}", "config.OPTIMIZER.num_epochs=1", "config.LOG_FREQUENCY=1"],
                    timeout=300)
    assert proc.returncode == 2
    if name == "train.lock":
        assert one_error_line(proc) == (f"error: {run / name} is a folder, not a lock file: the lock is a plain file "
                                        f"this tool creates and removes; remove it")
    else:
        assert one_error_line(proc) == (f"error: cannot use {run / name}: Is a directory; it is a folder where the "
                                        f"run writes a file: move it away")


def test_a_folder_turned_read_only_keeps_the_runs_own_error_not_the_locks(tmp_path, monkeypatch, caplog):
    # the run failed writing a checkpoint into a folder that became read-only; removing the lock
    # file fails the same way and must not replace the run's error with its own
    lock = FolderLock(tmp_path)
    real_unlink = Path.unlink

    def read_only(self, missing_ok=False):
        if self.name == LOCK_NAME:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", read_only)
    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointError, match="cannot write model_iteration6"):
        with lock:
            raise CheckpointError("cannot write model_iteration6.torch in x: read-only file system")
    assert "could not remove the lock file" in caplog.text and not lock.held


@pytest.mark.parametrize("kind", ["dangling link", "loop of links", "folder"])
def test_a_lock_name_taken_by_something_that_is_no_lock_file_is_one_line_not_a_spin(tmp_path, kind):
    """The lock is a plain file the tool creates: a link or a folder in its place never goes away by
    itself. It was an endless loop at full CPU (a dangling link) or a traceback (a loop); now it is
    one line naming the file, at once, before launch and in the rank."""
    from ssl_engine.errors import UserError

    lock = tmp_path / LOCK_NAME
    if kind == "dangling link":
        lock.symlink_to(tmp_path / "nowhere")
    elif kind == "loop of links":
        lock.symlink_to(lock)
    else:
        lock.mkdir()
    what = "a symbolic link" if "link" in kind else "a folder"
    for attempt in (lambda: check_folder_free(tmp_path), lambda: FolderLock(tmp_path).acquire()):
        t0 = time.monotonic()
        with pytest.raises(UserError, match=f"{re.escape(str(lock))} is {what}"):
            attempt()
        assert time.monotonic() - t0 < 5
    r = run_tool(["config=quick/simclr_synthetic", f"config.CHECKPOINT.DIR={tmp_path}"], timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(f"error: {lock} is {what}"), r.stderr


@pytest.mark.parametrize("kind", ["dangling", "loop"])
def test_a_run_folder_that_is_a_broken_link_is_one_line(tmp_path, kind):
    folder = tmp_path / "run"
    folder.symlink_to(tmp_path / "gone" if kind == "dangling" else folder)
    r = run_tool(["config=quick/simclr_synthetic", f"config.CHECKPOINT.DIR={folder}"], timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    expected = (f"is a symbolic link to {tmp_path / 'gone'}, which does not exist" if kind == "dangling"
                else "cannot be reached: a loop of symbolic links")
    assert expected in r.stderr.strip().splitlines()[-1], r.stderr


def test_a_plain_python_pickle_is_named_as_such_not_as_a_truncated_file(tmp_path, recwarn):
    import pickle

    plain = tmp_path / "weights.pkl"
    plain.write_bytes(pickle.dumps({"a": os.getcwd}, protocol=4))
    with pytest.raises(CheckpointError) as e:
        ck.load_checkpoint(plain)
    assert str(e.value) == (f"checkpoint {plain} is a file of Python's pickle (protocol 4), not one written by "
                            f"torch.save: it is not read, as loading it could run code ({plain.stat().st_size} bytes)")
    assert not [w for w in recwarn if "pickle protocol" in str(w.message)]  # torch's own warning stays quiet
    legacy = tmp_path / "legacy.pt"
    torch.save({"a": 1}, str(legacy), _use_new_zipfile_serialization=False)
    legacy.write_bytes(legacy.read_bytes()[:40])
    with pytest.raises(CheckpointError, match="is truncated or corrupt: its pickle cannot be read"):
        ck.load_checkpoint(legacy)


def test_ctrl_c_during_the_shutdown_after_the_command_ended_keeps_its_exit_code_and_prints_no_traceback(tmp_path):
    """A second Ctrl-C often lands while Python shuts down (torch's and multiprocessing's atexit
    functions): it printed 'Exception ignored in atexit callback ... KeyboardInterrupt'. Now the
    process ends at once with the command's exit code (here a finished run's 0)."""
    probe = tmp_path / "late_ctrl_c.py"
    probe.write_text(textwrap.dedent("""\
        import atexit, os, signal, time

        def arm(task):
            def late_ctrl_c():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.5)
            atexit.register(late_ctrl_c)
        """))
    r = run_tool(["config=quick/simclr_synthetic", f"config.CHECKPOINT.DIR={tmp_path / 'run'}",
                  "config.OPTIMIZER.num_epochs=1", "config.DATA.TRAIN.DATA_LIMIT=8",
                  "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4", f"config.USER_MODULES=[{probe}]",
                  "+config.HOOKS.CUSTOM=[{name: CallbackHook, params: {on_end: 'late_ctrl_c:arm'}}]"])
    assert r.returncode == 0 and "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr, r.stderr[-3000:]
    assert (tmp_path / "run" / "model_final_checkpoint_phase0.torch").is_file()


def test_sigint_is_ignored_after_the_atexit_functions_registered_while_the_command_ran():
    """After the last atexit function Python puts SIGINT back to its default action, and a Ctrl-C
    in the process's last milliseconds ended a finished run as killed by SIGINT (130 in a shell).
    The tool ignores SIGINT from its own atexit function on, which runs after those that torch,
    multiprocessing or a user module register once the command has started (atexit runs the last
    registered first); during those, a Ctrl-C still ends the process at once with its exit code."""
    code = textwrap.dedent("""\
        import atexit, signal, sys
        seen = {}
        atexit.register(lambda: print("after the tool's own:", seen["during"], signal.getsignal(signal.SIGINT) is signal.SIG_IGN))
        from ssl_engine import cli
        def body(cfg, node_id):
            atexit.register(lambda: seen.update(during=callable(signal.getsignal(signal.SIGINT))))  # as torch's
            return 0
        cli.prepare_config = lambda overrides, **kwargs: None
        sys.exit(cli.run_command(["config=quick/simclr_synthetic"], body, tool_process=True))
        """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "after the tool's own: True True", r.stdout


def test_a_ctrl_c_while_the_run_releases_its_lock_still_removes_it(tmp_path, monkeypatch):
    """A Ctrl-C at the very end of a run, between reading the lock and unlinking it, left
    train.lock behind: it is raised once the lock is removed."""
    import signal

    from ssl_engine import lock as lock_module

    real_read = lock_module._read

    def read_then_ctrl_c(path):
        raw = real_read(path)
        os.kill(os.getpid(), signal.SIGINT)
        return raw

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with lock_module.held_by_rank0(tmp_path):
                assert (tmp_path / LOCK_NAME).is_file()
                monkeypatch.setattr(lock_module, "_read", read_then_ctrl_c)
        assert not (tmp_path / LOCK_NAME).exists()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("pid", [10**20, -1, 0])
def test_a_lock_with_a_pid_no_process_can_have_is_garbled_not_a_live_owner(tmp_path, pid):
    """A hand-edited lock: pid 10**20 was an OverflowError traceback, -1 (os.kill(-1, 0) succeeds) a
    live owner forever; both are a garbled lock, taken over like any unreadable one."""
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
    check_folder_free(tmp_path)  # no refusal, no traceback
    old = time.time() - 60
    os.utime(tmp_path / LOCK_NAME, (old, old))  # past the grace period of a lock being written
    lock = FolderLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_checkpoint_whose_trunk_lacks_layers_of_this_model_names_them(interrupted_run, tmp_path):
    """A trunk config that adds a layer keeps the shapes of the old ones: the line names the
    tensors this model has and the file lacks, not torch's multi-line text."""
    run = _copy_run(interrupted_run, tmp_path / "run")
    proc = _resume(run, "config.MODEL.TRUNK.MLP.DIMS=[3072,16,16]")
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert "do not fit this model (2 tensor(s) of this model are not in the file ('trunk." in line, line
