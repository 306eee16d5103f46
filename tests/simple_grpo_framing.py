"""simple_GRPO's wire framing (its ref_server.py), verbatim apart from names: the baseline of bench/wire.py.

Every tensor is torch.save'd into its own blob and the blobs are length-prefixed into one
message. Decoding unpickles (torch.load, weights_only=True), which is why it lives here, with the
tests, and never in product code: our protocol (common/wire/protocol.py) is safetensors-only.
"""
from __future__ import annotations

import io

import torch


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(t, buffer)
    return buffer.getvalue()


def bytes_to_tensor(b: bytes) -> torch.Tensor:
    return torch.load(io.BytesIO(b), weights_only=True)


def make_bytes_list(blist: list[bytes]) -> bytes:
    buffer = io.BytesIO()
    buffer.write(len(blist).to_bytes(4, "big"))
    for b in blist:
        buffer.write(len(b).to_bytes(4, "big"))
        buffer.write(b)
    return buffer.getvalue()


def bytes_list_to_list(b: bytes) -> list[bytes]:
    buffer = io.BytesIO(b)
    num = int.from_bytes(buffer.read(4), "big")
    blist = []
    for _ in range(num):
        length = int.from_bytes(buffer.read(4), "big")
        blist.append(buffer.read(length))
    return blist
