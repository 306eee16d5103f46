"""TRL 1.16's GRPOTrainer on the demo's arith prompts: run by bench/vs_trl.py with the Python of TRL's own virtual
environment (never by the project's; the project does not depend on TRL).

    VENV/bin/python bench/vs_trl_lib/trl_grpo.py --model SFT_DIR --data prompts.jsonl --out DIR --steps N --seed S

prompts.jsonl: {"prompt": text already templated as the project's trainer templates it, "ground_truth": "11"}; TRL
takes a text prompt as it is. Rewards: the project's own `correct` and `format` (trainer/rewards/builtin.py, pure
Python, imported from the checkout by path), weights 1 each as configs/demo.json's reward_fns.
Writes OUT/log_history.json (TRL's per-step logs: reward, frac_reward_zero_std, ...), OUT/final (the model and
tokenizer, saved once at the end for the bench's evaluation only), OUT/config.json (the GRPOConfig used).
`--print-config` prints the GRPOConfig keyword arguments as JSON and exits without importing TRL.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def config_kwargs(out: Path, steps: int, seed: int) -> dict:
    """The issue's settings (issue 45); everything else is TRL 1.16's default."""
    return dict(
        output_dir=str(out / "trainer"), max_steps=steps, seed=seed,
        per_device_train_batch_size=64, num_generations=8, max_completion_length=32, temperature=1.0,
        beta=0.04, learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0, loss_type="grpo",
        scale_rewards="group", epsilon=0.2, adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0,
        bf16=False, fp16=False, use_cpu=True, model_init_kwargs={"dtype": "float32"},
        eval_strategy="no", save_strategy="no", logging_steps=1, report_to="none", disable_tqdm=True,
        dataloader_num_workers=0,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="start (and reference) model directory: the SFT checkpoint")
    p.add_argument("--data", required=True, help="prompts JSONL (prompt, ground_truth)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--print-config", action="store_true", help="print the GRPOConfig kwargs as JSON and exit")
    a = p.parse_args()
    out = Path(a.out)
    kwargs = config_kwargs(out, a.steps, a.seed)
    if a.print_config:
        print(json.dumps(kwargs, sort_keys=True))
        return
    import torch
    torch.set_num_threads(a.threads)
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(REPO))  # the project's reward functions: pure Python, no project dependency
    from trainer.rewards.builtin import reward_correct, reward_format

    def correct(completions, ground_truth, **_):
        return [reward_correct(c, g) for c, g in zip(completions, ground_truth)]

    def format(completions, **_):  # noqa: A001 (TRL logs a reward by its function's name: `format` as ours)
        return [reward_format(c) for c in completions]

    rows = [json.loads(line) for line in Path(a.data).read_text().splitlines() if line.strip()]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(kwargs, indent=1, sort_keys=True) + "\n")
    tok = AutoTokenizer.from_pretrained(a.model)
    trainer = GRPOTrainer(model=a.model, reward_funcs=[correct, format], args=GRPOConfig(**kwargs),
                          train_dataset=Dataset.from_list(rows), processing_class=tok)
    t0 = time.time()
    trainer.train()
    print(f"[trl] {a.steps} steps in {time.time() - t0:.0f} s", flush=True)
    (out / "log_history.json").write_text(json.dumps(trainer.state.log_history) + "\n")
    trainer.save_model(str(out / "final"))
    tok.save_pretrained(str(out / "final"))


if __name__ == "__main__":
    main()
