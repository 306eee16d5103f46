"""Score one group of completions with the configured reward functions: both signatures, weights, timeouts.

Two kinds of reward function, told apart by their signature:
    ours  fn(completion: str, ground_truth: str) -> float                 called once per completion
    TRL   fn(prompts, completions, **columns) -> list[float | None]       called once per group, by keyword,
          as TRL's GRPOTrainer calls it: `prompts` are the dataset prompts (a string, or the message list in
          `messages` runs), `completions` strings (message lists [{"role": "assistant", ...}] in `messages`
          runs), `completion_ids` (token ids) and every other dataset column as a keyword list, one value per
          completion.
None means "not applicable": skipped in the weighted sum (as TRL does) and in the per-function means; a completion
for which every reward says None is NaN (TRL: unscorable; left out of its group's baseline, advantage 0).
TRL's keywords: `trainer_state` (state.py), `log_extra`, `log_metric` (timeout.call_trl_fn), `environments` (copies
of the episodes' instances, environments.py); `async def` TRL-style
rewards are gathered on one event loop in the reward worker (timeout.gather_trl_fns), under one timeout.
Environment rewards (get_reward()) are named after their class, weight 1 (`env_names`; their values come with the
rollouts).
A call that runs past `reward_timeout` also counts as None (timeout.py). A function that
raises, returns the wrong length or a non-finite number stops the run, naming itself and the example.
"""
from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass, field

from trainer.rewards.environments import takes_environments
from trainer.rewards.models import reward_model_fns
from trainer.rewards.registry import load_reward_fns, reward_kind, reward_name  # noqa: F401 (reward_kind)
from trainer.rewards.state import TrainerState
from trainer.rewards.timeout import RewardCallError, make_caller

log = logging.getLogger("trainer")

@dataclass
class GroupScore:
    rewards: list[float]  # weighted sum per completion; NaN where every reward said None (TRL: unscorable)
    components: dict[str, list[float | None]]  # unweighted value per function and completion
    timeouts: int = 0  # timed-out calls in this group
    timed_out: dict[str, list[int]] = field(default_factory=dict)
    logged: dict[str, list] = field(default_factory=dict)  # log_extra: column -> one value per completion
    metrics: dict[str, list[float]] = field(default_factory=dict)  # log_metric: name -> values logged


@dataclass
class Group:
    """One prompt's completions as a round hands them to the rewards. completion_ids: the sampled token ids (TRL's
    `completion_ids`). messages: in a tool run, each completion as its list of messages (assistant turns with their
    tool_calls, tool turns): TRL-style `completions` for a conversational prompt; the text is then the whole
    completion's. env_rewards: per completion, {environment class name: its get_reward()} from the tool loop.
    environments: per completion, the copy of its episode's instance (when `wants_environments`). prompts: per
    completion, the prompt as its rollout started (reset()'s text appended), TRL's `prompts` (else the example's)."""
    example: object
    completions: list[str]
    completion_ids: list[list[int]] | None = None
    messages: list[list[dict]] | None = None
    env_rewards: list[dict | None] | None = None
    environments: list[dict] | None = None
    prompts: list | None = None


@dataclass
class RoundScore:
    groups: list[GroupScore]  # one per Group, in order
    metrics: dict[str, list[float]]  # log_metric over the round's calls: name -> values (TRL: once per batch)


def _short(x, n: int = 300) -> str:
    s = x if isinstance(x, str) else repr(x)
    return s if len(s) <= n else s[:n] + f"... ({len(s)} chars)"


