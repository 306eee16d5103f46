"""python -m ref_server --model PATH_OR_ID [--port 59875] ...   (see --help)"""
from __future__ import annotations

import logging
import sys

from common.gc_pause import imports_without_gc
from common.paths import check_model_path
from ref_server.config import check_bind, load_server_config, resolve_token


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [ref_server] %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    try:
        cfg = load_server_config(argv)
        check_bind(cfg, resolve_token(cfg))  # before the (slow) model load
        check_model_path(cfg.model)  # a wrong local path: one line, not a hub-lookup traceback
    except (ValueError, FileNotFoundError) as e:  # bad settings: one clear line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    with imports_without_gc():  # torch and transformers (common/gc_pause.py)
        from ref_server.serve import serve  # imported late: --help and bad flags answer without loading torch

    return serve(cfg)


if __name__ == "__main__":
    code = main()
    if code == 0:  # stopped cleanly, everything closed: skip the ~2 s interpreter teardown (common/fast_exit.py)
        from common.fast_exit import exit_cleanly
        exit_cleanly(0)
    sys.exit(code)
