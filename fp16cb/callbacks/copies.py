"""The copies a forward computes with. During a fit the model's params stay the user's FP32 Parameters: what the
optimizer steps, what `state_dict`, `deepcopy`, a save or any callback reads and writes (the one copy of the truth,
as PyTorch FSDP2's `MixedPrecisionPolicy` keeps them). As the model's forward starts, one fused pass makes the copies
its modules compute with (16-bit outside the FP32 islands; inside them, trainable params get same-dtype copies that
only carry the grads back) and puts them in the modules' places for that forward; as it returns, the Parameters are
back. In the backward the copies' grads come back onto the FP32 params, a fused pass per device and dtype, divided
by the loss scale on the way: `p.grad` is FP32 and unscaled, as FP32 fastai holds it, whoever reads it and whenever."""
from __future__ import annotations
import operator, warnings, weakref
from itertools import repeat
import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook, register_module_forward_hook

from ..policy import uncompiled, is_compiled
from ..dtypes import ours
from ..scaling.check import _by_device
from ..weights.layout import flat_views
from .casts import in_backward

__all__ = ['GradSink', 'ComputeCopies', 'hook_target']

class GradSink:
    """Where the copies' grads arrive: in their sources' dtypes, divided by the loss scale of the backward that made
    them (`inv_scale`, set by the callback before each backward). The inf/NaN check reads `p.grad` at the step, which
    sees whatever else wrote into it too.
    A loss-scaled fit (`hook`) divides the scale out of every part of `p.grad`, as FP32 fastai's is unscaled: the
    copies' grads in one fused pass as they arrive; a param that the backward reaches some other way too (code that
    uses the params outside the forward: a penalty on the weights in the loss), found by a walk of the loss's graph as
    the backward begins, after autograd has summed what reaches it, by a hook for that backward (its copy's grad left
    scaled then)."""
    inv_scale, scaled = 1., False

    def __init__(self): self.watched, self.hooks, self.others, self._mine = {}, [], set(), {}

    def begin(self, scale:float, loss:torch.Tensor|None=None):
        """The backward of `loss`, scaled by `scale`, is coming: its grads arrive divided by the scale, until it ends
        (autograd's engine calls `end` then: a later backward or `torch.autograd.grad` of other code is not scaled)."""
        self.inv_scale, self._mine = 1. / scale, {}
        self._drop()
        if scale != 1. and loss is not None and loss.grad_fn is not None:
            loss.grad_fn.register_prehook(self._started)  # (the scale's own product: the backward's first node)
            if self.scaled: self._hook_others(loss.grad_fn)

    def _started(self, grad_outputs):
        torch.autograd.Variable._execution_engine.queue_callback(self.end)  # (the callback: as the backward ends)

    def end(self):
        self.inv_scale = 1.
        self._drop()

    def hook(self, params):
        "From now on, the loss scale is divided out of every part of `params`' grads (the class docstring)."
        ps = [p for p in params if p.requires_grad]
        self.scaled = True
        self.watched.update(zip(map(id, ps), map(weakref.ref, ps)))

    def unhook(self):
        self._drop()
        self.watched, self.scaled = {}, False

    def _drop(self):
        for h in self.hooks: h.remove()
        self.hooks, self.others = [], set()

    def _hook_others(self, root):
        """A hook for this backward on each watched param that the graph of `root` reaches other than through the
        copies: a walk of the graph, which stops at the copies' nodes."""
        seen, todo, watched = {root}, [root], self.watched
        while todo:
            for node, _ in todo.pop().next_functions:
                if node is None or node in seen or isinstance(node, _CAST_NODE): continue
                seen.add(node)
                if not isinstance(node, _LEAF_NODE):
                    todo.append(node)
                    continue
                p = node.variable
                if (r := watched.get(id(p))) is not None and r() is p and id(p) not in self.others:
                    self.others.add(id(p))
                    self.hooks.append(p.register_hook(self._unscale))

    def _unscale(self, g):
        "A param's grad of this backward, all of it: divided by the scale (in place when it is one of ours)."
        if g is None or self.inv_scale == 1.: return None  # (an unused copy's: no grad)
        b = g._base
        if b is not None and (r := self._mine.get(id(b))) is not None and r() is b:
            g.mul_(self.inv_scale)  # our buffer's view, autograd's alone: the params' layout kept
            return None
        return g * self.inv_scale

    def arrive(self, grads:list, sources:tuple) -> list:
        """The grads of the copies (None: unused) as the grads of their `sources`: in their dtypes, unscaled (a source
        hooked for this backward: still scaled, its hook divides the sum), one after the other in memory in the
        sources' own order in memory (a fused step takes runs of both). Unscaled already (bf16), into sources that all
        hold a grad (fastai's `zero_grad` zeroes them in place): as they are, autograd casting each to its source's
        dtype as it adds it where that grad lies (no buffer of ours)."""
        inv, others = self.inv_scale, self.others
        if torch.is_grad_enabled():  # a backward that builds its own graph (`create_graph`): differentiable, no buffer
            return [g if g is None else g.to(p.dtype) * inv if inv != 1. and id(p) not in others else g.to(p.dtype)
                    for g, p in zip(grads, sources)]
        held = _held(grads, sources)
        if inv == 1. and held: return grads
        res, idx = [None] * len(grads), [i for i, g in enumerate(grads) if g is not None]
        if not idx: return res
        if not held: idx.sort(key=lambda i: sources[i].data_ptr())  # (they become the grads: laid out as the params)
        srcs = [grads[i].to_dense() if grads[i].is_sparse else grads[i] for i in idx]
        outs, flats = _consecutive(srcs, [sources[i].dtype for i in idx])
        torch._foreach_copy_(outs, srcs)
        if others:  # (their hooks divide the sums: in place in our buffers)
            self._mine.update((id(f), weakref.ref(f)) for f in flats)
        if inv != 1. and not others:  # (the buffers hold the grads and nothing else: one pass each)
            for f in flats: f.mul_(inv)
        elif inv != 1.:
            mine = [t for i, t in zip(idx, outs) if id(sources[i]) not in others]
            for ts in _by_device(mine).values(): torch._foreach_mul_(ts, inv)
        for i, t in zip(idx, outs): res[i] = t
        return res

