"""Print the ref server's status table in the terminal (what `./launch.sh status` runs), or how the run ended.

    python -m ref_server.status_cli [--run-dir D] [--ref-url URL] [--token-file F] [--stall-warn S] [--json]

Exit code 0 when nobody is stalled, 3 when someone is. When the server does not answer, the run directory
(--run-dir, else the newest run under the folder it is run from, or the checkout's runs/) says how the run ended
(exit code, last step, final model; common/run_record.py): exit 0; 1 when no run there has ended either.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from common.run_record import START, describe, newest_run
from common.settings.argparser import ArgumentParser
from common.wire.client import RefClient, RefServerError
from ref_server.status import format_table


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="launch.sh status", description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", help="the run to ask about: its ref server while it runs, how it ended after "
                                     "(default: the newest run under this folder, or the checkout's runs/)")
    p.add_argument("--ref-url", help="ref server URL (default: the run's, else http://127.0.0.1:59875)")
    p.add_argument("--token-file", help="file with the bearer token (default: $GRPO_REF_TOKEN)")
    p.add_argument("--stall-warn", type=float, help="seconds of silence that count as stalled (server's default)")
    p.add_argument("--json", action="store_true", help="print the raw JSON of GET /status")
    args = p.parse_args(argv)
    token = os.environ.get("GRPO_REF_TOKEN")
    here = Path(os.environ.get("GRPO_CALLER_DIR", "."))  # launch.sh runs us from the checkout
    if args.token_file:  # relative to where launch.sh was run, as --run-dir
        token = (here / args.token_file).read_text().strip()
    run = (here / args.run_dir).resolve() if args.run_dir else newest_run([here, Path(__file__).parents[1] / "runs"])
    url = args.ref_url or (json.loads((run / START).read_text()).get("ref_url") if run and (run / START).is_file()
                           else None) or "http://127.0.0.1:59875"
    client = RefClient(url, token=token, timeout=10.0)  # status(): one attempt
    try:
        status = client.status(stall_warn=args.stall_warn)
    except RefServerError as e:
        ended = describe(run) if run is not None and not e.status else None  # (a server that answers: its word)
        if ended is not None:  # the run is over: how it ended, from its directory
            print(ended)
            return 0
        where = "" if e.status else "; " + (f"run {run} has not ended" if run is not None else
                                            f"no run found under {here.resolve()}") + \
            " (--run-dir DIR names a run, --ref-url URL a server)"
        print(f"cannot read the status: {e}{where}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(json.dumps(status, indent=2) if args.json else format_table(status))
    return 3 if status["stalled"] else 0


if __name__ == "__main__":
    sys.exit(main())
