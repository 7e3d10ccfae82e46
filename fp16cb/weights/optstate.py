"""The optimizer's side of the weight store: which optimizer holds the params and state (inside fastai's `Lookahead`;
inside a torch optimizer that wraps another, such as timm's `Lookahead`), fastai's per-param update run by hand, and
the per-param state (and `Lookahead`'s slow weights) moved between the model's params and the tensors the optimizer
steps during a fit, merged into flat masters and split back."""
from __future__ import annotations
import torch
from torch import Tensor
from fastai.optimizer import Optimizer, OptimWrapper, _BaseOptimizer, _update

from ..compat import known_elementwise
from .layout import memory_order, with_layout_of

__all__ = ['copy_clone', 'innermost', 'wrapped', 'opt_state', 'opt_states', 'fastai_update',
           'steps_param_by_param', 'elementwise', 'PlainState', 'sliced_update', 'sliced', 'slice_state',
           'narrow_slice', 'narrow_new', 'keep_slice']

def innermost(opt):
    "The optimizer that holds the param lists and state: inside fastai's `Lookahead` (and the like), the wrapped one."
    while (not isinstance(opt, OptimWrapper) and type(opt) is not Optimizer
           and isinstance(getattr(opt, 'opt', None), _BaseOptimizer)):
        opt = opt.opt
    return opt

def _same_groups(a, b) -> bool:
    "Whether torch optimizers `a` and `b` step the same param groups (the same list, or lists of the same params)."
    ga, gb = a.param_groups, b.param_groups
    return ga is gb or (len(ga) == len(gb) and all(x is y or x['params'] is y['params'] for x, y in zip(ga, gb)))

def wrapped(opt) -> list:
    """Torch optimizer `opt` and those it wraps, outermost first: each an attribute of the one before that is a torch
    `Optimizer` stepping the same param groups (timm's `Lookahead` and its `_base_optimizer`, SAM's `base_optimizer`,
    SWA's `optimizer`), whose step the wrapper's calls, and whose state holds the per-param state (known by what it is,
    not by its attribute's name)."""
    res = [opt]
    while True:
        o = res[-1]
        inner = next((v for v in vars(o).values() if isinstance(v, torch.optim.Optimizer)
                      and all(v is not r for r in res) and _same_groups(v, o)), None)
        if inner is None: return res
        res.append(inner)

def opt_states(opt) -> list:
    """Every per-param state dict of `opt`, each once: a fastai `Optimizer`'s own; an `OptimWrapper`'s torch optimizer's
    and those of the optimizers it wraps (`wrapped`), the innermost last. Whatever moves between params moves in all."""
    opt = innermost(opt)
    inner = getattr(opt, 'opt', None)
    if not isinstance(inner, torch.optim.Optimizer): return [opt.state]
    return list({id(o.state): o.state for o in wrapped(inner)}.values())

def opt_state(opt) -> dict:
    """The per-param state dict of `opt` that holds its moments: a fastai `OptimWrapper` keeps it in the wrapped torch
    optimizer, and a torch optimizer that wraps another (timm's `Lookahead`) in that one (`opt_states`)."""
    return opt_states(opt)[-1]

def copy_clone(d:dict) -> dict:
    "A detached FP32 clone of every tensor of the optimizer-state dict `d`, other values as they are."
    return {k: (v.detach().clone().float() if isinstance(v, Tensor) and torch.is_floating_point(v) else
                v.detach().clone() if isinstance(v, Tensor) else v) for k, v in d.items()}

def fastai_update(core, p, hyper:dict, key=None):
    "fastai's `Optimizer.step` for one param `p`: its callbacks in order, on the state kept under `key` (default `p`)."
    key = p if key is None else key
    state = core.state[key]
    for cb in core.cbs: state = _update(state, cb(p, **{**state, **hyper}))
    core.state[key] = state

def steps_param_by_param(core) -> bool:
    "Whether `core` is a fastai `Optimizer` whose `step` is fastai's own loop over params (so we may run it ourselves)."
    return isinstance(core, Optimizer) and getattr(type(core), 'step', None) is Optimizer.step

def elementwise(core) -> bool:
    """Whether optimizer `core` steps each element on its own, as `fp16cb.compat` declares it (`known_elementwise`): a
    fastai `Optimizer` run by fastai's own loop whose callbacks are all elementwise, or an `OptimWrapper` around one of
    torch's elementwise optimizers. Such an optimizer steps a param cut in parts exactly as it steps it whole."""
    return (isinstance(core, OptimWrapper) or steps_param_by_param(core)) and known_elementwise(core)

class PlainState:
    """How a param's state is cut in slices and put back, for state tensors as they are (`storage.StateStorage` does the
    same for the 8-bit codes it keeps): the whole of it, laid out as the param and in memory order, its slices, and a
    slice's new value written into one."""
    def relaid(self, v:Tensor, p) -> Tensor: return with_layout_of(v, p)
    def flat(self, v:Tensor) -> Tensor: return memory_order(v)
    def part(self, v:Tensor, s:slice) -> Tensor: return v[s]
    def put_(self, dst:Tensor, src:Tensor): dst.copy_(src)
    def aligned(self, n:int) -> int: return n  # the slice size for `n` elements (8-bit state: whole blocks)

