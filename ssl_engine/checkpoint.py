"""The checkpoint folder: names, atomic writes, newest-good lookup, safe loading, weight init.

Names follow VISSL: model_phase{N}.torch, model_iteration{I}.torch,
model_final_checkpoint_phase{N}.torch, and checkpoint.torch, a symlink to the newest one.
Every file is written to a temporary name in the same folder, fsynced and renamed into
place, so a crash at any instant leaves the previous checkpoint loadable. Files are read
with torch.load(weights_only=True): loading never executes code.

With CHECKPOINT.ASYNC_WRITE the training thread only takes a snapshot of the state (a CPU
copy of its tensors, see ``snapshot_state``) and one background thread does the rest of
``save_checkpoint`` (serialize, temporary file, fsync, rename, folder fsync, pointer swap,
pruning); see ``CheckpointWriter``.
"""

import atexit
import copy
import errno
import logging
import os
import pickle
import queue
import re
import threading
import warnings
import zipfile
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
import collections
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ssl_engine.errors import (
    CheckpointError, UserError, closest, does_not_exist, first_few, folder_gone, is_url, url_error,
)
from ssl_engine.processes import pid_alive
from ssl_engine.resume_state import non_finite_tensors, state_problem

log = logging.getLogger(__name__)

POINTER = "checkpoint.torch"
# phase -1: the final checkpoint of a run without train phases (TEST_ONLY)
_NAME_RE = re.compile(r"^model_(phase|iteration|final_checkpoint_phase)(-1|\d+)\.torch$")


def phase_checkpoint_name(train_phase_idx: int) -> str:
    return f"model_phase{int(train_phase_idx)}.torch"


def iteration_checkpoint_name(iteration: int) -> str:
    return f"model_iteration{int(iteration)}.torch"


def final_checkpoint_name(train_phase_idx: int) -> str:
    return f"model_final_checkpoint_phase{int(train_phase_idx)}.torch"


def fsync_dir(folder: Path) -> None:
    """Make a rename inside ``folder`` durable."""
    try:
        fd = os.open(str(folder), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sync_files(paths: Sequence[Path]) -> None:
    """fdatasync each of ``paths`` that exists, so that lines appended to it without a sync
    (metrics.json) are durable; an error names the file (OSError with its filename)."""
    for path in paths:
        try:
            fd = os.open(str(path), os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fdatasync(fd)
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(path)) from e
        finally:
            os.close(fd)


def _in_chain(e: Optional[BaseException], kind: type) -> Optional[BaseException]:
    """The first exception of type ``kind`` in ``e``'s cause/context chain: torch.save reports a
    failed write as a RuntimeError whose context holds the real error (ENOSPC, EACCES...)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _os_error_in(e: Optional[BaseException]) -> Optional[OSError]:
    """The OSError behind ``e``, if any."""
    found = _in_chain(e, OSError)
    return found if isinstance(found, OSError) else None


def atomic_write(path: Path, write: Callable[[Any], None], mode: str = "wb") -> None:
    """Write ``path`` through a temporary file in the same folder, then rename it into place.

    A failure (disk full, permission) removes the temporary file, leaves any previous
    ``path`` untouched, and raises CheckpointError naming the folder.
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp.{os.getpid()}"
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        failure = write_failure(path, e)
        if failure is not None:
            raise failure from e
        raise


def write_failure(path: Path, e: BaseException) -> Optional[CheckpointError]:
    """The CheckpointError that says why writing ``path`` failed with ``e`` (its folder is gone,
    the disk is full, ...), or None when ``e`` holds no OSError."""
    os_error = _os_error_in(e)
    if os_error is None:
        return None
    # the run made this folder: a file that cannot be made in it means the folder went away
    gone = folder_gone(str(path), known=True) if os_error.errno == errno.ENOENT else None
    if gone is not None:
        return CheckpointError(str(gone))
    why = {errno.ENOSPC: "the disk is full", errno.EACCES: "permission denied", errno.EROFS: "read-only file system"}.get(
        os_error.errno, os_error.strerror or str(os_error)
    )
    return CheckpointError(f"cannot write {path.name} in {path.parent}: {why}; the previous files there are intact")


def remove_stale_temp_files(folder: Path) -> List[str]:
    """Delete temporary files that a killed writer left in ``folder`` (their pid is gone)."""
    removed = []
    folder = Path(folder)
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        m = re.match(r"^\..+\.tmp\.(\d+)$", p.name)
        if m and not pid_alive(int(m.group(1))):
            try:
                p.unlink()
                removed.append(p.name)
            except OSError:
                pass
    if removed:
        log.info("removed %d unfinished temporary file(s) of a killed run in %s", len(removed), folder)
    return removed


def free_name(path: Path) -> Path:
    """``path`` or, when it exists, ``path.1``, ``path.2``, ...: a name nothing has yet."""
    path = Path(path)
    candidate, n = path, 0
    while os.path.lexists(candidate):
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text), mode="w")


def point_to(folder: Path, name: str) -> None:
    """Swap checkpoint.torch to a symlink to ``name`` atomically."""
    folder = Path(folder)
    tmp = folder / f".{POINTER}.tmp.{os.getpid()}"
    try:
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        os.symlink(name, tmp)
        os.replace(tmp, folder / POINTER)
        fsync_dir(folder)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        # the run made this folder: a link that cannot be made in it means the folder went away
        gone = folder_gone(str(folder / POINTER), known=True) if e.errno == errno.ENOENT else None
        if gone is not None:
            raise CheckpointError(str(gone)) from e
        raise CheckpointError(f"cannot update {POINTER} in {folder}: {e.strerror}") from e


class WriteAbandoned(Exception):
    """A background write was given up (the run was interrupted) before its file was renamed into place."""


class _AbandonableFile:
    """The file object torch.save writes to, refusing further writes once the write is abandoned,
    so that an interrupted run does not wait for the rest of a large checkpoint."""

    def __init__(self, f: Any, cancel: threading.Event) -> None:
        self._f = f
        self._cancel = cancel

    def write(self, data: Any) -> int:
        if self._cancel.is_set():
            raise WriteAbandoned("checkpoint write abandoned")
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def _torch_save_to(f: Any, obj: Any, cancel: Optional[threading.Event]) -> None:
    """torch.save ``obj`` into the open file ``f``; with ``cancel``, stop (and raise) once it is set."""
    if cancel is None:
        torch.save(obj, f)
        return
    try:
        torch.save(obj, _AbandonableFile(f, cancel))
    except Exception as e:
        # torch's writer may report a refused write as an error of its own, with ours only as
        # its __context__, which a later raise from an except block (a wait interrupted by
        # Ctrl-C, say) overwrites: name the abandonment in the exception itself
        if cancel.is_set() and not isinstance(e, WriteAbandoned):
            raise WriteAbandoned("checkpoint write abandoned") from e
        raise
    if cancel.is_set():  # before the fsync and the rename: the temporary file is removed
        raise WriteAbandoned("checkpoint write abandoned")


def save_checkpoint(
    folder: Path, name: str, checkpoint: Dict[str, Any], keep_last: int = -1, cancel: Optional[threading.Event] = None,
    sync_first: Sequence[Path] = (),
) -> Path:
    """Write ``checkpoint`` as folder/name atomically, point checkpoint.torch at it, prune old ones.

    ``sync_first``: files the checkpoint covers that were appended to without a sync
    (metrics.json): they are made durable before the checkpoint is, so a checkpoint that
    survives a crash of the machine never stands for lines that did not.
    ``cancel`` (set by CheckpointWriter.abandon) stops the write before the file is renamed into
    place; once it is, the pointer swap and the pruning are always done.
    """
    folder = Path(folder)
    path = folder / name
    gone = folder_gone(str(path))  # the run made its folder: one that is gone now is not made again
    if gone is not None:
        raise CheckpointError(str(gone))
    sync_files(sync_first)
    atomic_write(path, lambda f: _torch_save_to(f, checkpoint, cancel))
    point_to(folder, name)
    if keep_last > 0:
        prune(folder, keep_last, protect={name})
    return path


