"""Ref server settings: one dataclass, from a JSON file (--config) and/or CLI flags.

    python -m ref_server --model tiny --max-queue 32
    python -m ref_server --config server.json --port 6000

Flags accept dashes or underscores (--max-queue == --max_queue); the bearer token comes from
--token-file or the GRPO_REF_TOKEN environment variable, never from a flag (flags show in `ps`).
"""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from common.settings.choices import OnOffAuto
from common.settings.knobs import build_parser, knob, load_config, parse_choices
from common.settings.model_options import ModelLoading

TOKEN_ENV = "GRPO_REF_TOKEN"


@dataclass
class ServerConfig(ModelLoading):
    """Reference-model server for GRPO: scores uploaded rollouts with a frozen model
    (per-token reference logprobs) and hands the scored batches out FIFO.
    Flags take dashes or underscores (--max-queue = --max_queue); a bare boolean flag means true.
    The model loads with trust_remote_code / attn_implementation / revision / model_init_kwargs, the trainer's
    options of those names (launch.sh passes the trainer's on: common/placement/launch_plan.py PLAN_REF_ARGS)."""

    model: str | None = knob(None, "Reference model: a Hugging Face id or local directory ('tiny' = the "
                                      "embedded tiny Qwen2). Required.")
    host: str = knob("127.0.0.1", "Address to bind. A non-loopback address needs a token (or --insecure).")
    port: int = knob(59875, "TCP port to listen on.")
    device: str = knob("auto", "auto, cpu or cuda:N.")
    dtype: str = knob("auto", "auto (bfloat16 on CUDA, float32 on CPU), bfloat16 or float32.")
    max_queue: int = knob(64, "Uploads waiting to be scored; beyond this /upload answers 503 + Retry-After.")
    max_output_queue: int = knob(256, "Scored batches waiting for /get; when full the scorer pauses, so the "
                                      "input queue fills and uploads get 503 (backpressure, never a drop).")
    max_body_mb: float = knob(64.0, "Largest accepted upload body in MiB (413 above).")
    max_weights_mb: float | None = knob(None, "Largest policy-weights publish (PUT /weights) in MiB (413 above, "
                                                 "decided from the header; only a request with the token gets its "
                                                 "body received). Default: derived from the model: parameters x 4 "
                                                 "bytes (float32) x 1.25 + 64 MiB (ref_server/weights_limit.py); "
                                                 "the startup log and GET /status show the limit in force.")
    token_file: str | None = knob(None, "File holding the bearer token that /upload and /get require "
                                           f"(default: ${TOKEN_ENV} if set, else no token).")
    insecure: bool = knob(False, "Allow binding a non-loopback address without a token.")
    threads: int = knob(8, "HTTP worker threads (waitress). Long-polling /get calls use at most half.")
    score_token_budget: int = knob(16384, "Max padded tokens (rows x length) of the uploads scored together, and "
                                          "max computed tokens in one forward (padded: rows x longest; "
                                          "padding_free: the rows' real tokens).")
    chunk_tokens: int = knob(256, "Positions per LM-head chunk in the logprob computation (bounds memory).")
    padding_free: OnOffAuto = knob("auto", "Padding-free scoring: the rows of a forward as ONE packed sequence, no "
                                           "padded token computed (common/packing.py); false pads each forward to "
                                           "its longest row, rows grouped by length. auto: per scoring call, "
                                           "whichever an estimate of the work both ways says is less "
                                           "(common/pack_choice.py).")
    max_get_wait: float = knob(10.0, "Cap in seconds on the long-poll of GET /get?wait=SECONDS.")
    retry_after: int = knob(1, "Seconds sent in Retry-After with 503 answers.")
    drain_timeout: float = knob(5.0, "On SIGTERM/SIGINT: after the batch being scored is done, keep answering "
                                     "/get this many seconds while scored batches wait (a 2nd signal skips it).")
    reward_models: list = knob([], "Reward models to hold and serve on POST /reward (launch.sh passes the trainer's "
                                   "reward_fns entries that are models): a JSON list of {path, name, tokenizer}, or "
                                   "paths (named by their last part). Same device and dtype as --model.")
    # --- run identity (issue 11) ---
    run_nonce: str | None = knob(None, "Opaque id of the run that started this server, echoed by /health: "
                                          "launch.sh checks it so that it never trains against a stranger's "
                                          "server that holds the same port.")

    placement_file: str | None = knob(None, "JSON placement plan of the run (launch.sh writes RUN_DIR/placement."
                                            "json: which GPU each process got); shown by GET /status.")

    # --- run status (GET /status) ----------------------------------------------------
    stall_warn: float = knob(120.0, "GET /status lists a participant as stalled after this many silent seconds "
                                    "(a client may pass ?stall_warn=S).")

    def validate(self) -> ServerConfig:
        checks = [
            (bool(self.model), "--model is required"),
            (0 <= self.port <= 65535, "port must be in 0..65535"),
            (self.max_queue >= 1 and self.max_output_queue >= 1, "queue sizes must be >= 1"),
            (self.max_body_mb > 0, "max_body_mb must be > 0"),
            (self.max_weights_mb is None or self.max_weights_mb > 0, "max_weights_mb must be > 0"),
            (self.threads >= 2, "threads must be >= 2"),
            (self.score_token_budget >= 1 and self.chunk_tokens >= 1, "score_token_budget and chunk_tokens >= 1"),
            (min(self.max_get_wait, self.retry_after, self.drain_timeout) >= 0,
             "max_get_wait, retry_after and drain_timeout must be >= 0"),
            (self.stall_warn > 0, "stall_warn must be > 0"),
            (self.placement_file is None or Path(self.placement_file).is_file(),
             f"placement_file {self.placement_file} not found"),
            (all(isinstance(m, str) or (isinstance(m, dict) and m.get("path") and m.get("name"))
                 for m in self.reward_models), "reward_models entries must be paths or {path, name, tokenizer}"),
        ] + self.loading_checks() + [(False, msg) for msg in parse_choices(self)]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"ref_server config: {msg}")
        return self

    def __post_init__(self) -> None:  # a plain path entry -> {path, name (TRL's: the last part), tokenizer: None}
        self.reward_models = [{"path": m, "name": m.rstrip("/").split("/")[-1], "tokenizer": None}
                              if isinstance(m, str) else m for m in self.reward_models or []]

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * (1 << 20))


