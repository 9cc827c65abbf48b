"""Compose the config in a forked child process while the tool's process imports torch.

The command line spends about half a second composing the config (hydra, yaml, validation)
and several seconds importing torch and torchvision. Neither needs the other, so the tool
forks a child right at the start, before anything heavy is imported, to compose the config
while the parent imports torch on another core; the child sends the composed config back
through a pipe (pickled) and exits. A watcher thread in the parent receives it and hands it
to a callback at once (the CLI starts the loader workers' forkserver there, so that its
imports overlap the parent's too).

A config mistake is still reported as soon as composing fails: with ``exit_on_user_error``
the watcher prints the one-line error and ends the process with exit code 2 while the main
thread is still importing (nothing has been written or started by then). Anything else the
child could not do (a bug in composing, the child killed) is not guessed at: the parent
composes the config again itself once its imports are done, so the error and its traceback
come out exactly as without the child.

The child's log records (compose warnings) are not written by the child: they travel with its
answer and the parent logs them, so that each appears once also when the parent composes again
(and logs its own); the records of a child that could not answer are dropped for that reason.

Only for a process that has not imported torch yet and can fork (not on Windows); the caller
falls back to composing in-process where :func:`start` returns None.
"""

import logging
import os
import pickle
import signal
import sys
import threading
from typing import Any, Callable, List, Optional, Tuple

from ssl_engine.errors import USER_ERROR_EXIT_CODE, UserError, one_line


def _compose(overrides: List[str]) -> Any:
    from ssl_engine.config.compose import compose

    return compose(overrides)


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


# A log record as the child sends it: (logger name, level, message).
Record = Tuple[str, int, str]


class _HoldRecords(logging.Handler):
    """Keeps the records logged in the child, to be sent to the parent with its answer."""

    def __init__(self) -> None:
        super().__init__()
        self.records: List[Record] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.records.append((record.name, record.levelno, record.getMessage()))
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is not worth failing for
            self.handleError(record)


def _hold_log_records() -> _HoldRecords:
    """In the child: what is logged from now on is held for the parent, not written."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    held = _HoldRecords()
    root.addHandler(held)
    return held


def _log_records(records: List[Record]) -> None:
    """In the parent: log the child's records as if they had been logged here."""
    for name, level, message in records:
        logging.getLogger(name).log(level, "%s", message)


def _child(overrides: List[str], write_fd: int) -> None:
    """The forked child: compose, send ``(kind, value, log records)`` to the parent, exit without cleanup."""
    code = 0
    try:
        held = _hold_log_records()
        try:
            payload: Tuple[str, Any, List[Record]] = ("config", _compose(overrides), held.records)
        except UserError as e:
            payload = ("user_error", str(e), held.records)
        except BaseException:  # noqa: B036 - a bug or Ctrl-C: the parent composes again and shows it
            payload = ("retry", None, [])  # the parent's compose logs the same records itself
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        with os.fdopen(write_fd, "wb") as pipe:
            pipe.write(data)
    except BaseException:  # noqa: B036 - nothing may escape a forked child
        code = 1
    finally:
        _flush_std_streams()  # anything printed (not logged) while composing
        os._exit(code)


