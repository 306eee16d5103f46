"""Print the ref server's status table in the terminal (what `./launch.sh status` runs).

    python -m ref_server.status_cli [--ref-url URL] [--token-file F] [--stall-warn S] [--json]

Exit code 0 when nobody is stalled, 3 when someone is, 1 when the server cannot be asked.
"""
from __future__ import annotations

import json
import os
import sys

from common.settings.cli import ArgumentParser
from common.wire.client import RefClient, RefServerError
from ref_server.status import format_table


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="launch.sh status", description=__doc__.split("\n\n")[0])
    p.add_argument("--ref-url", default="http://127.0.0.1:59875", help="ref server URL (default: %(default)s)")
    p.add_argument("--token-file", help="file with the bearer token (default: $GRPO_REF_TOKEN)")
    p.add_argument("--stall-warn", type=float, help="seconds of silence that count as stalled (server's default)")
    p.add_argument("--json", action="store_true", help="print the raw JSON of GET /status")
    args = p.parse_args(argv)
    token = os.environ.get("GRPO_REF_TOKEN")
    if args.token_file:
        with open(args.token_file) as f:
            token = f.read().strip()
    client = RefClient(args.ref_url, token=token, timeout=10.0)
    try:
        status = client.status(stall_warn=args.stall_warn)
    except RefServerError as e:
        print(f"cannot read the status: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(json.dumps(status, indent=2) if args.json else format_table(status))
    return 3 if status["stalled"] else 0


if __name__ == "__main__":
    sys.exit(main())