_LEAF_NODE = torch._C._functions.AccumulateGrad  # (the node of a leaf's grad: a param's)
_second, _sparse, _grad = operator.itemgetter(1), operator.attrgetter('is_sparse'), operator.attrgetter('grad')

def _held(grads:list, sources:list) -> bool:
    "Whether the grads that came (not None) are dense and their sources hold a grad (in C, not a loop per param)."
    gs, ps = [g for g in grads if g is not None], [p for g, p in zip(grads, sources) if g is not None]
    return not any(map(_sparse, gs)) and not any(map(operator.is_, map(_grad, ps), repeat(None)))

def _consecutive(like:list, dtypes:list) -> list:
    """Empty tensors shaped and strided as `like`, in `dtypes`: views one after the other into one buffer per device
    and dtype, so that the grads they become are consecutive in memory, as the params are for a fused step; and the
    buffers."""
    res, parts, flats = [None] * len(like), {}, []
    for i, (t, dt) in enumerate(zip(like, dtypes)): parts.setdefault((t.device, dt), []).append(i)
    for (dev, dt), ii in parts.items():
        ts = [like[i] for i in ii]
        flats.append(torch.empty(sum(t.numel() for t in ts), dtype=dt, device=dev))
        for i, v in zip(ii, flat_views(flats[-1], ts)): res[i] = v
    return res, flats

class _Cast(torch.autograd.Function):
    """The copies of a set of params in one fused pass, one autograd node for all; in the backward their grads come
    back through the `GradSink` (one fused pass per device and dtype), each onto its param (None where unused)."""
    @staticmethod
    def forward(ctx, sink:GradSink, dtypes:tuple, *ps):
        ctx.sink, ctx.sources = sink, ps
        ctx.set_materialize_grads(False)
        out = [torch.empty_like(p, dtype=d) for p, d in zip(ps, dtypes)]
        torch._foreach_copy_(out, list(ps))
        return tuple(out)

    @staticmethod
    def backward(ctx, *gs):
        return (None, None, *ctx.sink.arrive(list(gs), ctx.sources))

_CAST_NODE = _Cast._backward_cls  # (a node of the copies' grads)

def dtype_for(t:torch.Tensor, half:bool, dtype:torch.dtype):
    """The dtype of `t`'s copy in a forward (`half`: its module computes in 16-bit), None for no copy: FP32 floats
    of 16-bit modules are cast; trainable params of other dtypes (FP32 islands, float64, complex) get a copy of their
    own dtype, through which their grads arrive unscaled; a buffer keeps its own dtype, and an integer stays as is."""
    if not (t.is_floating_point() or t.is_complex()): return None
    if half and t.dtype == torch.float32: return dtype
    return t.dtype if isinstance(t, nn.Parameter) and t.requires_grad else None

def hook_target(model:nn.Module) -> nn.Module:
    """The module whose forward is the model's call: a DDP wrapper's module (DDP broadcasts its buffers first), a
    compiled model's wrapper (the copies are made outside the compiled graph, which takes them as inputs)."""
    while isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)): model = model.module
    return model

BUCKET = 2**19  # elements of a bucket of copies (one autograd node): 1 MiB of 16-bit grads

