"""The forkserver's preload list: what it imports once before forking loader workers and ranks.

Without a preload every forkserver child imports torch, torchvision (and through them
torch._dynamo) on its own while unpickling what it was sent: seconds of CPU per worker before
the first batch. Torch-free, so that the CLI can start the forkserver before it imports torch.
"""

from typing import List

# ssl_engine.forkserver_process keeps the forkserver alive through a preemption signal sent to
# the process group (it acts only inside a forkserver); the others import without side effects
# (a user's module is still imported by each child).
FORKSERVER_PRELOAD = ("ssl_engine.forkserver_process", "torch", "ssl_engine.data")


def preload_forkserver() -> List[str]:
    """Add FORKSERVER_PRELOAD to this process's forkserver preload list (keeping what was asked
    for elsewhere); takes effect when the forkserver starts. Returns the merged list."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    current = list(getattr(forkserver._forkserver, "_preload_modules", []) or [])
    merged = current + [m for m in FORKSERVER_PRELOAD if m not in current]
    if merged != current:
        mp.set_forkserver_preload(merged)
    return merged
