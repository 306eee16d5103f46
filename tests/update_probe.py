"""One DeepSpeed rank (gloo, CPU) stepping trainer/objective/update.py's schedule on synthetic batches of the tiny
model; prints, per step, what the test compares with a hand-computed schedule. Run by tests/test_update_schedule.py:
    python tests/update_probe.py MODEL_DIR OUT_DIR --grad_accum 2 --mu 2 ...   (GRPOConfig flags)"""
from __future__ import annotations

import json
import sys

import torch

from common.config import GRPOConfig
from common.settings.knobs import load_config
from common.wire.protocol import ScoredBatch
from trainer.deepspeed_policy import build_engine, init_deepspeed
from trainer.objective.update import new_round, starts_round, train_update


def batch(seed: int, vocab: int, version: int) -> ScoredBatch:
    g = torch.Generator().manual_seed(seed)
    B, P, T = 4, 3, 5
    ids = torch.randint(0, vocab, (B, P + T), generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    gen = -torch.rand(B, T, generator=g) * 3  # an engine whose logprobs are not the trainer's
    return ScoredBatch(input_ids=ids, prompt_lens=torch.full((B,), P), completion_lens=torch.full((B,), T),
                       advantages=adv, gen_logps=gen, policy_version=version, batch_id=f"b{seed}")


def main() -> None:
    model_dir, out_dir, *flags = sys.argv[1:]
    cfg = load_config(GRPOConfig, ["--model", model_dir, "--output_dir", out_dir, *flags])
    deepspeed, _, _, on_gpu = init_deepspeed(cfg)
    engine, _, _ = build_engine(cfg, deepspeed, model_dir, on_gpu)
    vocab = engine.module.config.vocab_size
    rows, seed = [], 0
    for step in range(1, cfg.all_steps + 1):
        fetched = starts_round(step, 0, cfg.mu)
        if fetched:
            seed += cfg.grad_accum
            rnd = new_round([batch(seed + k, vocab, step - 1) for k in range(cfg.grad_accum)], cfg, "cpu")
        lr = engine.get_lr()[0]  # the LR this update uses
        before = [p.detach().clone() for p in engine.module.parameters()]
        stats = train_update(engine, rnd, cfg)
        moved = any(not torch.equal(a, p.detach()) for a, p in zip(before, engine.module.parameters()))
        rows.append({"step": step, "fetched": fetched, "batches": [b.batch_id for b in rnd.batches], "lr": lr,
                     "global_steps": engine.global_steps, "moved": moved, **stats})
    print(json.dumps(rows))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    from common.fast_exit import exit_cleanly  # done: skip the interpreter's teardown (~1 CPU-s a rank)
    exit_cleanly(0)
