"""The fastai driver's fused runs: an elementwise fastai optimizer steps a run of per-param FP32 masters that lie
consecutive in one buffer as ONE call of its step callbacks on the run's flat view, instead of one call per param.

fastai's `Optimizer.step` runs its callbacks (weight decay, Adam's averages, the update) once per param: ~10 kernels
and ~80 us of host time each on a GPU, so a ResNet-50 (161 tensors) spends more host time in the optimizer than the
device spends in the whole step. A run's params are one flat tensor already (`lay_out`), and their FP32 grads one
flat buffer in the same memory order (`GradSink` puts them one after the other); the state of each param is kept as
views into one flat buffer per state key, so `opt.state[p]` still holds per-param tensors (checkpoints, `to_fp32()`,
Lookahead, the optimizer-state moves read them as before) while the step reads the buffer whole.

What steps on its own, as fastai would: a param whose scalar state differs from its neighbours' (its own step count, a
`do_wd=False` bias), one without a grad this step (not in the chunk's plan), and every param of an optimizer that reads
a param whole (LAMB, LARC: not `elementwise`)."""
from __future__ import annotations
import operator, weakref
from itertools import repeat
import torch
from torch import Tensor
from fastai.optimizer import _update

from .layout import flat_views, dense_strides, span_of

__all__ = ['FusedRun', 'fused_runs', 'is_param_state', 'FUSE_LIMIT', 'fuse_limit', 'FusedLoop', 'FUSED', 'lay_out',
           'flag_ranks', 'LAYOUT_RUN']

# The most elements one fused call of fastai's callbacks takes, by device type. On a CPU each callback is a pass over
# the stretch's weights, grads and moments: unbounded, a stretch of a whole chunk left the caches between the passes,
# and the compute-bound MLP's step went from 0.84-0.87x the bare bf16 model's speed to 0.77x; at 2^18 FP32 elements
# (1 MiB an array) it is 0.88-0.90x, and the many-tensor model still steps its small params a dozen to a call. A bigger
# param steps on its own. Elsewhere (a GPU: the calls' launches are the cost, not the caches) a stretch has no limit.
FUSE_LIMIT = {'cpu': 2**18}

def fuse_limit(device) -> float: return FUSE_LIMIT.get(torch.device(device).type, float('inf'))

def is_param_state(v, p) -> bool:
    "Whether the state entry `v` is a tensor shaped like its param `p` (a moment, a momentum), not a count or a flag."
    return isinstance(v, Tensor) and v.dim() > 0 and v.shape == p.shape

class FusedRun:
    """Masters consecutive in one FP32 buffer, of one param group, whose grads are consecutive in the scratch. Each
    step, its stretches of params with equal scalar state (step count, flags) and the same state keys are stepped by
    fastai's callbacks as one flat tensor each (`step`), at most `fuse_limit` elements a call; a param alone in its
    stretch is left to fastai's per-param update."""
    def __init__(self, items:list, master:Tensor, grad:Tensor):
        self.params, self.limit = [m for m, _ in items], fuse_limit(master.device)
        self.gi = items[0][1]
        self.master, self.grad = master, grad  # 1-d views over the run's masters and over their grads in the scratch
        self.offsets = [0]
        for p in self.params: self.offsets.append(self.offsets[-1] + p.numel())
        self.parts = {}  # {(first, end): _Stretch}, kept from step to step (their state buffers with them)

    def step(self, core, hyper:dict, kernel=None) -> list:
        """Step the run's stretches of equal state, each as one flat tensor (`kernel`: a compiled step to try first,
        `_Stretch.step`): returns the params stepped so."""
        if len(self.params) < 2: return []
        state, done, i = core.state, [], 0
        sts = list(map(state.__getitem__, self.params))
        sigs = _signatures(sts, self.params)
        n, off = len(self.params), self.offsets
        while i < n:
            j = i + 1
            while j < n and sigs[i] is not None and sigs[j] == sigs[i] and off[j + 1] - off[i] <= self.limit: j += 1
            if j - i > 1:
                part = self.parts.get((i, j))
                if part is None:  # new boundaries: the stretches they overlap go, with their buffers
                    self.parts = {k: v for k, v in self.parts.items() if k[1] <= i or k[0] >= j}
                    part = self.parts[(i, j)] = _Stretch(self, i, j)
                part.step(core, hyper, sts[i:j], sigs[i], kernel)
                done += self.params[i:j]
            i = j
        return done

