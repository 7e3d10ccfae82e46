"""The forward casts of a 16-bit model: floating inputs to its dtype as they enter, the FP32 islands' boundaries, the
entries that those miss (`EntryCasts`: calls from outside the model's forward, kept weights read without a call), and
a model converted for good (`to_half`, for the copies that diagnostics run). Cast containers keep their type."""
from __future__ import annotations
import copy, dataclasses, warnings
from functools import partial
import torch
from torch import nn

from ..dtypes import convert_network_keeping, ours
from ..policy import PrecisionPolicy, uncompiled, named_modules

__all__ = ['cast_floats', 'IslandHooks', 'EntryCasts', 'RangeWatch', 'to_half', 'in_backward']

def in_backward() -> bool:
    "Whether autograd's engine is running a backward in this thread (a tensor hook, a forward recomputed there)."
    return torch._C._current_graph_task_id() != -1

def _values(b):
    "The items of the container `b` (a dict's values, a dataclass's fields), in order; None for a leaf."
    if isinstance(b, (list, tuple)): return b
    if isinstance(b, dict): return list(b.values())
    if type(b).__name__ == 'L': return list(b)
    if dataclasses.is_dataclass(b) and not isinstance(b, type):
        return [getattr(b, f.name, None) for f in dataclasses.fields(b)]
    return None

_warned_types = set()  # the container types `_rebuild` could not rebuild, warned of once each

def _rebuild(b, new:list):
    """`b` with its items `new` (those that differ were cast), of `b`'s own type and with its other state: a dict
    subclass is copied then set item by item (transformers' `ModelOutput` syncs its attributes in `__setitem__`; its
    constructor takes fields, not pairs), a dataclass copied then set field by field (its `__init__`/`__post_init__` not
    run again), a namedtuple through `_make` (no custom `__new__`). A type that refuses: its builtin base, warned of."""
    if type(b) in (dict, tuple, list): return _plain(b, new)
    try: return _rebuilt(b, new)
    except Exception as e:
        res = _plain(b, new)
        if type(b) not in _warned_types:
            _warned_types.add(type(b))
            warnings.warn(f"fp16cb: cannot rebuild a {type(b).__qualname__} with its tensors cast ({e!r}): it is given "
                          f"as a plain {type(res).__name__} instead", RuntimeWarning, stacklevel=3)
        return res

def _plain(b, new:list):
    "`b`'s items `new` in a builtin container: a dict (a dataclass's fields too), a tuple or a list."
    if isinstance(b, dict): return dict(zip(b.keys(), new))
    if isinstance(b, tuple): return tuple(new)
    if isinstance(b, list) or type(b).__name__ == 'L': return list(new)
    return dict(zip([f.name for f in dataclasses.fields(b)], new))

def _rebuilt(b, new:list):
    "`_rebuild` for a subclass of a builtin container or a dataclass (may raise: the caller falls back)."
    if isinstance(b, dict):
        res = copy.copy(b)
        for (k, o), n in zip(list(b.items()), new):
            if n is not o: res[k] = n
        return res
    if isinstance(b, tuple) and hasattr(type(b), '_make'): return type(b)._make(new)
    if isinstance(b, (list, tuple)) or type(b).__name__ == 'L': return type(b)(new)
    res = copy.copy(b)  # a dataclass: frozen ones too (object.__setattr__), and the fields its `__init__` does not take
    for f, n in zip(dataclasses.fields(b), new):
        if n is not getattr(b, f.name, None): object.__setattr__(res, f.name, n)
    return res

def cast_floats(b, dtype:torch.dtype, keep64:bool=False):
    """Recursively cast the floating-point tensors of `b` (tensors, lists, tuples, dicts, dataclasses) to `dtype`;
    others untouched (`keep64`: float64 ones too, what a float64 layer inside an island is given on purpose). Each
    container keeps its type and its other fields (a Hugging Face `ModelOutput` read as `out.logits`, a namedtuple); one
    in which nothing was cast is given back as it is."""
    if isinstance(b, torch.Tensor):
        return (b.to(dtype) if torch.is_floating_point(b) and b.dtype != dtype
                and not (keep64 and b.dtype == torch.float64) else b)
    vals = _values(b)
    if not vals: return b
    new = [cast_floats(v, dtype, keep64) for v in vals]
    return b if all(n is v for n, v in zip(new, vals)) else _rebuild(b, new)

