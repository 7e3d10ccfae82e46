"""The optimizer's state stored in 16 or 8 bits between steps (`state_dtype`), on a fit whose optimizer steps the
model's own FP32 params: widened to FP32 around the optimizer's step and narrowed after (`StateStorage`), the
optimizer's own code in between, a bounded chunk of params at a time (`state_chunk`), so that the FP32 state of the
whole model never exists at once:

- fastai's loop (`fastai_step`, fastai's `Optimizer.step`): a run of consecutive params at a time (the fused loop's),
  then the other params a chunk at a time; a param bigger than a chunk a slice at a time (`optstate.sliced_update`)
  when the optimizer is elementwise;
- a torch optimizer in fastai's `OptimWrapper` (`wrapper_step`): its own `step` once per chunk, only that chunk's
  params with their grads (torch skips the others), a big param a slice at a time (`optstate.sliced_torch_step`);
  one call over everything when it is not known to be elementwise (timm's Lookahead counts its calls). Called
  directly, its step pre- and post-hooks widen and narrow the whole state (`TorchHooks`);
- any other optimizer (a fastai one with a `step` of its own): around fastai's `Learner._step` (`params.counted_step`).

Who reads the state mid-fit through the optimizer's state dict gets it in FP32, as FP32 fastai's: fastai's
`Optimizer.state_dict` (`fastai_state_dict`) and a torch optimizer's state-dict post-hook widen copies of it."""
from __future__ import annotations
import weakref
from contextlib import nullcontext, contextmanager
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..compat import MOVING_AVERAGES
from .drivers import FUSED, _same_order
from .layout import memory_order
from .optstate import wrapped, elementwise, fastai_update, sliced_update, sliced_torch_step
from .state8 import State8
from .state_storage import as_state_of

__all__ = ['STORED', 'HALF', 'STATE_CHUNK', 'state_chunk', 'fastai_step', 'fastai_state_dict', 'wrapper_step',
           'TorchHooks', 'wide_copy', 'as_stored', 'step_one', 'chunks']

STORED = weakref.WeakKeyDictionary()  # a fastai optimizer -> the `StateStorage` of its state, while a fit stores it
# a fastai optimizer or `OptimWrapper` -> the `lifted.LiftedSteps` that step its 16-bit params (`half_storage`)
HALF = weakref.WeakKeyDictionary()
TORCH = weakref.WeakKeyDictionary()  # an `OptimWrapper` -> its `TorchHooks`, while a fit stores its state narrow

# The most param elements whose state is widened to FP32 at once, by device type (elsewhere 2^25): on a CPU, a chunk
# its caches hold (2 MiB of FP32 per state tensor).
STATE_CHUNK = {'cpu': 2**19}

def state_chunk(device) -> int: return STATE_CHUNK.get(torch.device(device).type, 2**25)

def fastai_step(self, closure=None):
    """fastai's `Optimizer.step`: its callbacks run on each param with a grad, in order. During a mixed-precision fit
    that laid its params out (`FUSED`), the runs of consecutive params with consecutive grads go first, each as one
    flat tensor (`drivers.FusedLoop`): the same update, far fewer calls. With its state stored narrow (`STORED`), each
    run's and each chunk's state is widened for its update and narrowed after."""
    if closure is not None: raise NotImplementedError("fastai optimizers currently do not support closure")
    half = HALF.get(self)
    if half is not None: return half.fastai_loop(self)
    loop, storage = FUSED.get(self), STORED.get(self)
    lifted = (lambda ps: storage.lifted(ps, self.state)) if storage is not None else (lambda ps: nullcontext())
    done = set()
    for run in loop.runs(self) if loop is not None else ():
        if storage is not None and sum(p.numel() for p in run.params) > state_chunk(run.master.device): continue
        with lifted(run.params):
            fused = set(map(id, run.step(self, self.hypers[run.gi])))
            for p in run.params:
                if id(p) not in fused: fastai_update(self, p, self.hypers[run.gi])
        done.update(map(id, run.params))
        if storage is not None: run.parts.clear()  # their FP32 state buffers go: it is stored narrow between steps
    rest = [(p, hyper) for p, _, _, hyper in self.all_params(with_grad=True) if id(p) not in done]
    if storage is None:
        for p, hyper in rest: fastai_update(self, p, hyper)
        return
    for chunk in chunks(rest, key=lambda it: it[0]):
        if len(chunk) == 1:  # (a big param: a slice at a time)
            step_one(self, *chunk[0], storage)
            continue
        with lifted([p for p, _ in chunk]):
            for p, hyper in chunk: fastai_update(self, p, hyper)

def step_one(core, p, hyper:dict, storage=None):
    """fastai's update of the one param `p` (the step in the backward), its state widened around it when it is stored
    narrow; a param bigger than a chunk a slice at a time, the optimizer elementwise (the step's temporaries, and the
    widened state, of a slice's size: the backward's peak holds no whole-param step)."""
    if _sliceable(p, core): return sliced_update(core, p, hyper, state_chunk(p.device), *_slices(p), storage)
    if storage is None: return fastai_update(core, p, hyper)
    with storage.lifted([p], core.state): fastai_update(core, p, hyper)

def chunks(items:list, key=lambda p: p, limit=state_chunk) -> list:
    """`items` in consecutive chunks of params (`key(item)`) of one device and at most `limit(device)` elements
    (`state_chunk`; a bigger param alone)."""
    res, n = [], 0
    for it in items:
        p = key(it)
        if not res or n + p.numel() > limit(p.device) or p.device != key(res[-1][0]).device: res.append([]); n = 0
        res[-1].append(it); n += p.numel()
    return res

def _sliceable(p, core) -> bool:
    "Whether `p` is stepped a slice at a time: `_slices_well`, and `core` elementwise."
    return _slices_well(p) and elementwise(core)

def _slices_well(p) -> bool:
    """Whether `p` is bigger than a chunk, its grad in its memory order (not an FSDP2 param: a DTensor is stepped
    whole, its shard being what this rank holds)."""
    return p.numel() > state_chunk(p.device) and not isinstance(p, DTensor) and _same_order(p, p.grad)

def _slices(p) -> tuple:
    "`(lift, land)` for a sliced step of the model's own param `p`: a slice of it in memory order, with its grad's."
    flat, grads = memory_order(p), memory_order(p.grad)
    def lift(s:slice) -> Tensor:
        q = flat[s]
        q.grad = grads[s]
        return q
    return lift, lambda s, q: None  # stepped in place: nothing to land

def wrapper_step(self, closure=None):
    """fastai's `OptimWrapper` steps its torch optimizer (`opt.step()`); while a fit stores the state narrow, a chunk
    of params at a time (`TorchHooks.step`); its params 16-bit, each chunk lifted to FP32 (`HALF`)."""
    hooks, half = TORCH.get(self), HALF.get(self)
    if half is not None and closure is None:
        with hooks.quiet() if hooks is not None else nullcontext(): return half.torch_step(self, self.opt.step)
    if hooks is not None and closure is None: return hooks.step()
    return self.opt.step() if closure is None else self.opt.step(closure)

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
                if len(chunk) == 1 and _slices_well(p):
                    out = sliced_torch_step(self.opt, p, state_chunk(p.device), *_slices(p), self.opt.step,
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
