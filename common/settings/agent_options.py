"""GRPOConfig's fields for agents as rollouts (issue 61; trainer/agents/, docs/agents.md): the user's own
OpenAI-client program, called once per rollout against the worker's endpoint. A mixin, as tool_options.py.

    cfg.agent_reward_names()   # ["solve"] for agent "my_agent.py:solve": the agent's own float, a reward (weight 1)
    cfg.agent_errors()         # one line per refused combination (checked by validate())
"""
from __future__ import annotations

from dataclasses import dataclass

from common.settings.knobs import knob


@dataclass
class AgentOptions:
    agent: str | None = knob(None, "Your agent program as the rollout (issue 61, docs/agents.md): a function "
                                   "('module:function' or 'path/to/file.py:function', from your folder) called "
                                   "once per rollout, sync or async def, with base_url (an OpenAI-compatible "
                                   "endpoint recording this rollout), model, prompt and the example's other "
                                   "columns; it returns None or its own float reward (named after the function).")
    agent_timeout: float = knob(300.0, "Seconds one agent rollout may take; past it the rollout has no reward "
                                       "(TRL's all-None) and its later calls are refused.")
    agent_max_concurrency: int | None = knob(None, "Agent rollouts running at once (null = a round's rollouts: "
                                                   "Q_batch_size x num_pre_Q).")

    def agent_name(self) -> str | None:
        """The function's name ('my_agent.py:solve' -> 'solve'): its own float's reward name."""
        return str(self.agent).rsplit(":", 1)[-1].strip() if self.agent else None

    def agent_reward_names(self) -> list[str]:
        return [self.agent_name()] if self.agent else []

    def agent_errors(self) -> list[str]:
        if not self.agent:
            return []
        out = []
        spec = str(self.agent)
        if ":" not in spec or not spec.rsplit(":", 1)[-1].strip() or not spec.rsplit(":", 1)[0].strip():
            out.append(f"agent {spec!r} names no function: write 'module:function' or 'path/to/file.py:function'")
        if self.tools or self.environment_factory:
            out.append("agent runs the user's own rollout (its own tools and loop): it cannot be combined with "
                       "tools or environment_factory (our tool loop); give one or the other")
        if self.zero_stage == 3 and (self.num_gen_workers == 0 or self.get_wait > 0):
            out.append("agent with zero_stage 3: ranks generating for themselves must generate in lockstep, which "
                       "agents' uneven calls cannot keep; use genonly workers (num_gen_workers >= 1) and get_wait 0")
        if self.eval_steps or self.eval_before:  # trainer/evaluate.py samples plain completions, scored as text
            out.append("agent with eval_steps/eval_before: in-training evaluation does not run the agent yet "
                       "(docs/agents.md, Not wired yet); set eval_steps 0 and eval_before false")
        if self.agent_timeout <= 0:
            out.append("agent_timeout must be > 0 seconds")
        if self.agent_max_concurrency is not None and self.agent_max_concurrency < 1:
            out.append("agent_max_concurrency must be >= 1 (or null = a round's rollouts)")
        return out