# ----------------------------------------------------------------------------------------
# Writing in the background (CHECKPOINT.ASYNC_WRITE): a snapshot on the training thread, the
# file on one writer thread.


@dataclass
class Snapshot:
    """A copy of a state that later training steps cannot change.

    ``events`` are CUDA events recorded after the device-to-host copies were queued; the
    writer waits for them (``ready``), so that the training thread never does.
    """

    state: Any
    events: List[Any] = field(default_factory=list)

    def ready(self) -> Any:
        """The state, once every queued device-to-host copy has landed."""
        for event in self.events:
            event.synchronize()
        self.events = []
        return self.state


def _tensors_in(obj: Any, seen: Optional[set] = None) -> Iterator[torch.Tensor]:
    """Every tensor inside the containers (dicts, lists, tuples, sets) of a state."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (dict, list, tuple, set, frozenset)) and id(obj) not in seen:
        seen.add(id(obj))  # the state holds obj: its id is not reused while we walk
        items = [x for kv in obj.items() for x in kv] if isinstance(obj, dict) else obj
        for item in items:
            yield from _tensors_in(item, seen)


def _plain_strided(t: torch.Tensor) -> bool:
    """Whether ``t`` is a dense tensor (or Parameter) whose storage can be copied byte for byte."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and not t.is_quantized
            and t.device.type != "meta" and not t.__dict__)


def _copy_storage(t: torch.Tensor, copies: Dict[Tuple[str, int, int], torch.Tensor], devices: set) -> torch.Tensor:
    """A CPU copy of ``t``'s whole storage (as uint8), shared by every tensor that views it.

    A CUDA storage is copied into pinned memory with a non-blocking copy on the current
    stream: later kernels that update the source are queued after it, so the training
    thread does not wait for it (the writer does, see Snapshot.ready).
    """
    storage = t.untyped_storage()
    key = (str(t.device), storage.data_ptr(), storage.nbytes())
    if storage.nbytes() and key in copies:
        return copies[key]
    source = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
    on_cuda = t.device.type == "cuda"
    target = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=on_cuda)
    target.copy_(source, non_blocking=on_cuda)
    if on_cuda:
        devices.add(t.device)
    if storage.nbytes():
        copies[key] = target
    return target


def _cpu_copy(t: torch.Tensor, copies: Dict[Tuple[str, int, int], torch.Tensor], devices: set) -> torch.Tensor:
    """A CPU tensor equal to ``t`` (dtype, shape, strides, storage offset, storage sharing,
    requires_grad, Parameter-ness), so that torch.save writes the same data for it."""
    if not _plain_strided(t):
        return t.detach().to("cpu", copy=True) if t.device.type != "meta" else t.detach().clone()
    storage = _copy_storage(t, copies, devices).untyped_storage()
    out = torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.size(), t.stride())
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=t.requires_grad)
    return out.requires_grad_(t.requires_grad) if t.requires_grad else out


def snapshot_state(state: Any) -> Snapshot:
    """A copy of ``state`` that later training steps cannot change: every tensor copied to CPU
    memory (views of one storage keep sharing one copy), every mutable python object
    deep-copied, immutable ones shared.

    Cost: one extra CPU copy of the state's tensors, held until the write that uses it ends.
    """
    copies: Dict[Tuple[str, int, int], torch.Tensor] = {}
    devices: set = set()
    memo: Dict[int, Any] = {}
    for t in _tensors_in(state):
        if id(t) not in memo:
            memo[id(t)] = _cpu_copy(t, copies, devices)
    snap = copy.deepcopy(state, memo)
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return Snapshot(snap, events)


class CheckpointWriter:
    """Writes checkpoint files on one background thread, one file at a time.

    ``submit`` first waits for the previous write (and raises its error), then hands the next
    one to the writer thread, so at most one write is in flight. The thread is started at the
    first write and kept for the next ones: starting a thread per checkpoint cost the training
    thread 0.2-3 ms at each phase end on a busy machine. It is a daemon thread, so an idle one
    never holds the process; a write in flight at the end of the process is finished first (an
    exit hook waits for it). An error of the writer (a CheckpointError for a full disk, say) is
    raised by the next ``submit`` or ``wait``, in the training thread. Only the thread that
    submits calls these methods.
    """

    def __init__(self) -> None:
        self._future: Optional[Future] = None
        self._thread: Optional[threading.Thread] = None
        self._jobs: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._cancel = threading.Event()
        self._what = ""

    def in_flight(self) -> bool:
        """Whether a write was submitted and not yet waited for."""
        return self._future is not None

    def submit(self, job: Callable[[threading.Event], Any], what: str) -> None:
        """Wait for the previous write, then run ``job(cancel_event)`` on the writer thread."""
        self.wait()
        future: Future = Future()
        future.set_running_or_notify_cancel()
        cancel = threading.Event()
        self._future, self._cancel, self._what = future, cancel, what
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._serve, args=(self._jobs,), name="checkpoint-writer",
                                            daemon=True)
            self._thread.start()
        self._jobs.put((job, cancel, future))

    @staticmethod
    def _serve(jobs: "queue.SimpleQueue[Any]") -> None:
        """Body of the writer thread: each job's outcome goes to its future; None ends the thread."""
        while True:
            item = jobs.get()
            if item is None:
                return
            job, cancel, future = item
            try:
                result = job(cancel)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread by wait()
                future.set_exception(e)
            else:
                future.set_result(result)

    def wait(self) -> Any:
        """Block until the write in flight is on disk; raise its error. No-op when none is."""
        future = self._future
        if future is None:
            return None
        try:
            return future.result()
        finally:
            if future.done():  # an interrupted wait leaves the write in flight
                self._future = None

    def abandon(self) -> None:
        """Stop the write in flight: a file not yet renamed into place is given up and its
        temporary file removed (one already renamed gets its pointer swap); never raises an
        error of the write, logs it."""
        if self._future is None:
            return
        self._cancel.set()
        try:
            self._future.result()
        except KeyboardInterrupt:  # interrupted once more: the thread still ends soon, on its own
            raise
        except BaseException as e:  # noqa: BLE001
            if _abandoned(e):
                log.warning("abandoned the write of %s; its temporary file is removed", self._what)
            else:
                log.error("the write of %s failed: %s", self._what, " ".join(str(e).split()))
        finally:
            if self._future is not None and self._future.done():
                self._future = None

    def finish_at_exit(self) -> None:
        """At the end of the process: let the write in flight (if any) end, then stop the thread.
        Its error was the run's to raise; here it is only logged."""
        if self._future is not None:
            try:
                self._future.result()
            except BaseException as e:  # noqa: BLE001
                log.error("the checkpoint written in the background failed: %s", " ".join(str(e).split()))
            self._future = None
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        self._thread = None

    def reset_after_fork(self) -> None:
        """A forked child (a dataloader worker) has no writer thread: it starts with none in flight."""
        self._future, self._thread, self._cancel = None, None, threading.Event()
        self._jobs = queue.SimpleQueue()


def _abandoned(e: Optional[BaseException]) -> bool:
    """Whether ``e`` (or what it wraps: torch.save re-raises errors of the file) is WriteAbandoned."""
    return _in_chain(e, WriteAbandoned) is not None


_WRITER = CheckpointWriter()
atexit.register(_WRITER.finish_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WRITER.reset_after_fork)


def save_checkpoint_async(
    folder: Path, name: str, checkpoint: Dict[str, Any], keep_last: int = -1,
    on_saved: Optional[Callable[[Path], None]] = None, sync_first: Sequence[Path] = (),
) -> None:
    """``save_checkpoint`` on the background writer: waits for the previous write (raising its
    error), snapshots ``checkpoint`` now, and returns; the file (after the syncs of
    ``sync_first``), the pointer swap and the pruning follow in the background.
    ``on_saved(path)`` runs there once the file is durable."""
    _WRITER.wait()
    snap = snapshot_state(checkpoint)
    sync_first = list(sync_first)

    def job(cancel: threading.Event) -> Path:
        path = save_checkpoint(folder, name, snap.ready(), keep_last=keep_last, cancel=cancel, sync_first=sync_first)
        if on_saved is not None:
            on_saved(path)
        return path

    _WRITER.submit(job, name)


