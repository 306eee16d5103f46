"""ToolBox: the tools of one run, as the rollout loop sees them (trainer/tools/multi_turn.py calls it).

    box = ToolBox.from_config(cfg, tokenizer)        # None when the config has no tools
    prompt = tokenizer.apply_chat_template(messages, tools=box.schemas, **box.template_kwargs, ...)
    ids = box.start_episodes(len(rollouts))          # one environment instance per rollout, reset() called
    calls, bad = box.parse(turn_text)                # bad: ToolResult(status="malformed") to show the model
    results = box.run([(ids[i], calls_i), ...])      # one list of ToolResult per job, in order; never raises
    box.end_episodes(ids); box.close()

The calculator runs here; every other tool in the executor process (trainer/tools/executor.py: timeout, resource
limits, scratch folder; best-effort isolation, not a security boundary).
"""
from __future__ import annotations

import itertools
import logging
import time

from common.settings.tool_specs import environment_specs
from common.user_code import load_object
from trainer.tools.executor import ToolExecutor
from trainer.tools.parsing import parse_qwen, parse_with_template
from trainer.tools.schemas import ToolDef, load_tools
from trainer.tools.stats import ToolStats
from trainer.tools.templates import ToolTemplate, tool_template
from trainer.tools.types import ToolCall, ToolResult, one_line, truncate

log = logging.getLogger("trainer")


