"""Training/eval examples: loading (hub, local files and folders, synthetic), prompts, sharded sampling.

File formats are trainer/data/files.py; which examples a run trains and evaluates on is trainer/data/run_data.py.
Row layouts found without configuration (prompt_column/answer_column/prompt_template override them):
    GSM8K      {"question": ..., "answer": "... #### 72"}   ground truth = text after the last ####, commas removed
    ReasonRL   {"prompt": ..., "ground_truth": ...}         used as-is (a dict/list ground truth is JSON-encoded,
                                                             e.g. countdown's {"numbers": [...], "target": N})
    MATH       {"problem": ..., "solution": "... \\boxed{3}"} ground truth = the last \\boxed{} of the solution
    Countdown  {"nums": [...], "target": N}                 ground truth = {"nums": [...], "target": N}; the
                                                             prompt comes from prompt_template
    prompt-only {"prompt": ...} and no answer column         ground truth = None (judge or length rewards; the
                                                             built-ins that need a ground truth refuse the data)
A prompt that is a list of {"role", "content"} messages is conversational (prompt_format auto -> messages).
Other fields of a row are kept in Example.meta; Example.columns (all but the prompt) go to TRL-style rewards.
"""
from __future__ import annotations

import importlib
import json
import logging
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.prompts import SYSTEM_PROMPT  # re-exported: the R1-style prompt (simple_GRPO's wording)
from common.settings.checks import DATA_FILE_SUFFIXES
from common.user_code import user_dir
from trainer.data.example import Example  # re-exported: what a loader returns
from trainer.data.files import is_data_file, read_rows, split_file
from trainer.data.prompt_formats import build_prompt, check_messages  # re-exported: prompt formats live there
from trainer.rewards.answers import last_boxed

__all__ = ["Example", "ColumnSpec", "SYSTEM_PROMPT", "load_examples", "build_prompt", "PromptSampler"]

log = logging.getLogger("trainer")

# The configuration a hub dataset gets when dataset_config is not given (GSM8K has "main" and "socratic").
_HUB_CONFIGS = {"openai/gsm8k": "main", "gsm8k": "main"}
# Generated tasks by name -> "module:function(split) -> list[Example]".
SYNTHETIC_SOURCES = {"arith": "trainer.demo.arith:load_arith", "arith_tools": "trainer.demo.tool_task:load_arith_tools"}


# ----------------------------------------------------------------------------- rows -> examples
@dataclass(frozen=True)
class ColumnSpec:
    """Which row columns hold the prompt and the answer (None = detect the layout), and how to read them."""
    prompt_column: str | None = None
    answer_column: str | None = None  # "a,b" = several columns, passed on as the JSON object {"a": .., "b": ..}
    prompt_template: str | None = None  # str.format over the row's columns, e.g. "Reach {target} with {nums}"
    prompt_format: str = "auto"
    environment: bool = False  # environment_factory set: a row may have no prompt (TRL: reset() supplies it)

    @classmethod
    def from_config(cls, cfg) -> ColumnSpec:
        return cls(cfg.prompt_column, cfg.answer_column, cfg.prompt_template, cfg.prompt_format,
                   bool(cfg.environment_factory))


RESET_PROMPT = {"role": "user", "content": ""}  # TRL's stand-in for a row without a prompt; reset() appends to it
# Layouts found without configuration: (prompt column, answer column); the first that fits a row wins.
_LAYOUTS = (("prompt", "ground_truth"), ("question", "answer"), ("problem", "solution"), (None, "nums,target"))


def _detect(row: dict, spec: ColumnSpec, where: str) -> tuple[str | None, str | None]:
    """(prompt column, answer column); answer None = a prompt-only row."""
    own_prompt = spec.prompt_column or ("prompt" if spec.prompt_template is None else None)
    if spec.answer_column is not None:
        return own_prompt, spec.answer_column
    for pcol, acol in _LAYOUTS:
        if (spec.prompt_column or pcol) in row or pcol is None:
            if all(c in row for c in acol.split(",")):
                return spec.prompt_column or pcol, acol
    if own_prompt is None or own_prompt in row or spec.environment:  # TRL's prompt-only data (judge or length
        # rewards need no answer); with an environment also no prompt: reset() supplies it
        return own_prompt, None
    raise ValueError(f"{where}: row has none of the known layouts ('prompt' alone or with 'ground_truth', "
                     f"'question'+'answer', 'problem'+'solution', 'nums'+'target'); set prompt_column/answer_column "
                     f"(keys: {sorted(row)[:10]})")


def _ground_truth(row: dict, acol: str | None, where: str) -> str | None:
    if acol is None:
        return None
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
    if pcol is not None and pcol not in row and spec.environment:  # TRL (grpo_trainer.py ~2330-2337)
        if spec.prompt_format not in ("auto", "messages", "trl"):
            raise ValueError(f"{where}: no prompt column {pcol!r}: an environment's reset() supplies the prompt then "
                             f"(TRL), to an empty user message, which needs prompt_format auto, messages or trl, "
                             f"not {spec.prompt_format!r}")
        return [dict(RESET_PROMPT)]
    if pcol is None or pcol not in row:
        raise ValueError(f"{where}: no prompt column {pcol!r} (keys: {sorted(row)[:10]}); set prompt_column, "
                         f"or prompt_template to build the prompt from other columns")
    prompt = row[pcol]
    if spec.prompt_format == "messages" or (spec.prompt_format in ("auto", "trl") and isinstance(prompt, list)):
        check_messages(prompt, where)
    elif not isinstance(prompt, str) or not prompt.strip():
        hint = f" (a message list: use prompt_format 'auto', 'messages' or 'trl', not {spec.prompt_format!r})" \
            if isinstance(prompt, list) else ""
        raise ValueError(f"{where}: the prompt ({pcol!r}) must be a non-empty string{hint}")
    return prompt


