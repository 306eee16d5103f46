"""Run by tests/test_tool_e2e.py in its own process (vLLM sets up its own torch.distributed group): the tool
loop over the real HF and vLLM engines with the real ToolBox (the user's `add`, the Counter environment), on a
model fine-tuned to call them (tests/tool_sft.py). Prints one JSON line per engine.

    python tests/tool_engine_probe.py USER_DIR MODEL_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tool_sft  # noqa: E402


class Recording:
    """An engine that remembers every Sample it returned: the turns as the engine produced them."""

    def __init__(self, engine):
        self.engine, self.out = engine, []
        self.eos_ids = engine.eos_ids

    def generate(self, prompt_ids, n, **kw):
        got = self.engine.generate(prompt_ids, n, **kw)
        self.out.append([(list(s.prompt_ids), s.completion_ids.tolist()) for s in got])
        return got


def check(engine, tok, box, greedy: bool) -> dict:
    from trainer.tools.multi_turn import tool_rollouts, tool_suffix_ids

    prompt, _ = tool_sft.trace(box.schemas)
    p = tok(tok.apply_chat_template(prompt, tools=box.schemas, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False)["input_ids"]
    rec = Recording(engine)
    samples, messages, stats = tool_rollouts(rec, tok, box, [p], 1 if greedy else 3, max_new_tokens=400,
                                             max_iterations=3,
                                             greedy=greedy)
    rows = []
    later = [(pp, c) for call in rec.out[1:] for (pp, c) in call]  # every later turn the engine returned, once each
    for i, (s, msgs) in enumerate(zip(samples, messages)):
        # rebuild the completion from what the engine returned, turn by turn, and the template's tool turns
        ctx, built, tools = p, [], [m for m in msgs if m["role"] == "tool"]
        turn_msgs = []
        for m in msgs:
            if m["role"] == "tool":
                turn_msgs.append(m)
                continue
            if turn_msgs:
                built += tool_suffix_ids(tok, turn_msgs)
                turn_msgs = []
            if not built:
                turn = rec.out[0][i][1]
            else:
                # sampled rollouts that made the same turns so far share a context: any of the engine's turns from
                # it may be this rollout's, so take the one its completion goes on with (each used once); none
                # fits when the completion is not the engine's turns plus the tool turns, and then ids_exact fails
                fits = [k for k, (pp, c) in enumerate(later) if pp == ctx + built]
                k = next((k for k in fits if s.completion_ids.tolist()[len(built):len(built) + len(later[k][1])]
                          == later[k][1][:400 - len(built)]), fits[0])
                turn = later.pop(k)[1]
            built += turn[:400 - len(built)]
        rows.append({"ids_exact": s.completion_ids.tolist() == built, "n_ids": len(built),
                     "mask_false": int((~s.loss_mask).sum()), "tool_contents": [t["content"] for t in tools],
                     "tool_names": [t["name"] for t in tools], "calls": stats[i]["calls"],
                     "truncated": s.truncated,
                     "logp_zero_on_tools": None if s.logprobs is None else
                     bool((s.logprobs[~s.loss_mask] == 0).all()),
                     "logp_nonzero_on_model": None if s.logprobs is None else
                     bool((s.logprobs[s.loss_mask] != 0).any()),
                     "last": msgs[-1]["content"] if msgs else ""})
    return {"rows": rows, "generate_calls": [len(c) for c in rec.out]}


def main() -> None:
    from common.config import GRPOConfig
    from common.modeling import load_tokenizer
    from trainer.engines import make_engine
    from trainer.tools import ToolBox

    user, model = Path(sys.argv[1]), sys.argv[2]
    sys.path.insert(0, str(user))
    out = {}
    for backend in ("hf", "vllm"):
        cfg = GRPOConfig(model=model, gen_backend=backend, tools=[str(user / t) for t in tool_sft.TOOL_ARGS],
                         environment_factory=tool_sft.ENV, max_new_tokens=400, max_prompt_length=1024,
                         device="cpu", vllm_dtype="float32",
                         vllm_gpu_memory_utilization=0.3).validate()
        tok = load_tokenizer(model, cfg.load_options())
        box = ToolBox.from_config(cfg, tok)
        engine = make_engine(cfg, model, tokenizer=tok)
        try:
            out[backend] = {"greedy": check(engine, tok, box, True), "sampled": check(engine, tok, box, False)}
        finally:
            box.close()
            engine.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
    from common.fast_exit import exit_cleanly  # done: skip the interpreter's teardown (~1-2 CPU-s after torch)
    exit_cleanly(0)