class ToolBox:
    """The tools of one process's rollouts (see the module docstring). One ToolBox per rollout process; its
    executor child starts at the first call that needs it. limits: memory_mb / file_mb (trainer/tools/executor.py)."""

    def __init__(self, defs: list[ToolDef], environment_factory: str | dict | None = None, tokenizer=None,
                 timeout: float = 10.0, output_chars: int = 1000, model: str = "the model",
                 chat_template_kwargs: dict | None = None, **limits):
        self.all_defs = list(defs)
        self.defs = {d.name: d for d in defs}  # every name (two environments may share one: the first's here)
        self.schemas: list[dict] = [d.schema for d in self.defs.values()]
        self.tokenizer = tokenizer
        # TRL: with tools, the response template and the training chat template (trainer/tools/templates.py);
        # refused in one line where TRL refuses
        self.template: ToolTemplate | None = (tool_template(tokenizer, model, chat_template_kwargs)
                                              if tokenizer is not None and defs else None)
        self.family = self.template.family if self.template is not None else None
        # every render of the run: the prompts (trainer/rollout.py), the tool suffixes (trainer/tools/multi_turn.py)
        self.template_kwargs = (self.template.render_kwargs if self.template is not None
                                else dict(chat_template_kwargs or {}))
        self.output_chars = int(output_chars)
        self.envs = environment_specs(environment_factory)  # {name: class spec}; {"": spec} for one class
        self.has_env = bool(self.envs)
        classes = {name: load_object(spec) for name, spec in self.envs.items()}
        # TRL: a class with get_reward() owns a reward named after it (RewardScorer's env_names)
        self.env_rewards = {name: c.__name__ if callable(getattr(c, "get_reward", None)) else None
                            for name, c in classes.items()}
        self.env_reward = next(iter(self.env_rewards.values()), None) if len(self.envs) == 1 else None
        functions = {d.name: d.spec for d in defs if d.where == "executor"}
        env_tools = {name: [d.name for d in defs if d.where == "env" and d.env == name] for name in self.envs}
        self.executor = (ToolExecutor(functions, self.envs, env_tools, timeout, output_chars, **limits)
                         if functions or self.envs else None)  # a reset-only environment still needs it
        self.episode_env: dict[int, str] = {}  # live episode -> its environment's name
        self._ids = itertools.count()
        self.episodes: dict[int, str | None] = {}  # live episode -> why its reset() failed (None: it did not)
        # What each episode's reset() returned: TRL appends it to prompt[-1] (whatever its role) when not None.
        self.observations: dict[int, str | None] = {}
        self._stats = ToolStats()
        self._kills_at_reset = 0

    @classmethod
    def from_config(cls, cfg, tokenizer=None) -> ToolBox | None:
        """The ToolBox of cfg.tools / cfg.environment_factory (None when it has neither). Loads every tool and
        builds its schema here, so a bad tool fails before any rollout, in one line (ValueError)."""
        tools = [t for t in (cfg.tools or []) if str(t).strip()]
        if not tools and not cfg.environment_factory:
            return None
        defs = load_tools(tools, cfg.environment_factory)
        return cls(defs, cfg.environment_factory, tokenizer, cfg.tool_timeout, cfg.tool_output_chars, cfg.model,
                   cfg.chat_template_kwargs)

    @property
    def names(self) -> list[str]:
        return list(self.defs)

    def env_of(self, row: dict) -> str:
        """The environment a dataset row's rollouts run in: the one class, or (a dict environment_factory) the one
        its `environment` column names, as TRL routes them. ValueError, one line, for a row that names none."""
        if list(self.envs) in ([], [""]):
            return ""
        name = row.get("environment")
        if name not in self.envs:
            raise ValueError(f"environment_factory has environments {sorted(self.envs)}: each row's `environment` "
                             f"column must name one, got {name!r}")
        return name

    def _defs_for(self, env: str) -> dict[str, ToolDef]:
        return {d.name: d for d in self.all_defs if d.where != "env" or d.env == env}

    def prompt_tools(self, row: dict) -> list[dict] | None:
        """The JSON schemas a row's prompt lists: the functions and its environment's methods (None: no tools, so
        a template renders no tools section, as TRL passes `tools or None`)."""
        return [d.schema for d in self._defs_for(self.env_of(row)).values()] or None

    # ------------------------------------------------------------------ parsing
    def parse(self, text: str, prefix: str = "") -> tuple[list[ToolCall], list[ToolResult]]:
        """The calls in one assistant turn's decoded text, and a malformed result for each call that could not be
        parsed. prefix: the rendered conversation before the turn (the response template anchors on it). With a
        tokenizer: transformers' parse_response with the response template set at construction (TRL's way);
        without one (unit tests of the tools alone): Qwen2.5's <tool_call> blocks. No tools: nothing to call."""
        if not self.defs:
            return [], []
        if self.tokenizer is not None:
            calls, bad = parse_with_template(self.tokenizer, text, prefix, self.schemas)
        else:
            calls, bad = parse_qwen(text)
        for r in bad:
            self._stats.add(r, known=False)
        return calls, bad

    # ------------------------------------------------------------------ episodes
    def start_episodes(self, n: int, reset_kwargs: list[dict] | None = None) -> list[int]:
        """n new episodes (one per rollout); with environment_factory one instance each, reset(**kwargs) called
        (TRL passes the dataset row: give reset_kwargs, one dict per episode). What reset returned is in
        self.observations[id] (TRL appends it to prompt[-1]). A reset that raises or hangs does not
        stop the run: that episode's calls answer with the reason (status "error")."""
        ids = [next(self._ids) for _ in range(n)]
        rows = reset_kwargs or [{}] * n
        envs = [self.env_of(row) for row in rows]  # (a row that names no environment: refused before any reset)
        for k, ep in enumerate(ids):
            self.episodes[ep], self.observations[ep], self.episode_env[ep] = None, None, envs[k]
            if self.has_env:
                # TRL: in the dict form `environment` is a routing column, not passed to reset()
                row = {c: v for c, v in rows[k].items() if c != "environment"} if envs[k] else rows[k]
                status, content = self.executor.start_episode(ep, row, envs[k])
                if status == "ok":
                    self.observations[ep] = content
                else:
                    self.episodes[ep] = one_line(content or status)
                    log.warning("tools: an environment's reset() failed (episode %d): %s", ep, self.episodes[ep])
        return ids

    def episode_rewards(self, ids: list[int]) -> list[dict | None]:
        """TRL: an environment class with a get_reward() method (sync or async) owns a reward (weight 1, named
        after the class): per episode {class name: its value}, read from the instance's state in the executor
        before the episode ends; the value is None for an episode whose instance is gone, whose reset failed or
        whose get_reward raised (said in the log). None per episode when the environment has no get_reward."""
        out: list[dict | None] = []
        for ep in ids:
            name = self.env_rewards.get(self.episode_env.get(ep, ""))
            if not name or self.episodes.get(ep):
                out.append({name: None} if name else None)
                continue
            status, value = self.executor.episode_reward(ep)
            if status != "ok":
                log.warning("tools: get_reward() of episode %d: %s", ep, one_line(str(value or status)))
            out.append({name: value if status == "ok" else None})
        return out

    def episode_snapshots(self, ids: list[int]) -> list[dict]:
        """TRL's `environments` reward keyword: per episode a copy of its instance as the episode left it, on the
        wire (trainer/rewards/environments.py): its state as JSON, or why not ("lost": its reset failed, or the
        instance is gone with a restarted tool process)."""
        from trainer.rewards.environments import lost

        out = []
        for ep in ids:
            env = self.episode_env.get(ep, "")
            if self.episodes.get(ep):
                out.append(lost(self.envs[env], f"its reset() failed: {self.episodes[ep]}"))
                continue
            status, content = self.executor.snapshot(ep, env)
            out.append(content if status == "ok" else lost(self.envs[env], one_line(str(content or status))))
        return out

    def end_episodes(self, ids: list[int]) -> None:
        for ep in ids:
            self.episodes.pop(ep, None)
            self.observations.pop(ep, None)
            self.episode_env.pop(ep, None)
            if self.executor is not None:
                self.executor.end_episode(ep)

    # ------------------------------------------------------------------ running
    def _run_one(self, episode: int, call: ToolCall) -> ToolResult:
        defs = self._defs_for(self.episode_env.get(episode, ""))  # the functions and this rollout's environment's
        d = defs.get(call.name)
        if d is None:
            return ToolResult(call.name, f"Error: unknown tool {call.name!r}; the tools are: "
                                         f"{', '.join(defs)}", "unknown_tool")
        if d.where == "env" and self.episodes.get(episode):
            return ToolResult(call.name, f"Error: this rollout's environment did not start: {self.episodes[episode]}",
                              "error")
        if d.where != "inline":
            return self.executor.call(episode, call.name, call.arguments)
        t0 = time.monotonic()
        try:
            content, status = truncate(str(d.fn(**call.arguments)), self.output_chars), "ok"
        except Exception as e:  # noqa: BLE001 - a tool's exception is its result: the model reads it
            content, status = f"Error: {one_line(f'{type(e).__name__}: {e}')}", "error"
        return ToolResult(call.name, content, status, time.monotonic() - t0)

    def run(self, jobs: list[tuple[int, list[ToolCall]]]) -> list[list[ToolResult]]:
        """[(episode id, that turn's calls)] -> one ToolResult per call, in order. A tool's own failure (raise,
        timeout, crash, unknown name) is its result; this only raises for an episode id it never handed out."""
        out = []
        for episode, calls in jobs:
            if episode not in self.episodes:
                raise KeyError(f"episode {episode} was not started (or has ended): use start_episodes")
            results = []
            for call in calls:
                r = self._run_one(episode, call)
                self._stats.add(r, known=call.name in self._defs_for(self.episode_env.get(episode, "")))
                results.append(r)
            out.append(results)
        return out

    # ------------------------------------------------------------------ counters and the end
    def stats(self) -> dict:
        """Counters since the last reset_stats():
        calls, failed (status not "ok"), timed_out, malformed, unknown_tool, seconds (tool wall time),
        kills (executor processes killed for a timeout or found dead), and per_tool {name: {calls, failed,
        timed_out, seconds}} for the configured tools (malformed and unknown calls count in the totals only)."""
        kills = self.executor.kills if self.executor is not None else 0
        return self._stats.snapshot(kills - self._kills_at_reset)

    def reset_stats(self) -> None:
        self._stats.reset()
        self._kills_at_reset = self.executor.kills if self.executor is not None else 0

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()
