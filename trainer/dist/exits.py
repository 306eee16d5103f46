"""A process that exits while the run goes on is never silent (launch.sh's watch, the `workers` host role).

Without --keep-going the launcher ends the run, naming the process, its exit code and its last log lines. With
--keep-going it goes on and marks the process in the ref server's status table, so `./launch.sh status` (and
the HTML view) show it as exited rather than as a producer that merely went quiet:

    python -m trainer.dist.exits REF_URL NAME CODE       (launch.sh; the token comes from GRPO_REF_TOKEN)
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from common.wire.client import RefClient, RefServerError


def last_lines(path: Path, n: int = 15) -> str:
    """The log's last n lines, indented (empty when there is no log)."""
    if not path.is_file():
        return f"    (no log at {path})"
    lines = path.read_text(errors="replace").splitlines()[-n:]
    return "\n".join("    " + line for line in lines)


def mark_exited(ref_url: str, name: str, code: int, role: str = "worker") -> str:
    """Put 'exited with code N (--keep-going)' in NAME's row of the ref server's status; the state it set."""
    state = f"exited with code {code} (--keep-going: the run goes on without it)"
    client = RefClient(ref_url, token=os.environ.get("GRPO_REF_TOKEN"), timeout=5, max_retries=0)
    client.set_identity(name, role)
    client.heartbeat(state)
    return state


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3 or not args[2].lstrip("-").isdigit():
        print("usage: python -m trainer.dist.exits REF_URL NAME EXIT_CODE", file=sys.stderr)
        return 2
    try:
        mark_exited(args[0], args[1], int(args[2]))
    except RefServerError as e:  # the status row is a courtesy: the loud line in the launcher's log stands
        print(f"[launch] could not mark {args[1]} exited in {args[0]}/status: {e.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
