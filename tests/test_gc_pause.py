"""common/gc_pause.py: the collector is paused around a process's heavy imports, what they made is frozen after a
successful import and nothing after a failed one, nested uses resume it once, and a normal exit unfreezes first.
In a child process: a freeze in the test's own process would keep its garbage for the rest of the session."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, subprocess_env

SCRIPT = r"""
import atexit, gc, json
from common.gc_pause import imports_without_gc

# registered first, so it runs last: after the handler imports_without_gc registered
atexit.register(lambda: print(json.dumps({"frozen_at_exit": gc.get_freeze_count()})))

seen = {}
before = gc.get_freeze_count()
with imports_without_gc():
    seen["inside"] = gc.isenabled()
    with imports_without_gc():
        pass
    seen["after_nested"] = gc.isenabled()  # the inner exit does not resume it
    import email.mime.text  # noqa: F401  (a real import under the pause)
seen["after"] = gc.isenabled()
seen["frozen"] = gc.get_freeze_count() - before
gc.unfreeze()
try:
    with imports_without_gc():
        import no_such_module_anywhere  # noqa: F401
except ImportError:
    seen["after_failed"] = gc.isenabled()
seen["frozen_after_failed"] = gc.get_freeze_count()
gc.disable()
with imports_without_gc():
    pass
seen["kept_off"] = not gc.isenabled()  # a caller that had it off keeps it off, and nothing is frozen
seen["frozen_when_off"] = gc.get_freeze_count()
gc.enable()
with imports_without_gc():
    pass
seen["frozen_last"] = gc.get_freeze_count()
print(json.dumps(seen))
"""


def test_paused_inside_frozen_after_resumed_once_and_a_failed_import_freezes_nothing():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                          env=subprocess_env(PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr
    *_, line, at_exit = proc.stdout.strip().splitlines()
    seen = json.loads(line)
    assert seen["inside"] is False and seen["after_nested"] is False and seen["after"] is True
    assert seen["frozen"] > 1000  # the interpreter's and the imports' objects
    assert seen["after_failed"] is True and seen["frozen_after_failed"] == 0
    assert seen["kept_off"] is True and seen["frozen_when_off"] == 0
    assert seen["frozen_last"] > 1000 and json.loads(at_exit) == {"frozen_at_exit": 0}  # unfrozen for the teardown
