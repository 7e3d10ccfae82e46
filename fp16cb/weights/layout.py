"""The weight store's memory layout: flat buffers and the views into them, each keeping its tensor's strides (so
channels_last survives being flattened), and which runs of params each flat buffer holds."""
from __future__ import annotations
import torch
from torch import Tensor

__all__ = ['dense_strides', 'memory_order', 'span_of', 'spans', 'flat_views', 'flatten_like', 'owns_storage',
           'with_layout_of', 'shared', 'split_like', 'own_storages']

def _contiguous_strides(shape) -> tuple:
    res, s = [], 1
    for n in reversed(shape): res.append(s); s *= max(n, 1)
    return tuple(reversed(res))

def dense_strides(t:Tensor) -> tuple:
    """`t`'s strides when its elements fill a span of exactly `t.numel()` (contiguous, channels_last, or any other
    permutation of the dims); else the contiguous strides (an overlapping or gappy tensor gets a dense copy)."""
    if t.is_contiguous(): return tuple(t.stride())  # (the usual case, asked in C++)
    expected = 1
    for size, stride in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n != 1), key=lambda o: o[1]):
        if stride != expected: return _contiguous_strides(t.shape)
        expected *= size
    return tuple(t.stride())

def memory_order(t:Tensor) -> Tensor:
    "The dense tensor `t` as a 1-d view in memory order (channels_last included), detached."
    return t.detach().as_strided((t.numel(),), (1,), t.storage_offset())

def span_of(ts:list) -> Tensor|None:
    """The 1-d tensor over the memory of `ts` when each is dense and each starts in one storage where the one before
    it ends (views of one buffer, one after the other): their elements in memory order, no copy. Else None."""
    if not ts: return None
    ptr, end = ts[0].untyped_storage().data_ptr(), ts[0].storage_offset()
    for t in ts:
        if (t.untyped_storage().data_ptr() != ptr or t.storage_offset() != end or t.dim() == 0
                or tuple(t.stride()) != dense_strides(t)): return None
        end += t.numel()
    return ts[0].detach().as_strided((end - ts[0].storage_offset(),), (1,), ts[0].storage_offset())

def spans(ts:list) -> list:
    """`ts` cut into maximal runs `ts[i:j]` of dense tensors one after the other in one storage: `(i, j, span)` each,
    `span` the 1-d tensor over their memory (`span_of`: None for a tensor that is not dense, alone in its run)."""
    res, i = [], 0
    while i < len(ts):
        j = i + 1
        while j < len(ts) and span_of(ts[j - 1:j + 1]) is not None: j += 1
        res.append((i, j, span_of(ts[i:j])))
        i = j
    return res

def flat_views(flat:Tensor, like:list) -> list:
    "Views into the 1-d `flat`, one per tensor of `like` in order, each with the shape and dense strides of its tensor."
    if all(t.is_contiguous() for t in like): return list(torch._C._nn.unflatten_dense_tensors(flat, like))  # (in C++)
    res, o = [], 0
    for t in like:
        n = t.numel()
        chunk = flat[o:o+n]
        res.append(chunk.view(t.shape) if t.is_contiguous() else
                   chunk.as_strided(t.shape, dense_strides(t), chunk.storage_offset()))
        o += n
    return res

def flatten_like(tensors:list, like:list, dtype=None) -> Tensor:
    """One flat buffer holding `tensors` (in `dtype`), each laid out as its counterpart in `like` is (`flat_views`
    order)."""
    ref = like[0] if like else tensors[0]
    flat = torch.empty(sum(t.numel() for t in like), dtype=dtype or ref.dtype, device=ref.device)
    if like:
        with torch.no_grad(): torch._foreach_copy_(flat_views(flat, like), [t.detach() for t in tensors])
    return flat

def owns_storage(t:Tensor) -> bool:
    "Whether `t` is the whole of its storage (not a view into a larger buffer, which `torch.save` would write whole)."
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()

def with_layout_of(t:Tensor, like:Tensor) -> Tensor:
    "`t` itself when it owns its storage and has `like`'s strides; else a copy of it that does, laid out as `like`."
    strides = dense_strides(like)
    if owns_storage(t) and tuple(t.stride()) == strides: return t
    return torch.empty_strided(like.shape, strides, dtype=t.dtype, device=t.device).copy_(t)

def shared(t:Tensor, like:Tensor=None) -> Tensor:
    """`t`'s memory as a tensor of its own, laid out as `like` (default: `t`): `t` itself when it owns its storage;
    when it is a dense part of a larger buffer with those strides (a master in the masters' buffer), a tensor over a
    storage of exactly its elements, no copy (`torch.save` writes those alone; the buffer lives as long as any such
    part does); else `with_layout_of`'s copy."""
    like = t if like is None else like
    strides = dense_strides(like)
    if owns_storage(t) or not t.numel() or tuple(t.stride()) != strides or dense_strides(t) != strides:
        return with_layout_of(t, like)
    t, n = t.detach(), t.element_size()
    o = t.storage_offset()
    part = t.untyped_storage()[o * n:(o + t.numel()) * n]  # a storage over the buffer's memory
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(part, 0, t.shape, strides)

def split_like(pg, flats):
    "Cut the params `pg` (in flat-master order) into the consecutive runs that each of `flats` holds."
    if len(flats) == 1: return [pg]
    parts, i = [], 0
    for flat in flats:
        part, n = [], 0
        while n < flat.numel(): part.append(pg[i]); n += pg[i].numel(); i += 1
        parts.append(part)
    return parts

def own_storages(obj):
    """`obj` (a state dict: nested dicts, lists and tuples) with each tensor over memory of its own (`shared`: no copy),
    so that `torch.save` writes each alone, as it writes FP32's, never a whole buffer that it is a view into."""
    if isinstance(obj, Tensor): return shared(obj)
    if isinstance(obj, dict): return {k: own_storages(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)): return type(obj)(own_storages(v) for v in obj)
    return obj
