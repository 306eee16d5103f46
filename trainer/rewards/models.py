"""Reward models as reward functions: a TRL-style function `f(prompts, completions) -> list[float]` per reward
model, scored by the ref server that holds the model (ref_server/reward_models.py; POST /reward over the same
authenticated, size-limited HTTP as the rollouts). No weights are loaded here: ranks, workers and eval each only
send text. Which reward_fns entries are models, and their names: common/settings/reward_models.py.
"""
from __future__ import annotations

import logging

log = logging.getLogger("trainer")


class RewardModelFn:
    """One reward model, called as TRL calls reward functions (by keyword; the other columns are ignored)."""

    def __init__(self, name: str, client, timeout: float) -> None:
        self.__name__ = name  # TRL's name: config._name_or_path.split("/")[-1]
        self.client, self.timeout = client, timeout

    def __call__(self, prompts: list, completions: list, groups: int = 1, **_columns) -> list[float]:
        """One float per completion; a call covering `groups` groups (a round) may take reward_model_timeout each."""
        return self.client.reward_scores(self.__name__, prompts, completions, self.timeout * groups)


def reward_model_fns(cfg) -> dict[int, RewardModelFn]:
    """{reward_fns index: its RewardModelFn} for the entries of `cfg` that are reward models ({} when none)."""
    models = cfg.reward_models()
    if not models:
        return {}
    from trainer.runtime import make_client

    client = make_client(cfg)
    for m in models:  # said by every producer: its weights are not loaded here (the e2e test reads this)
        log.info("reward model %s (%s): scored by the ref server %s", m["name"], m["spec"], cfg.ref_server)
    return {m["index"]: RewardModelFn(m["name"], client, cfg.reward_model_timeout) for m in models}
