"""The forward casts of a 16-bit model: floating inputs to its dtype as they enter, the FP32 islands' boundaries, and
a model converted for good (`to_half`, for the copies that diagnostics run)."""
from __future__ import annotations
from functools import partial
import torch
from torch import nn

from ..dtypes import convert_network_keeping
from ..policy import PrecisionPolicy, uncompiled

__all__ = ['cast_floats', 'IslandHooks', 'RangeWatch', 'to_half']

def cast_floats(b, dtype:torch.dtype, keep64:bool=False):
    """Recursively cast the floating-point tensors of `b` (tensors, lists, tuples, dicts) to `dtype`; others untouched
    (`keep64`: float64 ones too, what a float64 layer inside an island is given on purpose)."""
    if isinstance(b, torch.Tensor):
        return b.to(dtype) if torch.is_floating_point(b) and b.dtype != dtype and not (keep64 and b.dtype == torch.float64) else b
    if isinstance(b, dict): return {k: cast_floats(v, dtype, keep64) for k, v in b.items()}
    if isinstance(b, tuple) and hasattr(b, '_fields'): return type(b)(*(cast_floats(o, dtype, keep64) for o in b))
    if isinstance(b, (list, tuple)) or type(b).__name__ == 'L': return type(b)([cast_floats(o, dtype, keep64) for o in b])
    return b

def _cast_inputs(dtype, watch=None):
    """A forward pre-hook: the model's floating inputs in `dtype`, whatever the callbacks did to `learn.xb` (MixUp).
    `watch(before, after)`: called with the inputs and their cast in eval mode (validation, inference)."""
    def hook(module, args, kwargs):
        a, k = cast_floats(args, dtype), cast_floats(kwargs, dtype)
        if watch is not None and not module.training: watch((args, kwargs), (a, k))
        return a, k
    return hook

def _floats(b) -> list:
    "The floating tensors of `b` (nested tensors, lists, tuples, dicts), in order."
    if isinstance(b, torch.Tensor): return [b] if torch.is_floating_point(b) else []
    if isinstance(b, dict): return [t for v in b.values() for t in _floats(v)]
    if isinstance(b, (list, tuple)) or type(b).__name__ == 'L': return [t for v in b for t in _floats(v)]
    return []

class RangeWatch:
    """Whether casting the eval inputs to fp16 made an inf of a finite value (beyond fp16's 65504): a flag on the device,
    OR-ed batch by batch (no host sync), read once at the end of the validation (`found`)."""
    def __init__(self): self.flag = None
    def __call__(self, before, after):
        for a, b in zip(_floats(before), _floats(after)):
            if b is a or b.dtype != torch.float16: continue
            bad = torch.isfinite(a).all() & ~torch.isfinite(b).all()
            self.flag = bad if self.flag is None else self.flag | bad
    def found(self) -> bool:
        "Whether it happened since the last call (one host read; none when nothing was cast)."
        flag, self.flag = self.flag, None
        return flag is not None and bool(flag)

class IslandHooks:
    """The boundary casts of the islands of a 16-bit model: an FP32 island's floating inputs to FP32 as it is entered,
    its floating outputs back to `dtype` as it returns (a 16-bit module inside a kept subtree: the other way round);
    an island output that is also the model's output is given back in FP32 (the loss and softmax see the FP32 values,
    not their 16-bit rounding). Under `torch.compile` the hooks trace into the model's graph (`fullgraph=True` too).
    `n_casts` counts the casts of eager forwards (counted in a graph, it would make dynamo compile it again)."""
    def __init__(self, model:nn.Module, islands:list, dtype:torch.dtype):
        self.model, self.dtype, self.handles, self.n_casts = model, dtype, [], 0
        self._outs = []  # `(16-bit output, its FP32 value)` of each FP32 island run in the current forward
        root = uncompiled(model)  # a compiled model's hooks go on the module it compiles: traced in its graph
        for name, m, fp32 in islands:
            if m is root: continue  # the whole model is FP32: its inputs are cast up by `ModelToHalf`'s own hook
            inside, outside = (torch.float32, dtype) if fp32 else (dtype, torch.float32)
            self.handles.append(m.register_forward_pre_hook(partial(self._cast_in, dtype=inside), with_kwargs=True))
            self.handles.append(m.register_forward_hook(partial(self._cast_out, dtype=outside)))
        if self.handles: self.handles.append(root.register_forward_hook(self._model_out))

    def _counted(self, *bs):
        if not torch.compiler.is_compiling(): self.n_casts += len(_floats(bs))

    def _cast_in(self, module, args, kwargs, dtype:torch.dtype):
        self._counted(args, kwargs)
        return cast_floats(args, dtype, keep64=True), cast_floats(kwargs, dtype, keep64=True)

    def _cast_out(self, module, args, out, dtype:torch.dtype):
        if isinstance(out, torch.Tensor) and torch.is_floating_point(out) and out.dtype != dtype:
            self._counted(out)
            res = out.to(dtype)
            if out.dtype == torch.float32: self._outs.append((res, out))
            return res
        self._counted(out)
        return cast_floats(out, dtype, keep64=True)

    def _model_out(self, module, args, out):
        "The model's output: an island's 16-bit output goes back to its exact FP32 value; forget this forward's outputs."
        outs = list(self._outs)
        self._outs.clear()
        for res, fp32 in outs:
            if res is out: return fp32
        return None

    def remove(self):
        for h in self.handles: h.remove()
        self.handles = []
        self._outs.clear()

def to_half(model:nn.Module, dtype:torch.dtype, policy:PrecisionPolicy):
    """Convert `model` in place, for good, as `ModelToHalf` does for a fit (a copy's: nothing to tear down): `policy`'s
    FP32 islands with their casts, the floating inputs cast to `dtype`. Returns the `Resolved` policy."""
    res = policy.resolve(model)
    convert_network_keeping(model, dtype, keep=set(res.kept))
    IslandHooks(model, res.islands, dtype)
    model.register_forward_pre_hook(_cast_inputs(torch.float32 if id(model) in res.kept else dtype), with_kwargs=True, prepend=True)
    return res

