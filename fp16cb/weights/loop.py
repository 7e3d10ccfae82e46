"""fastai's optimizer steps during a fit (the `Optimizer.step`, `Optimizer.zero_grad` and `OptimWrapper.step` rows of
`fp16cb.patches`), and where the optimizer's storage precision (`fp16cb.storage`) joins them: registries keyed by the
optimizer, which the storage's objects fill for a fit and empty after it. Without them, the steps are fastai's own:

- fastai's loop (`fastai_step`): the runs of consecutive params first, each as one flat tensor (`drivers.FusedLoop`),
  then the other params one by one; with its state stored narrow (`STORED`), each run's and each chunk's state
  widened around its update (a chunk: `state_chunk` elements at most), a param bigger than a chunk a slice at a time
  (`optstate.sliced_update`) when the optimizer is elementwise; with 16-bit params (`HALF`), the storage's loop;
- fastai's `zero_grad` (`fastai_zero_grad`): a pass over each run's grads (`drivers.FusedLoop.zero_grad`);
- one param alone (`step_one`: the step in the backward);
- a torch optimizer in fastai's `OptimWrapper` (`wrapper_step`): its own `step`, or the storage's (`TORCH`, `HALF`)."""
from __future__ import annotations
import weakref
from contextlib import nullcontext
import torch
from torch import Tensor

from ..distributed import is_dtensor
from .drivers import FUSED, _same_order
from .layout import memory_order
from .optstate import elementwise, fastai_update, sliced_update

__all__ = ['STORED', 'HALF', 'TORCH', 'STATE_CHUNK', 'state_chunk', 'chunks', 'fastai_step', 'fastai_zero_grad',
           'step_one', 'slices_well', 'slices', 'wrapper_step']

STORED = weakref.WeakKeyDictionary()  # a fastai optimizer -> the `StateStorage` of its state, while a fit stores it
# a fastai optimizer or `OptimWrapper` -> what steps its 16-bit params (`half_storage`: `storage.lifted.LiftedSteps`)
HALF = weakref.WeakKeyDictionary()
TORCH = weakref.WeakKeyDictionary()  # an `OptimWrapper` -> its `TorchHooks`, while a fit stores its state narrow

# The most param elements whose state is widened to FP32 at once, by device type (elsewhere 2^25): on a CPU, a chunk
# its caches hold (2 MiB of FP32 per state tensor).
STATE_CHUNK = {'cpu': 2**19}

def state_chunk(device) -> int: return STATE_CHUNK.get(torch.device(device).type, 2**25)

def chunks(items:list, key=lambda p: p, limit=state_chunk) -> list:
    """`items` in consecutive chunks of params (`key(item)`) of one device and at most `limit(device)` elements
    (`state_chunk`; a bigger param alone)."""
    res, n = [], 0
    for it in items:
        p = key(it)
        if not res or n + p.numel() > limit(p.device) or p.device != key(res[-1][0]).device: res.append([]); n = 0
        res[-1].append(it); n += p.numel()
    return res

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
        if storage is not None and storage.fused_step(self, run, self.hypers[run.gi]):
            done.update(map(id, run.params))
            continue
        with lifted(run.params):
            fused = set(map(id, run.step(self, self.hypers[run.gi])))
            for p in run.params:
                if id(p) not in fused: fastai_update(self, p, self.hypers[run.gi])
        done.update(map(id, run.params))
        if storage is not None: run.parts.clear()  # their FP32 state buffers go: it is stored narrow between steps
    # (every param with a grad stepped in a run: none left, without reading them all again)
    rest = [] if loop is not None and len(done) == loop.n_grads else [
        (p, hyper) for p, _, _, hyper in self.all_params(with_grad=True) if id(p) not in done]
    if storage is None:
        for p, hyper in rest: fastai_update(self, p, hyper)
        return
    for chunk in chunks(rest, key=lambda it: it[0]):
        if len(chunk) == 1:  # (a big param: a slice at a time)
            step_one(self, *chunk[0], storage)
            continue
        with lifted([p for p, _ in chunk]):
            for p, hyper in chunk: fastai_update(self, p, hyper)

def fastai_zero_grad(self):
    """fastai's `Optimizer.zero_grad`: every grad detached and zeroed in place; during a fit that laid its params out
    (`FUSED`), a pass over each run's grads where the runs hold them all (`FusedLoop.zero_grad`)."""
    if (loop := FUSED.get(self)) is not None and loop.zero_grad(self): return
    for p, *_ in self.all_params(with_grad=True): p.grad.detach_().zero_()

def step_one(core, p, hyper:dict, storage=None):
    """fastai's update of the one param `p` (the step in the backward), its state widened around it when it is stored
    narrow; a param bigger than a chunk a slice at a time, the optimizer elementwise (the step's temporaries, and the
    widened state, of a slice's size: the backward's peak holds no whole-param step); or, where the storage has a
    compiled step for the optimizer, by that."""
    if storage is not None and storage.fused_param(core, p, hyper): return
    if slices_well(p) and elementwise(core):
        return sliced_update(core, p, hyper, state_chunk(p.device), *slices(p), storage)
    if storage is None: return fastai_update(core, p, hyper)
    with storage.lifted([p], core.state): fastai_update(core, p, hyper)

def slices_well(p) -> bool:
    """Whether `p` is bigger than a chunk, its grad in its memory order (not an FSDP2 param: a DTensor is stepped
    whole, its shard being what this rank holds)."""
    return p.numel() > state_chunk(p.device) and not is_dtensor(p) and _same_order(p, p.grad)

def slices(p) -> tuple:
    "`(lift, land)` for a sliced step of the model's own param `p`: a slice of it in memory order, with its grad's."
    flat, grads = memory_order(p), memory_order(p.grad)
    def lift(s:slice) -> Tensor:
        q = flat[s]
        q.grad = grads[s]
        return q
    return lift, lambda s, q: None  # stepped in place: nothing to land

def wrapper_step(self, closure=None):
    """fastai's `OptimWrapper` steps its torch optimizer (`opt.step()`); while a fit stores the state narrow, a chunk
    of params at a time (`TORCH`); its params 16-bit, each chunk lifted to FP32 (`HALF`)."""
    hooks, half = TORCH.get(self), HALF.get(self)
    if half is not None and closure is None:
        with hooks.quiet() if hooks is not None else nullcontext(): return half.torch_step(self, self.opt.step)
    if hooks is not None and closure is None: return hooks.step()
    return self.opt.step() if closure is None else self.opt.step(closure)