def _buckets(pairs:list, size:int) -> list:
    "`pairs` (`(tensor, dtype)`) cut in consecutive runs of about `size` elements (a bigger tensor alone)."
    res, cur, n = [], [], 0
    for t, dt in pairs:
        if cur and n + t.numel() > size: res.append(cur); cur, n = [], 0
        cur.append((t, dt)); n += t.numel()
    return res + [cur] if cur else res

def _plan(slots:list, dtype:torch.dtype) -> tuple:
    """`(grad, nograd, live)` of the tensors in `slots` now (`(module, kind, name, half)`: read at each forward, so that
    a `.to()`, a param replaced or frozen since is followed): the trainable params and the others, each `(tensor,
    dtype of its copy)` once, and `(module, kind, name, tensor)` of every place to swap."""
    grad, nograd, live, seen = [], [], [], set()
    for m, kind, n, half in slots:
        t = getattr(m, kind).get(n)
        if t is None: continue
        to = dtype_for(t, half, dtype)
        if to is None: continue
        live.append((m, kind, n, t))
        if id(t) in seen: continue
        seen.add(id(t))
        (grad if kind == '_parameters' and t.requires_grad else nograd).append((t, to))
    return grad, nograd, live

class _Plans:
    """`_plan` of a list of slots, read again only when it may differ: a place holds another tensor since (a param
    replaced, deleted or registered), or one of the tensors changed dtype (`.data =`) or `requires_grad` (frozen,
    unfrozen). A forward reads its plan in one pass over the places, not one `dtype_for` per tensor."""
    def __init__(self, dtype:torch.dtype): self.dtype, self.memo = dtype, {}

    def __call__(self, slots:list) -> tuple:
        key, memo = id(slots), self.memo.get(id(slots))
        if memo is not None:
            dicts, names, ts, flags, res = memo
            if all(map(operator.is_, map(dict.get, dicts, names), ts)) and _flags(ts) == flags: return res
        res = _plan(slots, self.dtype)
        res += _layout(res)
        dicts, names = [getattr(m, kind) for m, kind, _, _ in slots], [n for _, _, n, _ in slots]  # (the modules' own)
        ts = list(map(dict.get, dicts, names))
        self.memo[key] = (dicts, names, ts, _flags(ts), res)
        return res

    def clear(self): self.memo = {}

def _layout(plan:tuple) -> tuple:
    """`(buckets, places)` of a `_plan`, what each forward of it does, worked out once: the trainable params' buckets
    (`(sources, their copies' dtypes)`), and the places to swap, `(dicts, names, sources, indices of the buffers)`."""
    grad, _, live = plan
    buckets = [([t for t, _ in b], tuple(map(_second, b))) for b in _buckets(grad, BUCKET)]
    places = ([getattr(m, kind) for m, kind, _, _ in live], [n for _, _, n, _ in live], [t for *_, t in live],
              [i for i, (_, kind, _, _) in enumerate(live) if kind == '_buffers'])
    return buckets, places

_dtype, _requires = operator.attrgetter('dtype'), operator.attrgetter('requires_grad')

def _flags(ts:list) -> tuple:
    ts = [t for t in ts if t is not None]
    return list(map(_dtype, ts)), list(map(_requires, ts))

