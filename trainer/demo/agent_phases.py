"""The agent demo's own phases (`./launch.sh demo --agent`; cli.py runs them in the demo's order): the tool demo's
task and cold-start SFT, then the user's agent (examples/agents/calculator_agent.py, written with the openai SDK)
as the rollout. The held-out evaluation before and after GRPO runs that agent against the real endpoint
(trainer/agents: `serve` over an HF engine of the model, greedy) exactly as the genonly worker runs it during GRPO
(configs/demo_agent.json: `agent`), and scores its conversations with the run's reward (tool_task.py
reward_agent_answer): accuracy is that reward's +1, as the tool demo's."""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from trainer.demo.phases import Log, _free_cuda
from trainer.demo.tool_task import TOOL, reward_agent_answer

REPO = Path(__file__).resolve().parents[2]
AGENT = REPO / "examples" / "agents" / "calculator_agent.py"
AGENT_SPEC = f"{AGENT}:solve"  # absolute: the trainer runs from the checkout, the demo from anywhere


def sft_config(cfg):
    """The agent config as the tool demo's SFT takes it: the built-in calculator in place of the agent (its traces
    list the same schema the agent sends: tests/test_demo_agent.py)."""
    return replace(cfg, agent=None, tools=[TOOL])


def run_agent_eval(model_dir: str, data: str, split: str, limit: int, cfg, batch_size: int, device: str) -> dict:
    """Greedy held-out accuracy of the agent: one rollout per example against an endpoint over an HF engine of
    `model_dir`, within the run's limits (max_new_tokens a session, max_tool_calling_iterations calls)."""
    from common.modeling import eos_ids, load_model, load_tokenizer
    from common.user_code import load_object
    from trainer.agents import rollout_of, serve
    from trainer.agents.rollout import conversation
    from trainer.agents.runner import run_agents
    from trainer.data import run_data
    from trainer.engines.hf import HFEngine

    t0 = time.time()
    examples = run_data.eval_examples(replace(cfg, agent=None, data=data, eval_split=split, eval_limit=limit,
                                              eval_before=True))
    tok = load_tokenizer(model_dir, cfg.load_options())
    model = load_model(model_dir, device=device, dtype="auto", options=cfg.load_options())
    engine = HFEngine(model, tok, eos_ids(tok, model, chat=True), temperature=1.0, top_p=1.0, top_k=0,
                      gen_batch_size=batch_size)
    server = serve(engine, tok, model=str(cfg.model), max_new_tokens=cfg.max_new_tokens,
                   max_prompt_length=cfg.max_prompt_length, max_calls=cfg.max_tool_calling_iterations, greedy=True)
    try:
        runs = run_agents(server, load_object(cfg.agent), [{"prompt": ex.prompt, **ex.columns} for ex in examples],
                          timeout=cfg.agent_timeout, max_concurrency=batch_size)
    finally:
        server.close()
    del model, engine
    _free_cuda()
    convs = [conversation(rollout_of(r.session)[1]) for r in runs]
    failed = [r.error for r in runs if r.error is not None]
    if failed:
        raise RuntimeError(f"the agent failed on {len(failed)} of {len(runs)} held-out examples; the first: "
                           f"{failed[0]}")
    scores = reward_agent_answer(convs, [ex.ground_truth for ex in examples])
    ok = [s == 1.0 for s in scores]
    called = [sum(len(m.get("tool_calls") or []) for m in c) for c in convs]
    n = max(len(runs), 1)
    return {"n": len(runs), "accuracy": sum(ok) / n, "tool_calls_per_completion": sum(called) / n,
            "calls_per_rollout": sum(r.session.calls for r in runs) / n,
            "accuracy_with_call": sum(o for o, c in zip(ok, called) if c) / max(sum(1 for c in called if c), 1),
            "accuracy_own": sum(o for o, c in zip(ok, called) if not c) / max(sum(1 for c in called if not c), 1),
            "seconds": time.time() - t0,
            "samples": [{"prompt": ex.prompt, "conversation": c, "ground_truth": ex.ground_truth, "ok": o}
                        for ex, c, o in zip(examples, convs, ok)]}


def show_agent_samples(log: Log, res: dict, n: int = 3) -> None:
    for s in res["samples"][:n]:
        turns = " | ".join(_turn(m) for m in s["conversation"])
        log(f"  [{'ok ' if s['ok'] else 'bad'}] {s['prompt']!r:>10} -> {turns[:140]!r} (answer {s['ground_truth']})")


def _turn(m: dict) -> str:
    calls = [c["function"]["arguments"] for c in m.get("tool_calls") or []]
    return f"{m['role']}: {m['content']}" + (f" calls {calls}" if calls else "")