def _row_to_example(row: Any, where: str, spec: ColumnSpec = ColumnSpec()) -> Example:
    """One dataset row -> Example; `where` ("file:line") goes into error messages."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    pcol, acol = _detect(row, spec, where)
    prompt, gt = _prompt(row, pcol, spec, where), _ground_truth(row, acol, where)
    if acol is not None and not gt:
        raise ValueError(f"{where}: empty ground truth")
    meta = {k: v for k, v in row.items() if k not in (pcol, acol)}
    if acol == "answer":
        meta = {"solution": row["answer"], **meta}  # GSM8K rows keep their worked solution
    columns = {k: v for k, v in row.items() if k != pcol}  # what TRL-style rewards receive as keywords
    return Example(prompt=prompt, ground_truth=gt, meta=meta, columns=columns,
                   reset_prompt=spec.environment and spec.prompt_template is None and pcol not in row)


def _read_file(path: Path, limit: int | None, spec: ColumnSpec) -> list[Example]:
    out: list[Example] = []
    for where, row in read_rows(path):
        if limit is not None and len(out) >= limit:
            break
        out.append(_row_to_example(row, where, spec))
    return out


def _check_uniform(examples: list[Example], source: str, split: str) -> None:
    """One kind of row per data set: all with a ground truth or none (a row that lost its answer column must not
    quietly become prompt-only), and under prompt_format auto all prompts text or all message lists."""
    for what, kind in (("an answer", lambda e: e.ground_truth is not None),
                       ("a message-list prompt", lambda e: isinstance(e.prompt, list))):
        kinds = [kind(e) for e in examples]
        if any(kinds) and not all(kinds):
            i, j = kinds.index(True), kinds.index(False)
            raise ValueError(f"data {source!r} (split {split!r}): example {i + 1} has {what} but example {j + 1} "
                             f"has none; every row must have the same columns")


# ----------------------------------------------------------------------------- public loader
def _local_path(source: str) -> Path | None:
    """The file or folder `source` names: absolute, or relative to the folder launch.sh ran in (GRPO_USER_DIR,
    as reward files are found: common/user_code.py), else to this process's working folder."""
    path = Path(source).expanduser()
    for p in ([path] if path.is_absolute() else [user_dir() / path, path]):
        if p.exists():
            return p
    return None


def _card_only(folder: Path, split: str) -> bool:
    """A dataset folder described by its README.md (`configs:`), with no {split}.<suffix> file of ours."""
    return (folder / "README.md").is_file() and not any((folder / f"{split}{s}").is_file() for s in DATA_FILE_SUFFIXES)


def load_examples(source: str, split: str = "train", limit: int | None = None,
                  columns: ColumnSpec | None = None, config: str | None = None) -> list[Example]:
    """Examples from `source`, first `limit` rows only when given.

    source: a SYNTHETIC_SOURCES name ("arith": the demo's task, trainer/demo/arith.py); an existing directory holding
    {split}.jsonl / .json / .csv / .parquet (with `config`: a dataset folder whose README.md lists `configs:`, read
    by datasets.load_dataset); an existing data file (split ignored; trainer/data/files.py); otherwise a Hugging
    Face hub id loaded with datasets.load_dataset (needs internet or a warm HF cache; `config` names its
    configuration, "openai/gsm8k" gets "main" without one). `columns` maps the row layout (ColumnSpec).
    """
    spec = columns or ColumnSpec()
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    path = None if source in SYNTHETIC_SOURCES else _local_path(source)
    if config is not None and (source in SYNTHETIC_SOURCES or (path is not None and path.is_file())):
        raise ValueError(f"dataset_config {config!r} picks a configuration of a hub dataset or a dataset folder; "
                         f"data {source!r} has none (leave dataset_config unset)")
    if source in SYNTHETIC_SOURCES:
        examples = _load_synthetic(source, split)
        return examples if limit is None else examples[:limit]
    if path is not None and path.is_dir() and config is None and not _card_only(path, split):
        examples = _read_file(split_file(path, split), limit, spec)
    elif path is not None and path.is_file():
        examples = _read_file(path, limit, spec)
    elif path is None and (source.startswith((".", "/", "~")) or is_data_file(source)):
        raise FileNotFoundError(f"data source {source!r} does not exist (relative paths start from {user_dir()})")
    else:
        examples = _load_hub(str(path or source), split, limit, spec, config or _HUB_CONFIGS.get(source))
    if not examples and limit != 0:
        raise ValueError(f"data source {source!r} (split {split!r}) holds no examples")
    _check_uniform(examples, source, split)
    if examples and examples[0].ground_truth is None:
        log.info("data %r (split %r): no answer column, prompt-only rows (ground truth None); columns for TRL-style "
                 "rewards: %s; set answer_column if one of them is the answer", source, split,
                 sorted(examples[0].columns))
    return examples


def _load_synthetic(name: str, split: str) -> list[Example]:
    """A generated task, reached by its dotted path: the demo sits above data loading and must not be imported
    from here statically (it imports Example below)."""
    mod_name, _, fn_name = SYNTHETIC_SOURCES[name].partition(":")
    return getattr(importlib.import_module(mod_name), fn_name)(split)


def _load_hub(source: str, split: str, limit: int | None, spec: ColumnSpec, config: str | None) -> list[Example]:
    import datasets

    ds = datasets.load_dataset(source, config, split=split)
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

    def progress(self) -> float:
        """Passes over this shard's examples so far, fractional (TRL's trainer_state.epoch)."""
        return max(self.epoch, 0) + (self._pos / len(self._order) if self._order else 0.0)

    def next_batch(self, n: int) -> list[Example]:
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        return [next(self) for _ in range(n)]
