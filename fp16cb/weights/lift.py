"""The lift of 16-bit storage (`half_storage`): how the 16-bit grads reach FP32 inside the step, a bounded chunk at a
time: the chunks of params the optimizer steps together (`lift_chunks`, `chunk_limit`) and the FP32 memory each
chunk's grads are lifted into, reused by every chunk (`Scratch`)."""
from __future__ import annotations
import torch
from torch import Tensor

__all__ = ['Scratch', 'lift_chunks', 'LIFT_CHUNK', 'OTHER_CHUNK', 'chunk_limit']

# The most elements of grads a chunk lifts to FP32 at once, by device type. On a CPU a chunk its caches hold (2 MiB of
# FP32): the copy in, the optimizer's passes and the copy out to the model find it there. On a GPU a chunk the device
# takes longer over than the host takes to launch it: each chunk costs the host ~100-150 us (an optimizer `step` call,
# the copies' launches), and a 2^22 chunk only ~70 us of an H100 (40 bytes an element at ~2.4 TB/s; the H100 run of
# 2026-11-25 stepped a 185M-param LM in 56 such chunks). 2^25 (128 MiB of FP32, ~0.6 ms a chunk) keeps the device busy.
LIFT_CHUNK = {"cpu": 2**19}
OTHER_CHUNK = 2**25

def chunk_limit(device, limit:int|None=None) -> int:
    """The chunk size on `device`: `limit` when given, else `LIFT_CHUNK`'s for its type (`OTHER_CHUNK` where it has
    none)."""
    return limit or LIFT_CHUNK.get(torch.device(device).type, OTHER_CHUNK)

class Scratch:
    """The FP32 memory the lift writes a chunk's grads into: one buffer per device, the size of the largest chunk (at
    most the chunk limit, or the largest master where one is bigger), made with the plans at the fit's set-up, kept for
    the fit and reused by every chunk of every step: no allocation, no page fault in the step (on a CPU, glibc would
    hand a freed buffer back to the system and fault it in again each step), and no allocator setting for the user."""
    def __init__(self, sizes:dict): self.sizes, self.bufs = sizes, {}  # sizes: {device: elements}
    def __call__(self, device, n:int) -> Tensor:
        "`n` elements of the device's buffer (made at its first use, the size of the device's largest chunk)."
        buf = self.bufs.get(device)
        if buf is None or buf.numel() < n:
            buf = self.bufs[device] = torch.empty(max(n, self.sizes.get(device, 0)), dtype=torch.float32, device=device)
        return buf[:n]
    def release(self): self.bufs = {}

def lift_chunks(items:list, limit) -> list:
    """`items` (`(param, group, sources)` in the optimizer's order) cut into consecutive chunks of one device whose
    masters hold at most `limit(device)` elements together (a bigger master is a chunk of its own)."""
    chunks, cur, n = [], [], 0
    for it in items:
        k = it[0].numel() if it[2] is not None else 0
        if cur and (n + k > limit(cur[0][0].device) or it[0].device != cur[0][0].device):
            chunks.append(cur); cur, n = [], 0
        cur.append(it); n += k
    return chunks + ([cur] if cur else [])

