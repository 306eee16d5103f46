"""Run by tests/test_vllm.py in its own process (vLLM's engine sets up its own torch.distributed group and
thread settings; kept out of the pytest process). Prints one JSON line of measurements.

    python tests/vllm_probe.py TINY_MODEL_DIR WORK_DIR
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path

import torch


def hf_logps(model, samples) -> list[torch.Tensor]:
    from common.logprobs import sequence_logprobs
    from trainer.rollout import pack_rows
    ids, plens, clens = pack_rows([(s.prompt_ids, s.completion_ids) for s in samples], 0)
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, ids, plens, clens)
    return [lp[i, :int(clens[i])] for i in range(len(samples))]


def max_diff(model, samples) -> float:
    return max(float((a - s.logprobs).abs().max()) for a, s in zip(hf_logps(model, samples), samples))


def manual_greedy(model, prompt: list[int], steps: int, eos: list[int]) -> list[int]:
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(t)
            ids.append(t)
            if t in eos:
                break
    return out


def eos_rules_ok(samples, eos: list[int], max_new: int) -> bool:
    for s in samples:
        c = s.completion_ids.tolist()
        inner = [t for t in c[:-1] if t in eos]
        if inner or len(c) > max_new or len(c) == 0:
            return False
        if s.truncated != (c[-1] not in eos) or (s.truncated and len(c) != max_new):
            return False
        if s.logprobs is not None and len(s.logprobs) != len(c):
            return False
    return True


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    from common.config import GRPOConfig
    from common.modeling import load_model
    from common.weights.kernels import warm
    from common.weights.sync import WeightSync
    from trainer.engines import make_engine

    tiny, work = Path(sys.argv[1]), Path(sys.argv[2])
    # A checkpoint whose generation_config would change the distribution if merged in.
    model_dir = work / "model"
    shutil.copytree(tiny, model_dir, dirs_exist_ok=True)
    gc = json.loads((model_dir / "generation_config.json").read_text())
    gc.update(repetition_penalty=5.0, top_k=1, top_p=0.1, temperature=0.05, no_repeat_ngram_size=1)
    (model_dir / "generation_config.json").write_text(json.dumps(gc))

    cfg = GRPOConfig(model=str(model_dir), gen_backend="vllm", vllm_dtype="float32", temperature=1.0,
                     max_new_tokens=24, max_prompt_length=64, seed=3).validate()
    warm([2])  # numba (the delta sync's loops) loaded before the engine starts: it must start all the same
    engine = make_engine(cfg, str(model_dir))
    base = load_model(str(model_dir), dtype="float32")
    prompts = [[5, 17, 33, 2 + 40], [7, 8, 9, 10, 11, 12], [100, 200, 300]]
    res: dict = {"eos_ids": engine.eos_ids}

    samples = engine.generate(prompts, 8, max_new_tokens=24)
    res["n_samples"] = len(samples)
    res["order_ok"] = all(s.prompt_ids == prompts[i // 8] for i, s in enumerate(samples))
    res["distinct_completions"] = len({tuple(s.completion_ids.tolist()) for s in samples[:8]})
    res["diff_base"] = max_diff(base, samples)
    res["greedy_ok"] = all(
        s.completion_ids.tolist() == manual_greedy(base, p, 24, engine.eos_ids)
        for p, s in zip(prompts, engine.generate(prompts, 1, max_new_tokens=24, greedy=True)))

    # The trainer's policy after some steps: perturbed weights, published through sync_dir.
    trained = load_model(str(model_dir), dtype="float32")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    samples = engine.generate(prompts, 4, max_new_tokens=24)
    res["diff_trained_before_sync"] = max_diff(trained, samples)
    WeightSync(sync_dir=str(work / "sync")).publish(trained, 1)
    follower = WeightSync(sync_dir=str(work / "sync"))
    res["synced_version"] = follower.follow(apply=lambda t, _meta: engine.load_weights(t.items()))
    samples = engine.generate(prompts, 4, max_new_tokens=24)
    res["diff_trained_after_sync"] = max_diff(trained, samples)

    # eos / truncation rules: many stop ids so that both outcomes happen
    engine.eos_ids = list(range(0, 40))
    samples = engine.generate(prompts, 8, max_new_tokens=12)
    res["eos_rules_ok"] = eos_rules_ok(samples, engine.eos_ids, 12)
    res["n_truncated"] = sum(s.truncated for s in samples)
    res["n_stopped"] = sum(not s.truncated for s in samples)
    # one budget per prompt (tool rounds, issue 42): one rare stop id (the last of the vocabulary), so the samples
    # run to their own budget (one stopping earlier is allowed; the test asks for the bounds)
    engine.eos_ids = [engine.llm.llm_engine.model_config.get_vocab_size() - 1]
    samples = engine.generate(prompts[:2], 2, max_new_tokens=[3, 7])
    res["budget_lengths"] = [len(s.completion_ids) for s in samples]
    res["prefix_caching"] = engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than  # torch.compile'd where vLLM imports it
    res["rank_count_compiled"] = hasattr(batched_count_greater_than, "_torchdynamo_orig_callable")
    res["dynamo_disable_after"] = os.environ.get("TORCHDYNAMO_DISABLE")
    # a model vLLM cannot serve: a clear error naming it, not a crash deep inside vLLM
    bad = work / "bad_model"
    shutil.copytree(model_dir, bad, dirs_exist_ok=True)
    conf = json.loads((bad / "config.json").read_text())
    conf["architectures"] = ["NoSuchModelForCausalLM"]
    (bad / "config.json").write_text(json.dumps(conf))
    try:
        make_engine(cfg, str(bad))
        res["bad_model_error"] = ""
    except RuntimeError as e:
        res["bad_model_error"] = str(e)[:300]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
    from common.fast_exit import exit_cleanly  # done: skip the interpreter's teardown (~1-2 CPU-s after torch)
    exit_cleanly(0)
