"""Whether a process runs: the one check the launcher, the forkserver ranks and the loader
workers watch each other with, and the stale-file cleanups use.

A module of its own with only the standard library: a loader worker's watchdog imports it, and a
worker must not pay for importing the checkpoint code to learn whether its training process runs.
"""

import os


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (as any user). A zombie (ended, not yet reaped by its parent)
    does not: a launcher killed under a parent that has not waited for it yet is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc (macOS): ask the kernel whether the pid exists
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
