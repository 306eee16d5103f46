"""Multi-turn rollouts with tools (TRL's tool-calling loop, over our GenEngine face).

Sample a group; for each rollout whose turn calls tools (ToolBox.parse on the decoded turn), run the calls (one
environment episode per rollout), append the tool turn's tokens as the chat template renders them, and generate
the next turn for every still-active rollout in one batched call per round (n=1), until a turn has no call,
`max_tool_calling_iterations` tool rounds, or the completion's token budget is spent.

Token exactness: the model's own tokens are never decoded and re-tokenised. Only the tool turn's suffix (the tool
message(s) and the next assistant opener) is tokenised, the way TRL's `_get_tool_suffix_ids` does it: render a
dummy conversation with and without the tool messages and keep the new tail, with the run's chat template (TRL's
training template where it swaps one in: trainer/tools/templates.py) and chat_template_kwargs. Those tokens are in
the completion (the policy and the reference see them) with loss_mask False and logprob 0.

Each assistant turn becomes a message as TRL's parse_response makes it (content without the calls, tool_calls,
reasoning_content where the template has one): what rewards, reward models and completions.jsonl get.

`max_new_tokens` counts every token after the prompt, tool tokens included (TRL's max_completion_length). A tool
turn that would take the completion past it is rolled back as TRL rolls it back: the rollout ends with the turn
that made the calls, as it is (not truncated: it ended where the model ended it), its tool messages dropped. A tool
turn that fills the budget exactly is kept and the rollout ends truncated (TRL's boundary is `>`).

ZeRO-3 (an HF engine with synced_gpus): every forward is a collective, so every rank makes the same number of
generate calls: the ranks agree each round whether any still has an active rollout, and a rank with none calls
generate with no prompts (the engine makes its dummy call, trainer/engines/hf.py).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import torch

from trainer.dist.comm import all_reduce_int
from trainer.engines.base import GenEngine, Sample
from trainer.tools.templates import tool_suffix_ids

log = logging.getLogger("trainer")
FAILED = ("error", "unknown_tool")  # statuses counted as tools/failed (timeouts and malformed calls apart)


@dataclass
class Rollout:
    """One rollout being built: its completion so far (every turn, tool tokens included)."""
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logps: list[float] | None = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the conversational completion rewards receive
    truncated: bool = False
    stats: dict = field(default_factory=lambda: {"calls": 0, "turns": 0, "failed": 0, "timed_out": 0,
                                                 "malformed": 0, "seconds": 0.0})

    def add_turn(self, s: Sample, limit: int) -> list[int]:
        """Append a generated turn, cut to what is left of the budget (cut there = truncated)."""
        ids = s.completion_ids.tolist()
        room = limit - len(self.ids)
        cut = len(ids) > room
        ids = ids[:room]
        self.ids += ids
        self.mask += [True] * len(ids)
        if self.logps is not None:
            self.logps = None if s.logprobs is None else self.logps + s.logprobs[:len(ids)].tolist()
        self.truncated = s.truncated or cut
        self.stats["turns"] += 1
        return ids

    def sample(self) -> Sample:
        return Sample(self.prompt_ids, torch.tensor(self.ids, dtype=torch.long),
                      None if self.logps is None else torch.tensor(self.logps, dtype=torch.float32),
                      self.truncated, torch.tensor(self.mask, dtype=torch.bool))


def _assistant_message(tokenizer, ids: list[int], prefix: list[int], schemas) -> dict:
    """The turn as TRL's parse_response gives it (its fallback where the response template cannot read the turn:
    the text, special tokens stripped, no tool_calls). A tokenizer with no response template (a ToolBox always sets
    one) gives the text, as TRL's _generate does then."""
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    from common.trl_import import trl_module
    return trl_module("chat_template_utils").parse_response(tokenizer, ids, prefix=prefix, tools=schemas or None)


def _count(r: Rollout, results) -> None:
    for res in results:
        r.stats["seconds"] += res.seconds
        if res.status == "malformed":  # not a call of any tool (TRL counts parsed calls only); said to the model
            r.stats["malformed"] += 1
            continue
        r.stats["calls"] += 1
        if res.status in FAILED:
            r.stats["failed"] += 1
        elif res.status == "timeout":
            r.stats["timed_out"] += 1
        if res.status != "unknown_tool":  # per tool: the configured ones only (not names the model made up)
            key = f"calls/{res.name}"
            r.stats[key] = r.stats.get(key, 0) + 1


