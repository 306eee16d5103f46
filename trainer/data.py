"""Training/eval examples: loading (hub, local JSONL/Parquet, synthetic), prompts, sharded sampling.

Row layouts found without configuration (prompt_column/answer_column/prompt_template override them):
    GSM8K      {"question": ..., "answer": "... #### 72"}   ground truth = text after the last ####, commas removed
    ReasonRL   {"prompt": ..., "ground_truth": ...}         used as-is (a dict/list ground truth is JSON-encoded,
                                                             e.g. countdown's {"numbers": [...], "target": N})
    MATH       {"problem": ..., "solution": "... \\boxed{3}"} ground truth = the last \\boxed{} of the solution
    Countdown  {"nums": [...], "target": N}                 ground truth = {"nums": [...], "target": N}; the
                                                             prompt comes from prompt_template
Other fields of a row are kept in Example.meta; Example.columns (all but the prompt) go to TRL-style rewards.
"""
from __future__ import annotations

import importlib
import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.prompts import SYSTEM_PROMPT  # re-exported: the R1-style prompt (simple_GRPO's wording)
from trainer.example import Example  # re-exported: what a loader returns
from trainer.prompt_formats import build_prompt, check_messages  # re-exported: prompt formats live there
from trainer.rewards.answers import last_boxed

__all__ = ["Example", "ColumnSpec", "SYSTEM_PROMPT", "load_examples", "build_prompt", "PromptSampler"]

# Hub datasets that need a config name (GSM8K has "main" and "socratic").
_HUB_CONFIGS = {"openai/gsm8k": "main", "gsm8k": "main"}
_FILE_SUFFIXES = (".jsonl", ".parquet")
# Generated tasks by name -> "module:function(split) -> list[Example]".
SYNTHETIC_SOURCES = {"arith": "trainer.demo.arith:load_arith"}


# ----------------------------------------------------------------------------- rows -> examples
@dataclass(frozen=True)
class ColumnSpec:
    """Which row columns hold the prompt and the answer (None = detect the layout), and how to read them."""
    prompt_column: str | None = None
    answer_column: str | None = None  # "a,b" = several columns, passed on as the JSON object {"a": .., "b": ..}
    prompt_template: str | None = None  # str.format over the row's columns, e.g. "Reach {target} with {nums}"
    prompt_format: str = "chat"

    @classmethod
    def from_config(cls, cfg) -> ColumnSpec:
        return cls(cfg.prompt_column, cfg.answer_column, cfg.prompt_template, cfg.prompt_format)


# Layouts found without configuration: (prompt column, answer column); the first that fits a row wins.
_LAYOUTS = (("prompt", "ground_truth"), ("question", "answer"), ("problem", "solution"), (None, "nums,target"))


def _detect(row: dict, spec: ColumnSpec, where: str) -> tuple[str | None, str]:
    if spec.answer_column is not None:
        return spec.prompt_column or ("prompt" if spec.prompt_template is None else None), spec.answer_column
    for pcol, acol in _LAYOUTS:
        if (spec.prompt_column or pcol) in row or pcol is None:
            if all(c in row for c in acol.split(",")):
                return spec.prompt_column or pcol, acol
    raise ValueError(f"{where}: row has none of the known layouts ('prompt'+'ground_truth', 'question'+'answer', "
                     f"'problem'+'solution', 'nums'+'target'); set prompt_column/answer_column "
                     f"(keys: {sorted(row)[:10]})")


def _ground_truth(row: dict, acol: str, where: str) -> str:
    cols = [c.strip() for c in acol.split(",")]
    missing = [c for c in cols if c not in row]
    if missing:
        raise ValueError(f"{where}: answer column(s) {missing} not in the row (keys: {sorted(row)[:10]})")
    if len(cols) > 1:  # e.g. countdown: {"nums": [...], "target": N}
        return json.dumps({c: row[c] for c in cols})
    gt = row[cols[0]]
    if isinstance(gt, (dict, list)):
        return json.dumps(gt)
    if isinstance(gt, bool) or not isinstance(gt, (int, float, str)):
        raise ValueError(f"{where}: {cols[0]} must be a string, number, object or list, got {gt!r}")
    gt = str(gt)
    if acol == "answer" and "####" not in gt:
        # Without the marker the whole solution would become the "ground truth" and every
        # reward would silently be -1, so this is an error, not a fallback.
        raise ValueError(f"{where}: GSM8K-style 'answer' has no '#### <final answer>' marker; "
                         f"use {{\"prompt\", \"ground_truth\"}} rows for other datasets")
    if "####" in gt:  # a GSM8K worked solution: the final answer follows the last ####
        return gt.rsplit("####", 1)[1].strip().replace(",", "")
    boxed = last_boxed(gt) if acol != "ground_truth" else None
    return gt if boxed is None else boxed.strip()  # a MATH-style solution: its last \\boxed{}


