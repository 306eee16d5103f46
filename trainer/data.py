"""Training/eval examples: loading (hub, local JSONL/Parquet, synthetic), prompts, sharded sampling.

Row formats understood:
    GSM8K    {"question": ..., "answer": "... #### 72"}   ground truth = text after the last ####, commas removed
    generic  {"prompt": ..., "ground_truth": ...}         used as-is (a dict/list ground truth is JSON-encoded,
                                                           e.g. countdown's {"numbers": [...], "target": N})
Other fields of a row are kept in Example.meta.
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from common.prompts import SYSTEM_PROMPT  # re-exported: the R1-style prompt (simple_GRPO's wording)

__all__ = ["Example", "SYSTEM_PROMPT", "load_examples", "build_prompt", "PromptSampler"]

# Hub datasets that need a config name (GSM8K has "main" and "socratic").
_HUB_CONFIGS = {"openai/gsm8k": "main", "gsm8k": "main"}
_FILE_SUFFIXES = (".jsonl", ".parquet")


@dataclass
class Example:
    prompt: str
    ground_truth: str
    meta: dict = field(default_factory=dict)
    index: int | None = None  # position in the loaded list, set by PromptSampler (batches log what they trained)


# ----------------------------------------------------------------------------- rows -> examples
def _row_to_example(row: Any, where: str) -> Example:
    """One dataset row in GSM8K or generic format; `where` ("file:line") goes into error messages."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "prompt" in row and "ground_truth" in row:
        prompt, gt = row["prompt"], row["ground_truth"]
        if isinstance(gt, (dict, list)):
            gt = json.dumps(gt)
        elif isinstance(gt, (int, float, str)) and not isinstance(gt, bool):
            gt = str(gt)
        else:
            raise ValueError(f"{where}: ground_truth must be a string, number, object or list, got {gt!r}")
        meta = {k: v for k, v in row.items() if k not in ("prompt", "ground_truth")}
    elif "question" in row and "answer" in row:
        prompt, answer = row["question"], row["answer"]
        # Without the marker the whole solution would become the "ground truth" and every
        # reward would silently be -1, so this is an error, not a fallback.
        if not isinstance(answer, str) or "####" not in answer:
            raise ValueError(f"{where}: GSM8K-style 'answer' has no '#### <final answer>' marker; "
                             f"use {{\"prompt\", \"ground_truth\"}} rows for other datasets")
        gt = answer.rsplit("####", 1)[1].strip().replace(",", "")
        meta = {"solution": answer, **{k: v for k, v in row.items() if k not in ("question", "answer")}}
    else:
        raise ValueError(f"{where}: row has neither 'prompt'+'ground_truth' nor 'question'+'answer' "
                         f"(keys: {sorted(row)[:10]})")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: the prompt/question must be a non-empty string")
    if not gt:
        raise ValueError(f"{where}: empty ground truth")
    return Example(prompt=prompt, ground_truth=gt, meta=meta)


def _read_jsonl(path: Path, limit: int | None) -> list[Example]:
    out: list[Example] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
            out.append(_row_to_example(row, f"{path}:{lineno}"))
    return out


def _read_parquet(path: Path, limit: int | None) -> list[Example]:
    import pyarrow.parquet as pq  # a dependency of `datasets`; reads without touching the HF cache

    rows = pq.read_table(path).to_pylist()
    rows = rows if limit is None else rows[:limit]
    return [_row_to_example(r, f"{path}:row {i}") for i, r in enumerate(rows, 1)]


def _read_file(path: Path, limit: int | None) -> list[Example]:
    if path.suffix == ".jsonl":
        return _read_jsonl(path, limit)
    if path.suffix == ".parquet":
        return _read_parquet(path, limit)
    raise ValueError(f"{path}: unsupported file type (use .jsonl or .parquet)")


def _split_file(directory: Path, split: str) -> Path:
    """{split}.jsonl, else {split}.parquet, else one hub-style {split}-00000-of-00001.parquet shard."""
    for name in (f"{split}.jsonl", f"{split}.parquet"):
        if (directory / name).is_file():
            return directory / name
    shards = sorted(directory.rglob(f"{split}-*.parquet"))
    if len(shards) == 1:
        return shards[0]
    if len(shards) > 1:
        raise ValueError(f"{directory}: several parquet shards for split {split!r} ({len(shards)}); "
                         f"merge them into {split}.parquet")
    raise FileNotFoundError(f"{directory}: no {split}.jsonl or {split}.parquet for split {split!r}")


# ----------------------------------------------------------------------------- public loader
def _looks_local(source: str) -> bool:
    return source.startswith((".", "/", "~")) or source.endswith(_FILE_SUFFIXES + (".json",))


