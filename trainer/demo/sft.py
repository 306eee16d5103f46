"""Cold-start SFT (R1's stage before RL): teach the format and some skill on worked solutions.

Loss on completion tokens only (prompt tokens are context), eos appended so the model learns
to stop. Stopped early on purpose: GRPO needs an able but imperfect model (groups with mixed
rewards).

    python -m trainer.demo.sft --model DIR --out DIR [--steps 250 --batch-size 64 --lr 1e-3]
"""
from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from common.modeling import load_model, load_tokenizer
from common.settings.argparser import ArgumentParser
from trainer.data.example import Example
from trainer.rollout import encode_prompts

SHARED_HEAD_MIN = 32  # shorter shared prompt heads are not worth a second forward


def sft(model, tokenizer, examples: list[Example], solution: Callable[[str], str], *, steps: int,
        batch_size: int, lr: float, seed: int, system_prompt: str | None = "", progress: bool = True,
        on_step: Callable[[int, float], bool | None] | None = None) -> list[float]:
    """Train in place; returns the loss per step. on_step(step, loss) is called after each step and
    stops the training early by returning True."""
    kept, _ = encode_prompts(tokenizer, examples, system_prompt, max_prompt_length=10 ** 9)
    pairs = []
    for ex, p_ids in kept:
        c_ids = tokenizer(solution(ex.prompt), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        pairs.append((p_ids, c_ids, [True] * len(c_ids)))
    return sft_pairs(model, tokenizer, pairs, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                     progress=progress, on_step=on_step)


def sft_pairs(model, tokenizer, pairs: list[tuple[list[int], list[int], list[bool]]], *, steps: int,
              batch_size: int, lr: float, seed: int, progress: bool = True,
              on_step: Callable[[int, float], bool | None] | None = None) -> list[float]:
    """sft() on token ids: pairs = [(prompt ids, completion ids, completion mask)]; the loss is on the completion
    tokens whose mask is True (False: a tool turn's tokens, which the model reads but never writes)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))  # short warmup
    model.train()
    losses = []
    for step in tqdm(range(1, steps + 1), desc="sft", disable=not progress):
        batch = rng.sample(pairs, min(batch_size, len(pairs)))
        loss = _batch_loss(model, tokenizer.pad_token_id, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if on_step is not None and on_step(step, losses[-1]):
            break
    model.eval()
    return losses


def _batch_loss(model, pad_id: int, batch: list[tuple[list[int], list[int], list[bool]]]) -> torch.Tensor:
    """Mean cross-entropy over the batch's masked-in completion tokens. A prompt head that every row shares (the
    tool demo's system section listing the tools: ~530 of its ~550 prompt tokens) is run once and its keys and
    values repeated over the batch: the same loss and gradients (causal attention: the head never sees what
    follows), at a fraction of the cost."""
    head = len(os.path.commonprefix([p for p, _, _ in batch])) - 1  # keep >= 1 own token per row (the logits)
    head = head if head >= SHARED_HEAD_MIN else 0
    L = max(len(p) + len(c) for p, c, _ in batch) - head
    ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, (p, c, m) in enumerate(batch):
        seq = (p + c)[head:]
        ids[i, :len(seq)] = torch.tensor(seq)
        labels[i, len(p) - head:len(seq)] = torch.where(torch.tensor(m), torch.tensor(c), -100)
        mask[i, :len(seq)] = 1
    if not head:
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss
    cache = model(input_ids=torch.tensor([batch[0][0][:head]]), use_cache=True).past_key_values
    cache.batch_repeat_interleave(len(batch))
    positions = torch.arange(head, head + L).unsqueeze(0).expand(len(batch), -1)
    logits = model(input_ids=ids, attention_mask=torch.cat([torch.ones(len(batch), head, dtype=mask.dtype), mask], 1),
                   past_key_values=cache, position_ids=positions, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                             ignore_index=-100)


def main(argv: list[str] | None = None) -> None:
    from trainer.demo.arith import load_arith, solution_text

    p = ArgumentParser(description="Cold-start SFT on the synthetic arithmetic task (R1 format).")
    p.add_argument("--model", required=True, help="Start model (HF dir or 'tiny').")
    p.add_argument("--out", required=True, help="Where to save the SFT model (HF directory).")
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    tok = load_tokenizer(a.model)
    model = load_model(a.model, device="cpu", dtype="float32", trainable=True)
    t0 = time.time()
    losses = sft(model, tok, load_arith("train"), solution_text, steps=a.steps, batch_size=a.batch_size,
                 lr=a.lr, seed=a.seed)
    model.save_pretrained(Path(a.out))
    tok.save_pretrained(Path(a.out))
    print(f"SFT {a.steps} steps in {time.time() - t0:.0f} s, final loss {losses[-1]:.4f}; saved to {a.out}")


if __name__ == "__main__":
    main()
