"""What trainer ranks and genonly workers both set up: logging and the ref-server client."""
from __future__ import annotations

import logging
import os

from common.client import RefClient
from common.config import GRPOConfig


def setup_logging(tag: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [{tag}] %(levelname)s %(message)s",
                        datefmt="%H:%M:%S", force=True)


def make_client(cfg: GRPOConfig) -> RefClient:
    token = cfg.ref_token or os.environ.get("GRPO_REF_TOKEN")
    return RefClient([u for u in cfg.ref_server.split(",") if u], token=token, timeout=cfg.ref_timeout)
