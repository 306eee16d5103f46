"""A tiny model that calls tools: the embedded random model, fine-tuned (a few seconds on a CPU) on one fixed
tool-calling trace until it reproduces it. Used by the slow tool tests (real engines, the end-to-end run).

    python tests/tool_sft.py USER_DIR OUT_DIR     # USER_DIR holds my_tools.py (add) and my_env.py (Counter)

The trace: the user asks for 2 + 3; the model calls the user's `add` and the environment's `tally` twice in one
turn; after the tool turn it answers "<answer> 5 </answer>". The environment's tally counts calls per episode, so
its results read 1 then 2 when every rollout has its own instance.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

MY_TOOLS = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b
'''

MY_ENV = '''
class Counter:
    """A stateful environment: one instance per rollout (TRL's environment_factory)."""

    def reset(self, **kwargs):
        self.count = 0
        return None

    def tally(self, n: int) -> int:
        """Add n to this episode's tally and return it.

        Args:
            n: how much to add
        """
        self.count += n
        return self.count
'''

TOOL_ARGS = ["my_tools.py:add"]
ENV = "my_env:Counter"
QUESTION = "What is 2 + 3?"
CALLS = [("add", {"a": 2, "b": 3}), ("tally", {"n": 1}), ("tally", {"n": 1})]
RESULTS = ["5", "1", "2"]
ANSWER = "<answer> 5 </answer>"


def write_user_tools(user_dir: Path) -> None:
    (user_dir / "my_tools.py").write_text(MY_TOOLS)
    (user_dir / "my_env.py").write_text(MY_ENV)


def trace(schemas: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the prompt messages, the completion messages) of the fixed trace."""
    prompt = [{"role": "user", "content": QUESTION}]
    calls = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in CALLS]
    comp = [{"role": "assistant", "content": "", "tool_calls": calls}]
    comp += [{"role": "tool", "name": n, "content": r} for (n, _), r in zip(CALLS, RESULTS)]
    comp += [{"role": "assistant", "content": ANSWER}]
    return prompt, comp


def sft(out_dir: Path, schemas: list[dict], steps: int = 200) -> Path:
    """Fine-tune the tiny model on the trace (loss on the assistant turns' tokens) and save it to out_dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.tiny_model import ensure_tiny_model

    src = ensure_tiny_model()
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src)
    prompt, comp = trace(schemas)
    p_text = tok.apply_chat_template(prompt, tools=schemas, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(prompt + comp, tools=schemas, tokenize=False)
    ids = tok(full, add_special_tokens=False)["input_ids"]
    p = len(tok(p_text, add_special_tokens=False)["input_ids"])
    labels = torch.tensor(ids)
    labels[:p] = -100
    x = torch.tensor([ids])
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(x, labels=labels[None]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    print(f"sft loss {loss.item():.4f}")
    return out_dir


def schemas_of(user_dir: Path) -> list[dict]:
    from common.config import GRPOConfig
    from trainer.tools import ToolBox

    sys.path.insert(0, str(user_dir))
    cfg = GRPOConfig(model="tiny", tools=[str(user_dir / t) for t in TOOL_ARGS], environment_factory=ENV)
    box = ToolBox.from_config(cfg)
    try:
        return box.schemas
    finally:
        box.close()


if __name__ == "__main__":
    user, out = Path(sys.argv[1]), Path(sys.argv[2])
    write_user_tools(user)
    sft(out, schemas_of(user))
    from common.fast_exit import exit_cleanly  # saved: skip the interpreter's teardown (~1 CPU-s)
    exit_cleanly(0)