def _cast_inputs(dtype, watch=None):
    """A forward pre-hook: the model's floating inputs in `dtype`, whatever the callbacks did to `learn.xb` (MixUp).
    `watch(before, after)`: called with the inputs and their cast in eval mode (validation, inference)."""
    def hook(module, args, kwargs):
        a, k = cast_floats(args, dtype), cast_floats(kwargs, dtype)
        if watch is not None and not module.training: watch((args, kwargs), (a, k))
        return a, k
    return hook

def _floats(b) -> list:
    "The floating tensors of `b` (nested tensors, lists, tuples, dicts, dataclasses), in order."
    if isinstance(b, torch.Tensor): return [b] if torch.is_floating_point(b) else []
    return [t for v in _values(b) or () for t in _floats(v)]

class RangeWatch:
    """Whether casting the eval inputs to fp16 made an inf of a finite value (beyond fp16's 65504): a flag on the
    device, OR-ed batch by batch (no host sync), read once at the end of the validation (`found`)."""
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
            self.handles.append(ours(m.register_forward_pre_hook(partial(self._cast_in, dtype=inside),
                                                                 with_kwargs=True)))
            self.handles.append(ours(m.register_forward_hook(partial(self._cast_out, dtype=outside))))
        if self.handles: self.handles.append(ours(root.register_forward_hook(self._model_out)))

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
        """The model's output: an island's 16-bit output goes back to its exact FP32 value; forget this forward's
        outputs."""
        outs = list(self._outs)
        self._outs.clear()
        for res, fp32 in outs:
            if res is out: return fp32
        return None

    def remove(self):
        for h in self.handles: h.remove()
        self.handles = []
        self._outs.clear()

def _own_params(m:nn.Module) -> bool:
    "Whether `m` holds floating params of its own (what meets its inputs: a dtype mismatch fails there)."
    return any(p.is_floating_point() for p in m.parameters(recurse=False))