def _prompt(row: dict, pcol: str | None, spec: ColumnSpec, where: str):
    if spec.prompt_template is not None:
        try:
            return spec.prompt_template.format(**row)
        except (KeyError, IndexError) as e:
            raise ValueError(f"{where}: prompt_template names a column the row lacks: {e} "
                             f"(keys: {sorted(row)[:10]})") from e
    if pcol is None or pcol not in row:
        raise ValueError(f"{where}: no prompt column {pcol!r} (keys: {sorted(row)[:10]}); set prompt_column, "
                         f"or prompt_template to build the prompt from other columns")
    prompt = row[pcol]
    if spec.prompt_format == "messages":
        check_messages(prompt, where)
    elif not isinstance(prompt, str) or not prompt.strip():
        hint = " (a message list: use prompt_format 'messages')" if isinstance(prompt, list) else ""
        raise ValueError(f"{where}: the prompt ({pcol!r}) must be a non-empty string{hint}")
    return prompt


def _row_to_example(row: Any, where: str, spec: ColumnSpec = ColumnSpec()) -> Example:
    """One dataset row -> Example; `where` ("file:line") goes into error messages."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    pcol, acol = _detect(row, spec, where)
    prompt, gt = _prompt(row, pcol, spec, where), _ground_truth(row, acol, where)
    if not gt:
        raise ValueError(f"{where}: empty ground truth")
    meta = {k: v for k, v in row.items() if k not in (pcol, acol)}
    if acol == "answer":
        meta = {"solution": row["answer"], **meta}  # GSM8K rows keep their worked solution
    columns = {k: v for k, v in row.items() if k != pcol}  # what TRL-style rewards receive as keywords
    return Example(prompt=prompt, ground_truth=gt, meta=meta, columns=columns)


def _read_jsonl(path: Path, limit: int | None, spec: ColumnSpec) -> list[Example]:
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
            out.append(_row_to_example(row, f"{path}:{lineno}", spec))
    return out


def _read_parquet(path: Path, limit: int | None, spec: ColumnSpec) -> list[Example]:
    import pyarrow.parquet as pq  # a dependency of `datasets`; reads without touching the HF cache

    rows = pq.read_table(path).to_pylist()
    rows = rows if limit is None else rows[:limit]
    return [_row_to_example(r, f"{path}:row {i}", spec) for i, r in enumerate(rows, 1)]


def _read_file(path: Path, limit: int | None, spec: ColumnSpec) -> list[Example]:
    if path.suffix == ".jsonl":
        return _read_jsonl(path, limit, spec)
    if path.suffix == ".parquet":
        return _read_parquet(path, limit, spec)
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


def load_examples(source: str, split: str = "train", limit: int | None = None,
                  columns: ColumnSpec | None = None) -> list[Example]:
    """Examples from `source`, first `limit` rows only when given.

    source: a SYNTHETIC_SOURCES name ("arith": the demo's task, trainer/demo/arith.py); an existing directory holding
    {split}.jsonl / {split}.parquet; an existing .jsonl / .parquet file (split ignored);
    otherwise a Hugging Face hub id loaded with datasets.load_dataset (needs internet or a
    warm HF cache; "openai/gsm8k" uses its "main" config). `columns` maps the row layout (ColumnSpec).
    """
    spec = columns or ColumnSpec()
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if source in SYNTHETIC_SOURCES:
        examples = _load_synthetic(source, split)
        return examples if limit is None else examples[:limit]
    path = Path(source).expanduser()
    if path.is_dir():
        examples = _read_file(_split_file(path, split), limit, spec)
    elif path.is_file():
        examples = _read_file(path, limit, spec)
    elif _looks_local(source):
        raise FileNotFoundError(f"data source {source!r} does not exist")
    else:
        examples = _load_hub(source, split, limit, spec)
    if not examples and limit != 0:
        raise ValueError(f"data source {source!r} (split {split!r}) holds no examples")
    return examples


def _load_synthetic(name: str, split: str) -> list[Example]:
    """A generated task, reached by its dotted path: the demo sits above data loading and must not be imported
    from here statically (it imports Example below)."""
    mod_name, _, fn_name = SYNTHETIC_SOURCES[name].partition(":")
    return getattr(importlib.import_module(mod_name), fn_name)(split)


def _load_hub(source: str, split: str, limit: int | None, spec: ColumnSpec) -> list[Example]:
    import datasets

    ds = datasets.load_dataset(source, _HUB_CONFIGS.get(source), split=split)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return [_row_to_example(r, f"{source}[{split}] row {i}", spec) for i, r in enumerate(ds, 1)]


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