def checkpoint_write_in_flight() -> bool:
    """Whether a background write was submitted and not yet waited for."""
    return _WRITER.in_flight()


def wait_for_checkpoint_writes() -> None:
    """Block until the background write in flight (if any) is durable; raise its error (one
    line for the user, e.g. "cannot write model_phase1.torch in /runs/x: the disk is full ...")."""
    _WRITER.wait()


def settle_checkpoint_writes() -> None:
    """On the way out of a failed run: finish the write in flight (it holds a state from before
    the failure); if interrupted again while waiting (a second Ctrl-C), abandon it. Its own
    error is logged, not raised, so that it does not hide the failure of the run."""
    if not _WRITER.in_flight():
        return
    try:
        _WRITER.wait()
    except KeyboardInterrupt:
        _WRITER.abandon()
    except BaseException as e:  # noqa: BLE001
        log.error("the checkpoint written in the background failed: %s", " ".join(str(e).split()))


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return -1


def _ahead_of_pointer(target: Path, listed: List[Path]) -> Optional[Path]:
    """The checkpoint of ``listed`` furthest into the run, when it is further than ``target`` (the
    pointer's file); None otherwise. Only files written after ``target`` are read (their counters,
    not their tensors): a folder copied without its times has other files newer than the
    pointer's, and their counters tell that they are not further."""
    newer = [p for p in listed if p.resolve() != target and _mtime(p) > _mtime(target)]
    if not newer:
        return None
    here = _position(target)
    if here is None:
        return None  # the pointer's file is unreadable: the search below skips it anyway
    best = max(((pos, p) for p in newer if (pos := _position(p)) is not None), default=None)
    return best[1] if best is not None and best[0] > here else None


def list_checkpoints(folder: Path) -> List[Path]:
    """Checkpoint files of a folder, newest first (by modification time, then name)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    files = [p for p in folder.iterdir() if _NAME_RE.match(p.name) and p.is_file()]
    return sorted(files, key=lambda p: (p.stat().st_mtime_ns, p.name), reverse=True)


def checkpoint_entries(folder: Path) -> List[str]:
    """The names of every entry of ``folder`` named as a checkpoint or as the pointer, whatever it
    is, sorted; one that is not a file says what it is ('checkpoint.torch (a link to nothing)',
    'model_phase0.torch (a folder)'). :func:`list_checkpoints` lists checkpoint files only."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    out = []
    for p in sorted(folder.iterdir()):
        if p.name != POINTER and not _NAME_RE.match(p.name):
            continue
        what = "" if p.is_file() else " (a folder)" if p.is_dir() else " (a link to nothing)" if p.is_symlink() \
            else " (not a file)"
        out.append(p.name + what)
    return out


def prune(folder: Path, keep_last: int, protect: Optional[set] = None) -> None:
    """Delete phase/iteration checkpoints beyond the newest ``keep_last``; never a final one."""
    protect = set(protect or ())
    target = os.readlink(Path(folder) / POINTER) if (Path(folder) / POINTER).is_symlink() else None
    if target:
        protect.add(target)
    kept = 0
    for p in list_checkpoints(folder):
        kind = _NAME_RE.match(p.name).group(1)
        if kind == "final_checkpoint_phase":
            continue
        kept += 1
        if kept > keep_last and p.name not in protect:
            try:
                p.unlink()
                log.info("removed old checkpoint %s (CHECKPOINT.KEEP_LAST=%d)", p.name, keep_last)
            except OSError as e:
                log.warning("could not remove old checkpoint %s: %s", p, e.strerror)


def named_file(value: Any, key: str) -> Path:
    """The checkpoint file config key ``key`` names; a CheckpointError when it is missing or a
    folder (naming the checkpoint to use from that folder, where it holds one)."""
    if is_url(value):  # Path() would collapse its '//'
        raise url_error(key, str(value))
    path = Path(str(value)).expanduser()
    if path.is_dir():
        found = [p for p in (path / POINTER, *list_checkpoints(path)) if p.is_file()]
        hint = f"e.g. {found[0]}" if found else "the folder holds no checkpoint"
        raise CheckpointError(f"{key}: {path} is a folder; name a checkpoint file ({hint})")
    if not path.is_file():
        if path.exists() or path.is_symlink():  # a device, a FIFO, a socket, a link that leads nowhere readable
            kind = ("a symbolic link that leads to no file (dangling, or a loop)" if not path.exists() else
                    "a character device" if path.is_char_device() else "a named pipe (FIFO)" if path.is_fifo() else
                    "a socket" if path.is_socket() else "not a regular file")
            raise CheckpointError(f"{key}: {str(value)!r} is {kind}; name a checkpoint file")
        raise CheckpointError(does_not_exist(key, value))
    return path


def resume_from_file(value: Any) -> Path:
    """The file ``config.CHECKPOINT.RESUME_FROM`` names (see :func:`named_file`)."""
    return named_file(value, "config.CHECKPOINT.RESUME_FROM")


def final_phase(path: Path) -> int:
    """The train phase a checkpoint file's name gives (-1: the final checkpoint of a TEST_ONLY run)."""
    match = _NAME_RE.match(Path(path).name)
    return int(match.group(2)) if match else -1


def final_checkpoint(folder: Path) -> Optional[Path]:
    """The final checkpoint of a finished training in ``folder``, if there is one."""
    finals = [p for p in list_checkpoints(folder) if p.name.startswith("model_final_checkpoint_phase")]
    return finals[0] if finals else None


def repoint_to_final(folder: Path, final: Path) -> bool:
    """Point checkpoint.torch at ``final`` (a finished run's final checkpoint) when a kill
    between that file's rename and the pointer swap left the pointer on an earlier file (or
    without a file): the folder's pointer then names the end of the run again, as the files that
    read it expect (``PARAMS_FILE=<folder>/checkpoint.torch``). Whether it changed. Rank 0,
    holding the folder's lock."""
    folder, final = Path(folder), Path(final)
    pointer = folder / POINTER
    try:
        target: Optional[Path] = pointer.resolve(strict=True)
    except (OSError, RuntimeError):  # missing, dangling, or a loop of links
        target = None
    if target == final.resolve() or (target is not None and _ahead_of_pointer(target, [final]) is None):
        return False
    point_to(folder, final.name)
    log.warning("%s pointed to %s, but the run's final checkpoint %s was written after it (the run was stopped "
                "between the two): it points to %s now", POINTER, target.name if target else "no file", final.name,
                final.name)
    return True


# a run's own files besides its checkpoints (log.txt stays: the new run already appends to it)
_RUN_FILES = ("model_best.torch", "metrics.json", "stdout.json", "train_config.yaml", "tb_logs")
PREVIOUS_RUN_PREFIX = "previous_run."


def holds_checkpoints(folder: Path) -> bool:
    """Whether ``folder`` holds checkpoints of a run (a checkpoint file, the pointer, model_best.torch)."""
    folder = Path(folder)
    return bool(list_checkpoints(folder)) or os.path.lexists(folder / POINTER) or (folder / "model_best.torch").is_file()


# names the previous_run.N folder while a set-aside is under way: a run killed in the middle of
# the moves leaves it, and the next run finishes the moves before it looks for a checkpoint
SET_ASIDE_MARKER = ".previous_run_move"


