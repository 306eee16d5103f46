"""TRL's reward sources end to end (issue 39), from a user's folder outside the checkout, PYTHONPATH unset, through
`launch.sh train` on the tiny model (real ref server, 2 DeepSpeed CPU ranks, one HF genonly worker):

- an `environment_factory` class whose (async) get_reward() is the run's only reward (`reward_fns: []`,
  `train_zero_spread: true`): 2 steps train, and the class's name is a key of every completions.jsonl row's
  `rewards`, with the value get_reward() read while the episode lived (a reading after the episode ended is None);
  its rows have no prompt (TRL: reset() supplies it): the prompt the model saw is reset()'s text, and reset() got
  the row without a stand-in `prompt`;
- an `async def` reward and a reward that declares `trainer_state` (TRL's curriculum pattern, logging with
  log_extra / log_metric) both run: their names are in every row's `rewards`, what they logged is in
  completions.jsonl and metrics.jsonl; a reward that declares `environments` (TRL's environment instances) reads
  each completion's own episode (the row's level that reset() kept, the notes get_reward() counts).
"""
from __future__ import annotations

import json

import pytest
from conftest import REPO, find_free_port, run_process_group, user_env

pytestmark = pytest.mark.slow

ENV = '''
class Board:
    """An environment that owns its reward: 0.5 plus 1 per note the model wrote (async, as TRL allows)."""

    def reset(self, **kwargs):
        self.notes = []
        self.level = kwargs.get("level")
        return f" Write notes if you like (reset got {sorted(kwargs)})."

    def note(self, text: str) -> int:
        """Write a note on the board.

        Args:
            text: The note.
        """
        self.notes.append(text)
        return len(self.notes)

    async def get_reward(self) -> float:
        return 0.5 + len(self.notes)
'''

REWARDS = '''
import asyncio


async def judge(prompts, completions, **kwargs):
    await asyncio.sleep(0)  # an LLM judge would await a client here
    return [float(len(c) % 3) for c in completions]


def curriculum(completions, trainer_state, log_extra, log_metric, **kwargs):
    log_extra("seen_step", [trainer_state.global_step] * len(completions))
    log_metric("curriculum/max_steps", trainer_state.max_steps)
    return [min(1.0, trainer_state.global_step / max(trainer_state.max_steps, 1))] * len(completions)


def notes_seen(completions, environments, level, log_extra, **kwargs):
    log_extra("env_level", [e.level for e in environments])
    log_extra("row_level", level)
    return [float(len(e.notes)) for e in environments]
'''


def train(user, name: str, extra: list[str], rows: list[dict], *launcher: str) -> tuple[list[dict], list[dict]]:
    (user / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--model", "tiny", "--data", "train.jsonl", "--num_pre_Q", "4", "--Q_batch_size", "1",
            "--max_new_tokens", "12", "--all_steps", "2", "--save_steps", "100", "--get_wait", "2",
            "--train_zero_spread", "true", "--log_completions", "true", "--lr", "1e-5", *extra]
    cmd = ["bash", str(REPO / "launch.sh"), "train", *launcher, "--run-dir", name, "--workers", "1", "--gpus", "2",
           "--port", str(find_free_port()), "--", *args]
    proc = run_process_group(cmd, cwd=user, env=user_env(), timeout=900)
    run = user / name
    logs = "".join((run / n).read_text() for n in ("trainer.log", "worker0.log") if (run / n).is_file())
    assert proc.returncode == 0, proc.stderr[-3000:] + logs[-4000:]
    assert "training done: 2 steps" in (run / "trainer.log").read_text() and "Traceback" not in logs
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    done = [json.loads(x) for x in (run / "completions.jsonl").read_text().splitlines() if x.strip()]
    assert [m["step"] for m in metrics] == [1, 2] and done
    return metrics, done


def test_environment_and_async_and_trainer_state_rewards(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "my_env.py").write_text(ENV)
    (user / "my_rewards.py").write_text(REWARDS)

    # --skip-checks: the checks' environment path (rows reset, instances copied, one-line refusals) is
    # tests/test_env_rewards.py's test_launch_check_scores_environment_rewards_...; the second run keeps them
    metrics, done = train(user, "env_run", ["--environment_factory", "my_env:Board", "--reward_fns", "[]"],
                          [{"level": i} for i in range(8)], "--skip-checks")  # no prompt: reset() gives it
    for r in done:  # the only reward: the environment's, read before its episode ended (else None)
        assert set(r["rewards"]) == {"Board"} and r["rewards"]["Board"] is not None and r["rewards"]["Board"] >= 0.5
        assert "user\n Write notes if you like (reset got ['level']).<|im_end|>" in r["prompt"]
    assert {r["producer"].rstrip("0123456789") for r in done} <= {"trainer-rank", "worker"}
    assert all(m["reward/Board"] >= 0.5 for m in metrics)

    fns = "my_rewards:judge,my_rewards:curriculum,my_rewards:notes_seen"
    metrics, done = train(user, "fn_run", ["--reward_fns", fns, "--environment_factory", "my_env:Board"],
                          [{"prompt": f"Say a number near {i}.", "answer": str(i), "level": i} for i in range(8)])
    for r in done:
        assert {"judge", "curriculum", "notes_seen", "Board"} == set(r["rewards"]) and r["rewards"]["judge"] is not None
        # `environments`: each completion's own episode, as it ended (the state get_reward() read too)
        assert r["env_level"] == r["row_level"] and r["rewards"]["notes_seen"] == r["rewards"]["Board"] - 0.5
        assert "(reset got ['answer', 'level', 'prompt'])" in r["prompt"]
        assert r["seen_step"] == r["policy_version"]  # trainer_state.global_step: the version that sampled it
        assert r["rewards"]["curriculum"] == pytest.approx(min(1.0, r["policy_version"] / 2))
    assert all(m["curriculum/max_steps"] == 2 for m in metrics)
