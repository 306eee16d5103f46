"""Wire-format micro-benchmark: our safetensors protocol vs simple_GRPO-style torch.save framing.

    python bench/wire.py [--rows 8] [--tokens 1024] [--repeats 300] [--seed 0] [--threads 1]

One group (rows x tokens, prompt included, with generation-time logprobs and rewards) is
encoded and decoded again, many times; the median round trip of each side is compared
(the two sides are interleaved, so background load hits both alike).

  ours      common.wire.protocol.encode_rollout + decode_rollout (decode validates everything:
            dtypes, ranks, shapes, lengths, token range, finiteness, logprob sign).
  baseline  simple_GRPO's framing: every tensor torch.save'd into its own blob
            (tensor_to_bytes), blobs length-prefixed into one message (make_bytes_list),
            and the inverse (bytes_list_to_list, each blob through torch's loader, weights_only=True),
            plus a JSON blob carrying the same metadata. No validation at all.
            That framing (tests/simple_grpo_framing.py) is the only torch.load in the repository:
            it is the baseline being measured, on bytes made in this process, never product code.

speedup     = median baseline round trip / median ours round trip   (target >= 3)
bytes_ratio = our message bytes / raw tensor bytes (sum of numel * element_size of the
              tensors we send)                                       (target <= 1.02)

This is a benchmark, not a test. The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_REPO, os.path.join(_REPO, "tests")]  # the baseline's torch.load lives with the tests

import torch  # noqa: E402
from simple_grpo_framing import bytes_list_to_list, bytes_to_tensor, make_bytes_list, tensor_to_bytes  # noqa: E402

from common.wire.protocol import RolloutBatch, decode_rollout, encode_rollout  # noqa: E402

TENSOR_NAMES = ("input_ids", "prompt_lens", "completion_lens", "advantages", "gen_logps", "rewards")


def baseline_encode(b: RolloutBatch) -> bytes:
    meta = {"policy_version": b.policy_version, "producer_id": b.producer_id, "batch_id": b.batch_id,
            "extra": b.extra}
    return make_bytes_list([json.dumps(meta).encode()] + [tensor_to_bytes(getattr(b, n)) for n in TENSOR_NAMES])


def baseline_decode(data: bytes) -> RolloutBatch:
    blobs = bytes_list_to_list(data)
    meta = json.loads(blobs[0])
    tensors = dict(zip(TENSOR_NAMES, (bytes_to_tensor(x) for x in blobs[1:])))
    return RolloutBatch(**tensors, **meta)


# ---------------------------------------------------------------------------------------------
def make_group(rows: int, tokens: int, seed: int, vocab: int = 151_936) -> RolloutBatch:
    """rows completions of one prompt, each row prompt + completion right-padded to `tokens`."""
    g = torch.Generator().manual_seed(seed)
    plen = max(1, min(tokens // 4, 256))
    prompt = torch.randint(0, vocab, (plen,), generator=g)
    completion_lens = torch.randint(max(1, (tokens - plen) // 4), tokens - plen + 1, (rows,), generator=g)
    completion_lens[0] = tokens - plen  # one row fills the whole width
    T = int(completion_lens.max())
    ids = torch.zeros(rows, tokens, dtype=torch.int64)
    ids[:, :plen] = prompt
    gen_logps = torch.zeros(rows, T)
    for i, c in enumerate(completion_lens.tolist()):
        ids[i, plen:plen + c] = torch.randint(0, vocab, (c,), generator=g)
        gen_logps[i, :c] = -torch.rand(c, generator=g) * 5
    rewards = torch.randint(0, 3, (rows,), generator=g).float()
    adv = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-4)
    return RolloutBatch(input_ids=ids, prompt_lens=torch.full((rows,), plen), completion_lens=completion_lens,
                        advantages=adv, gen_logps=gen_logps, rewards=rewards, policy_version=17,
                        producer_id="worker-0", extra={"reward_components": {"correct": rewards.tolist()}})


def _one(encode, decode, batch) -> tuple[float, float]:
    t0 = time.perf_counter()
    data = encode(batch)
    t1 = time.perf_counter()
    decode(data)
    return t1 - t0, time.perf_counter() - t1


def time_round_trips(sides: dict, batch: RolloutBatch, repeats: int, warmup: int = 20) -> dict:
    """Median seconds of encode, decode and encode+decode per side.

    The sides are interleaved (one round trip of each per repeat, order alternating), so a load
    spike from other processes hits both alike instead of skewing the ratio.
    """
    names = list(sides)
    times: dict = {n: ([], [], []) for n in names}
    for i in range(warmup + repeats):
        for n in (names if i % 2 == 0 else names[::-1]):
            e, d = _one(*sides[n], batch)
            if i >= warmup:
                times[n][0].append(e)
                times[n][1].append(d)
                times[n][2].append(e + d)
    return {n: tuple(statistics.median(x) for x in times[n]) for n in names}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--rows", type=int, default=8, help="completions per group (rows)")
    p.add_argument("--tokens", type=int, default=1024, help="row length, prompt included")
    p.add_argument("--repeats", type=int, default=300, help="timed round trips per side (median is reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 = like a busy server process)")
    p.add_argument("--smoke", action="store_true", help="the test suite's seconds-long run: 10 round trips per side")
    a = p.parse_args(argv)
    if a.smoke:
        a.repeats = 10
    if a.rows < 1 or a.tokens < 2 or a.repeats < 1:
        p.error("need --rows >= 1, --tokens >= 2 (a prompt and a completion token) and --repeats >= 1")
    torch.set_num_threads(a.threads)

    batch = make_group(a.rows, a.tokens, a.seed)
    ours_bytes = encode_rollout(batch)
    base_bytes = baseline_encode(batch)

    # Both sides must carry the same tensors, bit for bit.
    got_ours, got_base = decode_rollout(ours_bytes), baseline_decode(base_bytes)
    for n in TENSOR_NAMES:
        ref = getattr(batch, n)
        for side, got in (("ours", got_ours), ("baseline", got_base)):
            t = getattr(got, n)
            assert t.dtype == ref.dtype and torch.equal(t, ref), f"{side}: {n} did not round-trip"
    assert got_ours.extra == batch.extra and got_ours.batch_id == batch.batch_id

    raw = sum(getattr(batch, n).numel() * getattr(batch, n).element_size() for n in TENSOR_NAMES)
    med = time_round_trips({"ours": (encode_rollout, decode_rollout),
                            "baseline": (baseline_encode, baseline_decode)}, batch, a.repeats)
    (o_enc, o_dec, o_tot), (b_enc, b_dec, b_tot) = med["ours"], med["baseline"]

    us = 1e6
    print(f"group: {a.rows} rows x {a.tokens} tokens, T={batch.max_completion_len}, raw tensor bytes {raw}")
    print(f"ours     : {len(ours_bytes):8d} bytes ({len(ours_bytes) / raw:.4f} x raw)  "
          f"encode {o_enc * us:8.1f} us  decode+validate {o_dec * us:8.1f} us  round trip {o_tot * us:8.1f} us")
    print(f"baseline : {len(base_bytes):8d} bytes ({len(base_bytes) / raw:.4f} x raw)  "
          f"encode {b_enc * us:8.1f} us  decode          {b_dec * us:8.1f} us  round trip {b_tot * us:8.1f} us")
    result = {
        "speedup": round(b_tot / o_tot, 3),
        "bytes_ratio": round(len(ours_bytes) / raw, 5),
        "ours_us": round(o_tot * us, 1), "ours_encode_us": round(o_enc * us, 1), "ours_decode_us": round(o_dec * us, 1),
        "baseline_us": round(b_tot * us, 1), "baseline_encode_us": round(b_enc * us, 1),
        "baseline_decode_us": round(b_dec * us, 1),
        "ours_bytes": len(ours_bytes), "baseline_bytes": len(base_bytes), "raw_bytes": raw,
        "baseline_bytes_ratio": round(len(base_bytes) / raw, 5),
        "rows": a.rows, "tokens": a.tokens, "T": batch.max_completion_len, "repeats": a.repeats,
        "threads": a.threads,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
