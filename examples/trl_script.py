"""A TRL GRPO script with only the import changed (docs/trl.md): a dataset made in the script, a reward defined in
it, TRL's GRPOConfig names, GRPOTrainer(...).train(), save_model, evaluate.

    ./launch.sh python examples/trl_script.py                  # the checkout's venv, from any folder
    .venv/bin/python examples/trl_script.py --model tiny --max_steps 3 --max_completion_length 8   # CPU, a minute

The training code sits under `if __name__ == "__main__":` (as TRL's multi-process launches need): the ranks and
workers import this file for its reward functions, by their names.
"""
import argparse
import random
import re

from datasets import Dataset

from trainer.api import GRPOConfig, GRPOTrainer  # was: from trl import GRPOConfig, GRPOTrainer


def make_dataset(n: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        rows.append({"prompt": f"What is {a} + {b}? Answer with the number only.", "expected": str(a + b)})
    return Dataset.from_list(rows)


def reward_len(completions, **kwargs):
    """TRL's quickstart reward: completions near 20 characters score best."""
    return [-abs(20 - len(c if isinstance(c, str) else c[-1]["content"])) / 20 for c in completions]


def reward_correct_sum(completions, expected, **kwargs):
    """1.0 where the last number in the completion is the sum, else 0.0 (TRL's reward signature)."""
    scores = []
    for completion, want in zip(completions, expected):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        numbers = re.findall(r"-?\d+", text)
        scores.append(1.0 if numbers and numbers[-1] == want else 0.0)
    return scores


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--max_completion_length", type=int, default=64)
    parser.add_argument("--output_dir", default="Qwen2.5-0.5B-GRPO-sums")
    cli = parser.parse_args()

    training_args = GRPOConfig(
        output_dir=cli.output_dir,
        learning_rate=1e-6,
        num_generations=8,
        max_completion_length=cli.max_completion_length,
        max_steps=cli.max_steps,
        logging_steps=1,
        save_steps=100,
        temperature=1.0,
        report_to="none",
    )
    trainer = GRPOTrainer(
        model=cli.model,
        reward_funcs=[reward_correct_sum, reward_len],
        args=training_args,
        train_dataset=make_dataset(512, seed=0),
        eval_dataset=make_dataset(16, seed=1),
    )
    result = trainer.train()
    print(f"trained {result.global_step} steps, mean loss {result.training_loss:.4f}")
    print("last log:", trainer.state.log_history[-1])
    trainer.save_model(training_args.output_dir)
    print(trainer.evaluate())
