"""The checkpoint-folder lock: one training run writes a CHECKPOINT.DIR at a time.

Rank 0 of a training run creates ``<CHECKPOINT.DIR>/train.lock`` with O_CREAT | O_EXCL (an
atomic "create if absent", also on NFS) and writes who owns it: pid, host, the process's
start time, the SLURM job id and the command line. A second run on the same folder finds the
file and refuses with a message naming the owner, instead of interleaving its checkpoints
with the first run's. The owner removes the file when it ends, whether it finished, failed
or was interrupted.

A lock whose owner is gone is stale and is taken over, with a warning: the owner ran on this
host and its pid no longer runs (or now belongs to a process that started later), or the
owner was an earlier allocation of this same SLURM job (a requeued job after a preemption).
A lock held from another host cannot be checked from here; the message says which file to
delete once that run is known to be gone.
"""

import contextlib
import json
import logging
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

from ssl_engine.errors import FolderLockedError, UserError

log = logging.getLogger(__name__)

LOCK_NAME = "train.lock"
EXTRACT_LOCK_NAME = "extract.lock"
# what holds each kind of lock, and the key that names its folder (for the messages)
_KINDS = {
    LOCK_NAME: ("training run", "checkpoint folder", "config.CHECKPOINT.DIR"),
    EXTRACT_LOCK_NAME: ("feature extraction", "feature folder", "config.EXTRACT_FEATURES.OUTPUT_DIR"),
}
_TAKEOVER_SUFFIX = ".takeover"
_STALE_TAKEOVER_SECONDS = 30.0  # a takeover guard older than this was left by a process that died
_UNREADABLE_GRACE_SECONDS = 5.0  # an empty/garbled lock younger than this is still being written


def lock_path(folder: Any, name: str = LOCK_NAME) -> Path:
    """Where the lock of a checkpoint folder (or, with EXTRACT_LOCK_NAME, a feature folder) lives."""
    return Path(str(folder)).expanduser() / name


def _process_start_ticks(pid: int) -> Optional[int]:
    """The start time of a process in clock ticks since boot (Linux /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    try:  # the command name is in parentheses and may hold spaces: split after the last ')'
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def _owner_record() -> Dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "start_ticks": _process_start_ticks(os.getpid()),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv)[:500],
        "token": uuid.uuid4().hex,
    }


def _read(path: Path) -> Optional[bytes]:
    """The lock file's bytes, None when there is none; a UserError when the name is taken by
    something that is no lock (a symbolic link, dangling or not; a folder; an unreadable file):
    this tool only ever creates plain files there, so waiting for it to go away would not end."""
    if path.is_symlink():
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        raise UserError(f"{path} is a symbolic link (to {target}), not a lock file: the lock is a plain file this "
                        f"tool creates and removes; delete the link")
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        what = "a folder" if path.is_dir() else f"unreadable ({e.strerror or e})"
        raise UserError(f"{path} is {what}, not a lock file: the lock is a plain file this tool creates and "
                        f"removes; remove it") from None


def _parse(raw: bytes) -> Optional[Dict[str, Any]]:
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    pid = data.get("pid") if isinstance(data, dict) else None
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 2**31:
        return None  # garbled (a pid no process can have): taken over as unreadable
    return data


def owner_is_gone(owner: Dict[str, Any]) -> Optional[bool]:
    """True: the owner no longer runs; False: it runs; None: it ran on another host (unknown)."""
    job = os.environ.get("SLURM_JOB_ID", "")
    if job and owner.get("slurm_job_id") == job and owner.get("host") != socket.gethostname():
        return True  # an earlier allocation of this very job (requeued): it cannot still be running
    if owner.get("host") != socket.gethostname():
        return None
    pid = int(owner["pid"])
    if pid == os.getpid() and owner.get("start_ticks") == _process_start_ticks(pid):
        return True  # left behind by this process (an earlier run in the same interpreter)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # runs, as another user
    ticks = owner.get("start_ticks")
    now = _process_start_ticks(pid)
    return bool(ticks is not None and now is not None and ticks != now)  # the pid was reused


def describe_owner(owner: Dict[str, Any]) -> str:
    """'pid 123 on host node1, started 2024-05-01 10:00:00'."""
    text = f"pid {owner.get('pid')} on host {owner.get('host', '?')}"
    if owner.get("started"):
        text += f", started {owner['started']}"
    return text


def _refusal(path: Path, owner: Dict[str, Any], gone: Optional[bool]) -> FolderLockedError:
    folder = path.parent
    who, what, key = _KINDS.get(path.name, _KINDS[LOCK_NAME])
    if gone is None:
        return FolderLockedError(
            f"{what} {folder} is locked by another {who} ({describe_owner(owner)}); its host "
            f"cannot be checked from here. Use another {key}, or delete {path} once that run has ended"
        )
    return FolderLockedError(
        f"{what} {folder} is in use by another {who} ({describe_owner(owner)}; lock file {path}); "
        f"wait for it to end or use another {key}"
    )


def check_folder_free(folder: Any, name: str = LOCK_NAME) -> None:
    """Raise FolderLockedError when a live run holds the folder's lock (changes nothing on disk)."""
    path = lock_path(folder, name)
    raw = _read(path)
    if raw is None:
        return
    owner = _parse(raw)
    if owner is None:
        return  # garbled: acquire() decides after its grace period
    gone = owner_is_gone(owner)
    if not gone:
        raise _refusal(path, owner, gone)


