"""Where a run's rewards come from (TRL 1.16's rule): the reward functions of `reward_fns`, plus one reward per
environment class that has a get_reward() method (named after the class, weight 1, grpo_trainer.py).

    cfg.reward_specs()        # reward_fns; null -> correct,format, or none when an environment gives the reward
    cfg.env_reward_names()    # ["MyEnv"] when environment_factory's class has get_reward()

A mixin of GRPOConfig (methods only, no fields). It imports the environment class only when it must know whether
that class has get_reward (environment_factory set); the import is the same one the tool executor makes. Config
validation imports it only for `reward_fns: []` (refused when nothing gives a reward) or to count reward_weights.
"""
from __future__ import annotations

from common.settings.tool_specs import environment_specs, tool_spec_errors

DEFAULT_REWARDS = ["correct", "format"]


class RewardSources:
    """GRPOConfig's reward sources (mixed in; reward_fns and environment_factory are GRPOConfig fields)."""

    def env_reward_names(self) -> list[str]:
        """The class name of each environment_factory class with a get_reward() (sync or async), as TRL names it."""
        from common.user_code import load_object

        classes = []
        for spec in environment_specs(self.environment_factory).values():
            cls = load_object(spec)
            if callable(getattr(cls, "get_reward", None)) and cls not in classes:  # TRL: one reward per class
                classes.append(cls)
        return [cls.__name__ for cls in classes]

    def reward_specs(self) -> list[str]:
        """reward_fns as a list. Not given (null): the built-in correct,format, unless an environment gives the
        reward, which is then the only one (TRL: reward_funcs may be empty; nothing is added silently)."""
        if self.reward_fns is None:
            # an agent's own float is a reward too (issue 61): then it is the only one, as an environment's
            return [] if self.agent or self.env_reward_names() else list(DEFAULT_REWARDS)
        fns = self.reward_fns if isinstance(self.reward_fns, list) else str(self.reward_fns).split(",")
        return [str(f).strip() for f in fns if str(f).strip()]

    def reward_source_errors(self) -> list[str]:
        """One line when nothing gives a reward (reward_fns: [] without an environment reward)."""
        if self.reward_fns is None or self.reward_specs() or self.agent:  # an agent's float: the reward
            return []
        if tool_spec_errors([], self.environment_factory):  # a spec that names no class: said by its own check
            return []
        try:
            if self.env_reward_names():
                return []
        except ValueError as e:  # the class cannot be imported: say so here, in the same one line
            return [f"reward_fns is empty and environment_factory {e}"]
        env = self.environment_factory
        return ["reward_fns is empty and nothing else gives a reward: name reward functions, or use an "
                "environment_factory class with a get_reward() method"
                + (f" ({env!r} has none)" if env else "")]
