"""The optimizer's state stored in 16 or 8 bits between steps (`state_dtype`), as the optimizer's own code sees it: a
torch optimizer's steps (`TorchHooks`) and what reads its state through its state dict. fastai's loop widens it a run
of params at a time (`weights.loop.fastai_step`, from the `STORED` registry), and so does a torch optimizer in fastai's
`OptimWrapper` (`weights.loop.wrapper_step`, from `TORCH`): its own `step` once per chunk of params, only that chunk's
params with their grads (torch skips the others), a big param a slice at a time (`sliced_torch_step`); one call over
everything when it is not known to be elementwise (timm's Lookahead counts its calls). Called directly, its step pre-
and post-hooks widen and narrow the whole state.

Who reads the state mid-fit through the optimizer's state dict gets it in FP32, as FP32 fastai's: fastai's
`Optimizer.state_dict` (`fastai_state_dict`) and a torch optimizer's state-dict post-hook widen copies of it."""
from __future__ import annotations
from contextlib import contextmanager
import torch
from torch import Tensor

from ..compat import MOVING_AVERAGES
from ..distributed import as_state_of
from ..weights.loop import STORED, TORCH, state_chunk, chunks, slices_well, slices
from ..weights.optstate import wrapped, elementwise, sliced, slice_state, narrow_slice, narrow_new, keep_slice
from .state8 import State8

__all__ = ['fastai_state_dict', 'TorchHooks', 'wide_copy', 'as_stored', 'sliced_torch_step']

def wide_copy(d:dict, dtype, p=None) -> dict:
    """The state dict `d` of param `p` with each moving average stored in `dtype` ('8bit': 8-bit codes) replaced by its
    FP32 value, in a tensor of its own (a DTensor for an FSDP2 param); the other entries are `d`'s own."""
    def wide(k, v):
        if not (k in MOVING_AVERAGES and isinstance(v, Tensor) and v.dim() > 0): return v
        if isinstance(v, State8): return as_state_of(v.dequantize(), p)
        return v.float() if v.dtype == dtype else v
    return {k: wide(k, v) for k, v in d.items()}

_RAW = []  # while not empty: the state dicts as they are stored (a checkpoint's stream widens them one at a time)

@contextmanager
def as_stored():
    "Within: the optimizers' `state_dict()` gives the state as stored (16 or 8 bits), not FP32 copies."
    _RAW.append(1)
    try: yield
    finally: _RAW.pop()

def fastai_state_dict(self) -> dict:
    """fastai's `Optimizer.state_dict`: `{'state': [per-param state], 'hypers': ...}`; while a fit stores the state
    narrow, its FP32 values (copies), as an FP32 learner's."""
    storage = None if _RAW else STORED.get(self)
    state = [self.state[p] if storage is None else wide_copy(self.state[p], storage.dtype, p)
             for p, *_ in self.all_params()]
    return {'state': state, 'hypers': self.hypers}

class TorchHooks:
    """A torch optimizer's state stored narrow between its steps, for the fit of `wrapper` (an `OptimWrapper`): its
    steps a chunk at a time (`step`); called directly, widened by a step pre-hook (an entry at a time, each 16-bit
    tensor let go as its FP32 one is made) and narrowed by a post-hook; read through `state_dict()` in FP32."""
    def __init__(self, wrapper, storage):
        opt = wrapper.opt
        inner = wrapped(opt)[-1]  # the optimizer that holds the per-param state (timm's Lookahead's base optimizer)
        self.wrapper, self.opt, self.state, self.storage, self.busy = wrapper, opt, inner.state, storage, False
        self.elementwise = elementwise(wrapper)
        self.handles = [inner.register_step_pre_hook(self._widen), inner.register_step_post_hook(self._narrow),
                        opt.register_state_dict_post_hook(self._fp32)]
        TORCH[wrapper] = self

    def step(self):
        """The torch optimizer's `step()` once per chunk of params with a grad, the others' grads hidden for the call
        (a big param a slice at a time); one call over all of them when it is not known to be elementwise."""
        ps = [p for g in self.opt.param_groups for p in g['params'] if p.grad is not None]
        if not self.elementwise: return self.opt.step()
        grads, out, self.busy = {p: p.grad for p in ps}, None, True
        try:
            for p in ps: p.grad = None
            for chunk in chunks(ps):
                p = chunk[0]
                for q in chunk: q.grad = grads[q]
                if len(chunk) == 1 and slices_well(p):
                    out = sliced_torch_step(self.opt, p, state_chunk(p.device), *slices(p), self.opt.step,
                                            self.storage)
                else:
                    with self.storage.lifted(chunk, self.state): out = self.opt.step()
                for q in chunk: q.grad = None
        finally:
            for p, g in grads.items(): p.grad = g
            self.busy = False
        return out

    @contextmanager
    def quiet(self):
        "Within: the step hooks do nothing (a caller widens and narrows the state a chunk at a time)."
        self.busy = True
        try: yield
        finally: self.busy = False

    def _widen(self, opt, args, kwargs):
        if not self.busy: self.storage.widen_all(self.state)

    def _narrow(self, opt, args, kwargs):
        if self.busy: return
        for chunk in chunks(list(self.state)): self.storage.narrow(chunk, self.state)

    def _fp32(self, opt, sd:dict) -> dict:
        if 'state' in sd and not _RAW:
            ps = [p for g in opt.param_groups for p in g['params']]  # (the state dict's indices)
            sd['state'] = {i: wide_copy(d, self.storage.dtype, ps[i]) for i, d in sd['state'].items()}
        return sd

    def remove(self):
        for h in self.handles: h.remove()
        self.handles = []
        TORCH.pop(self.wrapper, None)

def sliced_torch_step(opt, p, n:int, lift, land, step, storage):
    """torch optimizer `opt` (elementwise) steps `p` `n` elements at a time, as `sliced_update` does fastai's: each
    slice (`lift`) stands in for `p` in its param group with the slices of `p`'s state (a copy of its step count: every
    slice counts the same step), `step()` steps it, `land` takes it. Returns the last `step()`'s value."""
    group = next(g for g in opt.param_groups if any(q is p for q in g['params']))
    i = next(i for i, q in enumerate(group['params']) if q is p)
    state, n = opt.state[p], storage.aligned(n)
    full, out, rest = sliced(p, state, storage), None, {}
    fresh = not state  # each slice makes its own (the first step)
    scalars = {k: v for k, v in state.items() if k not in full}
    q, done = None, False
    try:
        for o in range(0, p.numel(), n):
            s = slice(o, min(o + n, p.numel()))
            q = group['params'][i] = lift(s)
            sl, w = ({}, None) if fresh else slice_state(full, s, q, storage)
            opt.state[q] = ({} if fresh else
                            {**{k: v.clone() if isinstance(v, Tensor) else v for k, v in scalars.items()}, **sl})
            out = step()
            narrow_slice(sl, opt.state[q], q, storage, w)
            narrow_new(p, state, full, opt.state[q], q, storage)
            rest = keep_slice(p, state, full, opt.state.pop(q), s, q.numel(), storage)
            land(s, q)
            q.grad = None
        done = True
    finally:  # also when interrupted: no slice's state left behind, and `p`'s state that of the completed steps
        group['params'][i] = p
        if q is not None:
            opt.state.pop(q, None)
            q.grad = None
        if done: state.update(rest)  # the step count & co. (the same for every slice)
        elif fresh: state.clear()  # an interrupted first step: no state, as before it (torch makes it afresh)
    if done: storage.narrow([p], opt.state)  # made in FP32 by the first step
    return out
