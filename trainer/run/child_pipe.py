"""JSON lines from a child process's pipe, under a deadline: the one reader behind the tool executor
(trainer/tools/executor.py) and the reward worker's caller (trainer/rewards/timeout.py).

Why select + os.read and not readline(): a blocking read cannot be abandoned when the child hangs, and abandoning
it is the whole point of both callers (they kill the child on a timeout). Why our own buffer: one os.read may bring
several lines (the reward worker answers a group item by item) or part of one; what follows the first newline is
kept for the next read.

It lives in trainer/ (not common/, which is what the trainer and the ref server share), beside both of its users,
and imports nothing of the project: neither wing has to import the other.
"""
from __future__ import annotations

import json
import os
import select
import time


class ChildExited(Exception):
    """The child closed its end of the pipe (it exited, crashed or was killed) before a whole line came.

    An exception rather than a return value: the callers differ here (the executor turns it into a "died" result
    and goes on, the reward caller stops the run), and a sentinel would have to be told apart from a JSON value."""


class JsonLineReader:
    """Reads `stream` (a pipe opened with bufsize=0, e.g. Popen(...).stdout): one JSON value per line."""

    def __init__(self, stream):
        self.fd = stream.fileno()
        self.buf = b""  # bytes read past the last line returned: the start of the next line(s)

    def read(self, timeout: float):
        """The next line's JSON value; None when `timeout` seconds pass first (what arrived so far is kept).
        Raises ChildExited at the end of the pipe."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                raise ChildExited
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)
