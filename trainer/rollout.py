"""Rollouts: sample a group of completions per prompt, reward them (trainer/rewards/scoring.py), build upload
batches.

The exact sampled token ids travel to the server (never decoded and re-tokenised); the
completion length counts tokens up to and including the first end-of-sequence token, so
masks come from lengths even when pad == eos.
"""
from __future__ import annotations

import sys
import time
import uuid
from dataclasses import replace

import torch

from common.logprobs import forward_calls, sequence_logprobs
from common.pack_choice import choose_packed
from common.prompts import SYSTEM_PROMPT
from common.wire.protocol import RolloutBatch
from trainer.agents.rollout import expand_group
from trainer.data.loading import Example, build_prompt
from trainer.data.prompt_formats import resolve_format
from trainer.dist.comm import all_reduce, all_reduce_int
from trainer.engines import GenEngine, Sample
from trainer.objective.grpo import group_advantages, has_spread, overlong_penalty
from trainer.rewards.scoring import Group
from trainer.run.rollout_stats import RolloutStats
from trainer.tools.multi_turn import messages_extra, stats_extra, tool_rollouts


def encode_prompts(tokenizer, examples: list[Example], system_prompt: str | None, max_prompt_length: int,
                   prompt_format: str = "auto", tools=None, template_kwargs: dict | None = None
                   ) -> tuple[list[tuple[Example, list[int]]], int]:
    """Build the prompt text (trainer/data/prompt_formats.py) and tokenise; prompts over max_prompt_length are
    dropped and counted. system_prompt 'default' = the R1-style prompt for chat, none for messages. `tools`: the
    ToolBox's JSON schemas, rendered by the chat template (apply_chat_template(tools=...), as TRL does), or a
    function of the example's row giving them (ToolBox.prompt_tools: each row's environment has its own tools).
    prompt_format trl: no system prompt; a text prompt gets the tokenizer's special tokens (TRL's
    processing_class(text=prompts): a BOS for Llama); templated text never does (the template has its own)."""
    kept, skipped = [], 0
    for ex in examples:
        fmt = resolve_format(prompt_format, ex.prompt)  # auto: messages for a message list, else chat
        system = (SYSTEM_PROMPT if fmt == "chat" else None) if system_prompt == "default" else system_prompt
        text = build_prompt(tokenizer, ex.prompt, system, fmt, tools(ex.columns) if callable(tools) else tools,
                            template_kwargs)
        plain = fmt == "trl" and not isinstance(ex.prompt, list)
        ids = tokenizer(text, add_special_tokens=plain)["input_ids"]
        if len(ids) > max_prompt_length:
            skipped += 1
            continue
        kept.append((ex, ids))
    return kept, skipped


