"""One training/eval example: what data loading returns and the rest of the trainer consumes."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Example:
    prompt: str | list  # text, or a message list [{"role", "content"}, ...] (conversational: prompt_format messages)
    ground_truth: str | None  # None: a prompt-only row (no answer column; judge or length rewards)
    meta: dict = field(default_factory=dict)  # the row's other columns (GSM8K: "solution" = the worked answer)
    columns: dict = field(default_factory=dict, compare=False)  # all columns but the prompt: TRL reward keywords
    index: int | None = None  # position in the loaded list, set by PromptSampler (batches log what they trained)
    reset_prompt: bool = False  # no prompt column: an environment's reset() supplies it (TRL), appended to the empty
    # user message that stands in for it; reset() is not passed that placeholder as `prompt`
