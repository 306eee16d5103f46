"""common.wire.limits: validate_batch refuses every tensor of the wrong dtype, rank, shape or range (lengths,
NaN/inf, positive logprobs, token ids, sequence limits) with ProtocolError. Builders: tests/test_protocol.py."""
from __future__ import annotations

import pytest
import torch
from test_protocol import (
    expect,
    make_rollout,
    make_scored,
    raw,
    tensors_of,
    with_tensor,
)

from common.wire.protocol import (
    MAX_ROWS,
    ProtocolError,
    ScoredBatch,
    decode_rollout,
    decode_scored,
    encode_rollout,
    validate_batch,
)


def test_protocol_error_is_one_clear_type():
    assert issubclass(ProtocolError, ValueError)


@pytest.mark.parametrize("name,value,match", [
    ("input_ids", torch.zeros(4, 12, dtype=torch.int16), "'input_ids' has dtype torch.int16"),
    ("input_ids", torch.zeros(4, 12, dtype=torch.float32), "'input_ids' has dtype torch.float32"),
    ("prompt_lens", torch.tensor([3., 5., 1., 4.]), "'prompt_lens' has dtype"),
    ("advantages", torch.zeros(4, dtype=torch.float64), "'advantages' has dtype torch.float64"),
    ("advantages", torch.zeros(4, dtype=torch.bfloat16), "'advantages' has dtype torch.bfloat16"),
    ("gen_logps", torch.zeros(4, 9, dtype=torch.float16), "'gen_logps' has dtype torch.float16"),
    ("rewards", torch.zeros(4, dtype=torch.int64), "'rewards' has dtype"),
    ("advantages", torch.zeros(4, dtype=torch.bool), "'advantages' has dtype torch.bool"),
])
def test_rejects_wrong_dtypes(name, value, match):
    expect(match, with_tensor(name, value))


@pytest.mark.parametrize("name,value,match", [
    ("input_ids", torch.zeros(48, dtype=torch.int64), "'input_ids' has 1 dimensions, expected 2"),
    ("input_ids", torch.zeros(1, 4, 12, dtype=torch.int64), "'input_ids' has 3 dimensions, expected 2"),
    ("prompt_lens", torch.ones(4, 1, dtype=torch.int64), "'prompt_lens' has 2 dimensions, expected 1"),
    ("completion_lens", torch.tensor(3), "'completion_lens' has 0 dimensions, expected 1"),
    ("advantages", torch.zeros(4, 1), "'advantages' has 2 dimensions"),
    ("gen_logps", torch.zeros(36), "'gen_logps' has 1 dimensions, expected 2"),
    ("rewards", torch.zeros(4, 2), "'rewards' has 2 dimensions"),
])
def test_rejects_wrong_ranks(name, value, match):
    expect(match, with_tensor(name, value))


@pytest.mark.parametrize("name,value,match", [
    ("prompt_lens", torch.tensor([3, 5, 1]), "'prompt_lens' has 3 entries for 4 rows"),
    ("completion_lens", torch.tensor([6, 1, 9, 2, 1]), "'completion_lens' has 5 entries for 4 rows"),
    ("advantages", torch.zeros(2), "'advantages' has 2 entries for 4 rows"),
    ("gen_logps", torch.zeros(4, 8), r"'gen_logps' has shape \(4, 8\), expected \(4, 9\)"),
    ("gen_logps", torch.zeros(4, 10), r"'gen_logps' has shape \(4, 10\)"),
    ("gen_logps", torch.zeros(3, 9), r"'gen_logps' has shape \(3, 9\)"),
    ("rewards", torch.zeros(5), "'rewards' must be B finite values"),
])
def test_rejects_inconsistent_shapes(name, value, match):
    expect(match, with_tensor(name, value))


def test_rejects_inconsistent_ref_logps_shape():
    expect(r"'ref_logps' has shape \(4, 3\)", with_tensor("ref_logps", torch.zeros(4, 3), kind="scored"),
           decoder=decode_scored)


@pytest.mark.parametrize("name", ["input_ids", "prompt_lens", "completion_lens", "advantages"])
def test_rejects_missing_required_tensor(name):
    expect(f"tensor '{name}' missing", with_tensor(name, None))


def test_rejects_zero_rows_and_too_many_rows():
    t = {"input_ids": torch.zeros(0, 5, dtype=torch.int64), "prompt_lens": torch.zeros(0, dtype=torch.int64),
         "completion_lens": torch.zeros(0, dtype=torch.int64), "advantages": torch.zeros(0)}
    expect("batch has 0 rows", raw(t))
    n = MAX_ROWS + 1
    t = {"input_ids": torch.zeros(n, 2, dtype=torch.int64), "prompt_lens": torch.ones(n, dtype=torch.int64),
         "completion_lens": torch.ones(n, dtype=torch.int64), "advantages": torch.zeros(n)}
    expect(f"batch has {n} rows; allowed 1..{MAX_ROWS}", raw(t))


