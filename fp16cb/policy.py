"""Per-layer precision policy: which modules of a 16-bit model stay FP32, and the casts at the edges of each FP32 island.
After the op categories of the Google/NVIDIA "Automated Mixed-Precision for TensorFlow" slides (2019): most of the
network runs in 16-bit, numerically touchy layers in FP32; as Keras lets a layer carry its own dtype policy and
NVCaffe lets a layer choose its math (NVIDIA's "Training with mixed precision" slides, 2017), a module can carry its
own choice (`module.fp16cb_dtype = torch.float32`). Casts go only where a kept subtree (an *island*) meets the 16-bit
rest: its floating inputs cast up once, its outputs back once; nothing is cast inside an island."""
from __future__ import annotations
import fnmatch, re
from typing import NamedTuple
import torch
from torch import nn

from .dtypes import cast_floats

__all__ = ['CATEGORIES', 'PrecisionPolicy', 'Resolved', 'IslandHooks', 'policy_report']

_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm, nn.LocalResponseNorm)
if hasattr(nn, 'RMSNorm'): _NORMS += (nn.RMSNorm,)
_SOFTMAX = (nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.Softmax2d)

def _is_classifier(name:str, module:nn.Module, model:nn.Module) -> bool:
    return name == _last_layer_name(model)

def _last_layer_name(model:nn.Module):
    "The name of the last (in registration order) Linear or Conv layer: the model's final classifier."
    res = None
    for n, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd)): res = n
    return res

# the named op categories `keep_fp32` takes: name -> (what it is, a test of (name, module, model))
CATEGORIES = {
    'batchnorm': ("BatchNorm layers (the default)", lambda n, m, model: isinstance(m, nn.modules.batchnorm._BatchNorm)),
    'norm': ("LayerNorm, GroupNorm, InstanceNorm, LocalResponseNorm, RMSNorm", lambda n, m, model: isinstance(m, _NORMS)),
    'embedding': ("nn.Embedding and nn.EmbeddingBag", lambda n, m, model: isinstance(m, (nn.Embedding, nn.EmbeddingBag))),
    'classifier': ("the final classifier: the last Linear or Conv layer", _is_classifier),
    'softmax': ("Softmax, LogSoftmax, Softmin modules", lambda n, m, model: isinstance(m, _SOFTMAX)),
}
_NATIVE_MIXED = (nn.modules.batchnorm._BatchNorm,)  # torch's kernels take 16-bit inputs with FP32 params: no casts
_ATTR = 'fp16cb_dtype'  # the per-module override

def _matcher(spec):
    "A test `(name, module, model) -> bool` and a label for one item of `keep_fp32`."
    if isinstance(spec, type) and issubclass(spec, nn.Module):
        return (lambda n, m, model: isinstance(m, spec)), spec.__name__
    if isinstance(spec, str):
        if spec in CATEGORIES: return CATEGORIES[spec][1], spec
        if spec.startswith('re:'):
            rx = re.compile(spec[3:])
            return (lambda n, m, model: rx.fullmatch(n) is not None), spec
        return (lambda n, m, model: fnmatch.fnmatchcase(n, spec)), f"name {spec!r}"
    if isinstance(spec, re.Pattern): return (lambda n, m, model: spec.fullmatch(n) is not None), f"re {spec.pattern!r}"
    if callable(spec): return (lambda n, m, model: bool(spec(n, m))), getattr(spec, '__name__', 'predicate')
    raise TypeError(f"keep_fp32: cannot use {spec!r}: expected a module type, a category ({', '.join(CATEGORIES)}), "
                    "a name glob ('encoder.*'), 're:<regex>', a compiled regex or a predicate `(name, module) -> bool`")

class Resolved(NamedTuple):
    "What a policy gives on one model: the modules kept FP32 and why, and the roots of the FP32 islands."
    kept: dict  # id(module) -> reason
    islands: list  # (name, module) of the kept modules whose parent is 16-bit, which get the boundary casts
    names: dict  # id(module) -> qualified name

