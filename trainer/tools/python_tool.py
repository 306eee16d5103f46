"""The built-in `python` tool: runs a snippet and returns what it printed (stdout, then stderr).

It runs inside the tool executor process (trainer/tools/executor.py), never in the rollout process: the executor's
timeout, resource limits and scratch folder apply. Each snippet gets a fresh namespace; what it prints is kept up
to CAPTURE_CHARS characters (the rest is counted, not held), and the executor truncates the result again to
tool_output_chars. A snippet that raises returns its traceback's last line after what it printed, the way a
terminal would show it: the model reads its own error (the call's status stays "ok": the tool did its job).
"""
from __future__ import annotations

import contextlib
import io
import traceback

CAPTURE_CHARS = 100_000


class _BoundedText(io.TextIOBase):
    """A text sink that keeps the first `limit` characters and counts the rest (a print loop cannot fill memory)."""

    def __init__(self, limit: int):
        self.limit, self.parts, self.kept, self.dropped = limit, [], 0, 0

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        room = self.limit - self.kept
        if room > 0:
            self.parts.append(s[:room])
            self.kept += min(room, len(s))
        self.dropped += max(0, len(s) - max(room, 0))
        return len(s)

    def text(self) -> str:
        out = "".join(self.parts)
        return out + (f"\n...[{self.dropped} more characters]" if self.dropped else "")


def python(code: str) -> str:
    """Run a Python snippet and return what it printed to stdout and stderr.

    Args:
        code: The Python source to run; use print() to show results.
    """
    out, err = _BoundedText(CAPTURE_CHARS), _BoundedText(CAPTURE_CHARS)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            exec(compile(code, "<snippet>", "exec"), namespace)  # noqa: S102 - the tool's purpose; runs in the executor
        except SystemExit as e:  # exit() in a snippet ends the snippet, not the executor
            if e.code not in (None, 0):
                err.write(f"SystemExit: {e.code}\n")
        except Exception:  # noqa: BLE001 - the snippet's own error is its output, as in a terminal
            err.write(traceback.format_exc(limit=0).strip().splitlines()[-1] + "\n")
    stdout, stderr = out.text(), err.text()
    if stdout and stderr:
        return stdout + ("" if stdout.endswith("\n") else "\n") + stderr
    return stdout or stderr or "(no output)"
