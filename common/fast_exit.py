"""Leave a process that finished cleanly without the interpreter's teardown.

A process that imported torch, transformers and DeepSpeed spends ~2 s after its last line (30 s at load 18)
in the interpreter's finalisation, nearly all of it the garbage collector walking those modules' objects as they
are torn down (py-spy: gc_collect_main). Nothing of ours is left to it: by the time a rank, a worker or the ref
server says it is done, its files, sockets, process pools and tool processes are closed. `exit_cleanly` does what
a normal exit does that matters - joins the threads that are not daemons, runs every atexit handler (logging's
flush, multiprocessing's child reaping, the libraries' own shutdown hooks), flushes stdout and stderr - then
ends the process with os._exit, skipping only that teardown."""
from __future__ import annotations

import atexit
import os
import sys
import threading


def exit_cleanly(code: int = 0) -> None:
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()  # as the interpreter's own shutdown does first
    atexit._run_exitfuncs()  # the handlers a normal exit runs, in the same (last registered first) order
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader (a pipe) is gone: nothing more to say there
            pass
    os._exit(code)