class PrecisionPolicy:
    """What stays FP32 in a 16-bit model: BatchNorm (unless `batchnorm=False`) and whatever `specs` match, each with its
    whole subtree. A spec is a module type, a category name of `CATEGORIES`, a glob on the module's qualified name
    ('encoder.*.norm1'), 're:<regex>', a compiled regex, or a predicate `(name, module) -> bool`. A module's own
    `fp16cb_dtype` attribute wins over the specs: `torch.float32` keeps it, a 16-bit dtype converts it."""
    def __init__(self, *specs,
        batchnorm:bool=True, # keep BatchNorm layers FP32 (as fastai and Micikevicius et al. 2018 do)
    ):
        if len(specs) == 1 and isinstance(specs[0], (list, tuple, set)): specs = tuple(specs[0])
        self.specs = (('batchnorm',) if batchnorm else ()) + tuple(s for s in specs if s != 'batchnorm')
        self.matchers = [_matcher(s) for s in self.specs]

    @classmethod
    def make(cls, keep_fp32=None) -> PrecisionPolicy:
        "A policy from `keep_fp32`: None (BatchNorm only), a policy, one spec, or a list of specs (added to BatchNorm)."
        if isinstance(keep_fp32, PrecisionPolicy): return keep_fp32
        if keep_fp32 is None: return cls()
        return cls(*(keep_fp32 if isinstance(keep_fp32, (list, tuple, set)) else [keep_fp32]))

    def __repr__(self): return f"PrecisionPolicy(keep_fp32={list(self.specs)})"

    def _own_reason(self, name:str, m:nn.Module, model:nn.Module):
        "Why `m` itself is kept FP32 (None: it is not), from its override or the specs."
        if hasattr(m, _ATTR):
            dt = getattr(m, _ATTR)
            if dt not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(f"{name or 'the model'}.{_ATTR} = {dt!r}: expected torch.float32, torch.float16 or torch.bfloat16")
            return f"{_ATTR}=float32" if dt == torch.float32 else None
        return next((label for test, label in self.matchers if test(name, m, model)), None)

    def resolve(self, model:nn.Module) -> Resolved:
        "The modules of `model` kept FP32 (whole subtrees; and any module holding a tensor tied to a kept one)."
        names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        kept = {}
        def visit(name, m, inherited):
            reason = inherited or self._own_reason(name, m, model)
            if reason is not None: kept[id(m)] = reason
            for cn, c in m.named_children():
                visit(f"{name}.{cn}" if name else cn, c, f"inside {name or 'the model'}" if reason else None)
        visit('', model, None)
        self._pull_tied(model, kept, names)
        return Resolved(kept, self._islands(model, kept), names)

    def _pull_tied(self, model, kept:dict, names:dict):
        "A converted module that shares a tensor with a kept one is kept too (tied params stay one FP32 tensor)."
        changed = True
        while changed:
            changed = False
            owners = {}
            for n, m in model.named_modules(remove_duplicate=False):
                for t in list(m._parameters.values()) + list(m._buffers.values()):
                    if t is not None: owners.setdefault(id(t), []).append((n, m))
            for mods in owners.values():
                held = [n for n, m in mods if id(m) in kept]
                if not held: continue
                for n, m in mods:
                    if id(m) not in kept:
                        for sub in m.modules(): kept.setdefault(id(sub), f"tied to {held[0]}")
                        changed = True

    def _islands(self, model, kept:dict) -> list:
        "Kept modules whose parent is 16-bit (the root if the whole model is kept), except native mixed kernels."
        res = []
        def visit(name, m, parent_kept):
            if id(m) in kept and not parent_kept:
                if not (isinstance(m, _NATIVE_MIXED) and not any(True for _ in m.children())): res.append((name, m))
            for cn, c in m.named_children(): visit(f"{name}.{cn}" if name else cn, c, id(m) in kept)
        visit('', model, False)
        return res

