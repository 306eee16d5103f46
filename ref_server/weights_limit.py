"""The largest policy-weights publish (PUT /weights) the ref server takes: --max_weights_mb when given, else
derived from the model it holds, so that a 7B or 14B policy is not refused by a fixed cap.

Derived limit = parameters x 4 bytes x 1.25 + 64 MiB:
- 4 bytes: the server does not know the dtype the trainer publishes in (worker_dtype, or the training dtype
  when that is auto); float32 is the widest it uses. Tied weights count once, as a blob carries them once.
- x 1.25: a policy somewhat larger than the server's model (embeddings resized for added tokens) still fits.
- + 64 MiB: the safetensors header (names, shapes, offsets: ~100 bytes a tensor) and the metadata, with room
  to spare on a small model.
A 7B model gets ~35 GiB, a 14B one ~69 GiB. The limit allocates nothing: a publish's buffer is its own
declared size (ref_server/gate.py), so the margin costs no memory; only a token holder can send that much.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MIB = 1 << 20
PUBLISH_BYTES_PER_PARAM = 4  # float32
MARGIN = 1.25
HEADER_MIB = 64


@dataclass(frozen=True)
class WeightsLimit:
    bytes: int
    how: str  # how it was decided, for the startup log, GET /status and the 413 message

    @property
    def mb(self) -> float:
        """The limit in MiB, the unit of --max_weights_mb."""
        return self.bytes / MIB

    def refusal(self, length: int) -> str:
        """The 413 answer to a publish of `length` bytes: one line naming the size, the limit and the knob."""
        return (f"policy weights of {length / MIB:,.0f} MiB exceed this server's max_weights_mb {self.mb:,.0f} "
                f"({self.how}); start the ref server with --max_weights_mb {math.ceil(length / MIB):d} or more")


def derived_bytes(model: torch.nn.Module) -> int:
    """parameters x 4 bytes (float32) x 1.25 + 64 MiB (the reasons are in the module docstring)."""
    return int(count_parameters(model) * PUBLISH_BYTES_PER_PARAM * MARGIN) + HEADER_MIB * MIB


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def weights_limit(max_weights_mb: float | None, model: torch.nn.Module) -> WeightsLimit:
    """--max_weights_mb when given, else the limit derived from `model`."""
    if max_weights_mb is not None:
        return WeightsLimit(int(max_weights_mb * MIB), "set by --max_weights_mb")
    n = count_parameters(model)
    return WeightsLimit(derived_bytes(model), f"default, derived from its model: {n / 1e6:,.1f}M parameters x "
                                              f"{PUBLISH_BYTES_PER_PARAM} bytes x {MARGIN} + {HEADER_MIB} MiB")
