"""Preemption signals: SIGTERM and SIGUSR1 only set a flag.

The checkpoint hook looks at the flag at the next step boundary, writes an iteration
checkpoint and ends the run with PREEMPTED_EXIT_CODE; rerunning the same command resumes.

A flag is only seen when Python runs. While the main thread waits inside torch's C++ code
for other ranks to join, no Python signal handler runs, so ``stop_while_blocked`` watches the
signals from a thread instead and ends the process there: nothing is lost that early.
"""

import contextlib
import logging
import os
import select
import signal
import sys
import threading
import time
from typing import Any, Iterator

from ssl_engine.errors import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE

log = logging.getLogger(__name__)

_requested = threading.Event()


class Preempted(Exception):
    """Raised after the preemption checkpoint is written; the tool exits with PREEMPTED_EXIT_CODE."""


def _handler(signum: int, frame: Any) -> None:
    _requested.set()


def install() -> None:
    """Route SIGTERM and SIGUSR1 to the flag (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, _handler)


def ignore_from_now() -> None:
    """Ignore the preemption signals for the rest of the process (main thread only).

    For a tool process whose run has ended, its files complete: Python's shutdown puts the
    default handlers back before it is done, and a scheduler's SIGTERM in that last second
    would turn a finished run's exit code into "killed". An ignored signal stays ignored
    through the shutdown.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def requested() -> bool:
    return _requested.is_set()


def request() -> None:
    """Ask for a preemption stop (what the signal handler does; also for tests)."""
    _requested.set()


def clear() -> None:
    _requested.clear()


# A preemption signal that reaches ranks while they meet (the launcher's own SIGTERM, forwarded
# as they start) is kept: once they have met, the first step writes the checkpoint. Only ranks
# still waiting this long after it give up on the meeting, which might never happen (before
# SLURM's default KillWait of 30 s turns the signal into a SIGKILL).
PREEMPTED_WAIT_S = 20.0

_PREEMPTION_SIGNALS = (int(signal.SIGTERM), int(signal.SIGUSR1), int(signal.SIGUSR2))  # USR2: submitit's


@contextlib.contextmanager
def stop_while_blocked(waiting_for: str, preempted_wait_s: float = PREEMPTED_WAIT_S) -> Iterator[None]:
    """End the process on Ctrl-C, or on a preemption signal that the block outlasts.

    For a call that blocks in C++ until other processes arrive (the rendezvous of the ranks):
    Python runs no signal handler until it returns, which may be TIMEOUT_MINUTES later, so a
    Ctrl-C or a SLURM preemption would go unheard. The interpreter still writes each signal's
    number to its wakeup fd at once (for signals with a Python handler); a thread reads it and
    exits the process: with INTERRUPTED_EXIT_CODE at once on SIGINT, with PREEMPTED_EXIT_CODE
    when the block still lasts ``preempted_wait_s`` after a preemption signal (or after the
    block began, when the flag was already set). Nothing is lost: no step has run.
    ``waiting_for`` completes the log line. Outside the main thread this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    done = threading.Event()

    def stop(signum: int, code: int) -> None:
        # SIGINT is a Ctrl-C (the launcher says "interrupted") or the launcher stopping the ranks
        # that wait for one that failed: not worth a line beside that rank's error on stderr
        log.log(logging.INFO if signum == signal.SIGINT else logging.WARNING,
                "stopped by %s while waiting for %s; nothing to save yet, the run had not started",
                signal.Signals(signum).name, waiting_for)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(code)

    def watch() -> None:
        preempted = (int(signal.SIGTERM), time.monotonic() + preempted_wait_s) if requested() else None
        while not done.is_set():
            timeout = None if preempted is None else max(0.0, preempted[1] - time.monotonic())
            try:
                readable = select.select([read_fd], [], [], timeout)[0]
                received = os.read(read_fd, 64) if readable else b""
            except OSError:
                return
            if readable and not received:
                return  # the block ended: the write end is closed
            if done.is_set():
                return
            for signum in received:
                if signum == signal.SIGINT:
                    stop(signum, INTERRUPTED_EXIT_CODE)
                if signum in _PREEMPTION_SIGNALS and preempted is None:
                    preempted = (signum, time.monotonic() + preempted_wait_s)
                    log.warning("%s while waiting for %s: the run checkpoints at its first step once they have "
                                "joined, or stops in %.0f s if they have not", signal.Signals(signum).name,
                                waiting_for, preempted_wait_s)
            if preempted is not None and time.monotonic() >= preempted[1] and not done.is_set():
                stop(preempted[0], PREEMPTED_EXIT_CODE)

    watcher = threading.Thread(target=watch, name="stop-while-blocked", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(previous)
        os.close(write_fd)
        watcher.join(timeout=5)
        os.close(read_fd)