@pytest.mark.parametrize("pl,cl,match", [
    ([3, 0, 1, 4], [6, 1, 9, 2], "every prompt length must be >= 1"),
    ([3, -2, 1, 4], [6, 1, 9, 2], "every prompt length must be >= 1"),
    ([3, 5, 1, 4], [6, 0, 9, 2], "every completion length must be >= 1"),
    ([3, 5, 1, 4], [6, 1, -9, 2], "every completion length must be >= 1"),
    ([3, 5, 1, 9], [6, 1, 9, 4], "exceeds the row length 12"),       # 13 > L = 12
    ([3, 5, 12, 4], [6, 1, 1, 2], "exceeds the row length 12"),
    ([2 ** 63 - 1, 5, 1, 4], [6, 1, 9, 2], "exceeds the row length"),  # would overflow the sum
    ([3, 5, 1, 4], [6, 1, 2 ** 63 - 1, 2], "exceeds the row length"),
])
def test_rejects_lengths_out_of_range(pl, cl, match):
    b = make_rollout(gen_logps=False)  # L = 10 + 2 = 12
    t = tensors_of(b)
    t["prompt_lens"], t["completion_lens"] = torch.tensor(pl), torch.tensor(cl)
    expect(match, raw(t))


def test_rejects_int32_length_overflow():
    t = tensors_of(make_rollout(gen_logps=False))
    t["prompt_lens"] = torch.tensor([2 ** 31 - 1, 5, 1, 4], dtype=torch.int32)
    t["completion_lens"] = torch.tensor([6, 1, 9, 2], dtype=torch.int32)
    expect("exceeds the row length", raw(t))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ["advantages", "gen_logps", "rewards", "ref_logps"])
def test_rejects_non_finite_floats(name, bad):
    base = make_scored()
    t = getattr(base, name).clone()
    t.view(-1)[1] = bad
    expect(f"{name}.*(NaN or inf|finite)", with_tensor(name, t, base=base, kind="scored"), decoder=decode_scored)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_value_found_at_every_position(bad):
    """The range checks use one min/max reduction per tensor: a bad value anywhere must show."""
    b = make_scored(prompt_lens=(2,) * 8, completion_lens=(40, 3, 17, 40, 1, 8, 33, 21), extra_width=0)
    for name in ("gen_logps", "ref_logps", "advantages", "rewards"):
        t = getattr(b, name)
        for k in range(t.numel()):
            u = t.clone()
            u.view(-1)[k] = bad
            with pytest.raises(ProtocolError, match=f"{name}.*(NaN or inf|finite)"):
                validate_batch(ScoredBatch(**{**b.__dict__, name: u}))


@pytest.mark.parametrize("name", ["gen_logps", "ref_logps"])
def test_rejects_positive_logprobs(name):
    base = make_scored()
    t = getattr(base, name).clone()
    t[2, 3] = 0.5
    expect(f"'{name}' has positive log-probabilities", with_tensor(name, t, base=base, kind="scored"),
           decoder=decode_scored)
    t[2, 3] = 1e-7  # float noise around log(1) = 0 is fine
    decode_scored(with_tensor(name, t, base=base, kind="scored"))


def test_rejects_token_ids_out_of_vocab():
    b = make_rollout(gen_logps=False)
    data = encode_rollout(b)
    top = int(b.input_ids.max())
    decode_rollout(data, vocab_size=top + 1)
    expect(f"token id {top} >= vocab size {top}", data, vocab_size=top)
    t = tensors_of(b)
    t["input_ids"][1, 0] = -5
    expect("negative token id", raw(t))


def test_rejects_rows_longer_than_max_seq_len():
    b = make_rollout(gen_logps=False)  # L = 12, longest prompt 5
    data = encode_rollout(b)
    decode_rollout(data, max_seq_len=12)
    expect("sequence length 12 exceeds the limit 11", data, max_seq_len=11)
    expect("sequence length 12 exceeds the limit 6", data, max_seq_len=6)


def test_rejects_rows_over_the_hard_limit():
    from common.wire.protocol import MAX_SEQ_LEN
    L = MAX_SEQ_LEN + 1
    t = {"input_ids": torch.zeros(1, L, dtype=torch.int64), "prompt_lens": torch.tensor([1]),
         "completion_lens": torch.tensor([1]), "advantages": torch.zeros(1)}
    expect(f"sequence length {L} exceeds the limit {MAX_SEQ_LEN}", raw(t))