def pack_rows(rows: list[tuple[list[int], torch.Tensor]], pad_id: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[(prompt ids, completion ids)] -> right-padded input_ids (B, L), prompt_lens, completion_lens."""
    L = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)
        ids[i, len(p):len(p) + len(c)] = c
    return ids, torch.tensor([len(p) for p, _ in rows]), torch.tensor([len(c) for _, c in rows])


def round_advantages(rewards: list[torch.Tensor], mode: str) -> list[torch.Tensor]:
    """Advantages of each group of a generation round; grpo_batch_std (TRL scale_rewards="batch") centres per
    group and scales by the std of every reward of the round, so it needs the whole round."""
    if mode != "grpo_batch_std":
        return [group_advantages(r, mode) for r in rewards]
    scored = torch.cat(rewards).float()
    scored = scored[~torch.isnan(scored)]  # unscorable (all-None) completions: out of the baseline, advantage 0
    std = scored.std() if scored.numel() > 1 else torch.tensor(0.0)
    return [torch.nan_to_num(group_advantages(r, "grpo_no_std") / (std + 1e-4), nan=0.0) for r in rewards]


def engine_logps(samples: list[Sample]) -> torch.Tensor:
    """The engine's per-token logprobs of a group as (B, T) float32, zeros past each completion."""
    T = max(len(s.completion_ids) for s in samples)
    out = torch.zeros(len(samples), T, dtype=torch.float32)
    for i, s in enumerate(samples):
        out[i, :len(s.logprobs)] = s.logprobs
    return out


@torch.no_grad()
def policy_logps(batches: list[RolloutBatch], engine: GenEngine, cfg, synced: bool) -> None:
    """gen_logps of an engine that returns none (HF): forwards of its model per group (padding_free: one per
    pack of at most pack_tokens tokens), the same computation the trainer does. Synced (ZeRO-3): every module
    call gathers weights from all ranks, so each rank makes as many forwards, each with as many LM-head chunks,
    as the rank with the most (a 1-token dummy row past ours, dummy packs past our packs)."""
    n = all_reduce_int(len(batches), "max") if synced else len(batches)
    if n == 0:  # every batch has the engine's own logprobs (vLLM): no forward, and no HF model to ask
        return
    mine = list(batches)  # auto: one choice for all groups (summed over synced ranks)
    packed = choose_packed(cfg.padding_free, engine.model,
                           torch.cat([b.prompt_lens for b in mine]) if mine else torch.ones(1, dtype=torch.long),
                           torch.cat([b.completion_lens for b in mine]) if mine else torch.ones(1, dtype=torch.long),
                           max([b.num_rows for b in mine], default=1), cfg.pack_tokens,
                           all_reduce if synced else None)
    for i in range(n):
        b = batches[i] if i < len(batches) else None
        ids, plens, clens = (b.input_ids, b.prompt_lens, b.completion_lens) if b is not None else \
            (torch.zeros(1, 2, dtype=torch.long), torch.ones(1, dtype=torch.long), torch.ones(1, dtype=torch.long))
        packs, chunks = forward_calls(plens, clens, cfg.logp_chunk_tokens, packed, cfg.pack_tokens)
        if synced:  # as many packed forwards (pack_tokens each), and head calls in each, as the rank with the most
            packs, chunks = all_reduce_int(packs, "max"), all_reduce_int(chunks, "max")
        logps, _ = sequence_logprobs(engine.model, ids, plens, clens, chunk_tokens=cfg.logp_chunk_tokens,
                                     min_chunks=chunks if synced else 0, temperature=cfg.logprob_temperature(),
                                     padding_free=packed, pack_tokens=cfg.pack_tokens,
                                     min_packs=packs if synced else 0)
        if b is not None:
            b.gen_logps = logps.float().cpu()


def loss_mask(samples: list[Sample]) -> torch.Tensor:
    """(B, T) bool of a group: True where the model sampled the token, False on tool turns and past each end."""
    T = max(len(s.completion_ids) for s in samples)
    out = torch.zeros(len(samples), T, dtype=torch.bool)
    for i, s in enumerate(samples):
        out[i, :len(s.completion_ids)] = True if s.loss_mask is None else s.loss_mask
    return out


def with_observation(ex: Example, observation: str) -> Example:
    """The example with an environment's first observation appended to its last prompt message (prompt[-1],
    whatever its role), as TRL does with what reset() returns."""
    if isinstance(ex.prompt, list):
        msgs = [dict(m) for m in ex.prompt]
        msgs[-1]["content"] = msgs[-1]["content"] + observation
        return replace(ex, prompt=msgs)
    return replace(ex, prompt=ex.prompt + observation)


def reset_kwargs(ex: Example) -> dict:
    """What an environment's reset() gets: the dataset row, as TRL passes it (grpo_trainer.py ~2376): its prompt
    and every other column, less the prompt of a row that had none (TRL keeps its stand-in out of reset())."""
    return dict(ex.columns) if ex.reset_prompt else {"prompt": ex.prompt, **ex.columns}


def started_prompts(examples: list[Example], tool_stats: list | None) -> list | None:
    """Per rollout, its prompt as the rollout started: reset()'s text appended where an environment returned one
    (what TRL's rewards get as `prompts`); None when no rollout had one."""
    if tool_stats is None or not any("observation" in s for s in tool_stats):
        return None
    return [ex.prompt if "observation" not in s else with_observation(ex, str(s["observation"])).prompt
            for ex, s in zip(examples, tool_stats)]


def sample_groups(engine: GenEngine, tokenizer, kept: list[tuple[Example, list[int]]], n: int, max_new_tokens: int, *,
                  toolbox=None, max_iterations: int | None = None, greedy: bool = False,
                  system_prompt: str | None = None, prompt_format: str = "auto", template_kwargs: dict | None = None,
                  snapshots: bool = False) -> tuple[list[Sample], list | None, list | None]:
    """n completions per prompt (prompt-major): one engine call, or with a ToolBox the multi-turn tool loop
    (trainer/tools/multi_turn.py); then also each completion's messages and tool statistics (else None, None).
    system_prompt / prompt_format: how the prompts were rendered (encode_prompts), for a prompt that an
    environment's reset() extends. snapshots: each rollout's stats["environment"] is a copy of its environment
    instance after the episode (a reward takes TRL's `environments`; trainer/rewards/environments.py)."""
    prompts = [ids for _, ids in kept]
    if toolbox is None:
        return engine.generate(prompts, n, max_new_tokens=max_new_tokens, greedy=greedy), None, None

    def render(i: int, observation: str) -> list[int]:
        (_, ids), = encode_prompts(tokenizer, [with_observation(kept[i][0], str(observation))], system_prompt,
                                   sys.maxsize, prompt_format, toolbox.prompt_tools, template_kwargs)[0]
        return ids

    return tool_rollouts(engine, tokenizer, toolbox, prompts, n, max_new_tokens=max_new_tokens,
                         max_iterations=max_iterations, greedy=greedy,
                         reset_kwargs=[reset_kwargs(ex) for ex, _ in kept],
                         with_observation=render, snapshots=snapshots)


def generate_batches(engine: GenEngine, tokenizer, examples: list[Example], cfg, scorer,
                     policy_version: int = 0, producer_id: str = "", toolbox=None, epoch: float = 0.0,
                     agents=None) -> tuple[list[RolloutBatch], RolloutStats]:
    """One generation round: a RolloutBatch per prompt group with reward spread.

    toolbox (trainer/tools ToolBox, or None): multi-turn rollouts with tools; the batches then carry a loss_mask
    (False on tool tokens), extra["tools"] (per-completion tool statistics), and rewards get each completion as
    messages where the prompt is conversational (scorer.score_group).

    scorer: a trainer.rewards.scoring.RewardScorer (rewards, per-function components, timeouts per group).
    agents (trainer/agents/rollout.py AgentRollouts, or None): the user's agent makes each rollout; its
    segment rows share their rollout's reward and advantage, with a loss_mask and extra["agent_completion"].
    epoch: passes over the training data so far (PromptSampler.progress()), TRL's trainer_state.epoch.
    gen_logps are the engine's own logprobs when it returns them (vLLM, no second forward), otherwise
    one forward of the HF engine's model, the same computation the trainer does."""
    t0 = time.time()
    stats = RolloutStats()
    # a tool run renders with TRL's training chat template where it swaps one in (ToolBox.template_kwargs)
    render_kw = toolbox.template_kwargs if toolbox is not None else cfg.chat_template_kwargs
    system = None if agents is not None else cfg.system_prompt  # an agent owns its prompt: none added to count it
    kept, stats.skipped_long_prompt = encode_prompts(tokenizer, examples, system, cfg.max_prompt_length,
                                                     cfg.prompt_format, toolbox.prompt_tools if toolbox else None,
                                                     render_kw)
    synced = getattr(engine, "synced_gpus", False)  # ZeRO-3 ranks generating together (trainer/batches.py)
    if not kept and not synced:
        return [], stats
    q = cfg.num_pre_Q
    if agents is not None:  # the user's agent per rollout, against this engine's endpoint
        ar = agents.round(kept, q, policy_version)
        stats.agent_faults = ar.faults
        samples, messages, tool_stats, env_rewards, envs, seen = ar.samples, ar.messages, None, ar.env_rewards, \
            None, ar.prompts
    else:
        samples, messages, tool_stats = sample_groups(
            engine, tokenizer, kept, q, cfg.max_new_tokens, toolbox=toolbox,
            max_iterations=cfg.max_tool_calling_iterations, system_prompt=cfg.system_prompt,
            prompt_format=cfg.prompt_format, template_kwargs=render_kw,
            snapshots=getattr(scorer, "wants_environments", False))
        env_rewards = [s.get("env_rewards") for s in tool_stats] if tool_stats is not None else None
        envs = [s.get("environment") for s in tool_stats] if tool_stats is not None else None  # TRL's environments
        seen = started_prompts([ex for ex, _ in kept for _ in range(q)], tool_stats)
    groups = [samples[g * q:(g + 1) * q] for g in range(len(kept))]
    # TRL's trainer_state: the policy version that sampled these rollouts, the run's length, the passes over the data
    scorer.set_state(policy_version, cfg.all_steps, epoch)
    cut = lambda xs, g: xs[g * q:(g + 1) * q] if xs is not None else None  # noqa: E731 - group g's share
    # one call of each reward function for the round's groups, as TRL calls them once per generation batch
    scored = scorer.score_round([Group(ex, [tokenizer.decode(s.completion_ids, skip_special_tokens=True)
                                            for s in group], [s.completion_ids.tolist() for s in group],
                                       cut(messages, g), cut(env_rewards, g), cut(envs, g), cut(seen, g))
                                 for g, ((ex, _), group) in enumerate(zip(kept, groups))]) if kept else None
    scores = scored.groups if scored is not None else []
    pending = getattr(scorer, "pending_metrics", None)  # TRL's _pending_metrics: until a batch carries them
    if pending is not None and scored is not None:
        for name, values in scored.metrics.items():
            pending.setdefault(name, []).extend(values)
    # what log_metric logged in this round (and earlier ones that trained nothing), taken once a batch carries it;
    # every batch of the round carries it, under the round's id (counted once a step: reward_logged_metrics)
    logged_metrics: dict | None = None
    round_id = uuid.uuid4().hex
    all_rewards = [torch.tensor(sc.rewards, dtype=torch.float32) for sc in scores]  # NaN: unscorable (all None)
    penalties = [overlong_penalty(torch.tensor([len(s.completion_ids) for s in group]), cfg.max_new_tokens,
                                  cfg.overlong_buffer, cfg.overlong_penalty) for group in groups]
    all_shaped = [r + p for r, p in zip(all_rewards, penalties)]
    advantages = round_advantages(all_shaped, cfg.advantage_mode)
    batches = []
    for g, ((ex, _), group, sc, rewards, penalty, shaped, adv) in enumerate(zip(kept, groups, scores, all_rewards,
                                                                              penalties, all_shaped, advantages)):
        tools = stats_extra(tool_stats[g * q:(g + 1) * q]) if tool_stats is not None else None
        conv = None
        if agents is not None:  # each rollout's segment rows, sharing its reward and advantage
            group, sc, rewards, penalty, shaped, adv, conv = expand_group(ar.rows[g * q:(g + 1) * q], sc, rewards,
                                                                          penalty, shaped, adv, cut(messages, g))
            if not group:  # no agent of the group called the endpoint: nothing to train
                continue
        rows = [(s.prompt_ids, s.completion_ids) for s in group]
        truncated = [s.truncated for s in group]
        stats.groups += 1
        stats.completions += len(rows)
        stats.completion_tokens += sum(len(c) for _, c in rows)
        stats.reward_timeouts += sc.timeouts
        stats.rewards.extend(r for r in rewards.tolist() if r == r)  # unscorable (NaN) completions: no reward
        for k, v in sc.components.items():
            stats.components.setdefault(k, []).extend(v)
        for k, v in (tools or {}).items():
            stats.tools.setdefault(k, []).extend(v)
        # DAPO overlong shaping acted where rewards became advantages; `rewards` stays the task reward (metrics)
        if not has_spread(shaped) and not getattr(cfg, "train_zero_spread", False):
            stats.skipped_no_spread += 1  # zero advantages: only the KL term would train (train_zero_spread)
            if len(stats.skipped_samples) < 2:  # what the stall warning shows (trainer/run/stall.py)
                stats.skipped_samples.append((tokenizer.decode(group[0].completion_ids, skip_special_tokens=True),
                                              {k: v[0] for k, v in sc.components.items()}))
            continue
        ids, plens, clens = pack_rows(rows, tokenizer.pad_token_id)
        if logged_metrics is None:
            logged_metrics = scorer.take_metrics() if pending is not None else dict(scored.metrics)
        extra = {"components": sc.components, "truncated": truncated, "reward_timeouts": [sc.timeouts],
                 "logged": sc.logged,  # TRL's log_extra
                 "round_metrics": [{"round": round_id, "metrics": logged_metrics}]}  # TRL's log_metric
        if cfg.overlong_buffer > 0:
            extra["overlong_penalty"] = penalty.tolist()
        if tools is not None:
            extra["tools"] = tools  # tools/... metrics of the trained batch (trainer/run/step_metrics.py)
            if (said := messages_extra(messages[g * q:(g + 1) * q])) is not None:  # TRL's parsed turns
                extra["messages"] = said  # completions.jsonl's `messages`
        version = policy_version
        if agents is not None:  # agent/... metrics of the trained batch (trainer/run/step_metrics.py)
            st = ar.stats[g * q:(g + 1) * q]
            # staleness per recorded call: the batch is as old as its oldest call (the bound drops it by that)
            version = min((v for s in st for v in s["policy_versions"]), default=policy_version)
            extra["agent"] = {"rollouts": [len(st)], "calls": [sum(s["calls"] for s in st)],
                              "segments": [sum(s["segments"] for s in st)]}
        if conv is not None and (conv := messages_extra(conv)) is not None:  # if it fits the wire's room
            extra["agent_completion"] = conv  # completions.jsonl's `completion`: the conversation
        if ex.index is not None:  # which example this group answers (exact-resume checks, metrics)
            extra["example_index"] = [ex.index]  # a list: collate() concatenates lists
        batch = RolloutBatch(input_ids=ids, prompt_lens=plens, completion_lens=clens, advantages=adv,
                             rewards=torch.nan_to_num(rewards, nan=0.0),  # the wire takes finite rewards
                             policy_version=version, producer_id=producer_id,
                             batch_id=uuid.uuid4().hex, extra=extra,
                             loss_mask=loss_mask(group) if toolbox is not None or agents is not None else None,
                             # what the ref server needs: whether to run the reference at all, the T of the logprobs
                             needs_ref=cfg.beta > 0, logp_temperature=cfg.logprob_temperature())
        if cfg.compute_gen_logps and group[0].logprobs is not None:
            batch.gen_logps = engine_logps(group)
            batch.extra["gen_logps_source"] = "engine"  # the trainer's mismatch metric compares against these
        batches.append(batch)
    if agents is not None and batches:  # every fault since the last batch, on this round's first (agent/faults)
        batches[0].extra["agent_faults"] = [agents.take_faults()]
    if cfg.compute_gen_logps:
        policy_logps([b for b in batches if b.gen_logps is None], engine, cfg, synced)
    stats.seconds = time.time() - t0
    return batches, stats