def _normalize_flags(argv: list[str]) -> list[str]:
    """--max-queue[=v] -> --max_queue[=v] for known flags only (values are never touched);
    a bare boolean flag (--insecure) -> --insecure=true."""
    fields = ServerConfig.__dataclass_fields__
    known = set(fields) | {"config", "help"}
    out = []
    for i, a in enumerate(argv):
        if a.startswith("--"):
            name, eq, value = a[2:].partition("=")
            name = name.replace("-", "_")
            if name in known:
                bare_bool = (name in fields and fields[name].type in (bool, "bool") and not eq
                             and (i + 1 == len(argv) or argv[i + 1].startswith("--")))
                a = f"--{name}=true" if bare_bool else "--" + name + eq + value
        out.append(a)
    return out


def load_server_config(argv: list[str] | None = None) -> ServerConfig:
    import sys
    argv = list(sys.argv[1:] if argv is None else argv)
    return load_config(ServerConfig, _normalize_flags(argv), prog="python -m ref_server")


def server_parser():
    """The argparse parser behind --help (for docs)."""
    return build_parser(ServerConfig, prog="python -m ref_server")


def resolve_token(cfg: ServerConfig) -> str | None:
    """Token from --token-file, else $GRPO_REF_TOKEN, else None. An empty token file is an error."""
    if cfg.token_file:
        path = Path(cfg.token_file)
        if not path.is_file():
            raise FileNotFoundError(f"token file not found: {path}")
        token = path.read_text().strip()
        if not token:
            raise ValueError(f"token file {path} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a hostname: we cannot tell where it resolves, so treat it as public
        return False


def check_bind(cfg: ServerConfig, token: str | None) -> None:
    """Refuse to expose an unauthenticated server beyond this machine unless asked to."""
    if not is_loopback(cfg.host) and token is None and not cfg.insecure:
        raise ValueError(f"refusing to bind {cfg.host!r} without a token: pass --token-file, set {TOKEN_ENV}, "
                         "or --insecure if the network is trusted")
