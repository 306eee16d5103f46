"""Limits that keep a producer (genonly worker, or a rank generating for itself) from spinning without a word:
prompts that never fit, rewards that never apply (issue 41): exit 7; rewards that never spread (issue 60): exit 8.
trainer/run/stall.py enforces them."""
from __future__ import annotations

from dataclasses import dataclass

from common.settings.knobs import knob


@dataclass
class SpinLimits:
    max_skipped_prompts: int = knob(64, "A worker or rank that skips this many prompts in a row because they do not "
                                        "fit max_prompt_length (template, tools section and reset() text included) "
                                        "ends the run with exit 7 naming max_prompt_length; 0 = never.")
    none_reward_groups: int = knob(8, "A worker or rank whose first this-many groups got None (not applicable) from "
                                      "every reward for every completion ends the run with exit 7 naming the "
                                      "rewards (a reward None on all of them beside others that apply: one warning "
                                      "line); 0 = never.")
    max_no_spread_groups: int = knob(1000, "A worker or rank that samples this many groups in a row with equal "
                                           "rewards (no spread: skipped under dynamic sampling) and no batch in "
                                           "between ends the run with exit 8, giving each reward's values; 0 = never. "
                                           "Off with train_zero_spread (every group trains).")
