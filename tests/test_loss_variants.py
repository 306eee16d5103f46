"""The loss variants TRL names map to (issue 13): scale_rewards="batch" (advantage_mode grpo_batch_std) and
loss_type="dapo" (aggregation dapo), each against a float64 re-derivation."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.rollout import round_advantages


def test_batch_std_advantages_match_float64():
    rng = np.random.default_rng(0)
    groups = [rng.normal(size=4) for _ in range(3)] + [np.full(4, 2.0)]
    got = round_advantages([torch.tensor(g, dtype=torch.float32) for g in groups], "grpo_batch_std")
    std = np.concatenate(groups).std(ddof=1)  # one std over the whole round (torch.std is unbiased too)
    for g, a in zip(groups, got):
        np.testing.assert_allclose(a.numpy(), (g - g.mean()) / (std + 1e-4), rtol=1e-5, atol=1e-6)
    same = round_advantages([torch.tensor(g, dtype=torch.float32) for g in groups], "grpo")
    np.testing.assert_allclose(same[0].numpy(), (groups[0] - groups[0].mean()) / (groups[0].std(ddof=1) + 1e-4),
                               rtol=1e-5)


def _dapo_rank(rank: int, world: int, port: int, shards, out) -> None:
    import torch.distributed as dist

    from trainer.objective.grpo import grpo_loss
    from trainer.objective.update import dapo_scales

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x, adv, mask_np = shards[rank]
    w = torch.ones(x.shape, dtype=torch.float64, requires_grad=True)  # a parameter shared by the ranks
    logps = w * torch.tensor(x)
    mask = torch.tensor(mask_np)
    loss = grpo_loss(logps, None, logps.detach().clone(), torch.tensor(adv), mask, beta=0.0, eps_low=0.2,
                     eps_high=0.2, aggregation="token_mean", max_new_tokens=8) * dapo_scales([mask])[0]
    loss.backward()
    grad, lossv = w.grad.clone(), loss.detach().clone()
    for t in (grad, lossv):  # what DeepSpeed does with gradients: the mean over ranks
        dist.all_reduce(t)
        t /= world
    out.put((rank, float(lossv), grad.numpy()))
    dist.destroy_process_group()


def test_dapo_normalises_by_the_global_token_count():
    """Ranks with very different token counts: each token weighs 1 / (all tokens of all ranks), as TRL's dapo."""
    import torch.multiprocessing as mp
    from conftest import find_free_port

    rng = np.random.default_rng(1)
    shards = []
    for n_tokens in (2, 7):  # rank 0 has few tokens, rank 1 many
        mask = np.zeros((2, 8), bool)
        mask[0, :n_tokens] = True
        mask[1, :max(1, n_tokens // 2)] = True
        shards.append((rng.normal(size=(2, 8)), rng.normal(size=2), mask))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_dapo_rank, args=(r, 2, port, shards, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = sorted((q.get(timeout=120) for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    total = sum(m.sum() for _, _, m in shards)
    # float64 re-derivation: ratio 1, so loss = sum over every token of every rank of -A_i / total and
    # d loss / d w = sum over ranks of -A_i * x * mask / total
    want_loss = sum(-(a[:, None] * m).sum() for _, a, m in shards) / total
    want_grad = sum(-(a[:, None] * m * x) for x, a, m in shards) / total
    for _, loss, grad in res:
        assert loss == pytest.approx(want_loss, rel=1e-9)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-9, atol=1e-12)
    # token_mean alone (TRL bnpo) would weigh rank 0's 3 tokens as much as rank 1's 10: not the same
    bnpo = np.mean([-(a[:, None] * m).sum() / m.sum() for _, a, m in shards])
    assert abs(bnpo - want_loss) > 1e-3