class IslandHooks:
    """The boundary casts of the FP32 islands of a 16-bit model: each island's floating inputs to FP32 as it is entered,
    its floating outputs back to `dtype` as it returns; an island output that is also the model's output is given
    back in FP32 (the loss and softmax see the FP32 values, not their 16-bit rounding). `n_casts` counts the casts."""
    def __init__(self, model:nn.Module, islands:list, dtype:torch.dtype):
        self.model, self.dtype, self.handles, self.n_casts = model, dtype, [], 0
        self._fp32_of = {}  # id(16-bit island output) -> its FP32 value, for the current forward
        for name, m in islands:
            if m is model: continue  # the whole model is FP32: its inputs are cast up by `ModelToHalf`'s own hook
            self.handles.append(m.register_forward_pre_hook(self._cast_in, with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._cast_out))
        if self.handles: self.handles.append(model.register_forward_hook(self._model_out))

    def _count(self, b) -> int:
        if isinstance(b, torch.Tensor): return int(torch.is_floating_point(b))
        if isinstance(b, dict): return sum(self._count(v) for v in b.values())
        if isinstance(b, (list, tuple)): return sum(self._count(v) for v in b)
        return 0

    def _cast_in(self, module, args, kwargs):
        self.n_casts += self._count(args) + self._count(kwargs)
        return cast_floats(args, torch.float32), cast_floats(kwargs, torch.float32)

    def _cast_out(self, module, args, out):
        if isinstance(out, torch.Tensor) and torch.is_floating_point(out) and out.dtype != self.dtype:
            self.n_casts += 1
            res = out.to(self.dtype)
            self._fp32_of[id(res)] = (res, out)
            return res
        self.n_casts += self._count(out)
        return cast_floats(out, self.dtype)

    def _model_out(self, module, args, out):
        "The model's output: an island's 16-bit output goes back to its exact FP32 value; forget this forward's outputs."
        fp32, self._fp32_of = self._fp32_of, {}
        rec = fp32.get(id(out)) if isinstance(out, torch.Tensor) else None
        return rec[1] if rec is not None and rec[0] is out else None

    def remove(self):
        for h in self.handles: h.remove()
        self.handles, self._fp32_of = [], {}

def _dtype_name(dt) -> str: return str(dt).replace('torch.', '')

def _storage(m:nn.Module, dtype:torch.dtype, kept:bool) -> str:
    "The dtype(s) of `m`'s own params during a fit ('-' for none)."
    dts = {t.dtype for t in m.parameters(recurse=False)}
    if not dts: return '-'
    conv = {torch.float32, torch.float16, torch.bfloat16}
    return '/'.join(sorted({_dtype_name(d if kept or d not in conv else dtype) for d in dts}))

def policy_report(model:nn.Module, policy:PrecisionPolicy, dtype:torch.dtype, leaves:bool=False):
    """Each module of `model` (`leaves`: the modules without children, and the islands) with its storage dtype (its own
    params, during a fit), compute dtype, the casts inserted at its edges and why it is FP32: a pandas DataFrame."""
    import pandas as pd
    res = policy.resolve(model)
    roots = {id(m) for _, m in res.islands}
    rows = []
    for name, m in model.named_modules():
        kept, island = id(m) in res.kept, id(m) in roots
        if leaves and any(True for _ in m.children()) and not island: continue
        native = kept and not island and isinstance(m, _NATIVE_MIXED) and not _inside(res.kept[id(m)])
        compute = (f"float32 (16-bit in/out)" if native else 'float32') if kept else _dtype_name(dtype)
        casts = f"in: -> float32, out: -> {_dtype_name(dtype)}" if island and m is not model else '-'
        rows.append(dict(module=name or '(model)', type=type(m).__name__, storage=_storage(m, dtype, kept),
                         compute=compute, casts=casts, fp32_because=res.kept.get(id(m), '-')))
    return pd.DataFrame(rows, columns=['module', 'type', 'storage', 'compute', 'casts', 'fp32_because'])

def _inside(reason:str) -> bool: return reason.startswith('inside ')
