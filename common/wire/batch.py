"""The typed batches that travel on the wire: a RolloutBatch (a producer's sampled group) and a ScoredBatch
(the same, with the reference model's logprobs), and `collate`, which concatenates them row-wise.

Row i of `input_ids` is prompt_i followed by completion_i, right-padded to L. The
completion tokens of row i are input_ids[i, prompt_lens[i] : prompt_lens[i] + completion_lens[i]],
and per-token tensors (gen_logps, ref_logps) are (B, T) with T = max(completion_lens),
entry [i, j] belonging to completion token j of row i; entries past completion_lens[i] are 0.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import torch

# What the ref server must know to score a batch: typed fields of the batch, carried in the message's `extra` JSON
# under these names (the wire form docs/protocol.md gives producers; absent = the default).
CONTROL_DEFAULTS = {"needs_ref": True, "logp_temperature": 1.0}


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor                    # (B, L) int64: prompt + completion, right-padded
    prompt_lens: torch.Tensor                  # (B,) int64
    completion_lens: torch.Tensor              # (B,) int64
    advantages: torch.Tensor                   # (B,) float32
    gen_logps: torch.Tensor | None = None   # (B, T) float32, generation-time policy logprobs
    rewards: torch.Tensor | None = None     # (B,) float32, raw rewards (for metrics)
    policy_version: int = 0
    producer_id: str = ""
    batch_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    extra: dict = field(default_factory=dict)  # small JSON-able metadata (e.g. reward components)
    # (B, T) bool, 1 = a token the policy sampled; 0 = a tool turn's token (in the sequence, out of the loss).
    # None = all ones (protocol-1 producers). Keyword-only, so it comes after every positional field, ScoredBatch's too.
    loss_mask: torch.Tensor | None = field(default=None, kw_only=True)
    # False: the consumer trains with beta 0, the server runs no reference forward (and sends no ref_logps)
    needs_ref: bool = field(default=True, kw_only=True)
    # the temperature of gen_logps, and the one ref_logps are computed at (log_softmax(logits / T))
    logp_temperature: float = field(default=1.0, kw_only=True)

    def __post_init__(self) -> None:
        """A batch whose `extra` names a control field (a decoded message, or a producer writing the wire form):
        the value moves to the typed field, so `extra` holds only data. Checked by validate_batch, as every field."""
        if any(k in self.extra for k in CONTROL_DEFAULTS):
            extra = dict(self.extra)
            for k in CONTROL_DEFAULTS:
                if k in extra:
                    setattr(self, k, extra.pop(k))
            self.extra = extra

    def control_extra(self) -> dict:
        """The control fields as the message's `extra` carries them: those that differ from the default."""
        return {k: getattr(self, k) for k, default in CONTROL_DEFAULTS.items() if getattr(self, k) != default}

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_completion_len(self) -> int:
        return int(self.completion_lens.max())

    def completion_mask(self) -> torch.Tensor:
        """(B, T) bool from lengths, never from pad ids (pad may equal eos)."""
        t = torch.arange(self.max_completion_len, device=self.completion_lens.device)
        return t[None, :] < self.completion_lens[:, None]

    def num_completion_tokens(self) -> int:
        return int(self.completion_lens.sum())


@dataclass
class ScoredBatch(RolloutBatch):
    ref_logps: torch.Tensor | None = None   # (B, T) float32, reference-model logprobs (None when beta == 0)

    @classmethod
    def from_rollout(cls, rb: RolloutBatch, ref_logps: torch.Tensor | None) -> ScoredBatch:
        return cls(**{k: getattr(rb, k) for k in RolloutBatch.__dataclass_fields__}, ref_logps=ref_logps)


def _pad_cat(ts: list[torch.Tensor], width: int) -> torch.Tensor:
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in ts], dim=0)


def collate(batches: list[RolloutBatch]) -> RolloutBatch:
    """Concatenate batches row-wise (padding input_ids and per-token tensors with 0).

    The result has the type of the first batch; an optional tensor survives only if every
    batch has it, except loss_mask, which is all ones (over each completion) where a batch has none.
    Metadata of the first batch is kept (its control fields too), `extra` lists are concatenated.
    """
    if not batches:
        raise ValueError("collate needs at least one batch")
    L = max(int(b.input_ids.shape[1]) for b in batches)
    T = max(b.max_completion_len for b in batches)
    kw = dict(
        input_ids=_pad_cat([b.input_ids for b in batches], L),
        prompt_lens=torch.cat([b.prompt_lens for b in batches]),
        completion_lens=torch.cat([b.completion_lens for b in batches]),
        advantages=torch.cat([b.advantages for b in batches]),
        policy_version=min(b.policy_version for b in batches),
        producer_id=batches[0].producer_id, batch_id=batches[0].batch_id,
        needs_ref=batches[0].needs_ref, logp_temperature=batches[0].logp_temperature,
    )
    names = ["gen_logps"] + (["ref_logps"] if isinstance(batches[0], ScoredBatch) else [])
    for name in names:
        ts = [getattr(b, name) for b in batches]
        kw[name] = _pad_cat(ts, T) if all(t is not None for t in ts) else None
    masks = [b.loss_mask for b in batches]
    if any(m is not None for m in masks):  # None = all ones over the completion: made explicit for those rows
        kw["loss_mask"] = _pad_cat([b.completion_mask() if m is None else m.bool() for b, m in zip(batches, masks)], T)
    rs = [b.rewards for b in batches]
    kw["rewards"] = torch.cat(rs) if all(r is not None for r in rs) else None
    extra: dict = {}
    for b in batches:
        for k, v in b.extra.items():
            if isinstance(v, list):
                extra.setdefault(k, []).extend(v)
            elif isinstance(v, dict):  # e.g. reward components: dict of lists
                d = extra.setdefault(k, {})
                for kk, vv in v.items():
                    d.setdefault(kk, []).extend(vv if isinstance(vv, list) else [vv])
    kw["extra"] = extra
    return type(batches[0])(**kw)
