"""`launch.sh check`'s agent line (trainer/check.py runs it for a config with `agent`, in place of the rewards
line): the agent once on the first example against the real endpoint, over an HF engine of the run's model (its
weights loaded: the only check that loads them), then the rollout scored as training scores it (TRL's
conversational signature, the agent's own float under its name). Prints the recorded conversation and token counts.
"""
from __future__ import annotations

import dataclasses
import sys


def check_agent(c) -> str:
    """c: trainer.check.Checker, its config, tokenizer and first examples loaded."""
    from trainer.agents.rollout import AgentRollouts
    from trainer.engines import make_engine
    from trainer.rewards.scoring import RewardScorer
    from trainer.rollout import encode_prompts
    cfg = c.cfg
    if c.tokenizer is None or not c.examples:
        raise ValueError("no tokenizer or no data row: the agent cannot be run")
    kept, _ = encode_prompts(c.tokenizer, c.examples[:1], None, sys.maxsize, cfg.prompt_format,
                             template_kwargs=cfg.chat_template_kwargs)
    engine = make_engine(dataclasses.replace(cfg, gen_backend="hf"), c.model_path, tokenizer=c.tokenizer)
    agents = AgentRollouts.from_config(cfg, engine, c.tokenizer)
    try:
        ar = agents.round(kept, 1)  # one rollout; every agent failing raises, naming why
    finally:
        agents.close()
    st = ar.stats[0]
    print(f"     {cfg.agent} on row 0: {st['calls']} call(s), {st['segments']} training row(s), {st['sampled_tokens']}"
          f" sampled token(s), finish {st['finish_reasons']}; the conversation after its first request:")
    for m in ar.messages[0]:
        calls = f" tool_calls={m['tool_calls']}" if m.get("tool_calls") else ""
        print(f"     | {m['role']}: {m['content']!r}{calls}")
    for k, row in enumerate(ar.rows[0]):
        print(f"     | row {k}: {len(row.prompt_ids)} prompt tokens, {len(row.completion_ids)} after it, "
              f"{int(row.loss_mask.sum())} trained (sampled)")
    scorer = RewardScorer.from_config(cfg, reward_models=False)
    try:
        ex, sample = kept[0][0], ar.samples[0]
        text = c.tokenizer.decode(sample.completion_ids, skip_special_tokens=True)
        sc = scorer.score_group(ex, [text], [sample.completion_ids.tolist()], ar.messages, ar.env_rewards, None,
                                ar.prompts)
    finally:
        scorer.close()
    return f"{cfg.agent} ran on row 0 against the endpoint, scored: " + ", ".join(
        f"{n}={v[0]}" for n, v in sc.components.items())
