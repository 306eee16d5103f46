"""Reward models as reward functions: a TRL-style function `f(prompts, completions) -> list[float]` per reward
model, scored by the ref server that holds the model (ref_server/reward_models.py; POST /reward over the same
authenticated, size-limited HTTP as the rollouts). No weights are loaded here: ranks, workers and eval each only
send text. Which reward_fns entries are models, and their names: common/settings/reward_models.py.
"""
from __future__ import annotations

import logging

log = logging.getLogger("trainer")


class RewardModelFn:
    """One reward model, called as TRL calls reward functions (by keyword; the other columns are ignored). Each
    prompt goes as the policy saw it (prompt_formats.prompt_as_seen: a text prompt of a `chat` run as its system +
    user messages, which the reward tokenizer's chat template renders, as TRL renders a conversational prompt), with
    the run's chat_template_kwargs (TRL: `apply_chat_template(..., **self.chat_template_kwargs)`)."""

    def __init__(self, name: str, client, timeout: float, system_prompt: str | None = "default",
                 prompt_format: str = "auto", template_kwargs: dict | None = None) -> None:
        self.__name__ = name  # TRL's name: config._name_or_path.split("/")[-1]
        self.client, self.timeout = client, timeout
        self.system_prompt, self.prompt_format = system_prompt, prompt_format
        self.template_kwargs = dict(template_kwargs or {})

    def __call__(self, prompts: list, completions: list, groups: int = 1, **_columns) -> list[float]:
        """One float per completion; a call covering `groups` groups (a round) may take reward_model_timeout each."""
        from trainer.data.prompt_formats import prompt_as_seen

        seen = [prompt_as_seen(p, self.system_prompt, self.prompt_format) for p in prompts]
        return self.client.reward_scores(self.__name__, seen, completions, self.timeout * groups,
                                         self.template_kwargs)


def reward_model_fns(cfg) -> dict[int, RewardModelFn]:
    """{reward_fns index: its RewardModelFn} for the entries of `cfg` that are reward models ({} when none)."""
    models = cfg.reward_models()
    if not models:
        return {}
    from trainer.runtime import make_client

    client = make_client(cfg)
    for m in models:  # said by every producer: its weights are not loaded here (the e2e test reads this)
        log.info("reward model %s (%s): scored by the ref server %s", m["name"], m["spec"], cfg.ref_server)
    return {m["index"]: RewardModelFn(m["name"], client, cfg.reward_model_timeout, cfg.system_prompt,
                                      cfg.prompt_format, cfg.chat_template_kwargs) for m in models}