def load_examples(source: str, split: str = "train", limit: int | None = None) -> list[Example]:
    """Examples from `source`, first `limit` rows only when given.

    source: "arith" (the synthetic task in trainer/arith.py); an existing directory holding
    {split}.jsonl / {split}.parquet; an existing .jsonl / .parquet file (split ignored);
    otherwise a Hugging Face hub id loaded with datasets.load_dataset (needs internet or a
    warm HF cache; "openai/gsm8k" uses its "main" config).
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if source == "arith":
        from trainer.arith import load_arith  # lazy: trainer.arith imports Example from here

        examples = load_arith(split)
        return examples if limit is None else examples[:limit]
    path = Path(source).expanduser()
    if path.is_dir():
        examples = _read_file(_split_file(path, split), limit)
    elif path.is_file():
        examples = _read_file(path, limit)
    elif _looks_local(source):
        raise FileNotFoundError(f"data source {source!r} does not exist")
    else:
        examples = _load_hub(source, split, limit)
    if not examples and limit != 0:
        raise ValueError(f"data source {source!r} (split {split!r}) holds no examples")
    return examples


def _load_hub(source: str, split: str, limit: int | None) -> list[Example]:
    import datasets

    ds = datasets.load_dataset(source, _HUB_CONFIGS.get(source), split=split)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return [_row_to_example(r, f"{source}[{split}] row {i}") for i, r in enumerate(ds, 1)]


# ----------------------------------------------------------------------------- prompts
def build_prompt(tokenizer, question: str, system_prompt: str | None = SYSTEM_PROMPT) -> str:
    """The chat-templated prompt text, ending with the assistant turn opener.

    A tokenizer without a chat template is an error: a plain-text fallback would train on a
    prompt format the model was never meant to see.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat_template; use an "
                         f"instruct/chat model or set tokenizer.chat_template")
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ----------------------------------------------------------------------------- sampling
class PromptSampler:
    """Endless, seeded stream of examples in shuffled epochs, sharded across ranks.

    Every shard draws the same permutation per epoch (from `seed` alone) and takes every
    `num_shards`-th item from position `shard`, so shards are disjoint within an epoch and the
    stream is reproducible. With fewer examples than shards, a shard gets one example per epoch.
    """

    def __init__(self, examples: Iterable[Example], seed: int, shard: int = 0, num_shards: int = 1):
        self.examples = list(examples)
        if not self.examples:
            raise ValueError("PromptSampler needs at least one example")
        if num_shards < 1 or not 0 <= shard < num_shards:
            raise ValueError(f"need 0 <= shard < num_shards, got shard={shard} num_shards={num_shards}")
        self.seed, self.shard, self.num_shards = seed, shard, num_shards
        self.epoch = -1
        self._order: list[int] = []
        self._pos = 0

    def epoch_indices(self, epoch: int) -> list[int]:
        """This shard's example indices for `epoch`, in order."""
        perm = list(range(len(self.examples)))
        random.Random(f"{self.seed}:{epoch}").shuffle(perm)  # str seed: stable across processes
        mine = perm[self.shard::self.num_shards]
        return mine or [perm[self.shard % len(perm)]]

    def __iter__(self) -> Iterator[Example]:
        return self

    def __next__(self) -> Example:
        if self._pos >= len(self._order):
            self.epoch += 1
            self._order, self._pos = self.epoch_indices(self.epoch), 0
        self._pos += 1
        i = self._order[self._pos - 1]
        return replace(self.examples[i], index=i)

    # Exact resume: the position (epoch, offset) is the whole state; the epoch's order is recomputed
    # from the seed. The identity fields make a resume with other data or sharding fail loudly.
    def state_dict(self) -> dict:
        return {"seed": self.seed, "shard": self.shard, "num_shards": self.num_shards,
                "num_examples": len(self.examples), "epoch": self.epoch, "pos": self._pos}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("seed", "shard", "num_shards", "num_examples"):
            if state.get(key) != mine[key]:
                raise ValueError(f"PromptSampler state does not fit: {key} is {state.get(key)!r} in the saved state, "
                                 f"{mine[key]!r} here (same data, seed and number of ranks/workers needed to resume)")
        epoch, pos = int(state["epoch"]), int(state["pos"])
        self.epoch, self._pos = epoch, pos
        self._order = self.epoch_indices(epoch) if epoch >= 0 else []
        if pos > len(self._order):
            raise ValueError(f"PromptSampler state: position {pos} beyond epoch {epoch}'s {len(self._order)} items")

    def next_batch(self, n: int) -> list[Example]:
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        return [next(self) for _ in range(n)]
