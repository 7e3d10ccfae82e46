"""Other code's writes to the model's 16-bit params reaching the FP32 masters (a weight constraint, WGAN's clipping, a
`load_state_dict` in a callback): as in FP32, the optimizer steps from the weights as they were written.

torch counts every in-place write to a param (`Tensor._version`); the store's own copies go to the flat buffer behind
the params (or through `.data`), which torch counts apart. The store notes the counts at the set-up; before each step
a count that moved means other code wrote: only then are that param's elements compared with its master rounded, and
those that differ are taken into the master (the others keep their exact FP32 values). Otherwise one integer read per
param and step. A write through `.data` is not counted by torch: code known to write so (`compat.DATA_WRITERS`:
fastai's WGAN clipping) has every weight compared after its `before_batch`; for any other, the end of the fit compares
everything once and warns."""
from __future__ import annotations
import warnings
import torch

from .layout import memory_order, dense_strides
from .lift import chunk_limit

__all__ = ['WriteWatch']

def _parts(p, m, limit) -> list:
    """`[(part of p, the same part of m)]` in memory order when they are laid out alike, each of a quarter chunk
    (`limit(device)`): a comparison's temporaries (12 bytes an element) then stay under one chunk of FP32."""
    if p.stride() != m.stride() or tuple(p.stride()) != dense_strides(p): return [(p, m)]
    a, b, n = memory_order(p), memory_order(m), max(1, limit(p.device) // 4)
    return [(a[o:o + n], b[o:o + n]) for o in range(0, a.numel(), n)]

class WriteWatch:
    "Follows in-place writes to the model's params (`params`) into their FP32 masters (`masters`, shaped alike)."
    def __init__(self, params:list, masters:list, limit=chunk_limit):
        self.pairs, self.limit = list(zip(params, masters)), limit  # `limit(device)`: the chunk size there
        self.note()

    def note(self):
        "The write counts from which other code's writes are told (at the set-up)."
        self.versions = [p._version for p, _ in self.pairs]

    @torch.no_grad()
    def follow(self, everything:bool=False, count:bool=False) -> int:
        """Take the elements other code wrote into the masters: of the params whose write count moved (`everything`:
        all of them, compared element by element). `count`: return how many were taken (one host read), else 0.
        (The store's own writes go through the flat buffers behind the params, whose counts are their own.)"""
        counts = []
        for i, ((p, m), v) in enumerate(zip(self.pairs, self.versions)):
            if not everything and p._version == v: continue
            for a, b in _parts(p, m, self.limit):  # a part at a time: the comparison's temporaries stay small
                changed = torch.ne(a, b.to(a.dtype)).logical_and_(a == a)  # a NaN master rounds to NaN: not a write
                b.copy_(torch.where(changed, a.to(b.dtype), b))
                if count: counts.append(changed.sum())
            self.versions[i] = p._version
        return int(sum(counts)) if counts else 0  # the host read: at the fit's end only

    def settle(self):
        """The fit's end: writes seen by their counts taken; any that torch did not count (through `.data`) taken, and
        said."""
        self.follow()
        n = self.follow(everything=True, count=True)
        if n: warnings.warn(
            f"{n} weights of the model were changed in place during the fit in a way torch does not count (through "
            f"`.data`, as in `p.data.clamp_(...)`): fp16cb took them into the FP32 weights at the end of the fit, but "
            f"the steps before did not start from them as FP32 would. Write the weights under `with torch.no_grad():` "
            f"(`p.clamp_(...)`), which every step sees.", RuntimeWarning, stacklevel=3)