PLAIN = PlainState()

def sliced(p, state:dict, storage=None) -> dict:
    """`{key: 1-d view in memory order}` of `p`'s state tensors of its shape (what a slice of `p` takes a slice of),
    each laid out as `p` first if it was not (elementwise: the layout changes nothing of the step)."""
    how = storage or PLAIN
    for k, v in state.items():
        if isinstance(v, Tensor) and v.shape == p.shape and v.stride() != p.stride(): state[k] = how.relaid(v, p)
    return {k: how.flat(v) for k, v in state.items() if isinstance(v, Tensor) and v.shape == p.shape}

def keep_slice(p, state:dict, full:dict, st:dict, s:slice, n:int, storage=None) -> dict:
    """After a slice's step: its state `st` written into `p`'s whole `state` (`full`: its views) where the step replaced
    a tensor instead of updating it in place, or made one (the first step); returns the rest (the step count & co.)."""
    rest, how = {}, storage or PLAIN
    for k, v in st.items():
        if k not in full:
            if k in state or not (isinstance(v, Tensor) and v.dim() == 1 and v.numel() == n): rest[k] = v; continue
            # made by this (first) step
            state[k] = torch.zeros_like(p.detach(), dtype=v.dtype); full[k] = memory_order(state[k])
        if v.data_ptr() != full[k][s].data_ptr(): how.put_(how.part(full[k], s), v)  # replaced, not in place
    return rest

def slice_state(full:dict, s:slice, q, storage) -> tuple:
    """`{key: slice s}` of `p`'s state (`full`: its 1-d views), as the step of slice `q` takes it, and what `storage`
    widened of it: 16-bit state in FP32 for this slice only (a scratch of the slice's size, not the param's)."""
    sl = {k: (storage or PLAIN).part(v, s) for k, v in full.items()}
    w = storage.widen([q], {q: sl}) if storage is not None else None
    return sl, w

def narrow_slice(sl:dict, st:dict, q, storage, w):
    """After a slice's step: its widened state rounded back into the 16-bit slices (what the step replaced instead of
    updating in place taken first), `st` pointing at them again."""
    if not w: return
    for k, v in sl.items():
        if st.get(k) is not None and st[k] is not v and st[k].dtype == torch.float32: v.copy_(st[k])
    tmp = {q: sl}
    storage.narrow([q], tmp, w)
    st.update(tmp[q])

def narrow_new(p, state:dict, full:dict, st:dict, q, storage):
    """The first step: the moving averages it made for slice `q` in FP32 rounded to 16-bit at once, into whole 16-bit
    tensors made for `p` (its whole FP32 state never exists; 8-bit: whatever the slice's size, `p`'s decides)."""
    new = {k: v for k, v in st.items() if k not in full and storage is not None and storage.stores(k, v, q, p.numel())}
    if not new: return
    tmp = {q: dict(new)}
    storage.narrow([q], tmp, numel=p.numel())
    for k in new:
        state[k] = storage.zeros_like(p, k)
        full[k], st[k] = sliced(p, {k: state[k]}, storage)[k], tmp[q][k]

def sliced_update(core, p, hyper:dict, n:int, lift, land, storage=None, kernel=None):
    """fastai's update of `p` by an `elementwise` optimizer `core`, `n` elements at a time, in memory order: per slice
    `lift(slice)` gives the FP32 values to step (a slice of `p`'s master, or a copy of `p`'s) with their FP32 grad set,
    the optimizer's callbacks run on them and on the slice of `p`'s state, and `land(slice, values)` takes the stepped
    values while they are in the caches. The state stays `p`'s: tensors made by the first step are made whole, and a
    slice's step count is the param's (each slice counts the same step). `storage`: 16-bit state widened a slice at a
    time (one slice's FP32 copy at the step's peak, not the param's); what the first step makes is narrowed after.
    `kernel`: a compiled step to try first on each slice (`drivers._Stretch.step`'s)."""
    state, n = core.state[p], (storage or PLAIN).aligned(n)
    full, rest = sliced(p, state, storage), {}
    for o in range(0, p.numel(), n):
        s = slice(o, min(o + n, p.numel()))
        q = lift(s)
        sl, w = slice_state(full, s, q, storage)
        st = {**state, **sl}
        new = None if kernel is None else kernel(q, q.grad, sl, {k: v for k, v in state.items() if k not in sl}, hyper)
        if new is not None: st = new
        else:
            for cb in core.cbs: st = _update(st, cb(q, **{**st, **hyper}))
        narrow_slice(sl, st, q, storage, w)
        narrow_new(p, state, full, st, q, storage)
        rest = keep_slice(p, state, full, st, s, q.numel(), storage)
        land(s, q)
        q.grad = None
    state.update(rest)  # the step count & co. (the same for every slice)
    core.state[p] = state
    if storage is not None: storage.narrow([p], core.state)  # made in FP32 by the first step: stored as the rest
