"""Import the heavy libraries with the cyclic garbage collector paused, then keep their objects out of it.

Importing torch, transformers, DeepSpeed or vLLM makes some 370,000 long-lived objects and next to no garbage, yet
the collector, run every 700 allocations, walks the growing heap again and again while they load: ~17 % of
`python -c "import trainer.loop"` (4.2 -> 3.5 CPU-s), paid by every rank, worker, ref server and check at every
start. And after the imports every full collection walks those objects once more: 2 million small allocations
after `import trainer.loop` cost 2.4 CPU-s with them in the heap, 0.8 with them frozen.

`imports_without_gc()` pauses the collector around such imports; when they succeed it freezes what exists
(gc.freeze: left out of every later collection; the ~10,000 objects of import-time garbage with them, once) and
resumes it. A failed import resumes it and freezes nothing. Nested uses resume it once, at the outermost exit.
Use it at a process's start, where the heap holds nothing but what the imports made. At a normal exit the objects
are unfrozen first (an atexit handler), so the interpreter's teardown is what it was.
"""
from __future__ import annotations

import atexit
import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def imports_without_gc() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    except BaseException:
        if was_enabled:
            gc.enable()
        raise
    if was_enabled:
        gc.freeze()
        gc.enable()
        atexit.register(gc.unfreeze)  # a normal exit's last collection sees everything, as without the freeze