class PendingConfig:
    """The config a forked child is composing; :meth:`result` waits for it."""

    def __init__(self, overrides: List[str], pid: int, read_fd: int,
                 on_config: Optional[Callable[[Any], None]], exit_on_user_error: bool) -> None:
        self._overrides = list(overrides)
        self._pid = pid
        self._read_fd = read_fd
        self._on_config = on_config
        self._exit_on_user_error = exit_on_user_error
        self._outcome: Tuple[str, Any, List[Record]] = ("retry", None, [])
        self._callback_error: Optional[BaseException] = None
        self._cancelled = False
        self._thread = threading.Thread(target=self._receive, name="ssl_engine-compose", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        try:
            with os.fdopen(self._read_fd, "rb") as pipe:
                data = pipe.read()
        except OSError:
            data = b""
        try:
            os.waitpid(self._pid, 0)
        except ChildProcessError:
            pass
        try:
            outcome = pickle.loads(data) if data else ("retry", None, [])
        except Exception:  # a child killed while writing: compose again in the parent
            outcome = ("retry", None, [])
        self._outcome = outcome
        if self._cancelled:
            return
        kind, value, records = outcome
        _log_records(records)
        if kind == "user_error" and self._exit_on_user_error:
            _flush_std_streams()
            print(f"error: {one_line(value)}", file=sys.stderr, flush=True)
            os._exit(USER_ERROR_EXIT_CODE)
        if kind == "config" and self._on_config is not None:
            try:
                self._on_config(value)
            except BaseException as e:  # noqa: B036 - raised again by result(), in the main thread
                self._callback_error = e

    def cancel(self) -> None:
        """The parent is leaving before it asked for the config (its imports failed, Ctrl-C):
        stop the child, and let neither its error nor its config act any more."""
        self._cancelled = True
        try:
            os.kill(self._pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._thread.join(timeout=5)  # reaps the child
        _remove_scratch_folders(self._pid)

    def result(self) -> Any:
        """The composed config; raises the config's UserError, or composes here if the child could not."""
        self._thread.join()
        if self._callback_error is not None:
            raise self._callback_error
        kind, value, _ = self._outcome
        if kind == "config":
            return value
        if kind == "user_error":
            raise UserError(value)
        cfg = _compose(self._overrides)
        if self._on_config is not None:
            self._on_config(cfg)
        return cfg


_SCRATCH_PREFIX = "ssl_engine_cfg_"


def scratch_folder_prefix(pid: int) -> str:
    """The name prefix of compose's scratch folder in the system temp folder: it holds the
    composing process's pid, so that the folder of a compose child killed while composing
    (cancelled on Ctrl-C) can be found and removed by its parent."""
    return f"{_SCRATCH_PREFIX}{pid}_"


def _remove_scratch_folders(pid: int) -> None:
    """Remove the scratch folder that compose child ``pid``, killed while composing, left behind."""
    import glob
    import shutil
    import tempfile

    for path in glob.glob(os.path.join(tempfile.gettempdir(), scratch_folder_prefix(pid) + "*")):
        shutil.rmtree(path, ignore_errors=True)


def remove_stale_scratch_folders(min_age_s: float = 600.0) -> None:
    """Remove the scratch folders of composing processes that no longer run (killed with
    SIGKILL while composing, which leaves no chance to clean up). Composing takes about a
    second: a folder younger than ``min_age_s`` is left alone, also when its pid looks gone
    (a process of another pid namespace sharing the temp folder)."""
    import glob
    import shutil
    import tempfile
    import time

    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{_SCRATCH_PREFIX}*_*")):
        pid = os.path.basename(path)[len(_SCRATCH_PREFIX):].split("_", 1)[0]
        try:
            if not pid.isdigit() or time.time() - os.path.getmtime(path) < min_age_s:
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # another user's process: it runs
            pass


def start(overrides: List[str], on_config: Optional[Callable[[Any], None]] = None,
          exit_on_user_error: bool = False) -> Optional[PendingConfig]:
    """Fork a child that composes ``overrides``; None where composing in-process is the better
    choice (torch is imported already, so there is nothing to overlap, or there is no fork).

    ``on_config(cfg)`` runs in the parent's watcher thread as soon as the config arrives.
    """
    if "torch" in sys.modules or not hasattr(os, "fork"):
        return None
    if on_config is not None:
        # what the callback imports, imported now: the watcher thread then imports nothing
        # while the main thread is inside torch's import
        import multiprocessing.forkserver  # noqa: F401

        import ssl_engine.forkserver  # noqa: F401
        import ssl_engine.socket_dir  # noqa: F401
    _flush_std_streams()  # or the child would write the parent's buffered output a second time
    read_fd, write_fd = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(read_fd)
        os.close(write_fd)
        return None
    if pid == 0:
        os.close(read_fd)
        _child(overrides, write_fd)  # never returns
    os.close(write_fd)
    return PendingConfig(overrides, pid, read_fd, on_config, exit_on_user_error)