def set_aside_previous_run(folder: Path) -> Optional[Path]:
    """Move the checkpoints and run files of an earlier run in ``folder`` into a new subfolder
    ``previous_run.N`` (renames: same bytes, same times; nothing is deleted), so that a new run
    started there from scratch can never resume from them after a crash. None when there was
    nothing to move.

    The moves are one rename per file: a kill among them would leave part of the earlier run in
    the folder, where the next run would resume from it. So the target is named in
    SET_ASIDE_MARKER first, and :func:`finish_set_aside` completes an interrupted set-aside.
    """
    folder = Path(folder)
    if not holds_checkpoints(folder):
        return None
    n = 1
    while os.path.lexists(folder / f"{PREVIOUS_RUN_PREFIX}{n}"):
        n += 1
    target = folder / f"{PREVIOUS_RUN_PREFIX}{n}"
    atomic_write_text(folder / SET_ASIDE_MARKER, target.name + "\n")  # first: a kill after it leaves no empty folder
    target.mkdir(exist_ok=True)
    moved = _move_run_files(folder, target)
    log.warning(
        "%s holds the checkpoints of an earlier run and this run starts from scratch: moved %d of its files into %s "
        "(nothing is deleted; remove that folder when you no longer need it)", folder, moved, target,
    )
    return target


def finish_set_aside(folder: Path) -> Optional[Path]:
    """Complete a set-aside that a killed run left half done (see :func:`set_aside_previous_run`):
    the earlier run's files still in ``folder`` join the others in its previous_run.N. Call it
    while holding the folder's lock, before looking for a checkpoint. The target, or None."""
    folder = Path(folder)
    marker = folder / SET_ASIDE_MARKER
    if not marker.is_file():
        return None
    try:
        name = marker.read_text(errors="replace").strip()
    except OSError:
        name = ""
    if not re.fullmatch(re.escape(PREVIOUS_RUN_PREFIX) + r"[0-9]+", name):
        log.warning("ignoring %s: it does not name a %sN folder (%r)", marker, PREVIOUS_RUN_PREFIX, name[:80])
        marker.unlink()
        fsync_dir(folder)
        return None
    target = folder / name
    target.mkdir(exist_ok=True)
    moved = _move_run_files(folder, target)
    log.warning("a run that was killed while it moved an earlier run's files into %s left %d of them here: moved them "
                "there too, so that no run resumes from them", target, moved)
    return target


def _move_run_files(folder: Path, target: Path) -> int:
    """Move the run's files of ``folder`` into ``target``, then drop the set-aside marker; the count."""
    checkpoints = sorted(list_checkpoints(folder), key=lambda p: (p.name.startswith("model_final_"), p.stat().st_mtime_ns, p.name))
    moving = [folder / POINTER] + [folder / name for name in _RUN_FILES] + checkpoints
    moved = 0
    for p in moving:
        if os.path.lexists(p):
            os.replace(p, target / p.name)  # the pointer is a relative link: it still names its file there
            moved += 1
    fsync_dir(target)
    marker = folder / SET_ASIDE_MARKER
    if os.path.lexists(marker):
        marker.unlink()
    fsync_dir(folder)
    return moved


def _data_globals() -> List[Any]:
    """The classes besides tensors and plain containers that a weights file may hold and that
    build data without running code: numeric numpy arrays (VISSL's converted Caffe2 models hold
    them; VISSL's loader takes them with torch.from_numpy) and ``argparse.Namespace`` (the
    training arguments DINO's and other repositories' checkpoints carry under ``args``; its
    attributes go through the same restricted reader)."""
    import argparse

    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct, scalar  # type: ignore[no-redef]
    numbers = (np.bool_, np.int8, np.uint8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64)
    return [_reconstruct, scalar, np.ndarray, np.dtype, *(type(np.dtype(t)) for t in numbers), argparse.Namespace]


def unloadable_value(state: Any, path: str = "") -> Optional[Tuple[str, str]]:
    """(where, type name) of the first value in ``state`` that :func:`load_checkpoint` would
    refuse (an object other than a tensor, a number, a string, a numeric numpy array or scalar,
    and lists, tuples, sets and dicts of them), or None when it all loads."""
    import numpy as np

    if isinstance(state, (torch.Tensor, bool, int, float, complex, str, bytes, torch.Size, torch.dtype, torch.device)) \
            or state is None:
        return None
    if isinstance(state, (np.ndarray, np.generic)):
        return None if state.dtype.kind in "biuf" else (path or "the state", f"numpy {state.dtype} value")
    if type(state) in (dict, collections.OrderedDict):
        for key, value in state.items():
            found = unloadable_value(key, f"{path} (a key)") or unloadable_value(value, f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(state, (list, tuple, set)) and type(state) in (list, tuple, set):
        for i, value in enumerate(state):
            found = unloadable_value(value, f"{path}[{i}]")
            if found:
                return found
        return None
    return (path or "the state", type(state).__name__)


def load_checkpoint(path: Path) -> Dict[str, Any]:
    """Read a checkpoint on the CPU without executing code.

    A file carrying pickled objects other than tensors and plain containers is refused;
    a truncated or unreadable file raises CheckpointError naming it.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        with warnings.catch_warnings():  # torch warns of what it did not write; the error says more
            _quiet_foreign_file_warnings()
            with torch.serialization.safe_globals(_data_globals()):
                data = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        built = re.search(r"but got <class '([^']+)'>", text)  # an object torch's reader will not build
        blocked = built or re.search(r"(Unsupported global: GLOBAL [^\s]+|unsupported GLOBAL [^\s]+|GLOBAL [\w.]+ [\w.]+)", text)
        if blocked:
            raise CheckpointError(
                f"refused to load {path}: it carries pickled objects that are not tensors, numeric arrays or plain "
                f"containers, and loading it would run code ({'a ' + built.group(1) if built else blocked.group(1)[:160]})"
            ) from None
        raise CheckpointError(f"checkpoint {path} {_unreadable_because(path, e)}") from None
    except Exception as e:  # noqa: BLE001 - torch's readers raise many kinds (EOFError, KeyError, ...) on garbage
        raise CheckpointError(f"checkpoint {path} {_unreadable_because(path, e)}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a checkpoint: it holds a {type(data).__name__}, not a dict")
    return data


def _quiet_foreign_file_warnings() -> None:
    """Inside ``warnings.catch_warnings()``: leave out torch.load's warnings about a file it did not
    write (a pickle protocol of its own, a TorchScript archive it hands to torch.jit.load); the
    error the load then raises says what the file is (:func:`_unreadable_because`)."""
    warnings.filterwarnings("ignore", message="Detected pickle protocol")
    warnings.filterwarnings("ignore", message=".*looks like a TorchScript archive")


def peek_checkpoint(path: Path) -> Dict[str, Any]:
    """A checkpoint's structure without reading its tensor data (tensors come back on the meta
    device); loads with weights_only, so a file carrying pickled code is refused, never run."""
    try:
        with warnings.catch_warnings():
            _quiet_foreign_file_warnings()
            data = torch.load(str(path), map_location="meta", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - old formats cannot be mmapped; load_checkpoint explains real problems
        data = load_checkpoint(path)
    if not isinstance(data, dict):
        return load_checkpoint(path)  # raises its "not a checkpoint" error
    return data


def _position(path: Path) -> Optional[Tuple[int, int, bool]]:
    """(iteration, phase_idx, phase ended) a checkpoint file was written at, read without its
    tensors; None when it cannot be read. An iteration checkpoint of a phase's last step and the
    checkpoint of that phase's end (a final one) share iteration and phase_idx; the phase's end
    is the further."""
    try:
        data = peek_checkpoint(path)
        position = data["iteration"], data["phase_idx"]
    except (CheckpointError, KeyError, TypeError):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in position):
        return None  # a tensor, a string, ...: the search skips the file with its own warning
    state = data.get("classy_state_dict")
    return position + (isinstance(state, dict) and state.get("phase_complete") is True,)


def _unreadable_because(path: Path, error: Exception) -> str:
    """Why torch.load failed on ``path``, in words: what the file's first bytes say it is.

    torch's own errors name internals (``KeyError: '101'`` for a text file, a miniz message
    cut mid-sentence for a truncated archive); the file's start tells a user more.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            f.seek(max(0, size - 1))
            last = f.read(1)  # a whole pickle ends with its STOP opcode, '.'
    except OSError as e:
        return f"cannot be read: {e.strerror}"
    if size == 0:
        return "is empty (0 bytes)"
    if head.startswith(b"PK"):  # torch.save's zip format, or another program's zip (np.savez, a zip of files)
        records = _zip_records(path)
        if any(r.endswith("/constants.pkl") or "/code/" in r for r in records):  # holds data.pkl too
            return (f"is a TorchScript archive (torch.jit.save), not a file of weights written by torch.save: it "
                    f"is not read; save the model's weights with torch.save(model.state_dict(), path) (a scripted "
                    f"model's too) and name that file ({size} bytes)")
        if records and not any(r.endswith("data.pkl") for r in records):
            return (f"is a zip archive that torch.save did not write (it holds {first_few(records, 3)}; np.savez "
                    f"writes such .npz files): save the weights with torch.save ({size} bytes)")
        return f"is truncated or corrupt: its zip archive cannot be read ({size} bytes)"
    if head[:3] == b"\x80\x02\x8a" or (head[:1] == b"\x80" and last != b"."):
        # torch's legacy format (protocol 2, then its magic number), or a pickle cut before its STOP
        return f"is truncated or corrupt: its pickle cannot be read ({type(error).__name__}, {size} bytes)"
    if head[:1] == b"\x80":  # a whole pickle that python's pickle wrote
        return (f"is a file of Python's pickle (protocol {head[1]}), not one written by torch.save: it is not "
                f"read, as loading it could run code ({size} bytes)")
    return f"is not a file written by torch.save (it starts with {head!r}, {size} bytes)"


