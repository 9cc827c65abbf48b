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

import gc


def pause() -> bool:
    """Switch the collector off; returns whether it was on (for :func:`resume`)."""
    was_on = gc.isenabled()
    gc.disable()
    return was_on


def resume(was_on: bool) -> None:
    """Freeze every object tracked now (imports done) and switch the collector back on when it
    was on before :func:`pause`. Safe to call more than once."""
    gc.freeze()
    if was_on:
        gc.enable()
