"""What a batch may hold: the hard limits of every message and `validate_batch`, which checks each tensor's
dtype, rank, shape and range and raises ProtocolError saying what is wrong (decode_* and encode_* call it).
"""
from __future__ import annotations

import math

import torch

from common.wire.batch import RolloutBatch, ScoredBatch
from common.wire.batch_extra import ExtraError, check_control, check_extra

# Hard limits that hold whatever the model: they bound what a decoder will allocate.
MAX_ROWS = 4096
MAX_SEQ_LEN = 1 << 17
MAX_META_CHARS = 64 * 1024


class ProtocolError(ValueError):
    """A message that is malformed, inconsistent or out of range. The text says what."""


def _check_tensor(name: str, t, dtypes: tuple, ndim: int) -> None:
    if t is None:
        raise ProtocolError(f"tensor {name!r} missing")
    if not isinstance(t, torch.Tensor):
        raise ProtocolError(f"{name!r} is not a tensor")
    if t.dtype not in dtypes:
        raise ProtocolError(f"{name!r} has dtype {t.dtype}, expected one of {[str(d) for d in dtypes]}")
    if t.ndim != ndim:
        raise ProtocolError(f"{name!r} has {t.ndim} dimensions, expected {ndim}")


_INT = (torch.int64, torch.int32)
_FLOAT = (torch.float32,)
_MASK = (torch.bool, torch.uint8)


def _minmax(t: torch.Tensor) -> tuple:
    """(min, max) as Python numbers in one pass over t (non-empty); a NaN anywhere gives NaN for both."""
    lo, hi = torch.aminmax(t)
    return lo.item(), hi.item()


def _finite(lo: float, hi: float) -> bool:
    return math.isfinite(lo) and math.isfinite(hi)


def validate_batch(b: RolloutBatch, vocab_size: int | None = None, max_seq_len: int | None = None) -> None:
    """Raise ProtocolError unless every tensor has the right dtype, rank, shape and range.

    One min/max pass per tensor (torch.aminmax) answers all of its range checks: finite iff
    min and max are finite (NaN propagates), lengths from their extremes, logprob sign from max.
    """
    _check_tensor("input_ids", b.input_ids, _INT, 2)
    _check_tensor("prompt_lens", b.prompt_lens, _INT, 1)
    _check_tensor("completion_lens", b.completion_lens, _INT, 1)
    _check_tensor("advantages", b.advantages, _FLOAT, 1)
    B, L = b.input_ids.shape
    if not 1 <= B <= MAX_ROWS:
        raise ProtocolError(f"batch has {B} rows; allowed 1..{MAX_ROWS}")
    limit = min(MAX_SEQ_LEN, max_seq_len or MAX_SEQ_LEN)
    if L > limit:
        raise ProtocolError(f"sequence length {L} exceeds the limit {limit}")
    for name in ("prompt_lens", "completion_lens", "advantages"):
        if getattr(b, name).shape[0] != B:
            raise ProtocolError(f"{name!r} has {getattr(b, name).shape[0]} entries for {B} rows")
    p_min, p_max = _minmax(b.prompt_lens)
    c_min, c_max = _minmax(b.completion_lens)
    if p_min < 1:
        raise ProtocolError("every prompt length must be >= 1")
    if c_min < 1:
        raise ProtocolError("every completion length must be >= 1")
    # Python ints: no overflow. Each length alone first, then the per-row sum only when the
    # extremes alone could exceed L.
    if p_max > L or c_max > L or (p_max + c_max > L and int((b.prompt_lens + b.completion_lens).max()) > L):
        raise ProtocolError(f"prompt_len + completion_len exceeds the row length {L}")
    if max_seq_len is not None and p_max >= max_seq_len:
        raise ProtocolError(f"prompt length {p_max} >= the model's sequence length {max_seq_len}")
    id_min, id_max = _minmax(b.input_ids)
    if id_min < 0:
        raise ProtocolError("negative token id")
    if vocab_size is not None and id_max >= vocab_size:
        raise ProtocolError(f"token id {id_max} >= vocab size {vocab_size}")
    if not _finite(*_minmax(b.advantages)):
        raise ProtocolError("advantages contain NaN or inf")
    T = c_max
    per_token = ["gen_logps"] + (["ref_logps"] if isinstance(b, ScoredBatch) else [])
    for name in per_token:
        t = getattr(b, name)
        if t is None:
            continue
        _check_tensor(name, t, _FLOAT, 2)
        if tuple(t.shape) != (B, T):
            raise ProtocolError(f"{name!r} has shape {tuple(t.shape)}, "
                                f"expected ({B}, {T}) = (rows, max completion len)")
        lo, hi = _minmax(t)
        if not _finite(lo, hi):
            raise ProtocolError(f"{name!r} contains NaN or inf")
        if hi > 1e-3:
            raise ProtocolError(f"{name!r} has positive log-probabilities (max {hi:.4g})")
    if b.loss_mask is not None:
        _check_loss_mask(b.loss_mask, b.completion_lens, B, T)
    if b.rewards is not None:
        _check_tensor("rewards", b.rewards, _FLOAT, 1)
        if b.rewards.shape[0] != B or not _finite(*_minmax(b.rewards)):
            raise ProtocolError("'rewards' must be B finite values")
    if not isinstance(b.policy_version, int) or b.policy_version < 0:
        raise ProtocolError("policy_version must be a non-negative integer")
    try:
        check_extra(b.extra, B)
        check_control(b.needs_ref, b.logp_temperature)
    except ExtraError as e:
        raise ProtocolError(str(e)) from None


def _check_loss_mask(mask, completion_lens: torch.Tensor, B: int, T: int) -> None:
    """(B, T) bool, 0 past each completion, and at least one 1 in every row: a completion starts with the
    policy's own tokens (tool turns only follow a model turn), and a row without one would train nothing while
    still counting as a row in seq_mean / dr_grpo (a producer bug, refused rather than silently diluting)."""
    _check_tensor("loss_mask", mask, (torch.bool,), 2)
    if tuple(mask.shape) != (B, T):
        raise ProtocolError(f"'loss_mask' has shape {tuple(mask.shape)}, "
                            f"expected ({B}, {T}) = (rows, max completion len)")
    inside = torch.arange(T, device=mask.device)[None, :] < completion_lens.to(mask.device)[:, None]
    if bool((mask & ~inside).any()):
        raise ProtocolError("'loss_mask' has ones past a row's completion_lens")
    empty = ~mask.any(1)
    if bool(empty.any()):
        raise ProtocolError(f"'loss_mask' row {int(empty.nonzero()[0])} has no 1: every completion needs a token "
                            f"the policy sampled")
