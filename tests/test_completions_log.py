"""What the run shows of what it trains on (issue 31, item 5): completions.jsonl (TRL's log_completions), in-training
eval scored with the run's own reward functions, and report_to (none / tensorboard / wandb, W&B offline here).
The end-to-end check (a real run writing completions.jsonl and eval_reward/<name>) is in tests/test_user_code.py."""
from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import find_free_port

from common.config import GRPOConfig
from common.modeling import load_model, load_tokenizer, resolve_model_path
from common.wire.protocol import ScoredBatch
from trainer.data.loading import load_examples
from trainer.rewards.scoring import RewardScorer
from trainer.run.completions import COLUMNS, CompletionLog, completion_rows, table_text
from trainer.run.metrics import MetricsLogger


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model_path("tiny"))


def batch(tok) -> ScoredBatch:
    prompt = tok("Q: 2+2?")["input_ids"]
    comps = [tok("4")["input_ids"], tok("five")["input_ids"] + [tok.eos_token_id]]
    L = len(prompt) + max(len(c) for c in comps)
    ids = torch.zeros(2, L, dtype=torch.long)
    for i, c in enumerate(comps):
        ids[i, :len(prompt) + len(c)] = torch.tensor(prompt + c)
    return ScoredBatch(ids, torch.tensor([len(prompt)] * 2), torch.tensor([len(c) for c in comps]),
                       torch.tensor([0.7, -0.7]), rewards=torch.tensor([1.5, 0.0]), policy_version=3,
                       producer_id="worker0", extra={"components": {"correct": [1.0, 0.0], "judge": [0.5, None]}})


def test_rows_say_what_was_trained(tok):
    rows = completion_rows([batch(tok)], tok, step=5)
    assert [list(r) for r in rows] == [COLUMNS, COLUMNS]
    assert rows[0]["prompt"] == "Q: 2+2?" and rows[0]["completion"] == "4"
    assert rows[1]["completion"] == "five"  # special tokens stripped, as the rewards saw it
    assert rows[0]["rewards"] == {"correct": 1.0, "judge": 0.5}
    assert rows[1]["rewards"] == {"correct": 0.0, "judge": None}
    assert rows[0]["reward"] == 1.5 and rows[0]["advantage"] == pytest.approx(0.7)
    assert rows[1]["policy_version"] == 3 and rows[1]["producer"] == "worker0"
    text = table_text(rows)
    assert "worker0" in text and "five" in text and len(text.splitlines()) == 4


def test_completion_log_appends_prints_and_keeps_resumed_steps(tok, tmp_path, caplog):
    rows = completion_rows([batch(tok)], tok, step=1)
    log = CompletionLog(tmp_path, None, to_print=1)
    with caplog.at_level("INFO", logger="trainer"):
        log.log(1, rows)
        log.log(2, [dict(r, step=2) for r in rows])
    got = [json.loads(x) for x in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == [1, 1, 2, 2]
    assert "(1 of 2;" in caplog.text  # num_completions_to_print rows shown, all written
    CompletionLog(tmp_path, resume_step=1, to_print=0)  # a resume at step 1: step 2 re-runs, its rows go
    assert [json.loads(x)["step"] for x in (tmp_path / "completions.jsonl").read_text().splitlines()] == [1, 1]


@pytest.mark.parametrize("report_to, tb, wandb", [("none", False, False), ("tensorboard", True, False),
                                                  ("wandb", False, True), ("all", True, True)])
def test_report_to_picks_the_sinks(tmp_path, monkeypatch, report_to, tb, wandb):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = GRPOConfig(report_to=report_to, run_name="r1").validate()
    m = MetricsLogger(tmp_path, reporters=cfg.reporters(), run_config={"lr": 1}, wandb_project="p", run_name="r1")
    m.log(1, {"loss": 0.5})
    m.table(1, "completions", ["a"], [["x"]])
    m.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 0.5}  # always
    assert (tmp_path / "tensorboard").is_dir() == tb
    runs = list((tmp_path / "wandb").glob("offline-run-*")) if (tmp_path / "wandb").is_dir() else []
    assert bool(runs) == wandb


def test_report_to_is_validated_and_trl_names_are_accepted():
    from common.settings.knobs import from_dict
    cfg = from_dict(GRPOConfig, {"report_to": ["wandb"], "log_completions": True, "num_completions_to_print": 3})
    assert cfg.reporters() == {"wandb"} and cfg.log_completions and cfg.num_completions_to_print == 3
    with pytest.raises(ValueError, match="report_to"):
        GRPOConfig(report_to="comet").validate()


@pytest.fixture
def one_rank():
    mp = pytest.MonkeyPatch()
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(find_free_port())).items():
        mp.setenv(k, v)
    torch.distributed.init_process_group("gloo")
    yield
    torch.distributed.destroy_process_group()
    mp.undo()


def test_eval_scores_with_the_runs_reward_functions(one_rank, tok, monkeypatch):
    """run_eval with the run's scorer: eval_reward/<name> per function and their weighted mean; accuracy only
    where a correctness reward is configured, equal to the built-in GSM8K-style eval's when it is `correct`."""
    from trainer.loop import run_eval
    monkeypatch.syspath_prepend(os.path.dirname(__file__))  # toy_rewards, trl_rewards: here and
    monkeypatch.setenv("GRPO_USER_DIR", os.path.dirname(__file__))  # in the reward process
    model = load_model(resolve_model_path("tiny"), device="cpu", dtype="float32")
    examples = load_examples("arith", "test", limit=6)
    cfg = GRPOConfig(model=resolve_model_path("tiny"), data="arith", system_prompt="", eval_max_new_tokens=8,
                     reward_fns=["correct", "toy_rewards:digit_fraction", "trl_rewards:digit_reward"],
                     reward_weights=[1.0, 2.0, 0.0]).validate()
    scorer = RewardScorer(cfg.reward_fns, cfg.reward_weights, timeout=5)  # in the reward process, as runs do
    res = run_eval(model, tok, cfg, examples, scorer=scorer)
    plain = run_eval(model, tok, cfg, examples)  # the built-ins, as before
    assert set(res) == {"eval_n", "eval_reward_mean", "eval_reward/correct", "eval_reward/digit_fraction",
                        "eval_reward/digit_reward", "eval_accuracy"}  # TRL-style too (completion_ids as JSON)
    assert res["eval_n"] == plain["eval_n"] == 6 and res["eval_accuracy"] == plain["eval_accuracy"]
    assert res["eval_reward_mean"] == pytest.approx(res["eval_reward/correct"] + 2 * res["eval_reward/digit_fraction"])
    cfg2 = GRPOConfig(model=cfg.model, data="arith", system_prompt="", eval_max_new_tokens=8,
                      reward_fns=["toy_rewards:digit_fraction"]).validate()
    res2 = run_eval(model, tok, cfg2, examples, scorer=RewardScorer(cfg2.reward_fns, timeout=0))
    assert "eval_accuracy" not in res2 and "eval_format" not in res2  # no correctness reward: no accuracy
    scorer.close()
