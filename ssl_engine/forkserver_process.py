"""Imported in the forkserver process only (first on its preload list, see ssl_engine.forkserver).

A scheduler, ``timeout`` or ``kill -TERM -<pgid>`` sends a preemption signal to the whole
process group, and the forkserver is in it. Its default action would end the forkserver while
the ranks it forked write their preemption checkpoint; the launcher then reads no exit status
for them (multiprocessing reports 255 when the forkserver is gone), takes that for a failed
rank, and stops the others before their checkpoint is written. So the forkserver ignores the
preemption signals (it still ends when the process that started it ends: its alive pipe
closes), and every process it forks gets the default actions back before its target runs,
as if forked from a process that never changed them (ranks and loader workers install their
own handlers).
"""

import signal
import sys

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class _AfterFork:
    """The object multiprocessing's after-fork registry holds (it keeps weak references)."""

    def restore_default_actions(self) -> None:
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)


_AFTER_FORK = _AfterFork()


def in_forkserver() -> bool:
    """Whether this process is a forkserver: started as ``python -c`` running
    ``multiprocessing.forkserver.main``."""
    return sys.argv == ["-c"] and "multiprocessing.forkserver" in sys.modules


def shield_forkserver() -> bool:
    """In a forkserver: ignore the preemption signals here, restore them in each forked child.
    Elsewhere: nothing. True when it acted."""
    if not in_forkserver():
        return False
    from multiprocessing import util

    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    util.register_after_fork(_AFTER_FORK, _AfterFork.restore_default_actions)
    return True


shield_forkserver()