class RewardScorer:
    """The run's reward functions, ready to score groups (one worker process when reward_timeout > 0)."""

    def __init__(self, specs, weights: list | None = None, timeout: float = 10.0, conversational: bool | None = None,
                 env_names: list[str] | None = None, models: dict | None = None, environments: bool = False):
        specs = [s for s in specs.split(",") if s.strip()] if isinstance(specs, str) else list(specs or [])
        self.specs = [s.strip() for s in specs]
        # models: {index in specs: a reward model's TRL-style function (trainer/rewards/models.py)}, scored by the
        # ref server; the other entries are functions, imported here and in the reward worker
        models = models or {}
        fn_idx = [i for i in range(len(self.specs)) if i not in models]
        loaded = dict(zip(fn_idx, load_reward_fns([self.specs[i] for i in fn_idx])))
        self.fns = [models[i] if i in models else loaded[i] for i in range(len(self.specs))]
        self.call_idx = {i: k for k, i in enumerate(fn_idx)}  # the reward worker's index of each function
        self.names: list[str] = []
        for fn in self.fns:  # a repeated name gets a #2, #3... suffix
            name = base = reward_name(fn)
            k = 2
            while name in self.names:
                name, k = f"{base}#{k}", k + 1
            self.names.append(name)
        self.kinds = ["model" if i in models else reward_kind(fn, n)
                      for i, (fn, n) in enumerate(zip(self.fns, self.names))]
        weights = [1.0] * len(self.fns) if not weights else [float(w) for w in weights]
        if len(weights) != len(self.fns):
            raise ValueError(f"reward_weights has {len(weights)} values for {len(self.fns)} reward functions "
                             f"({', '.join(self.names)})")
        self.weights = weights
        # TRL: each environment class with get_reward() is one more reward source, named after the class, weight 1;
        # its values come from the rollouts (read in the tool executor before the episode ends, trainer/tools/).
        self.env_names = []
        for base in env_names or []:  # in self.names too (metrics keys, eval), after the functions'
            name, k = base, 2
            while name in self.names:
                name, k = f"{base}#{k}", k + 1
            self.env_names.append(name)
            self.names.append(name)
        # TRL's `environments` keyword (copies of the episodes' instances, environments.py): passed when the run has
        # an environment_factory to the TRL-style functions that name it or take **kwargs; naming it without one
        # cannot be honoured (TRL would not pass it either: the call would fail), so it is refused here, early.
        takers = {n: takes_environments(fn) for n, fn, k in zip(self.names, self.fns, self.kinds) if k == "trl"}
        named = [n for n, how in takers.items() if how == "named"]
        if named and not environments:
            raise ValueError(f"reward function {named[0]!r} takes `environments` (TRL's environment instances), but "
                             f"no environment_factory is configured: set one, or drop the argument")
        self.wants_environments = environments and any(takers.values())
        if not self.fns and not self.env_names:
            raise ValueError("no reward source: reward_fns is empty and no environment_factory class has get_reward()")
        self.timeout, self.conversational = timeout, conversational
        self.caller = make_caller([self.specs[i] for i in fn_idx], [loaded[i] for i in fn_idx],
                                  timeout if fn_idx else 0)  # no functions: no worker
        self.state = TrainerState()  # trainer_state of the next groups (set_state)
        # log_metric values of generated rounds not yet carried by a batch (TRL's _pending_metrics; rollout.py)
        self.pending_metrics: dict[str, list[float]] = {}

    @classmethod
    def from_config(cls, cfg, reward_models: bool = True) -> RewardScorer:
        """reward_models=False: the reward functions only (launch.sh check: no ref server to score with)."""
        conversational = {"messages": True, "auto": None, "trl": None}.get(cfg.prompt_format, False)
        conversational = True if getattr(cfg, "agent", None) else conversational  # an agent's rollout: messages
        specs, weights = cfg.reward_specs(), cfg.reward_weights
        if not reward_models:
            keep = [i for i in range(len(specs)) if i not in {m["index"] for m in cfg.reward_models()}]
            specs, weights = [specs[i] for i in keep], [weights[i] for i in keep] if weights else weights
        # an agent's own float: one more reward named after its function, weight 1, as an environment's (issue 61)
        return cls(specs, weights, cfg.reward_timeout, conversational,
                   cfg.env_reward_names() + cfg.agent_reward_names(),
                   reward_model_fns(cfg) if reward_models else None, bool(cfg.environment_factory))

    def set_state(self, global_step: int, max_steps: int = 0, epoch: float = 0.0) -> None:
        """What TRL-style rewards get as trainer_state (trainer/rewards/state.py) for the groups scored next."""
        self.state = TrainerState(int(global_step), int(max_steps), float(epoch))

    def take_metrics(self) -> dict[str, list[float]]:
        """The pending log_metric values, now carried by a batch (emptied)."""
        out, self.pending_metrics = self.pending_metrics, {}
        return out

    def close(self) -> None:
        self.caller.close()

    def _fail(self, idx: int, example, completion, why: str):
        # The first line is the cause (the process's last line and launch.sh's diagnosis): the function, what it
        # did, the row and its columns. The row's text, the completion and a traceback follow, never as the cause.
        first, _, rest = why.partition("\n")
        row = "?" if example.index is None else example.index
        cols = ", ".join(["prompt", *example.columns])
        kind = "reward model" if self.kinds[idx] == "model" else "reward function"
        raise RuntimeError(f"{kind} {self.names[idx]!r} failed on row {row} (columns: {cols}): {first}\n"
                           f"  prompt: {_short(example.prompt)}\n  ground_truth: {_short(example.ground_truth)}\n"
                           f"  completion: {_short(completion)}" + (f"\n{rest.rstrip()}" if rest.strip() else ""))

    def _trl_kwargs(self, example, completions: list[str], completion_ids: list | None,
                    messages: list[list[dict]] | None = None, environments: list[dict] | None = None,
                    prompts: list | None = None) -> dict:
        n = len(completions)
        # conversational None (prompt_format auto): as TRL, message completions for a message-list prompt
        conv = isinstance(example.prompt, list) if self.conversational is None else self.conversational
        if conv and messages is not None:  # a tool run: every turn, as TRL gives them (assistant, tool, ...)
            comps = messages
        else:
            comps = [[{"role": "assistant", "content": c}] for c in completions] if conv else completions
        kwargs = {col: [v] * n for col, v in example.columns.items()}
        kwargs.update(prompts=list(prompts) if prompts is not None else [example.prompt] * n, completions=comps)
        if completion_ids is not None:
            kwargs["completion_ids"] = completion_ids
        if self.wants_environments:  # copies on the wire, restored where the function is called (environments.py)
            if environments is None or len(environments) != n:
                raise RuntimeError("a reward takes `environments` but no copies of the episodes' environment "
                                   "instances came with these completions (a producer that does not take them)")
            kwargs["environments"] = environments
        return kwargs  # the reward worker passes each function the names it takes (timeout.accepted_kwargs)

    def _round_kwargs(self, groups: list[Group]) -> dict:
        """The keyword lists of one call over the round: each group's, concatenated (a column a row lacks: None)."""
        parts = [self._trl_kwargs(g.example, g.completions, g.completion_ids, g.messages, g.environments, g.prompts)
                 for g in groups]
        keys = list(dict.fromkeys(k for part in parts for k in part))
        return {k: [v for g, part in zip(groups, parts) for v in part.get(k, [None] * len(g.completions))]
                for k in keys}

    def score_group(self, example, completions: list[str], completion_ids: list[list[int]] | None = None,
                    messages: list[list[dict]] | None = None, env_rewards: list[dict | None] | None = None,
                    environments: list[dict] | None = None, prompts: list | None = None) -> GroupScore:
        """score_round of one group (eval, launch.sh check); its `metrics` are what the rewards logged."""
        out = self.score_round([Group(example, completions, completion_ids, messages, env_rewards, environments,
                                      prompts)])
        out.groups[0].metrics = out.metrics
        return out.groups[0]

    def score_round(self, groups: list[Group]) -> RoundScore:
        """Rewards for the groups of one generation round, each reward function called once for all of them, as TRL
        calls them once per generation batch (decoded text, special tokens stripped; see Group). Functions of our
        signature are called per completion, each under reward_timeout; a TRL-style call (and the gathered async
        ones) covers every group of the round, under reward_timeout x groups: reward_timeout stays one function's
        time on one group."""
        sizes = [len(g.completions) for g in groups]
        starts = [sum(sizes[:g]) for g in range(len(groups))]
        n = sum(sizes)
        where = [(g, k) for g, size in enumerate(sizes) for k in range(size)]  # flat index -> (group, completion)
        scores = [GroupScore(rewards=[0.0] * size, components={}) for size in sizes]
        metrics: dict[str, list[float]] = {}
        kwargs = self._round_kwargs(groups)
        gathered = self._gather(groups, where, kwargs)
        for i, (name, kind) in enumerate(zip(self.names, self.kinds)):
            try:
                if kind == "ours":
                    values, late = self.caller.call_simple(
                        self.call_idx[i], [(c, g.example.ground_truth) for g in groups for c in g.completions])
                elif kind == "model":  # scored in the ref server, under reward_model_timeout per group
                    values, late = self._call_model(i, kwargs["prompts"], kwargs["completions"], len(groups)), []
                else:
                    answer = gathered[i] if i in gathered else self.caller.call_trl(
                        self.call_idx[i], kwargs, self.state.to_dict(), len(groups))
                    late = [] if answer is not None else list(range(n))
                    values, logged = answer if answer is not None else ([None] * n, {})
                    self._keep_logged(i, groups, where, scores, metrics, logged)
            except RewardCallError as e:
                self._fail_at(i, groups, where, e.item if kind == "ours" else None, str(e))
            if len(values) != n:
                self._fail_at(i, groups, where, None, f"returned {len(values)} values for {n} completions")
            for k, v in enumerate(values):
                if v is not None and not math.isfinite(v):  # a NaN would poison the group's advantages
                    self._fail_at(i, groups, where, k, f"returned {v!r}")
            if late:
                self._timed_out(name, kind, groups, where, scores, late)
            for g, sc in enumerate(scores):
                sc.components[name] = vals = values[starts[g]:starts[g] + sizes[g]]
                sc.rewards = [r + self.weights[i] * v if v is not None else r for r, v in zip(sc.rewards, vals)]
        for g, sc in zip(groups, scores):
            for name in self.env_names:  # weight 1; None for a rollout of another environment or with no reading
                key = name.split("#")[0]  # the class name the tool loop reports
                values = [(d or {}).get(key) for d in g.env_rewards] if g.env_rewards is not None \
                    else [None] * len(sc.rewards)
                sc.components[name] = values
                sc.rewards = [r + v if v is not None else r for r, v in zip(sc.rewards, values)]
            for k in range(len(sc.rewards)):  # TRL: every reward said None -> NaN, out of the baseline, advantage 0
                if all(vals[k] is None for vals in sc.components.values()):
                    sc.rewards[k] = math.nan
        return RoundScore(scores, metrics)

    def _fail_at(self, i: int, groups: list[Group], where: list, k: int | None, why: str):
        """_fail naming completion k of the round (its group's row), or the whole call (k None: the first row)."""
        if k is not None:
            g, j = where[k]
            self._fail(i, groups[g].example, groups[g].completions[j], why)
        first = groups[0].completions[0] if groups[0].completions else ""
        self._fail(i, groups[0].example, f"(the call's {len(where)} completions of {len(groups)} group(s); first) "
                                         f"{first!r}", why)

    def _timed_out(self, name: str, kind: str, groups: list[Group], where: list, scores: list, late: list[int]):
        """Count a timed-out call in each group it covered (ours: each completion's own call) and say so once."""
        for k in late if kind == "ours" else sorted({where[k][0] for k in late}):
            g, j = where[k] if kind == "ours" else (k, None)
            scores[g].timeouts += 1
            scores[g].timed_out.setdefault(name, []).extend([j] if j is not None else range(len(groups[g].completions)))
        g, j = where[late[0]]
        limit = self.timeout * (1 if kind == "ours" else len(groups))
        log.warning("reward function %r timed out (%.1f s) on prompt %s, completion %s%s: counted as not applicable",
                    name, limit, _short(groups[g].example.prompt, 120), _short(groups[g].completions[j], 120),
                    "" if kind == "ours" else f" (one call for {len(groups)} group(s))")

    def _gather(self, groups: list[Group], where: list, kwargs: dict) -> dict[int, tuple | None]:
        """TRL gathers the `async def` rewards on one event loop: {function index: (values, logged) or None (the
        gather timed out: every one of them counts as timed out)}."""
        idxs = [i for i, (fn, kind) in enumerate(zip(self.fns, self.kinds))
                if kind == "trl" and inspect.iscoroutinefunction(fn)]
        if not idxs:
            return {}
        try:
            answers = self.caller.gather_trl([self.call_idx[i] for i in idxs], kwargs, self.state.to_dict(),
                                             len(groups))
        except RewardCallError as e:  # fn_index: the reward worker's index
            idx = next(i for i in idxs if self.call_idx[i] == e.fn_index)
            self._fail_at(idx, groups, where, None, str(e))
        return dict(zip(idxs, answers if answers is not None else [None] * len(idxs)))

    def _call_model(self, i: int, prompts: list, completions: list, groups: int) -> list[float]:
        from common.wire.client import RefServerError

        try:
            return self.fns[i](prompts, completions, groups=groups)
        except RefServerError as e:
            raise RewardCallError(i, 0, str(e)) from e

    def _keep_logged(self, i: int, groups: list[Group], where: list, scores: list, metrics: dict,
                     logged: dict) -> None:
        """What a TRL-style reward logged with log_extra (a column: one value per completion of the call, split
        into its groups) / log_metric (the round's: name -> values)."""
        for column, values in (logged.get("extra") or {}).items():
            if len(values) != len(where):
                self._fail_at(i, groups, where, None, f"log_extra({column!r}) got {len(values)} values for "
                                                      f"{len(where)} completions")
            for k, v in enumerate(values):
                g, _ = where[k]
                scores[g].logged.setdefault(column, []).append(v)
        for name, values in (logged.get("metrics") or {}).items():
            metrics.setdefault(name, []).extend(values)
