"""FP32 tensors that `torch.save` writes one at a time, without their all existing at once: a checkpoint taken mid-fit
streams the FP32 values of 16-bit weights (`half_storage`) and of 16-bit optimizer state (`state_dtype`). A `Stream`
hands out stand-ins that are pickled exactly as the FP32 tensor would be (the file is the same, byte for byte); the
bytes of each are made when `torch.save` reaches its storage (it asks the storage's size just before writing it) and
freed when it reaches the next one: at most one such tensor exists at a time. Masters need none of this: `shared`
gives `torch.save` their memory as tensors of their own, no copy."""
from __future__ import annotations
import sys
from collections import OrderedDict
import torch
from torch import Tensor

from ..weights.layout import dense_strides, owns_storage, shared

__all__ = ['Stream', 'lazy_state']

class _LazyStorage(torch.UntypedStorage):
    """An empty storage until `torch.save`'s writer asks its size, just before writing it: its bytes are then made (the
    last ones made freed). Anything else asking (a tool walking the live objects) finds it as it is, empty."""
    def nbytes(self):
        if (super().nbytes() == 0 and getattr(self, '_lazy', None) is not None
                and sys._getframe(1).f_globals.get('__name__') == 'torch.serialization'):
            self._lazy.stream._make(self)
        return super().nbytes()

class _Lazy:
    "Stands in for an FP32 tensor (no requires_grad) in what `torch.save` pickles: `fill(out)` writes its values."
    def __init__(self, stream, shape, stride, device, dtype, fill):
        self.stream, self.shape, self.stride, self.device = stream, shape, stride, device
        self.dtype, self.fill = dtype, fill
        self.numel = 1
        for n in shape: self.numel *= n

    def __reduce_ex__(self, proto):
        "What a tensor of its shape, strides and dtype owning its storage reduces to (`Tensor._reduce_ex_internal`)."
        st = _LazyStorage(0, device=self.device)
        st._lazy = self
        self.stream.storages.append(st)
        typed = torch.TypedStorage(wrap_storage=st, dtype=self.dtype, _internal=True)
        n = self.numel
        typed._size = lambda: n  # its element count, without making it
        return torch._utils._rebuild_tensor_v2, (typed, 0, tuple(self.shape), tuple(self.stride), False, OrderedDict())

class Stream:
    """FP32 tensors for one `torch.save`: `tensor(...)` returns a stand-in made as the file is written (`eager`: the
    tensor itself, made now: for a writer that does not ask a storage's size before writing it, torch's legacy format).
    Close it after the save (`with Stream() as s:`): what it made last is freed."""
    def __init__(self, eager:bool=False): self.eager, self.memo, self.storages, self.made = eager, {}, [], None
    def __enter__(self): return self
    def __exit__(self, *exc): self.close()

    def tensor(self, shape, stride, device, fill, dtype=torch.float32, key=None):
        """An FP32 tensor of `shape` and `stride` on `device` whose values `fill(out)` writes into `out` (a stand-in
        unless `eager`); `key`: the same stand-in for the same key (a tensor saved under two names: a tied weight)."""
        if key is not None and key in self.memo: return self.memo[key]
        if self.eager:
            res = torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype, device=device)
            fill(res)
        else: res = _Lazy(self, tuple(shape), tuple(stride), device, dtype, fill)
        if key is not None: self.memo[key] = res
        return res

    def _make(self, st:_LazyStorage):
        "Make the bytes of `st`, the previous ones freed first."
        self.free()
        lz = st._lazy
        st.resize_(lz.numel * torch.empty((), dtype=lz.dtype).element_size())
        lz.fill(torch.empty(0, dtype=lz.dtype, device=st.device).set_(st, 0, lz.shape, lz.stride))
        self.made = st

    def free(self):
        if self.made is not None: self.made.resize_(0)
        self.made = None

    def close(self):
        self.free()
        for st in self.storages: st._lazy = None  # a stand-in pickled again makes nothing (the save is over)
        self.storages, self.memo = [], {}

def _fp32_meta(storage, p, k, v):
    """What `storage` widens the entry `k: v` of `p` into, as a meta tensor (None: it stays as it is). A plain tensor is
    asked of `storage` on the meta device; integer codes of another kind of tensor (8-bit state) are what `storage`
    stores: widened, they are FP32 of their shape and layout."""
    if type(v) is not Tensor:
        if v.is_floating_point(): return None
        return torch.empty_strided(v.shape, dense_strides(v), dtype=torch.float32, device='meta')
    probe = {p: {k: v.to('meta')}}
    storage.widen_all(probe)
    w = probe[p][k]
    return None if w.dtype == v.dtype else w

def lazy_state(osd, state:dict, storage, stream:Stream):
    """The optimizer state dict `osd` as the FP32 learner's: every entry of `state` (`{param: {key: tensor}}`, the one
    `osd` was made from) that `storage` stores in 16 (or 8) bits replaced by its FP32 value, made by `stream` as it is
    written; a tensor that is a part of a larger buffer (state stepped as one flat tensor) by a tensor of its own over
    its memory (`shared`: written alone, as FP32's). The optimizer's own dicts are left as they are."""
    wide = {}
    for p, d in state.items() if storage is not None and storage.dtype is not None else ():
        for k, v in d.items():
            if not isinstance(v, Tensor) or not v.numel() or v.dtype == torch.float32: continue
            w = _fp32_meta(storage, p, k, v)
            if w is None: continue
            fill = lambda out, p=p, k=k, v=v: storage.widen_into(p, k, v, out)
            wide[id(v)] = stream.tensor(w.shape, w.stride(), v.device, fill, w.dtype, key=id(v))
    return _replaced(osd, wide)

def _replaced(o, wide:dict):
    """`o` with the tensors whose ids `wide` holds replaced, and parts of larger buffers by tensors of their own
    (`shared`, made once per tensor): the dicts, lists and tuples holding one are copied (of their type), the rest is
    `o`'s own."""
    if isinstance(o, Tensor):
        if id(o) not in wide: wide[id(o)] = o if o.is_sparse or owns_storage(o) else shared(o)
        return wide[id(o)]
    if type(o) is dict:
        res = {k: _replaced(v, wide) for k, v in o.items()}
        return o if all(res[k] is v for k, v in o.items()) else res
    if type(o) in (list, tuple):
        res = [_replaced(v, wide) for v in o]
        return o if all(a is b for a, b in zip(res, o)) else type(o)(res)
    return o
