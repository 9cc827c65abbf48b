"""Preemption signals: SIGTERM and SIGUSR1 only set a flag.

The checkpoint hook looks at the flag at the next step boundary, writes an iteration
checkpoint and ends the run with PREEMPTED_EXIT_CODE; rerunning the same command resumes.
"""

import logging
import signal
import threading
from typing import Any

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


def requested() -> bool:
    return _requested.is_set()


def request() -> None:
    """Ask for a preemption stop (what the signal handler does; also for tests)."""
    _requested.set()


def clear() -> None:
    _requested.clear()
