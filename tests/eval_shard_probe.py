"""Read by tests/test_eval_shard.py, run in tests/rank_probes.py's two real DeepSpeed ranks: the in-training eval
(trainer/loop.py run_eval) at each ZeRO stage of `stages` (below 3; a fresh engine from the same weights each), with
a record of the prompts each rank generated for, next to one process evaluating the whole set (trainer/evaluate.py
evaluate, no collective). Prints one line `EVALPROBE {json}` per rank and stage.
"""
from __future__ import annotations

import json
from dataclasses import replace

import torch

from common.config import GRPOConfig
from common.modeling import load_tokenizer
from trainer.data.loading import load_examples
from trainer.deepspeed_policy import build_engine
from trainer.engines.hf import HFEngine
from trainer.evaluate import evaluate
from trainer.loop import run_eval
from trainer.rollout import encode_prompts

N_EXAMPLES = 7  # odd: the ranks' shares differ in size


def run(model: str, stages, deepspeed, rank: int, world: int, on_gpu: bool) -> None:
    cfg = GRPOConfig(model=model, data="arith", system_prompt="", eval_max_new_tokens=8, gen_batch_size=1,
                     dist_timeout=120, output_dir="/nonexistent-not-written").validate()
    for stage in stages:
        probe_stage(replace(cfg, zero_stage=stage).validate(), deepspeed, rank, world, on_gpu)


def probe_stage(cfg: GRPOConfig, deepspeed, rank: int, world: int, on_gpu: bool) -> None:
    model = cfg.model
    engine, zero_stage, _ = build_engine(cfg, deepspeed, model, on_gpu)
    policy, tok = engine.module, load_tokenizer(model)
    examples = load_examples("arith", split="test", limit=N_EXAMPLES)

    def whole(exs):  # one process, the whole set, the settings run_eval uses
        return evaluate(policy, tok, exs, system_prompt=cfg.system_prompt, prompt_format=cfg.prompt_format,
                        max_new_tokens=cfg.eval_max_new_tokens, max_prompt_length=cfg.max_prompt_length,
                        batch_size=cfg.gen_batch_size, num_samples=len(exs), progress=False)

    # a random tiny model answers nothing right: make every other example's ground truth its own greedy
    # completion, so the accuracy to reproduce is neither 0 nor 1
    first = whole(examples)
    examples = [replace(ex, ground_truth=s["completion"]) if i % 2 == 0 else ex
                for i, (ex, s) in enumerate(zip(examples, first["samples"]))]
    reference = whole(examples)

    index = {tuple(ids): i for i, (_, ids) in enumerate(encode_prompts(tok, examples, cfg.system_prompt,
                                                                       cfg.max_prompt_length, cfg.prompt_format)[0])}
    evaluated: list[int] = []
    generate = HFEngine.generate

    def recording_generate(self, prompt_ids, n, **kw):  # the real generate, recording which prompts it got
        evaluated.extend(index[tuple(p)] for p in prompt_ids if tuple(p) in index)
        return generate(self, prompt_ids, n, **kw)

    HFEngine.generate = recording_generate
    res = run_eval(policy, tok, cfg, examples, lockstep=zero_stage == 3)
    HFEngine.generate = generate
    torch.distributed.barrier()
    print("EVALPROBE " + json.dumps({"rank": rank, "world": world, "zero_stage": zero_stage, "evaluated": evaluated,
                                     "result": res, "reference": {k: reference[k] for k in (
                                         "accuracy", "format_rate", "n", "correct", "formatted")}}), flush=True)
