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
from trainer.rewards.registry import load_reward_fns, reward_name
from trainer.rewards.state import TrainerState
from trainer.rewards.timeout import RewardCallError, make_caller

log = logging.getLogger("trainer")

OURS_SIG = "fn(completion: str, ground_truth: str) -> float"
TRL_SIG = "fn(prompts, completions, **columns) -> list[float | None]"


def reward_kind(fn, name: str) -> str:
    """'ours' or 'trl' from the signature; anything else is an error naming both signatures."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ValueError(f"reward function {name!r}: cannot read its signature ({e})") from e
    params = sig.parameters
    if "completions" in params:
        return "trl"
    try:
        sig.bind("completion", "ground truth")
        return "ours"
    except TypeError:
        pass
    if all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in params.values()) and params:
        return "trl"  # keyword-only / **kwargs: TRL calls by keyword
    raise ValueError(f"reward function {name!r} has signature {sig}, which fits neither {OURS_SIG} (ours) "
                     f"nor {TRL_SIG} (TRL-style)")


@dataclass
class GroupScore:
    rewards: list[float]  # weighted sum per completion; NaN where every reward said None (TRL: unscorable)
    components: dict[str, list[float | None]]  # unweighted value per function and completion
    timeouts: int = 0  # timed-out calls in this group
    timed_out: dict[str, list[int]] = field(default_factory=dict)
    logged: dict[str, list] = field(default_factory=dict)  # log_extra: column -> one value per completion
    metrics: dict[str, list[float]] = field(default_factory=dict)  # log_metric: name -> values logged


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

    @classmethod
    def from_config(cls, cfg, reward_models: bool = True) -> RewardScorer:
        """reward_models=False: the reward functions only (launch.sh check: no ref server to score with)."""
        conversational = {"messages": True, "auto": None, "trl": None}.get(cfg.prompt_format, False)
        specs, weights = cfg.reward_specs(), cfg.reward_weights
        if not reward_models:
            keep = [i for i in range(len(specs)) if i not in {m["index"] for m in cfg.reward_models()}]
            specs, weights = [specs[i] for i in keep], [weights[i] for i in keep] if weights else weights
        return cls(specs, weights, cfg.reward_timeout, conversational, cfg.env_reward_names(),
                   reward_model_fns(cfg) if reward_models else None, bool(cfg.environment_factory))

    def set_state(self, global_step: int, max_steps: int = 0, epoch: float = 0.0) -> None:
        """What TRL-style rewards get as trainer_state (trainer/rewards/state.py) for the groups scored next."""
        self.state = TrainerState(int(global_step), int(max_steps), float(epoch))

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

    def score_group(self, example, completions: list[str], completion_ids: list[list[int]] | None = None,
                    messages: list[list[dict]] | None = None, env_rewards: list[dict | None] | None = None,
                    environments: list[dict] | None = None, prompts: list | None = None) -> GroupScore:
        """Rewards for the completions of one prompt (decoded text, special tokens stripped; TRL-style
        functions also get `completion_ids`, the sampled token ids, when given). `messages`: in a tool run, each
        completion as its list of messages (assistant turns with their tool_calls, tool turns): what TRL-style
        functions receive as `completions` for a conversational prompt; the text is then the whole completion's
        (tool turns included), for functions of our signature and plain-text prompts. `env_rewards`: per completion,
        {environment class name: its get_reward()} from the tool loop (None: no environment reward read).
        `environments`: per completion, the copy of its episode's instance (when `wants_environments`).
        `prompts`: per completion, the prompt as its rollout started (an environment's reset() text appended), what
        TRL-style functions get as `prompts` (else the example's prompt)."""
        n = len(completions)
        comps: dict[str, list[float | None]] = {}
        score = GroupScore(rewards=[0.0] * n, components=comps)
        kwargs = self._trl_kwargs(example, completions, completion_ids, messages, environments, prompts)
        gathered = self._gather(example, completions, kwargs)
        for i, (name, kind) in enumerate(zip(self.names, self.kinds)):
            try:
                if kind == "ours":
                    values, late = self.caller.call_simple(self.call_idx[i],
                                                           [(c, example.ground_truth) for c in completions])
                elif kind == "model":  # scored in the ref server, under reward_model_timeout
                    values, late = self._call_model(i, kwargs["prompts"], kwargs["completions"]), []
                else:
                    answer = gathered[i] if i in gathered else self.caller.call_trl(self.call_idx[i], kwargs,
                                                                                    self.state.to_dict())
                    late = [] if answer is not None else list(range(n))
                    values, logged = answer if answer is not None else ([None] * n, {})
                    self._keep_logged(score, i, example, completions, logged)
            except RewardCallError as e:
                bad = completions[e.item] if kind == "ours" else f"(the group of {n}; first) {completions[0]!r}"
                self._fail(i, example, bad, str(e))
            if len(values) != n:
                self._fail(i, example, completions[0], f"returned {len(values)} values for {n} completions")
            for k, v in enumerate(values):
                if v is not None and not math.isfinite(v):  # a NaN would poison the group's advantages
                    self._fail(i, example, completions[k], f"returned {v!r}")
            if late:
                calls = len(late) if kind == "ours" else 1
                score.timeouts += calls
                score.timed_out[name] = late
                log.warning("reward function %r timed out (%.1f s) on prompt %s, completion %s: counted as not "
                            "applicable", name, self.timeout, _short(example.prompt, 120),
                            _short(completions[late[0]], 120))
            comps[name] = values
            for k, v in enumerate(values):
                if v is not None:
                    score.rewards[k] += self.weights[i] * v
        for name in self.env_names:  # weight 1; None for a rollout of another environment or with no reading
            key = name.split("#")[0]  # the class name the tool loop reports
            values = [(d or {}).get(key) for d in env_rewards] if env_rewards is not None else [None] * n
            comps[name] = values
            score.rewards = [r + v if v is not None else r for r, v in zip(score.rewards, values)]
        for k in range(n):  # TRL: every reward said None -> NaN, out of the group's baseline, advantage 0
            if all(vals[k] is None for vals in comps.values()):
                score.rewards[k] = math.nan
        return score

    def _gather(self, example, completions: list[str], kwargs: dict) -> dict[int, tuple | None]:
        """TRL gathers the `async def` rewards on one event loop: {function index: (values, logged) or None (the
        gather timed out: every one of them counts as timed out)}."""
        idxs = [i for i, (fn, kind) in enumerate(zip(self.fns, self.kinds))
                if kind == "trl" and inspect.iscoroutinefunction(fn)]
        if not idxs:
            return {}
        try:
            answers = self.caller.gather_trl([self.call_idx[i] for i in idxs], kwargs, self.state.to_dict())
        except RewardCallError as e:  # fn_index: the reward worker's index
            idx = next(i for i in idxs if self.call_idx[i] == e.fn_index)
            self._fail(idx, example, f"(the group of {len(completions)}; first) {completions[0]!r}", str(e))
        return dict(zip(idxs, answers if answers is not None else [None] * len(idxs)))

    def _call_model(self, i: int, prompts: list, completions: list) -> list[float]:
        from common.wire.client import RefServerError

        try:
            return self.fns[i](prompts, completions)
        except RefServerError as e:
            raise RewardCallError(i, 0, str(e)) from e

    def _keep_logged(self, score: GroupScore, i: int, example, completions: list[str], logged: dict) -> None:
        """What a TRL-style reward logged with log_extra (a column: one value per completion) / log_metric."""
        for column, values in (logged.get("extra") or {}).items():
            if len(values) != len(completions):
                self._fail(i, example, completions[0], f"log_extra({column!r}) got {len(values)} values for "
                                                       f"{len(completions)} completions")
            score.logged[column] = values
        for name, values in (logged.get("metrics") or {}).items():
            score.metrics.setdefault(name, []).extend(values)


def component_means(components: dict[str, list]) -> dict[str, float]:
    """Per-function mean over the completions where it applied ("reward/<name>" metrics)."""
    out = {}
    for name, vals in components.items():
        vs = [v for v in vals if v is not None]
        if vs:
            out[f"reward/{name}"] = sum(vs) / len(vs)
    return out