class EntryCasts:
    """The casts at the entry of 16-bit modules that neither the model's input cast nor the islands' casts reach:
    - calls from outside the model's forward: fastai's `GANLoss` calls the critic and the generator itself. The model's
      16-bit children, called outside its forward (the outermost call), take their floating inputs in `dtype` as the
      model does, and give their outputs in FP32 as `after_pred` gives the model's (the loss sees FP32 values). Inside
      the model's forward their hooks only read a counter;
    - a kept module's weights read without calling it: fastai's `EmbeddingDropout` runs `F.embedding(words,
      self.emb.weight)` and `AWD_LSTM` makes its hidden state from `one_param(self)`, both FP32 once the embedding is
      kept. Beside each FP32 island holding params (in its parent's subtree), the outermost 16-bit modules holding
      params of their own cast their floating inputs of another dtype to `dtype` as they are entered (a no-op when
      they are in `dtype`). None when no FP32 island holds params (the default: BatchNorm takes 16-bit inputs as it is).
    No hook at all when the whole model is FP32 (its 16-bit parts are islands: cast on entry already)."""
    def __init__(self, model:nn.Module, res, dtype:torch.dtype, copies=None):
        self.dtype, self.handles, self.depth, self._outer = dtype, [], 0, None  # depth: the model's calls under way
        self._out = None  # the forward hook of the outside call under way (or just ended: removed at the next)
        self.copies = copies  # the model keeps its FP32 params: a child called on its own computes with its copies
        root = uncompiled(model)
        if isinstance(root, (nn.DataParallel, nn.parallel.DistributedDataParallel)): root = uncompiled(root.module)
        if id(root) in res.kept: return
        self._outside(model, root, res.kept)
        self._beside(root, res)

    def _outside(self, model:nn.Module, root:nn.Module, kept:dict):
        """Hooks on the model (it counts its calls) and on its 16-bit children holding params (kept ones: cast already):
        a pre-hook each, which within the model's forward only reads the count; an outside call gets a forward hook
        of its own for its end (`_child_in`)."""
        kids = [c for c in root.children() if id(uncompiled(c)) not in kept and any(True for _ in c.parameters())]
        if not kids: return
        # no `always_call` hooks on the model: dynamo guards on their ids, and each fit's new ones would compile the
        # model again; a forward that raised leaves the counts behind: `reset` (`ModelToHalf.before_batch`) clears them
        self.handles += [ours(model.register_forward_pre_hook(self._enter, prepend=True)),
                         ours(model.register_forward_hook(self._leave))]
        self.handles += [ours(c.register_forward_pre_hook(self._child_in, with_kwargs=True)) for c in kids]

    def _enter(self, module, args): self.depth += 1
    def _leave(self, module, args, out): self.depth = max(self.depth - 1, 0)

    def reset(self):
        "No call under way; the forward hook of the last outside call gone (before the next forward: dynamo sees none)."
        self.depth, self._outer = 0, None
        if self._out is not None: self._out.remove(); self._out = None

    def _child_in(self, module, args, kwargs):
        """The outermost call of a child outside the model's forward: its inputs cast (inside it, its siblings' are
        not), and a forward hook for its end, before any other (always called: a forward that raises puts the params
        back too)."""
        # compiled: within the model's graph; in a backward: a recomputed forward, copies in place (`recompute`)
        if self.depth or torch.compiler.is_compiling() or in_backward(): return None
        self.reset()
        self.depth, self._outer = 1, module
        self._out = ours(module.register_forward_hook(self._child_out, prepend=True, always_call=True))
        if self.copies is not None: self.copies.enter(module)
        return cast_floats(args, self.dtype), cast_floats(kwargs, self.dtype)

    def _child_out(self, module, args, out):
        "The outside call's end: the params back, its output in FP32 (the hook itself goes at the next `reset`)."
        if self._outer is not module: return None
        self.depth, self._outer = 0, None  # (not removed here: torch may be iterating over the module's hooks)
        if self.copies is not None: self.copies.leave()
        return cast_floats(out, torch.float32)

    def _beside(self, root:nn.Module, res):
        "Entry casts on the 16-bit modules holding params beside the FP32 islands holding params."
        held = {id(i.module) for i in res.islands if i.fp32 and any(True for _ in i.module.parameters())}
        if not held: return
        seen = set()
        for _, p in named_modules(root):
            if id(p) not in res.kept and any(id(uncompiled(c)) in held for c in p.children()):
                self._hook_under(p, res.kept, seen)

    def _hook_under(self, m:nn.Module, kept:dict, seen:set):
        "The outermost 16-bit modules holding params under `m` (what they pass on inside is in `dtype` already)."
        for c in map(uncompiled, m.children()):
            if id(c) in kept or id(c) in seen: continue  # a kept subtree: FP32, its 16-bit parts are islands
            seen.add(id(c))
            if _own_params(c):
                self.handles.append(ours(c.register_forward_pre_hook(self._cast_entry, with_kwargs=True)))
            else: self._hook_under(c, kept, seen)

    def _cast_entry(self, module, args, kwargs):
        return cast_floats(args, self.dtype, True), cast_floats(kwargs, self.dtype, True) if kwargs else kwargs

    def remove(self):
        for h in self.handles: h.remove()
        self.handles = []
        self.reset()

def to_half(model:nn.Module, dtype:torch.dtype, policy:PrecisionPolicy):
    """Convert `model` in place, for good, as `ModelToHalf` does for a fit (a copy's: nothing to tear down): `policy`'s
    FP32 islands with their casts, the floating inputs cast to `dtype`. Returns the `Resolved` policy."""
    res = policy.resolve(model)
    convert_network_keeping(model, dtype, keep=set(res.kept))
    IslandHooks(model, res.islands, dtype)
    model.register_forward_pre_hook(_cast_inputs(torch.float32 if id(model) in res.kept else dtype), with_kwargs=True,
                                    prepend=True)
    EntryCasts(model, res, dtype)
    return res