class FolderLock:
    """The lock of one checkpoint folder (or feature folder: ``name=EXTRACT_LOCK_NAME``), held by
    this process between acquire() and release()."""

    def __init__(self, folder: Any, name: str = LOCK_NAME) -> None:
        self.path = lock_path(folder, name)
        self.record: Optional[Dict[str, Any]] = None

    def __enter__(self) -> "FolderLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    @property
    def held(self) -> bool:
        return self.record is not None

    def acquire(self) -> None:
        """Take the lock, taking over a stale one; FolderLockedError when a live run holds it."""
        if self.held:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = _owner_record()
        payload = (json.dumps(record, indent=1) + "\n").encode("utf-8")
        deadline = time.monotonic() + 10.0
        warned: Optional[bytes] = None
        while True:
            if self._create(payload):
                self.record = record
                return
            raw = _read(self.path)
            if raw is None:
                if time.monotonic() > deadline:
                    raise FolderLockedError(f"could not take the lock {self.path}: other runs keep taking it; try again")
                continue  # released meanwhile: try again
            owner = _parse(raw)
            if owner is None:
                if self._age() < _UNREADABLE_GRACE_SECONDS and time.monotonic() < deadline:
                    time.sleep(0.05)  # its owner is writing it right now
                    continue
                log.warning("taking over the unreadable lock file %s", self.path)
                self._remove_if_unchanged(raw)
                continue
            gone = owner_is_gone(owner)
            if not gone:
                raise _refusal(self.path, owner, gone)
            if raw != warned:  # once per stale lock, not once per try while a takeover guard is in the way
                warned = raw
                log.warning(
                    "taking over the stale lock of %s %s: its owner (%s) no longer runs",
                    _KINDS.get(self.path.name, _KINDS[LOCK_NAME])[1], self.path.parent, describe_owner(owner),
                )
            self._remove_if_unchanged(raw)
            if time.monotonic() > deadline:
                raise FolderLockedError(f"could not take the lock {self.path}: other runs keep taking it; try again")

    def release(self) -> None:
        """Remove the lock file if it is still ours (never another run's)."""
        if not self.held:
            return
        owner = _parse(_read(self.path) or b"")
        if owner is not None and owner.get("token") == self.record.get("token"):
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                # the folder became read-only (or the disk went away) while the run held it: the
                # run's own error, which an exception here would replace, is what the user must
                # see; the lock file left behind is taken over as stale by the next run
                log.warning("could not remove the lock file %s: %s", self.path, e.strerror or e)
        self.record = None

    # -- internals ------------------------------------------------------------------------

    def _create(self, payload: bytes) -> bool:
        try:
            fd = os.open(str(self.path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        except OSError as e:
            raise UserError(f"cannot create the lock file {self.path}: {e.strerror or e}") from None
        try:
            os.write(fd, payload)
            os.fsync(fd)
        except OSError as e:
            # a full disk (or quota) takes the file but not its record: an empty lock left behind
            # would hold the folder for the next run's grace period, and the OSError was a traceback
            os.close(fd)
            try:
                self.path.unlink()
            except OSError:
                pass
            raise UserError(f"cannot write the lock file {self.path}: {e.strerror or e}; free space there (or use "
                            f"another folder) and rerun") from None
        os.close(fd)
        return True

    def _age(self) -> float:
        try:
            return time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return 0.0

    def _remove_if_unchanged(self, raw: bytes) -> None:
        """Delete the stale lock, unless another process replaced it since we read it.

        A guard file created with O_EXCL makes "check content, then delete" one step among the
        processes that take over at the same moment.
        """
        guard = self.path.with_name(self.path.name + _TAKEOVER_SUFFIX)
        try:
            fd = os.open(str(guard), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            _remove_stale_guard(guard)
            time.sleep(0.05)
            return
        try:
            os.write(fd, (json.dumps(_owner_record()) + "\n").encode("utf-8"))  # who holds it, if it is left behind
            if _read(self.path) == raw:
                self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:  # a full disk: the guard is removed below, the stale lock stays for the next run
            raise UserError(f"cannot write {guard} (to take over the stale lock {self.path.name}): {e.strerror or e}; "
                            f"free space there (or use another folder) and rerun") from None
        finally:
            os.close(fd)
            try:
                guard.unlink()
            except FileNotFoundError:
                pass


def _remove_stale_guard(guard: Path) -> None:
    """Delete a takeover guard that a process killed while it held it left behind: its owner (the
    record inside) no longer runs, or it is older than any takeover takes (an empty guard: the
    owner was killed before it wrote the record, or one written by an older version)."""
    try:
        raw = guard.read_bytes()
        age = time.time() - guard.stat().st_mtime
    except OSError:
        return  # gone meanwhile, or not readable: the age rule of a later try decides
    owner = _parse(raw)
    stale = age > _STALE_TAKEOVER_SECONDS or (owner is not None and owner_is_gone(owner) is True) or (
        owner is None and age > _UNREADABLE_GRACE_SECONDS)
    if stale:
        try:
            if guard.read_bytes() == raw:  # not replaced by another process's guard since it was read
                guard.unlink()
        except OSError:
            pass


@contextlib.contextmanager
def held_by_rank0(folder: Any, name: str = LOCK_NAME) -> Iterator[bool]:
    """Rank 0 holds the lock of ``folder`` for the block. Every rank learns whether it got it:
    the block sees True, or, on ranks > 0 when rank 0 was refused, False (they stop quietly
    while rank 0 raises the refusal). Released at the end of the block, also on an error."""
    from ssl_engine import distributed as du

    lock = FolderLock(folder, name) if du.is_primary() else None
    error: Optional[UserError] = None
    if lock is not None:
        try:
            lock.acquire()
        except UserError as e:
            error = e
    ok = du.all_gather_object(error is None)[0] if du.get_world_size() > 1 else error is None
    if error is not None:
        raise error
    try:
        yield ok
    finally:
        if lock is not None:
            with _ctrl_c_held_back():
                lock.release()


@contextlib.contextmanager
def _ctrl_c_held_back() -> Iterator[None]:
    """A Ctrl-C during the block is raised after it, not inside: a run stopped at its very end
    still removes its lock (an interrupt between reading the lock and unlinking it left it
    behind). Only the main thread can change the handler; elsewhere the block runs as it is."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)  # None: set outside Python
        if caught and callable(previous):
            previous(signal.SIGINT, caught[0])  # the interrupt, now that the block is done