def _zip_records(path: Path) -> List[str]:
    """The record names of the zip archive ``path``; empty when it cannot be read as one (cut short)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            return archive.namelist()
    except (OSError, zipfile.BadZipFile, RuntimeError, ValueError):
        return []


def damaged_record(path: Path) -> Optional[str]:
    """Why ``path`` (torch's zip format) is damaged although it loads, or None.

    torch.load does not check the CRC-32 that the zip format stores for each record, so bytes
    changed on a disk or in a copy load as other weights without a word. A resume reads its
    checkpoint through this once (one pass over the file) and goes back to the previous
    checkpoint instead. Files in torch's older pickle format carry no checksums: None.
    """
    import zipfile

    try:
        if not zipfile.is_zipfile(path):
            return None
        with zipfile.ZipFile(path) as archive:
            written = [r for r in archive.infolist() if r.file_size]
            if written and all(r.CRC == 0 for r in written):
                return None  # saved with torch.serialization.set_crc32_options(False): no checksums to check
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile, RuntimeError, ValueError) as e:
        return f"is corrupt: its zip archive cannot be checked ({e})"
    return None if bad is None else f"is corrupt: the stored checksum of its record {bad} does not match its bytes"


def check_intact(path: Path, key: str) -> None:
    """A CheckpointError naming config key ``key`` when the file it names fails its checksums
    (see :func:`damaged_record`): a file a user names is never loaded as other weights."""
    damaged = damaged_record(path)
    if damaged:
        raise CheckpointError(f"{key}: {path} {damaged}; copy it again, or name another checkpoint")


def is_engine_checkpoint(data: Dict[str, Any]) -> bool:
    state = data.get("classy_state_dict")
    return isinstance(state, dict) and "phase_idx" in data and isinstance(state.get("base_model"), dict)


def newest_good_checkpoint(folder: Path, skip: Sequence[Path] = ()) -> Optional[Tuple[Path, Dict[str, Any]]]:
    """The newest checkpoint of ``folder`` that loads, with its content.

    checkpoint.torch is tried first; a truncated or unreadable file is skipped with a
    warning naming it, and the next older one is used. Files in ``skip`` (found unusable by
    the caller, who said so) are passed over without reading them again.
    """
    skipped = {Path(p).resolve() for p in skip}
    folder = Path(folder)
    candidates: List[Path] = []
    pointer = folder / POINTER
    if pointer.is_symlink() or pointer.is_file():
        try:
            candidates.append(pointer.resolve(strict=True))
        except (OSError, RuntimeError) as e:  # dangling, or a loop of links
            log.warning("skipping %s: it points nowhere readable (%s)", POINTER, e)
    listed = list_checkpoints(folder)
    ahead = _ahead_of_pointer(candidates[0], listed) if candidates else None
    if ahead is not None:
        # a run stopped between the rename of a checkpoint and the swap of the pointer: resuming
        # from the pointer would train that stretch again
        log.warning("%s points to %s, but %s was written later in the run: resuming from the later one", POINTER,
                    candidates[0].name, ahead.name)
        candidates = [ahead]
    candidates += [p for p in listed if p.resolve() not in candidates]
    for p in candidates:
        if not p.exists() or p.resolve() in skipped:
            continue
        problem, data = checkpoint_problem(p)
        if problem:
            log.warning("skipping checkpoint %s: %s", p.name, problem)
            continue
        return p, data
    return None


def checkpoint_problem(path: Path) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """(why the run cannot resume from ``path``, None) or (None, its content): the file loads,
    its stored checksums match its bytes, and it holds an ssl_engine training state."""
    try:
        data = load_checkpoint(path)
        damaged = damaged_record(path)
    except CheckpointError as e:
        return str(e), None
    if damaged:
        return f"it {damaged}", None
    if not is_engine_checkpoint(data):
        kind = vissl_fsdp_type(data)
        if kind:
            return (f"it is a VISSL FSDP checkpoint (type {kind!r}), which cannot be resumed here (the engine trains "
                    f"with DistributedDataParallel); to start from its weights, {_CONSOLIDATE} in "
                    f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE"), None
        return "not an ssl_engine checkpoint", None
    problem = state_problem(data)
    return (problem, None) if problem else (None, data)


# ----------------------------------------------------------------------------------------
# Weight initialisation of new runs from our checkpoints, VISSL's, or plain state dicts.


def _is_vissl_model_layout(state: Dict[str, Any]) -> bool:
    """Whether ``state`` is VISSL's model layout: {trunk: {...}, heads: {...}} (either may be missing)."""
    return bool(set(state) & {"trunk", "heads"}) and all(isinstance(state.get(k, {}), dict) for k in ("trunk", "heads"))


_VISSL_EVAL_TRUNK = "trunk.base_model."  # a trunk's names inside VISSL's feature-evaluation wrapper


def _flatten_vissl_model(state: Dict[str, Any]) -> Tuple[Dict[str, torch.Tensor], bool]:
    """classy_state_dict -> base_model -> model -> {trunk, heads} becomes 'trunk.x' / 'heads.x'.

    Also says whether that layout was found (and so mapped onto the model's names)."""
    if "base_model" in state and isinstance(state["base_model"], dict):
        state = state["base_model"]
    if "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    if _is_vissl_model_layout(state):
        flat = {}
        for part in ("trunk", "heads"):
            weights = state.get(part, {})
            for k, v in (without_eval_wrapper(weights) if part == "trunk" else weights).items():
                flat[f"{part}.{k}"] = v
        return flat, True
    return state, False


_EVAL_WRAPPER = "base_model."


def without_eval_wrapper(trunk: Dict[str, Any], own_names: Sequence[str] = ()) -> Dict[str, Any]:
    """A trunk's weights under the trunk's own names.

    VISSL wraps the trunk of a feature evaluation (frozen trunk, pooled layers) in a feature
    extractor, so the checkpoints of a linear evaluation name its weights ``base_model.<name>``;
    VISSL drops the prefix when it loads them into a model that is not one. Weights without the
    prefix are kept as they are, and so are all of them when the trunk's ``own_names`` use it
    (a user's trunk with a submodule of that name)."""
    if any(k.startswith(_EVAL_WRAPPER) for k in own_names) or not any(
            isinstance(k, str) and k.startswith(_EVAL_WRAPPER) for k in trunk):
        return trunk  # as it is (a state dict keeps its _metadata)
    return {k[len(_EVAL_WRAPPER):] if isinstance(k, str) and k.startswith(_EVAL_WRAPPER) else k: v
            for k, v in trunk.items()}


def _as_tensor(value: Any) -> Optional[torch.Tensor]:
    """A weight as a tensor: a tensor as it is, a numpy array (as VISSL's loader takes it) as one; else None."""
    if isinstance(value, torch.Tensor):
        return value
    import numpy as np

    return torch.from_numpy(value) if isinstance(value, np.ndarray) and value.dtype != object else None


# VISSL's checkpoint types (its CheckpointItemType) whose file holds no weights under their names:
# what the file is, and what to name instead
_CONSOLIDATE = ("convert the FSDP checkpoint with VISSL's extra_scripts/convert_sharded_checkpoint.py -i <its "
                "model_*.torch that lists the shards> -o <new file> -t consolidated and name the new file")
_VISSL_FSDP_TYPES = {
    "shard_list": f"it lists the files of an FSDP run's shards and holds no weights; {_CONSOLIDATE}",
    "shard": f"one rank's shard of an FSDP run, its parameters flattened; {_CONSOLIDATE}",
    "slice_list": (f"it lists a file for each weight and holds no weights; name the checkpoint it was sliced from, "
                   f"or {_CONSOLIDATE}"),
}


def vissl_fsdp_type(data: Dict[str, Any]) -> Optional[str]:
    """The VISSL FSDP checkpoint type of a loaded file (a key of ``_VISSL_FSDP_TYPES``), or None."""
    kind = data.get("type")
    return kind if isinstance(kind, str) and kind in _VISSL_FSDP_TYPES else None


_USUAL_KEYS = ("classy_state_dict", "model_state_dict", "state_dict", "model")  # read in this order by default


def _read_state_dict(data: Dict[str, Any], key_name: str, source: str,
                     others: Optional[Dict[Any, str]] = None) -> Tuple[Dict[str, torch.Tensor], bool]:
    """The model weights held by a loaded file, and whether VISSL's prefix rule exempts them.
    ``others`` (when given) gets the type of each entry beside them that holds no tensor.

    VISSL applies REMOVE_PREFIX / APPEND_PREFIX only when STATE_DICT_KEY_NAME is not
    classy_state_dict: a classy_state_dict's trunk/heads layout is mapped onto the model's names
    by itself. The second value is True for exactly that case (STATE_DICT_KEY_NAME=classy_state_dict,
    the file has that key, and it holds the trunk/heads layout). Where VISSL would stop
    instead (no such key, another layout), the weights are read as below and the prefixes apply.
    """
    state: Any = data
    fsdp_kind = vissl_fsdp_type(data)
    if fsdp_kind:
        # VISSL's FSDP files: a list of shard files, one rank's shard (flattened parameters), or a
        # list of per-weight files; none holds the model's weights under their names
        raise CheckpointError(
            f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE {source} is a VISSL FSDP checkpoint of type {fsdp_kind!r}: "
            f"{_VISSL_FSDP_TYPES[fsdp_kind]}"
        )
    key_found = bool(key_name) and key_name in data
    # what the default (or '') reads: the first usual key holding a mapping, else the file itself
    fallback = next((k for k in _USUAL_KEYS if k in data and isinstance(data[k], dict)), None)
    if key_name and key_name != "classy_state_dict" and not key_found:
        # a key the user chose (the default falls back to the usual layouts): reading another one
        # instead would load other weights without a word (a misspelt model_ema loads model)
        keys = [str(k) for k in data]
        near = closest(key_name, keys)
        raise CheckpointError(
            f"config.MODEL.WEIGHTS_INIT.STATE_DICT_KEY_NAME={key_name!r} is not a key of {source}"
            + (f" (closest: {', '.join(near)})" if near else "")
            + (f"; its top-level keys: {first_few(keys)}" if keys else "; it holds an empty mapping")
            + (f"; '' reads its {fallback!r} (the first of {', '.join(_USUAL_KEYS)} it holds)"
               if fallback is not None else "; '' reads the file itself as the weights")
        )
    if key_found:
        state = data[key_name]
    elif fallback is not None:
        state = data[fallback]
    mapped = False
    if isinstance(state, dict):
        state, mapped = _flatten_vissl_model(state)
    weights = {}
    for k, v in (state.items() if isinstance(state, dict) else ()):
        tensor = _as_tensor(v)
        if tensor is not None:
            weights[k] = tensor
        elif others is not None:
            others[k] = type(v).__name__
    if not weights:
        # e.g. a DINO file's {"teacher": {...}, "student": {...}}: the keys that do hold weights
        holders = [str(k) for k, v in data.items() if k != key_name and isinstance(v, dict)
                   and sum(_as_tensor(t) is not None for t in v.values()) > 1]  # not a loss's one buffer
        raise CheckpointError(
            f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE {source} holds no weights under "
            f"STATE_DICT_KEY_NAME={key_name!r} "
            + (f"(top-level keys: {', '.join(map(str, list(data)[:8]))})" if data else "(it holds an empty mapping)")
            + (f"; weights are under {first_few(holders)}: set config.MODEL.WEIGHTS_INIT.STATE_DICT_KEY_NAME to one"
               if holders else "")
        )
    return weights, key_found and key_name == "classy_state_dict" and mapped


def extract_state_dict(data: Dict[str, Any], key_name: str, source: str) -> Dict[str, torch.Tensor]:
    """The model weights held by a loaded file, whatever its layout."""
    return _read_state_dict(data, key_name, source)[0]


def loads_head_weights(model_cfg: Any) -> bool:
    """Whether MODEL.WEIGHTS_INIT.PARAMS_FILE sets the heads too (VISSL's rule).

    A training run loads the whole model. An evaluation (FEATURE_EVAL_SETTINGS.EVAL_MODE_ON)
    trains or extracts from new heads unless EVAL_TRUNK_AND_HEAD asks for the file's heads: a
    linear probe never starts from the pretraining's head, even when the shapes happen to fit.
    """
    fe = model_cfg.FEATURE_EVAL_SETTINGS
    return not fe.EVAL_MODE_ON or bool(fe.EVAL_TRUNK_AND_HEAD)


def heads_not_set(report: Dict[str, List[str]], model_cfg: Any) -> Optional[str]:
    """For an :func:`init_model_from_weights` report: None when the file set a head weight, else
    why the heads keep their random init, as the end of a warning ('' when the file has none)."""
    if any(k.startswith("heads.") for k in report["loaded"]):
        return None
    return "" if loads_head_weights(model_cfg) else (
        ": config.MODEL.FEATURE_EVAL_SETTINGS.EVAL_MODE_ON loads the file's heads only with EVAL_TRUNK_AND_HEAD=true")


def _refuse_non_finite(state: Dict[str, torch.Tensor], path: Path) -> None:
    """Weights with NaN or infinite values (a file of a run that diverged) would train on NaN
    losses or extract NaN features with a 'complete' status: a UserError naming the file."""
    bad = [(k, int((~torch.isfinite(state[k])).sum())) for k in non_finite_tensors(state)]
    if bad:
        raise UserError(
            f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE {path}: {sum(n for _, n in bad)} of its weights are NaN or "
            f"infinite, in {len(bad)} tensor(s) ({first_few([k for k, _ in bad])}): the run that wrote it had "
            f"diverged or the file was damaged; use an earlier checkpoint of that run"
        )


def _weights_of_missing_blocks(model: torch.nn.Module, names: Sequence[str]) -> List[str]:
    """Those of the trunk weights ``names`` (not in ``model``) that sit in a numbered block of a
    container the model has, past its last block: ``layer1.2.conv1.weight`` where the model's
    ``layer1`` holds blocks 0 and 1, a RegNet's ``res4.block3-6`` where ``res4`` holds
    ``block3-0`` to ``block3-5``, or a whole stage past the model's last (``res5`` next to
    ``res2`` to ``res4``, ``layer5`` next to ``layer1`` to ``layer4``). Other weights the model
    lacks, such as a classifier the trunk does not have (torchvision's ``fc``), are not such
    blocks."""
    modules = dict(model.named_modules())
    out = []
    for name in names:
        path = name.split(".")[:-1]
        if not name.startswith("trunk.") or len(path) < 2 or ".".join(path) in modules:
            continue  # a weight of a module the model has (a bias its conv lacks) is no missing block
        for i in range(len(path) - 1, 0, -1):  # the deepest module of the path that the model has
            parent = ".".join(path[:i])
            if parent in modules:
                if _beyond_siblings(path[i], [c for c, _ in modules[parent].named_children()]):
                    out.append(name)
                break
    return out


def _beyond_siblings(name: str, siblings: Sequence[str]) -> bool:
    """Whether module ``name`` is a numbered block or stage that continues ``siblings``'s series
    (``siblings`` in the model's order): a block (ResNet's ``2``, RegNet's ``block3-6``) when one
    sibling is of its series; a stage (``res5``, ``layer5``, an MLP's ``fc2``) when its number is
    past theirs and its series has two or more siblings or is the series of the last numbered
    sibling, the deepest stage (so an MLP trunk's single ``fc1`` is a series; a stem's single
    ``conv1`` before ``res2``-``res4`` is not)."""
    m = _numbered(name)
    if m is None:
        return False
    series, number = m
    numbered = [x for x in map(_numbered, siblings) if x is not None]
    numbers = [n for s, n in numbered if s == series]
    if series == "" or series.endswith("-"):
        return bool(numbers)
    deepest = bool(numbered) and numbered[-1][0] == series
    return bool(numbers) and number > max(numbers) and (len(numbers) >= 2 or deepest)


def _numbered(name: str) -> Optional[Tuple[str, int]]:
    """(series, number) of a name that ends in a number: ('', 2) for ResNet's block ``2``,
    ('block3-', 6) for RegNet's ``block3-6``, ('res', 5) for a stage ``res5``; None otherwise."""
    m = re.fullmatch(r"(|.*-|[A-Za-z_]+)(\d+)", name)
    return (m.group(1), int(m.group(2))) if m else None


def _prefix_advice(weights: Dict[str, Any], own: Dict[str, torch.Tensor]) -> str:
    """The end of the "none of its weights match" error: the REMOVE_PREFIX / APPEND_PREFIX that map
    the most of the file's weights onto the model's names (with the model's shapes), when a pair
    maps at least a quarter of them; e.g. a DINO teacher's ``backbone.conv1.weight`` onto
    ``trunk._feature_blocks.conv1.weight``. Candidates come from the longest dotted name ending
    that a file key shares with a model key."""
    endings: Dict[str, List[str]] = {}
    for name in own:
        parts = name.split(".")
        for i in range(len(parts) - 1):  # endings of two parts or more ("conv1.weight", "0.bn1.weight")
            endings.setdefault(".".join(parts[i:]), []).append(name)
    candidates: Dict[Tuple[str, str], int] = {}
    for key in [k for k in weights if isinstance(k, str)][:64]:
        parts = key.split(".")
        for i in range(len(parts) - 1):
            ending = ".".join(parts[i:])
            if ending in endings:
                for name in endings[ending][:4]:
                    pair = (key[: len(key) - len(ending)], name[: len(name) - len(ending)])
                    candidates[pair] = candidates.get(pair, 0) + 1
                break

    def matched(pair: Tuple[str, str]) -> int:
        remove, append = pair
        return sum(1 for k, v in weights.items() if isinstance(k, str) and k.startswith(remove) and isinstance(v, torch.Tensor)
                   and getattr(own.get(append + k[len(remove):]), "shape", None) == v.shape)

    best = max(sorted(candidates, key=candidates.get, reverse=True)[:3], key=matched, default=None)
    count = matched(best) if best is not None else 0
    if best is None or count < max(1, len(weights) // 4):
        return "set REMOVE_PREFIX / APPEND_PREFIX / STATE_DICT_KEY_NAME"
    remove, append = best
    shown = [f"config.MODEL.WEIGHTS_INIT.{k}={v or chr(39) * 2}" for k, v in (("REMOVE_PREFIX", remove), ("APPEND_PREFIX", append))]
    return f"{shown[0]} and {shown[1]} map {count} of them onto the model's names"


def init_model_from_weights(model: torch.nn.Module, model_cfg: Any,
                            heads_used_untrained: Optional[bool] = None) -> Dict[str, List[str]]:
    """Load MODEL.WEIGHTS_INIT.PARAMS_FILE into ``model``; return loaded/missing/unexpected names.

    ``model_cfg`` is config.MODEL; head weights are left out when :func:`loads_head_weights` says so.
    A head weight of another shape is skipped with a warning (the head trains from its random
    init) unless ``heads_used_untrained`` (default: the model's heads are frozen): an extraction
    of the heads' output, or frozen heads, would give a partly random head's output, so it is a
    UserError.
    """
    weights_cfg = model_cfg.WEIGHTS_INIT
    path = named_file(weights_cfg.PARAMS_FILE, "config.MODEL.WEIGHTS_INIT.PARAMS_FILE")
    try:
        data = load_checkpoint(path)
    except CheckpointError as e:  # say which setting names the file
        raise CheckpointError(f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE: {e}") from None
    check_intact(path, "config.MODEL.WEIGHTS_INIT.PARAMS_FILE")
    others: Dict[Any, str] = {}
    weights, layout_mapped = _read_state_dict(data, weights_cfg.STATE_DICT_KEY_NAME, str(path), others)
    remove, append = weights_cfg.REMOVE_PREFIX, weights_cfg.APPEND_PREFIX
    if layout_mapped and (remove or append):
        # VISSL's rule: its fulltune / low-shot configs set APPEND_PREFIX: trunk. with a
        # classy_state_dict file, where it does nothing
        given = ", ".join(f"{k}={v!r}" for k, v in (("REMOVE_PREFIX", remove), ("APPEND_PREFIX", append)) if v)
        log.info(
            "config.MODEL.WEIGHTS_INIT.%s not applied: %s is read with STATE_DICT_KEY_NAME=classy_state_dict, whose "
            "trunk/heads layout is mapped onto the model's names by itself (as in VISSL, the prefixes apply to other "
            "STATE_DICT_KEY_NAMEs only)", given, path.name,
        )
        remove, append = "", ""

    def rename(k: Any) -> str:
        if remove and k.startswith(remove):
            k = k[len(remove):]
        k = f"{append}{k}"
        if k.startswith(_VISSL_EVAL_TRUNK):
            # VISSL's feature-evaluation wrapper: its docs give APPEND_PREFIX=trunk.base_model._feature_blocks.
            # for torchvision weights; this model's trunk has no wrapper (as _flatten_vissl_model reads it)
            k = "trunk." + k[len(_VISSL_EVAL_TRUNK):]
        return k

    renamed = {rename(k): v for k, v in weights.items()}
    skip = [s for s in weights_cfg.SKIP_LAYERS if s]
    own = model.state_dict()
    heads_load = loads_head_weights(model_cfg)
    # an entry under a weight's name that is no tensor, or a tensor of values the weight cannot hold
    # (integers, booleans or complex numbers for a float weight), is a damaged or foreign file: it was
    # left out as a 'missing' weight at its random init, or copied with its values cut (0.7 -> 0)
    def read(name: str) -> bool:  # a weight of the model that this file initialises
        return name in own and (heads_load or not name.startswith("heads.")) and not any(s in name for s in skip)

    wrong = [f"{name} holds a {kind}, not a tensor"
             for name, kind in ((rename(k), t) for k, t in others.items() if isinstance(k, str)) if read(name)]
    wrong += [f"{k} holds {v.dtype} values, the model's weight is {own[k].dtype}" for k, v in renamed.items()
              if read(k) and own[k].is_floating_point() and not v.is_floating_point()]
    if wrong:
        raise UserError(
            f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE {path}: {len(wrong)} of its entries named as the model's weights "
            f"are not weights ({first_few(wrong, 3, quote=False)}); each weight is a tensor (or numeric array) of "
            f"floating-point values: the file was changed, or written by a program that stores something else there"
        )
    if not heads_load:
        heads = [k for k in renamed if k.startswith("heads.")]
        renamed = {k: v for k, v in renamed.items() if not k.startswith("heads.")}
        if heads:
            log.info(
                "left %d head weights of %s out: config.MODEL.FEATURE_EVAL_SETTINGS.EVAL_MODE_ON evaluates new "
                "heads unless EVAL_TRUNK_AND_HEAD=true", len(heads), path,
            )
    loaded, unexpected, shape_mismatch, skipped = [], [], [], []
    mismatched = set()
    new_state = {}
    for k, v in renamed.items():
        if any(s in k for s in skip):
            skipped.append(k)
            continue
        if k not in own:
            unexpected.append(k)
        elif own[k].shape != v.shape:
            shape_mismatch.append(f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}")
            mismatched.add(k)
        else:
            new_state[k] = v
            loaded.append(k)
    # a trunk weight named as the model's but of another shape is a file of another depth, width or
    # input (VISSL stops on it too): a ResNet-50's file in a ResNet-18 shares conv1, bn1 and many BN
    # shapes, and would train as a mix of loaded and random layers. Layers left out on purpose are
    # named in SKIP_LAYERS. Outside the trunk (a head of another class count) it is a warning below.
    counted = [k for k in loaded if not k.endswith("num_batches_tracked")]
    trunk_differ = [m for m in shape_mismatch if m.startswith("trunk.")]
    differ = trunk_differ or (shape_mismatch if not counted else [])
    if differ:
        fitting = [k for k in counted if k.startswith("trunk.")] if trunk_differ else counted
        raise UserError(
            f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE {path}: {len(differ)} of its weights are named as the model's "
            f"but have another shape (e.g. {differ[0]}, file vs model)"
            + ("" if fitting else ", and none has the model's shape")
            + ": the file is for another architecture, depth or width; set config.MODEL.TRUNK (and HEAD) to the "
            f"model it was trained with, or name those layers in config.MODEL.WEIGHTS_INIT.SKIP_LAYERS to keep "
            f"them at their random init"
        )
    if heads_used_untrained is None:
        heads_used_untrained = bool(getattr(model, "heads_frozen", False))
    head_differ = [m for m in shape_mismatch if m.startswith("heads.")]
    if head_differ and heads_used_untrained:
        raise UserError(
            f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE {path}: {len(head_differ)} of its head weights have another shape "
            f"than the model's (e.g. {head_differ[0]}, file vs model), and the heads are not trained here (frozen, "
            f"a test-only run, or their output extracted): they would be partly random; set config.MODEL.HEAD.PARAMS "
            f"to the heads the file was trained with"
        )
    # the same where the file sets some of the heads' weights and lacks others: its heads were
    # built otherwise (one mlp of three dims where the config has two mlp heads, say); a head
    # the file has none of is new, and warned about by the callers (heads_not_set)
    if heads_used_untrained and any(k.startswith("heads.") for k in loaded):
        head_missing = [k for k in own if k.startswith("heads.") and k not in new_state and k not in mismatched
                        and not any(s in k for s in skip)]
        if head_missing:
            extra = [k for k in unexpected if k.startswith("heads.")]
            raise UserError(
                f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE {path}: it sets {sum(k.startswith('heads.') for k in loaded)} "
                f"of the model's head weights but lacks {len(head_missing)} (e.g. {head_missing[0]})"
                + (f" and has {len(extra)} head weights the model lacks (e.g. {extra[0]})" if extra else "")
                + ", and the heads are not trained here (frozen, a test-only run, or their output extracted): they "
                f"would be partly random; set config.MODEL.HEAD.PARAMS to the heads the file was trained with"
            )
    deeper = _weights_of_missing_blocks(model, unexpected) if loaded else []
    if deeper:  # a ResNet-34's file in a ResNet-18 fits every layer the model has, and more
        raise UserError(
            f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE {path}: {len(deeper)} of its weights belong to numbered blocks "
            f"this model does not have (e.g. {deeper[0]}): the file is for a deeper network; set config.MODEL.TRUNK "
            f"to the model it was trained with (e.g. RESNETS.DEPTH), or name those blocks in "
            f"config.MODEL.WEIGHTS_INIT.SKIP_LAYERS to leave them out"
        )
    # names this run would load: not SKIP_LAYERS, not heads it leaves out
    loadable = {k: v for k, v in own.items()
                if not any(s in k for s in skip) and (loads_head_weights(model_cfg) or not k.startswith("heads."))}

    def advice() -> str:  # the end of the two errors below (the prefix search reads the file's names)
        if layout_mapped:
            return ("the file's classy_state_dict is mapped by its trunk/heads layout (REMOVE_PREFIX / APPEND_PREFIX "
                    "do not apply to it); set STATE_DICT_KEY_NAME to read another key of the file")
        return _prefix_advice(weights, loadable)

    if not loaded:
        raise UserError(
            f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE {path}: none of its {len(renamed)} weights match the model "
            f"(first file key {next(iter(renamed), '-')!r}, first model key {next(iter(own), '-')!r}); {advice()}"
        )
    # the heads loaded but not one trunk weight, though the file has trunk weights under other names
    # (a wrapper's prefix inside the trunk, 'trunk.module._feature_blocks...'): the run would train a
    # random trunk under a pretrained head, which no one asks for (SKIP_LAYERS leaves a trunk out)
    trunk_own = [k for k in loadable if k.startswith("trunk.") and not k.endswith("num_batches_tracked")]
    trunk_unmatched = [k for k in unexpected if k.startswith("trunk.")]
    if trunk_own and trunk_unmatched and not any(k.startswith("trunk.") for k in counted):
        raise UserError(
            f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE {path}: none of its {len(trunk_unmatched)} trunk weights match "
            f"the model's (first file trunk key {trunk_unmatched[0]!r}, first model trunk key {trunk_own[0]!r}), "
            f"only {len(counted)} head weights do: the trunk would train from its random init; {advice()}"
        )
    _refuse_non_finite(new_state, path)
    model.load_state_dict(new_state, strict=False)
    missing = [k for k in own if k not in new_state and k not in mismatched and not any(s in k for s in skip)]
    # heads missing from a pretrained trunk's file is the usual case (new heads); a trunk weight left
    # at its random init (missing, or skipped by SKIP_LAYERS, BatchNorm's counters aside, which the
    # default skips) or a head skipped for its shape is a warning. A skipped file key the model lacks
    # (a head that APPEND_PREFIX put under trunk.) leaves no trunk weight random.
    skipped_trunk = [k for k in skipped if k in own and k.startswith("trunk.") and not k.endswith("num_batches_tracked")]
    trunk_random = shape_mismatch or skipped_trunk or any(k.startswith("trunk.") for k in missing)
    level = logging.WARNING if trunk_random else logging.INFO
    log.log(
        level, "initialised weights from %s: %d loaded, %d missing, %d unexpected, %d shape mismatches, "
        "%d skipped by config.MODEL.WEIGHTS_INIT.SKIP_LAYERS%s",
        path, len(loaded), len(missing), len(unexpected), len(shape_mismatch), len(skipped),
        " (the weights not loaded keep their random init)" if level == logging.WARNING else "",
    )
    shown_skipped = skipped_trunk if level == logging.WARNING else []
    for what, names in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shape_mismatch),
                        ("skipped trunk weights", shown_skipped)):
        if names:
            log.log(level, "  %s: %s%s", what, ", ".join(names[:10]), " ..." if len(names) > 10 else "")
    return {"loaded": loaded, "missing": missing, "unexpected": unexpected, "shape_mismatch": shape_mismatch,
            "skipped": skipped}
