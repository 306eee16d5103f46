"""The words each multi-valued knob takes, as types: a field typed with one of these is parsed once, from the type
(common/settings/knobs.py parse_choices, run by validate()): the CLI and --help list the words, a value outside
them is one line naming the knob, and no module compares a knob against its own copy of the list.
"""
from __future__ import annotations

from typing import Literal

AdvantageMode = Literal["grpo", "grpo_no_std", "grpo_batch_std", "raw", "reinforce_pp"]
Aggregation = Literal["seq_mean", "token_mean", "dr_grpo", "dapo", "luspo"]
LrSchedule = Literal["constant", "linear", "cosine"]
WorkerDtype = Literal["auto", "bfloat16", "bf16", "float32", "fp32", "float16", "fp16"]
PromptFormat = Literal["auto", "chat", "messages", "raw", "r1zero", "trl"]
GenBackend = Literal["hf", "vllm", "auto"]
VllmDtype = Literal["auto", "bfloat16", "float16", "float32"]
OldLogps = Literal["trainer", "engine"]
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]  # TRL's names
ISLevel = Literal["token", "sequence"]
SaveStrategy = Literal["steps", "no"]
# A tri-state: true, false or auto (decided at start); JSON true/false, or the strings as configs wrote them.
OnOffAuto = bool | Literal["auto"]

