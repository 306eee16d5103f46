"""What trainer ranks and genonly workers both set up: logging and the ref-server client."""
from __future__ import annotations

import logging
import os

from common.config import GRPOConfig
from common.wire.client import RefClient


def setup_logging(tag: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [{tag}] %(levelname)s %(message)s",
                        datefmt="%H:%M:%S", force=True)


def make_client(cfg: GRPOConfig, participant_id: str | None = None, role: str = "",
                host: str | None = None) -> RefClient:
    """The ref-server client; `participant_id` names this process in the server's heartbeat table."""
    token = cfg.ref_token or os.environ.get("GRPO_REF_TOKEN")
    client = RefClient([u for u in cfg.ref_server.split(",") if u], token=token, timeout=cfg.ref_timeout)
    if participant_id:
        client.set_identity(participant_id, role, host)
    return client
