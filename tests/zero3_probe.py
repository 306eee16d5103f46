"""Read by tests/test_zero3_lockstep.py, run in tests/rank_probes.py's two real DeepSpeed ranks: ZeRO-3 ranks
train on batches whose longest completion differs between ranks (rank r: 64 - 40 r tokens), so the per-rank LM-head
chunk counts differ. Each scenario (a list of GRPOConfig overrides, name then value) gets a fresh engine from the
model in the same ranks: after `steps` train_step calls and a barrier every rank prints "scenario I DONE", and
"PROBE DONE" after the last; a rank out of lockstep hangs (until dist_timeout) or fails instead.
"""
from __future__ import annotations

import torch

from common.config import GRPOConfig
from common.wire.protocol import ScoredBatch
from trainer.deepspeed_policy import build_engine
from trainer.objective.update import train_step


def batch_for(rank: int, rows: int, vocab: int) -> ScoredBatch:
    g = torch.Generator().manual_seed(rank)
    longest = 64 - 40 * rank
    plen = torch.full((rows,), 6)
    clen = torch.tensor([longest] + [max(1, longest - 3 * i) for i in range(1, rows)])
    ids = torch.zeros(rows, int((plen + clen).max()), dtype=torch.long)
    for i in range(rows):
        ids[i, :plen[i] + clen[i]] = torch.randint(3, vocab, (int(plen[i] + clen[i]),), generator=g)
    T = int(clen.max())
    return ScoredBatch(ids, plen, clen, torch.randn(rows, generator=g), gen_logps=-torch.rand(rows, T, generator=g) - 5,
                       ref_logps=-torch.rand(rows, T, generator=g) - 5)


def probe_config(model: str, over: list[str]) -> GRPOConfig:
    cfg = GRPOConfig(model=model, zero_stage=3, max_new_tokens=64, logp_chunk_tokens=8, num_pre_Q=4, lr=1e-3,
                     dist_timeout=60, output_dir="/nonexistent-not-written")
    for a, v in zip(over[::2], over[1::2]):  # int knobs (micro_batch_size may default to None: unset), else str
        setattr(cfg, a.lstrip("-"), int(v) if v.lstrip("-").isdigit() else v)
    return cfg


def run(model: str, steps: int, scenarios, deepspeed, rank: int, on_gpu: bool) -> None:
    for i, scenario in enumerate(scenarios):
        cfg = probe_config(model, scenario)
        engine, _, _ = build_engine(cfg, deepspeed, model, on_gpu)
        vocab = engine.module.config.vocab_size
        for step in range(steps):
            stats = train_step(engine, batch_for(rank, cfg.num_pre_Q * cfg.train_batch_groups, vocab), cfg)
            print(f"rank{rank} scenario {i} step {step + 1} loss {stats['loss']:.6f}", flush=True)
        torch.distributed.barrier()
        print(f"rank{rank} scenario {i} DONE", flush=True)
        del engine
    print(f"rank{rank} PROBE DONE", flush=True)