def _signature(st:dict, p) -> tuple|None:
    """`(scalar entries, state keys shaped like p)` of a param's state: equal ones step together (None: never, a tensor
    scalar)."""
    scalars, keys = {}, []
    for k, v in st.items():
        if is_param_state(v, p): keys.append(k)
        elif isinstance(v, Tensor): return None
        else: scalars[k] = v
    return scalars, tuple(keys)

_shape, _grad, _requires = map(operator.attrgetter, ('shape', 'grad', 'requires_grad'))

def _signatures(sts:list, ps:list) -> list:
    """`_signature` of each param's state (`sts`, of `ps`), read a key at a time over all of them where every state
    holds the first one's keys in its order and each key is param-shaped tensors for all or a tensor for none (what an
    optimizer's states are): a few passes over the params in C, not a loop in Python per param and key (1 ms a step
    on the 300-param model); else param by param."""
    shapes = list(map(_shape, ps))
    order = list(sts[0]) if sts else []
    if not all(shapes) or not all(map(operator.eq, map(list, sts), repeat(order))):
        return list(map(_signature, sts, ps))
    keys, names, vals = [], [], []
    for k in order:
        vs = list(map(operator.itemgetter(k), sts))
        tensors = sum(map(isinstance, vs, repeat(Tensor)))
        if tensors == len(vs) and list(map(_shape, vs)) == shapes: keys.append(k)
        elif tensors: return list(map(_signature, sts, ps))
        else: names.append(k); vals.append(vs)
    scalars = map(dict, map(zip, repeat(names), zip(*vals) if vals else repeat((), len(ps))))
    return list(zip(scalars, repeat(tuple(keys))))

class _Stretch:
    "Params `first:end` of a `FusedRun`: its flat views, and one flat buffer per state key whose views the params hold."
    def __init__(self, run:FusedRun, first:int, end:int):
        a, b = run.offsets[first], run.offsets[end]
        self.params, self.master, self.grad = run.params[first:end], run.master[a:b], run.grad[a:b]
        self.bufs, self.views = {}, {}

    def step(self, core, hyper:dict, sts:list, sig:tuple, kernel=None):
        """One update by fastai's callbacks of the stretch as one flat tensor, its state spread back into each param's;
        or by `kernel(weights, grads, {key: flat state}, scalars, hyper)`, which gives the new state (None: it did not
        apply)."""
        scalars, keys = sig
        flat = {k: self._flat(k, sts) for k in keys}
        st = None if kernel is None else kernel(self.master, self.grad, flat, scalars, hyper)
        self._spread(self._callbacks(core, hyper, scalars, flat) if st is None else st, sts, flat)

    def _callbacks(self, core, hyper:dict, scalars:dict, flat:dict) -> dict:
        "fastai's callbacks on the stretch as one flat tensor: the new state."
        q = self.master
        q.grad = self.grad
        try:
            st = {**scalars, **flat}
            for cb in core.cbs: st = _update(st, cb(q, **{**st, **hyper}))
        finally: q.grad = None
        return st

    def _flat(self, k, sts:list) -> Tensor:
        """The flat buffer of state key `k`, whose views the params' states `sts` hold (when they don't: a buffer made,
        filled with their tensors, and its views given to them in their place)."""
        ts, views = [st[k] for st in sts], self.views.get(k)
        if views is not None and all(map(operator.is_, ts, views)): return self.bufs[k]
        if all(map(_same_order, self.params, ts)) and (span := span_of(ts)) is not None:
            return span  # widened for this step, one after the other: stepped in place
        buf = torch.empty(self.master.numel(), dtype=ts[0].dtype, device=self.master.device)
        views = flat_views(buf, self.params)
        torch._foreach_copy_(views, [t.detach() for t in ts])
        for st, v in zip(sts, views): st[k] = v
        self.bufs[k], self.views[k] = buf, views
        return buf

    def _spread(self, st:dict, sts:list, flat:dict):
        """The fused update's state back into each param's: flat tensors the step replaced are copied into the buffer,
        new ones (the first step's moments) become buffers whose views the params get; scalars (the step count) each its
        own."""
        n = self.master.numel()
        for k, v in st.items():
            if k in flat:
                if v is not flat[k]: flat[k].copy_(v)
                continue
            if isinstance(v, Tensor) and v.dim() == 1 and v.numel() == n:
                self.bufs[k], self.views[k] = v, flat_views(v, self.params)
                for s, view in zip(sts, self.views[k]): s[k] = view
                continue
            for s in sts: s[k] = v.clone() if isinstance(v, Tensor) else v

