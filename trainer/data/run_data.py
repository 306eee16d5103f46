"""What a run trains and evaluates on: the ranks and the genonly workers each load it this way.

    train  `data`'s data_split
    eval   `eval_data` when given (a folder or hub id gives its eval_split; a file is all eval rows), else `data`'s
           eval_split. Never the training rows: a single-file `data` has no eval split (config.validate refuses
           eval_steps there), and a folder or hub dataset without one is refused here, naming eval_data.
Both are checked against the reward functions before anything runs: a built-in that compares against a ground truth
(correct, contains, countdown, math_verify) refuses prompt-only rows in one line naming the reward and the data.
"""
from __future__ import annotations

from common.settings.reward_models import reward_model_path
from trainer.data.files import is_data_file
from trainer.data.loading import ColumnSpec, Example, load_examples
from trainer.rewards.registry import load_reward_fns, needs_ground_truth


def _label(source: str, split: str) -> str:
    return f"data {source!r} (split {split!r})"


def check_ground_truths(reward_fns, examples: list[Example], what: str) -> None:
    """ValueError, one line, when a reward that needs a ground truth meets prompt-only rows."""
    if not examples or examples[0].ground_truth is not None:  # load_examples keeps a data set all one kind
        return
    specs = reward_fns.split(",") if isinstance(reward_fns, str) else list(reward_fns)
    specs = [s for s in specs if reward_model_path(s) is None]  # a reward model reads no ground truth
    for spec, fn in zip(specs, load_reward_fns(specs)):
        if needs_ground_truth(fn):
            raise ValueError(f"reward {spec.strip()!r} needs a ground truth, but {what} is prompt-only (no answer "
                             f"column; columns: {sorted(examples[0].columns) or 'none but the prompt'}): use rewards "
                             f"that need none (format, a judge or length reward of yours), or set answer_column")


CHECK_ROWS = 100_000  # rows `launch.sh check` reads and validates at most: bounded in time (a hub dataset's millions)


def train_examples(cfg, limit: int | None = None) -> list[Example]:
    """The training examples (`limit`: the first rows only, e.g. for `launch.sh check`; default data_limit)."""
    examples = load_examples(cfg.data, split=cfg.data_split, limit=cfg.data_limit if limit is None else limit,
                             columns=ColumnSpec.from_config(cfg), config=cfg.dataset_config)
    check_ground_truths(cfg.reward_specs(), examples, _label(cfg.data, cfg.data_split))
    return examples


def eval_examples(cfg, limit: int | None = None) -> list[Example]:
    """The held-out examples of eval_steps / eval_before ([] when neither is set; `limit` as in train_examples)."""
    if not (cfg.eval_steps or cfg.eval_before):
        return []
    source = cfg.eval_data or cfg.data
    if cfg.eval_data is None and is_data_file(cfg.data):  # config.validate says the same; here for callers without it
        raise ValueError(f"eval on held-out rows, but data {cfg.data!r} is one file with no eval split: give "
                         f"eval_data (a file, folder or hub id)")
    try:
        examples = load_examples(source, split=cfg.eval_split, limit=cfg.eval_limit if limit is None else limit,
                                 columns=ColumnSpec.from_config(cfg), config=cfg.dataset_config)
    except (FileNotFoundError, ValueError) as e:
        where = "eval_data" if cfg.eval_data else "data"
        raise ValueError(f"eval_steps/eval_before evaluate on {where} {source!r} split {cfg.eval_split!r}, which "
                         f"did not load ({e}); give eval_data (held-out rows), set eval_split, or set eval_steps 0 "
                         f"and eval_before false") from e
    check_ground_truths(cfg.reward_specs(), examples, _label(source, cfg.eval_split))
    return examples
