"""The cyclic garbage collector during a tool's startup: paused while it imports, then told to
leave the imported objects alone.

Importing torch, torch._dynamo (which torch.optim imports), torchvision and classy_vision
creates about half a million container objects. Python's collector runs whenever enough new
objects have been allocated, and each full collection walks every one of them: on the 2-core
test machine about 800 collections during these imports, 0.6-1.0 s of a 5 s startup, with
nothing to free but a few MB of import-time leftovers. So the tool's own process (not a library
caller: that process's collector is its own business) pauses the collector from its first line
until its imports are done, then moves every object alive at that point into the collector's
permanent generation (``gc.freeze``), so that later collections scan only what the run itself
creates, and switches it back on.

The price: the import-time leftovers that a collection would have freed (cycles of functions,
cells and tuples that modules dropped; about 7 MB next to 700 MB of imported code on the test
machine) stay in memory for the life of the process. Nothing the run creates later is affected.
"""

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def paused(active: bool = True) -> Iterator[None]:
    """The collector is off inside the block (the imports); on leaving it, also on an error,
    every object tracked then is frozen and the collector is switched back on when it was on
    before. ``active=False`` leaves the collector alone (a library caller's process)."""
    if not active:
        yield
        return
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_on:
            gc.enable()