def _contiguous(a:Tensor, b:Tensor) -> bool:
    "Whether the dense tensor `b` starts right where `a` ends, in the same storage."
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() + a.numel() == b.storage_offset())

def fused_runs(masters:list, views:list, groups:list) -> list:
    """The `FusedRun`s of a chunk's plan: its `masters` with their grads' scratch `views` and param `groups`, in scratch
    order, cut where a master or its grad does not continue the previous one in memory, or the group changes."""
    runs, cur = [], []
    def close():
        if not cur: return
        ms, vs = [m for m, _, _ in cur], [v for _, v, _ in cur]
        runs.append(FusedRun([(m, gi) for m, _, gi in cur], _span(ms), _span(vs)))
    for m, v, gi in zip(masters, views, groups):
        if cur:
            pm, pv, pgi = cur[-1]
            if not (gi == pgi and _contiguous(pm, m) and _contiguous(pv, v) and _same_order(m, v)
                    and _same_order(pm, pv)):
                close(); cur = []
        cur.append((m, v, gi))
    close()
    return runs

def _same_order(m:Tensor, g:Tensor) -> bool:
    "Whether `m` and its grad `g` are dense with the same strides (their elements in the same memory order)."
    return _dense(m) and tuple(m.stride()) == tuple(g.stride())

def _dense(t:Tensor) -> bool:
    "Whether `t` (at least 1-d) fills exactly `t.numel()` elements of its storage (any order of its dims)."
    return tuple(t.stride()) == dense_strides(t) and t.dim() > 0

def _span(ts:list) -> Tensor:
    "The 1-d tensor over the memory of the consecutive dense tensors `ts`."
    t = ts[0].detach()
    return t.as_strided((sum(x.numel() for x in ts),), (1,), t.storage_offset())

# -- the fused loop of a fit whose optimizer steps the model's own FP32 params (`params.ModelParams`)
FUSED = weakref.WeakKeyDictionary()  # a fastai optimizer -> its `FusedLoop`, while a fit steps its params laid out