class ComputeCopies:
    """The copies the model computes with during a fit (module docstring). `dtype`: the compute dtype outside the FP32
    islands; `kept`: the ids of the modules that stay FP32 (`PrecisionPolicy.resolve(...).kept`)."""
    def __init__(self, model:nn.Module, kept, dtype:torch.dtype, sink:GradSink=None):
        target = hook_target(model)
        self.dtype, self.sink, self.kept = dtype, sink or GradSink(), kept
        self.depth, self._live, self._cache, self._subsets, self._again = 0, None, None, {}, []
        self._plans, self._watched = _Plans(dtype), None
        self.slots = self._slots(uncompiled(target))
        self._mods = {id(m) for m in uncompiled(target).modules()}
        # dynamo reads `.grad` of the tensors a compiled forward takes, which warns for copies (not leaves): quiet there
        self._quiet, self._quieted = is_compiled(target), None
        self.handles = [ours(target.register_forward_pre_hook(self._enter_root, prepend=True)),
                        ours(target.register_forward_hook(self._leave_root, always_call=True))]

    def _slots(self, root:nn.Module) -> list:
        "`(module, kind, name, half)` of every param and buffer under `root` (`half`: its module computes in 16-bit)."
        res = []
        for m in root.modules():  # each module once (a shared one too)
            half = id(m) not in self.kept
            res += [(m, '_parameters', n, half) for n in m._parameters]
            if half: res += [(m, '_buffers', n, True) for n in m._buffers]
        return res

    def computed_in(self, dtype) -> list:
        "The trainable params that compute in `dtype` now (their grads were `dtype` grads before they arrived)."
        return [t for t, dt in _plan(self.slots, self.dtype)[0] if dt == dtype]

    def _subset(self, module:nn.Module) -> list:
        key = id(module)
        if key not in self._subsets:
            mods = {id(m) for m in uncompiled(module).modules()}
            self._subsets[key] = [s for s in self.slots if id(s[0]) in mods]
        return self._subsets[key]

    def _make(self, grad:list, nograd:list, buckets:list, whole:bool) -> dict:
        """`{id(source): copy}` (`whole`: of the whole model). The trainable params' copies in buckets of about `BUCKET`
        elements in the modules' order, an autograd node each: the backward brings a bucket's grads to FP32 once it
        has passed the bucket's modules, and its 16-bit grads go, so that they never all live at once."""
        if torch.is_grad_enabled() and grad:
            if self.sink.scaled and grad is not self._watched:  # (a plan of params, new or made trainable since)
                self.sink.hook([t for t, _ in grad])
                self._watched = grad
            self._cache, copies = None, {}
            for srcs, dtypes in buckets: copies.update(zip(map(id, srcs), _Cast.apply(self.sink, dtypes, *srcs)))
            rest = nograd
        else: copies, rest = {}, grad + nograd
        if rest: copies.update(self._nograd(rest, cache=whole and not copies))
        return copies

    def _nograd(self, pairs:list, cache:bool) -> dict:
        "Copies made without autograd (frozen params, buffers, inference), kept while their sources do not change."
        stamp = tuple((t.data_ptr(), t._version) for t, _ in pairs) if cache else None
        if cache and self._cache is not None and self._cache[0] == stamp: return self._cache[1]
        with torch.no_grad():
            outs = [torch.empty_like(t, dtype=dt) for t, dt in pairs]
            torch._foreach_copy_(outs, [t for t, _ in pairs])
        res = {id(t): o for (t, _), o in zip(pairs, outs)}
        self._cache = (stamp, res) if cache else None
        return res

    def enter(self, module:nn.Module=None):
        "A forward of the model (or, `module`, of a part of it called on its own) starts: its copies in place."
        self.depth += 1
        if self.depth > 1: return
        if self._quiet:
            self._quieted = warnings.catch_warnings()
            self._quieted.__enter__()
            warnings.filterwarnings('ignore', message='The .grad attribute of a Tensor that is not a leaf')
        grad, nograd, _, buckets, places = self._plans(self.slots if module is None else self._subset(module))
        copies = self._make(grad, nograd, buckets, module is None)
        dicts, names, srcs, bufs = places
        cs = list(map(copies.__getitem__, map(id, srcs)))
        self._live = (places, cs, [cs[i]._version for i in bufs])
        list(map(operator.setitem, dicts, names, cs))

    def leave(self):
        "The forward returns: the sources back in place (a buffer the forward changed gets the change)."
        self.depth = max(self.depth - 1, 0)
        if self.depth: return
        quieted, self._quieted = self._quieted, None
        if quieted is not None: quieted.__exit__(None, None, None)
        if self._live is None: return
        ((dicts, names, srcs, bufs), cs, versions), self._live = self._live, None
        list(map(operator.setitem, dicts, names, srcs))
        for i, v in zip(bufs, versions):
            if cs[i]._version != v:
                with torch.no_grad(): srcs[i].copy_(cs[i])

    def sources(self) -> dict:
        "`{copy: its source}` of the copies in place now (mid-forward), for code that wants the FP32 truth of a module."
        if self._live is None: return {}
        return dict(zip(self._live[1], self._live[0][2]))

    def recompute(self, on:bool=True):
        """From the forward's end to the backward's (`on`): a module of the model that runs inside a backward
        (activation checkpointing recomputes its forward there) computes with copies of its params, made anew as in the
        forward: the same values, and in a reentrant checkpoint the grads' way back to the params. Hooks on every module
        of the process, so off during the forward (which pays nothing)."""
        if not on:
            for h in self._again: h.remove()
            self._again = []
        elif not self._again:
            self._again = [register_module_forward_pre_hook(self._again_in),
                           register_module_forward_hook(self._again_out, always_call=True)]

    def _again_in(self, module, args):
        if id(module) in self._mods and in_backward(): self.enter(module)
    def _again_out(self, module, args, out):
        if id(module) in self._mods and in_backward(): self.leave()

    def _enter_root(self, module, args): self.enter()
    def _leave_root(self, module, args, out): self.leave()

    def drop_cache(self):
        "Let the copies kept for inference go (a validation is over: training makes its own each forward)."
        self._cache = None

    def reset(self):
        "A forward that raised before its hook could return: the sources back."
        self.depth = min(self.depth, 1)
        self.leave()

    def remove(self):
        self.reset()
        self.recompute(False)
        for h in self.handles: h.remove()
        self.handles, self._cache, self._subsets = [], None, {}
        self._plans.clear()