def tool_rollouts(engine: GenEngine, tokenizer, toolbox, prompt_ids: list[list[int]], n: int, *,
                  max_new_tokens: int, max_iterations: int | None, greedy: bool = False,
                  reset_kwargs: list[dict] | None = None, with_observation=None, snapshots: bool = False
                  ) -> tuple[list[Sample], list[list[dict]], list[dict]]:
    """n rollouts per prompt (prompt-major, as engine.generate orders them) -> one Sample per rollout (all turns'
    tokens, loss_mask False on tool tokens, logprobs 0 there when the engine gives them), its completion as a
    list of messages (what TRL gives reward functions for a conversational prompt), and its tool statistics.

    reset_kwargs: one dict per prompt, what each rollout's environment reset() gets (TRL passes the dataset row).
    with_observation(prompt index, observation) -> prompt ids: as TRL, what an environment's reset() returns is
    appended to the prompt's last message (prompt[-1]); the rollouts with one then start from their own prompt.
    snapshots: a reward takes TRL's `environments`: each rollout's stats["environment"] is a copy of its instance
    after the last turn (ToolBox.episode_snapshots), taken before get_reward() as TRL calls the functions first."""
    synced = getattr(engine, "synced_gpus", False)
    episodes = toolbox.start_episodes(len(prompt_ids) * n,
                                      [kw for kw in reset_kwargs for _ in range(n)] if reset_kwargs else None)
    try:
        obs = [toolbox.observations.get(e) for e in episodes]
        if with_observation is not None and any(o is not None for o in obs):
            own = [prompt_ids[k // n] if o is None else with_observation(k // n, o) for k, o in enumerate(obs)]
            first = engine.generate(own, 1, max_new_tokens=max_new_tokens, greedy=greedy)
        else:
            first = engine.generate(prompt_ids, n, max_new_tokens=max_new_tokens, greedy=greedy)
        rolls = [Rollout(list(s.prompt_ids)) for s in first]
        for r, o in zip(rolls, obs):  # TRL's rewards get the prompt reset() extended (grpo_trainer.py ~2398, ~2753)
            if o is not None:
                r.stats["observation"] = o
        turns = list(zip(range(len(rolls)), first))
        rounds = 0
        while True:
            active = _tool_round(tokenizer, toolbox, rolls, episodes, turns, max_new_tokens,
                                 max_iterations is not None and rounds >= max_iterations)
            rounds += 1
            go = all_reduce_int(int(bool(active)), "max") if synced else int(bool(active))
            if not go:
                break
            ctx = [rolls[i].prompt_ids + rolls[i].ids for i in active]
            # each rollout its own remaining tokens: a short one is not generated past its end (and then cut)
            budget = [max_new_tokens - len(rolls[i].ids) for i in active]
            outs = engine.generate(ctx, 1, max_new_tokens=budget, greedy=greedy)
            turns = list(zip(active, outs))
        for r, snap in zip(rolls, toolbox.episode_snapshots(episodes) if snapshots else []):
            r.stats["environment"] = snap  # rewards read it (trainer/rewards/environments.py), not metrics
        for r, env_reward in zip(rolls, toolbox.episode_rewards(episodes)):  # TRL: read before the episodes end
            r.stats["env_rewards"] = env_reward  # {class name: get_reward()} or None; rewards read it, not metrics
    finally:
        toolbox.end_episodes(episodes)
    return [r.sample() for r in rolls], [r.messages for r in rolls], [r.stats for r in rolls]


def _tool_round(tokenizer, toolbox, rolls: list[Rollout], episodes: list[int], turns: list[tuple[int, Sample]],
                max_new_tokens: int, last: bool) -> list[int]:
    """Append each rollout's new turn; run the tool calls of the turns that made some and append the tool turns.
    Returns the rollouts that go on to generate another turn."""
    jobs, pending = [], []
    for i, s in turns:
        r = rolls[i]
        ids = r.add_turn(s, max_new_tokens)
        prefix = r.prompt_ids + r.ids[:len(r.ids) - len(ids)]
        calls, bad = ([], []) if r.truncated else toolbox.parse(tokenizer.decode(ids, skip_special_tokens=False),
                                                                tokenizer.decode(prefix, skip_special_tokens=False))
        r.messages.append(_assistant_message(tokenizer, ids, prefix, toolbox.schemas))
        if (calls or bad) and not last:
            jobs.append((episodes[i], calls))
            pending.append((i, bad))
    results = toolbox.run(jobs) if jobs else []
    active = []
    for (i, bad), res in zip(pending, results):
        r, res = rolls[i], list(res) + list(bad)
        _count(r, res)
        tool_msgs = [x.to_message() for x in res]
        suffix = tool_suffix_ids(tokenizer, tool_msgs, toolbox.template_kwargs)
        if len(r.ids) + len(suffix) > max_new_tokens:  # TRL: the tool results roll back, the turn stays as it is
            continue
        r.ids += suffix
        r.mask += [False] * len(suffix)
        if r.logps is not None:
            r.logps += [0.0] * len(suffix)
        r.messages += tool_msgs
        if len(r.ids) == max_new_tokens:  # kept, and no token left: TRL's next turn is cut to nothing
            r.truncated = True
            continue
        active.append(i)
    return active


MESSAGES_CHARS = 32 * 1024  # half of the wire's 64 KiB for a batch's `extra` (common/wire/limits.py)
_said_too_long = []


def messages_extra(messages: list[list[dict]]) -> list[list[dict]] | None:
    """A group's completions as messages for its batch's extra["messages"] (completions.jsonl's `messages`, as TRL
    logs them): None, said once per process, where they would take more than MESSAGES_CHARS of the wire's room."""
    size = len(json.dumps(messages, separators=(",", ":")))
    if size <= MESSAGES_CHARS:
        return messages
    if not _said_too_long:
        _said_too_long.append(size)
        log.warning("tools: a group's messages take %d KiB, more than the %d KiB a batch carries for them: "
                    "completions.jsonl shows such groups' text only (said once)", size // 1024, MESSAGES_CHARS // 1024)
    return None


def stats_extra(stats: list[dict]) -> dict:
    """Per-completion tool statistics for a batch's `extra["tools"]` (a dict of lists: collate concatenates them,
    and every tool name seen in the group gets a list)."""
    names = sorted({k for s in stats for k in s if k.startswith("calls/")})
    keys = ["calls", "turns", "failed", "timed_out", "malformed", "seconds", *names]
    return {k: [float(s.get(k, 0)) for s in stats] for k in keys}


COUNTED = ("failed", "timed_out", "malformed", "seconds")  # per-completion means, as tools/<key>


def tool_metrics(tools: dict, prefix: str = "tools/") -> dict:
    """A batch's extra["tools"] -> its metrics, each a mean per completion: tools/calls_per_completion,
    tools/turns_per_completion, tools/failed, tools/timed_out, tools/malformed, tools/seconds, tools/<name>/calls."""
    n = max(len(tools.get("calls", [])), 1)
    mean = lambda k: sum(tools.get(k, [])) / n  # noqa: E731
    out = {f"{prefix}calls_per_completion": mean("calls"), f"{prefix}turns_per_completion": mean("turns")}
    out.update({f"{prefix}{k}": mean(k) for k in COUNTED})
    out.update({f"{prefix}{k.removeprefix('calls/')}/calls": mean(k) for k in tools if k.startswith("calls/")})
    return out


def tool_metric_keys(names: list[str]) -> list[str]:
    """The tools/... keys of a run with these tools (averaged over ranks, trainer/run/step_metrics.py)."""
    return ["tools/calls_per_completion", "tools/turns_per_completion", *(f"tools/{k}" for k in COUNTED),
            *(f"tools/{name}/calls" for name in names)]


TOTALS = {"calls": "tool_calls", "failed": "tool_failed", "timed_out": "tool_timed_out",
          "malformed": "tool_malformed"}


def add_tool_totals(totals: dict, tools: dict) -> None:
    """Cumulative counters a producer reports in its heartbeat (the ref server's /status view): completions,
    tool_calls, tool_failed, tool_timed_out, tool_malformed."""
    totals["completions"] = totals.get("completions", 0) + len(tools.get("calls", []))
    for k, name in TOTALS.items():
        totals[name] = totals.get(name, 0) + int(sum(tools.get(k, [])))