class FusedLoop:
    """The `FusedRun`s of a fastai optimizer's params, remade when a param's or a grad's memory changed. The runs hold
    views of the memory they step, so an address seen again is the same memory, never a new tensor put there."""
    def __init__(self): self._key, self._runs, self.n_grads = None, [], 0

    def runs(self, core) -> list:
        """The `FusedRun`s of `core`'s params with a grad (those of the last step, when nothing moved since); how many
        params have a grad: `n_grads`."""
        items = [(p, gi) for gi, pg in enumerate(core.param_lists) for p in pg if p.grad is not None]
        self.n_grads = len(items)
        key = [(p.data_ptr(), p.grad.data_ptr()) for p, _ in items]
        if key != self._key:  # runs in memory order (the step does not depend on the order of the params)
            pos = {id(p): i for i, (p, _) in enumerate(items)}
            items = sorted(items, key=lambda it: (it[1], it[0].data_ptr()))
            runs = fused_runs([p for p, _ in items], [p.grad for p, _ in items], [gi for _, gi in items])
            # stepped in the params' order, whatever their addresses: ranks draw their stochastic roundings alike
            self._runs, self._key = sorted(runs, key=lambda r: pos[id(r.params[0])]), key
        return self._runs

    def zero_grad(self, core) -> bool:
        """fastai's `zero_grad` of `core` as a pass over each run's grads, where the runs of the last step hold them all
        and none is one that `detach_` changes or refuses (in a graph, a view); else False, nothing done."""
        ps = [p for pg in core.param_lists for p in pg if p.grad is not None]
        if self._key is None or [(p.data_ptr(), p.grad.data_ptr()) for p in ps] != self._key: return False
        gs = list(map(_grad, ps))
        if any(map(_requires, gs)) or any(map(Tensor._is_view, gs)): return False
        for r in self._runs:
            if len(r.params) > 1: r.grad.zero_()
        if alone := [r.params[0].grad for r in self._runs if len(r.params) == 1]: torch._foreach_zero_(alone)
        return True

    def forget(self):
        "Let the runs (and the grads' memory they view) go: the grads were dropped."
        self._key, self._runs = None, []

LAYOUT_RUN = {'cpu': 2**18}  # the most elements laid out in one buffer, by device type (elsewhere 2^25: 128 MiB)

def flag_ranks(params:list, state:dict) -> list:
    """Each param's rank of its optimizer flags (the state's entries that are not tensors: fastai's `do_wd`), ranked by
    where each set first appears: params of one rank lie together, so that fastai's loop steps them as one."""
    flags = [tuple(sorted((k, repr(v)) for k, v in state.get(p, {}).items() if not isinstance(v, Tensor)))
             for p in params]
    first = {}
    for f in flags: first.setdefault(f, len(first))
    return [first[f] for f in flags]

def lay_out(groups:list, state:dict, limit:int=0):
    """Each group's trainable params made consecutive in memory, a buffer per run of one device and dtype (at most
    `limit` elements; 0: `LAYOUT_RUN`'s, so that the copy made for it is bounded; None: no limit, one buffer), ordered
    by their optimizer flags in `state` (fastai's `do_wd`: what steps as one flat tensor lies together): `p.data`
    becomes a view into it, with the same values and strides. Params consecutive already stay where they are."""
    for pg in groups:
        ps = [q for q in pg if q.requires_grad and q.numel()]
        ranks = flag_ranks(ps, state)
        run, n = [], 0
        for p in [ps[i] for i in sorted(range(len(ps)), key=lambda i: ranks[i])] + [None]:
            if p is not None and (not run or _joins(run[0], p, n + p.numel(), limit)):
                run.append(p); n += p.numel(); continue
            if len(run) > 1 and not all(_contiguous(a, b) and _dense(a) and _dense(b) for a, b in zip(run, run[1:])):
                _move(run, n)
            run, n = ([p], p.numel()) if p is not None else ([], 0)

def _move(run:list, n:int):
    """The params of `run` (`n` elements) copied into one buffer, each `.data` a view into it; the grads they have into
    another, at the same places (the grads the backward adds to in place, as fastai's `zero_grad` keeps them)."""
    for attr in ('data', 'grad'):
        ps = [q for q in run if getattr(q, attr) is not None]
        if not ps: continue
        views = flat_views(torch.empty(n, dtype=run[0].dtype, device=run[0].device), run)
        # not views for autograd (as the backward's own grads are not): fastai's `zero_grad` detaches a grad in place
        views = [v.detach() for q, v in zip(run, views) if getattr(q, attr) is not None]
        with torch.no_grad(): torch._foreach_copy_(views, [getattr(q, attr).detach() for q in ps])
        for q, v in zip(ps, views): setattr(q, attr, v)

def _joins(first, p, n:int, limit:int=0) -> bool:
    "Whether `p` continues the run that starts with `first` (the same device and dtype, `n` elements within `limit`)."
    if limit == 0: limit = LAYOUT_RUN.get(first.device.type, 2**25)
    return p.device == first.device and p.dtype == first.dtype and (limit is None or n <= limit)
