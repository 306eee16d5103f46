"""A generation round of agents (issue 61): the user's `agent` called num_generations times per prompt against the
worker's endpoint, each session turned into training rows, its conversation into what the rewards score.

    agents = AgentRollouts.from_config(cfg, engine, tokenizer)   # None without `agent`; serves on 127.0.0.1
    ar = agents.round(kept, q, policy_version)   # kept: encode_prompts' (example, ids); prompt-major rollouts
    ar.samples / ar.messages / ar.prompts / ar.env_rewards   # one per rollout: what trainer/rollout.py scores
    group, sc, ... = expand_group(ar.rows[g*q:(g+1)*q], sc, ...)   # each rollout's segment rows, sharing its values

Rewards get TRL's conversational signature: `prompts` = the session's first request's messages, `completions` = the
messages the session added after them (content always a string). The agent's own float is one more reward, named
after the function, weight 1 (as an environment's get_reward; trainer/rewards/scoring.py env_names). A rollout whose
agent raised, timed out or never called has reward None (TRL's all-None: out of the baseline, advantage 0); the
round counts them and names the first few in one line; a round where every agent failed ends the producer.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from common.user_code import load_object
from trainer.agents import rollout_of, serve
from trainer.agents.runner import run_agents
from trainer.engines.base import Sample

log = logging.getLogger("trainer")
NAMED_FAULTS = 3  # rollouts named in a round's fault line


def conversation(messages: list[dict]) -> list[dict]:
    """completions.jsonl's and the rewards' form: {role, content, tool_calls?}, content a string ("" when empty)."""
    out = []
    for m in messages:
        row = {"role": m.get("role", "assistant"), "content": m.get("content") or ""}
        if m.get("tool_calls"):
            row["tool_calls"] = m["tool_calls"]
        out.append(row)
    return out


@dataclass
class AgentRound:
    samples: list[Sample]          # per rollout: its first row (an empty one where it has none), for scoring
    rows: list[list[Sample]]       # per rollout: its training rows, one per segment
    messages: list[list[dict]]     # per rollout: the conversation after its first request's messages
    prompts: list                  # per rollout: its first request's messages (the example's prompt if none)
    env_rewards: list[dict | None]  # per rollout: {agent name: its own float} (None: no verdict)
    faults: int = 0
    stats: list[dict] | None = None


class AgentRollouts:
    """The worker's endpoint and the user's agent; `round` runs one generation round of it."""

    def __init__(self, cfg, engine, tokenizer, agent):
        self.cfg, self.agent, self.name = cfg, agent, cfg.agent_name()
        self.version = 0
        self.unreported_faults = 0  # rollouts with no reward, not yet carried by an uploaded batch (metrics)
        self.server = serve(engine, tokenizer, model=str(cfg.model), max_new_tokens=cfg.max_new_tokens,
                            max_prompt_length=cfg.max_prompt_length, max_calls=cfg.max_tool_calling_iterations,
                            temperature=cfg.temperature, top_p=cfg.top_p, version=lambda: self.version)
        log.info("agent %s: serving its rollouts on %s:%d (OpenAI-compatible, docs/agents.md)", cfg.agent,
                 self.server.host, self.server.port)

    @classmethod
    def from_config(cls, cfg, engine, tokenizer) -> AgentRollouts | None:
        return cls(cfg, engine, tokenizer, load_object(cfg.agent)) if cfg.agent else None

    def round(self, kept: list, q: int, version: int = 0) -> AgentRound:
        self.version = version
        examples = [ex for ex, _ in kept for _ in range(q)]
        rows = [{"prompt": ex.prompt, **ex.columns} for ex in examples]
        runs = run_agents(self.server, self.agent, rows, timeout=self.cfg.agent_timeout,
                          max_concurrency=self.cfg.agent_max_concurrency)
        out = AgentRound([], [], [], [], [], stats=[])
        for k, (run, (_, ids)) in enumerate(zip(runs, [kept[i // q] for i in range(len(runs))])):
            samples, added, st = rollout_of(run.session)
            first = run.session.prompt_messages()
            out.rows.append(samples)
            out.samples.append(samples[0] if samples else Sample(list(ids), torch.zeros(0, dtype=torch.long),
                                                                  None, False, torch.zeros(0, dtype=torch.bool)))
            out.messages.append(conversation(added))
            out.prompts.append(first if first is not None else examples[k].prompt)
            out.env_rewards.append({self.name: run.value} if run.error is None and run.value is not None else None)
            out.stats.append({**st, "error": run.error, "seconds": run.seconds})
        failed = [(k, r.error) for k, r in enumerate(runs) if r.error is not None]
        out.faults = len(failed)
        self.unreported_faults += out.faults
        if failed:
            named = "; ".join(f"rollout {k} (row {kept[k // q][0].index}): {why}" for k, why in failed[:NAMED_FAULTS])
            log.warning("agent %s: %d of %d rollouts have no reward (None): %s%s", self.name, len(failed), len(runs),
                        named, " ..." if len(failed) > NAMED_FAULTS else "")
        if runs and len(failed) == len(runs):
            raise RuntimeError(f"agent {self.cfg.agent}: every rollout of the round failed; the first: "
                               f"{failed[0][1]}")
        return out

    def take_faults(self) -> int:
        """The faults since the last call: generate_batches puts them on a round's first batch (metrics.jsonl's
        agent/faults), so a round whose groups all fail or have no spread still counts in a later round's batch."""
        n, self.unreported_faults = self.unreported_faults, 0
        return n

    def close(self) -> None:
        self.server.close()


def expand_group(rows: list[list[Sample]], sc, rewards: torch.Tensor, penalty: torch.Tensor, shaped: torch.Tensor,
                 adv: torch.Tensor, messages: list[list[dict]]) -> tuple:
    """A group's values per training row: each rollout's segment rows share its reward, advantage, reward
    components, log_extra columns and conversation; a rollout with no rows (its agent never called) trains none."""
    index = [k for k, rs in enumerate(rows) for _ in rs]
    pick = lambda xs: [xs[k] for k in index]  # noqa: E731 - a per-rollout list, per row
    at = torch.tensor(index, dtype=torch.long)
    sc = replace(sc, rewards=pick(sc.rewards), components={n: pick(v) for n, v in sc.components.items()},
                 logged={c: pick(v) if len(v) == len(rows) else v for c, v in sc.logged.items()})
    return ([s for rs in rows for s in rs], sc, rewards[at], penalty[at], shaped[at], adv[at], pick(messages))
