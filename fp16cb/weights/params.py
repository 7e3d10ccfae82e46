"""The model's own FP32 params as what the optimizer steps: the store of a fit whose forward computes with copies
(`callbacks/copies.py`). Nothing moves: the optimizer is the user's, on the model's Parameters, with their FP32 grads,
which arrive unscaled and checked (`GradSink`). What is left for a step: read the check, skip (the grads go, which
params held inf/NaN is noted), or clip the grads in place, on the device. The check reads `p.grad` as it is at the
step, so that an inf written there by other code after the backward skips the step too."""
from __future__ import annotations
import weakref
from contextlib import contextmanager
from enum import Enum
import torch

from ..scaling import OverflowCheck, nonfinite_flags, _real
from ..scaling.check import _FEW
from ..distributed import broadcast_
from .functional import check_unique_params
from .optstate import innermost, steps_param_by_param, elementwise, opt_state
from .drivers import FUSED, FusedLoop, lay_out
from .loop import step_one
from .backward import BackwardSteps
from .layout import shared, own_storages

__all__ = ['ModelParams', 'Stage', 'counted_step', 'AROUND']

class Stage(Enum):
    "Where a store is in the current optimizer step (as torch's `GradScaler` keeps an `OptState` per optimizer)."
    NEW = 0       # set up for a fit: under DDP, the ranks still have to agree on the weights (at the first batch)
    READY = 1     # between steps: the next backward accumulates into the model's grads
    CHECKED = 2   # `prepare_grads` checked the grads for inf/NaN; the step may still be cancelled
    STEPPED = 3   # the optimizer stepped; the model's grads are owed a clearing
    SKIPPED = 4   # the step overflowed and was skipped; the model's grads are owed a clearing

STEPS = weakref.WeakKeyDictionary()  # learner -> the optimizer steps fastai's loop took (`counted_step`)

# learner -> `fn(step)` that runs its optimizer's `step` for it (`counted_step`): an optimizer neither fastai's loop nor
# a torch one, with all its state widened (`state_dtype`) or its 16-bit params lifted (`half_storage`)
AROUND = weakref.WeakKeyDictionary()

def counted_step(self):
    """fastai's `Learner._step` (the optimizer's step), counted: a step whose `after_step` never came is still known.
    An optimizer with a `step` of its own, whose state is stored narrow or whose params are 16-bit, steps through
    `AROUND`."""
    around = AROUND.get(self)
    if around is None: self.opt.step()
    else: around(self.opt.step)
    STEPS[self] = STEPS.get(self, 0) + 1

class ModelParams:
    """What a step needs of the model's FP32 params during a fit whose forward computes with copies: the interface
    `MixedPrecision` asks a step through, where most of it has nothing to do (`p.grad` is always FP32 fastai's)."""
    flat, in_backward, checked, stepped_hook = False, False, (), None
    grads_final = property(lambda self: True, lambda self, v: None)  # the grads are unscaled as they arrive
    def __init__(self,
        learn, # the learner: its optimizer (read at each step: a callback may make a new one) and model
        sink, # the copies' `GradSink`: where the grads arrive, divided by the loss scale of their backward
        names:dict=None, # `{id(param): name}`, for the overflow log and error messages
        computed_in:dict=None, # `{dtype: [params]}`: which trainable params compute in which 16-bit dtype
        scaled:bool=True, # the fit is loss-scaled (fp16): each param's summed grad is unscaled on its way in
        flat:bool=False, # `flat_master`: each group's params laid out in one buffer, whatever the optimizer
        state=None, # the optimizer's state between steps (`storage.StateStorage`, `state_dtype`; None: FP32)
        in_backward:bool=False, # `step_in_backward`: each trainable param stepped by a hook as its grad completes
    ):
        self.learn, self.sink, self.names, self.computed = learn, sink, names or {}, computed_in or {}
        self.flat, self.state = flat, state if state is not None and state.dtype is not None else None
        self.steps = lambda: STEPS.get(learn, 0)
        self._dtypes = [(n, p, p.dtype) for n, p in learn.model.named_parameters()]
        check_unique_params(innermost(learn.opt).param_lists, self.names)
        self.stage, self.scale, self.check = Stage.NEW, 1., OverflowCheck()
        if scaled and sink is not None: sink.hook(p for p in learn.model.parameters() if p.requires_grad)
        self._fuse(innermost(learn.opt))
        self._store_state(innermost(learn.opt))
        self._backward = self._arm(innermost(learn.opt)) if in_backward else None
        self.in_backward = in_backward

    def _arm(self, core) -> BackwardSteps:
        """The step in the backward: a hook on each trainable param of fastai's optimizer `core` steps it with fastai's
        update as soon as its grad is complete, and drops the grad (`backward.BackwardSteps`)."""
        group = {id(p): gi for gi, pg in enumerate(core.param_lists) for p in pg}
        return BackwardSteps(self.params, lambda p: self._step_one(core, p, core.hypers[group[id(p)]]))

    def _step_one(self, core, p, hyper:dict): step_one(core, p, hyper, self.state)

    def _fuse(self, core):
        """fastai's loop, where its callbacks are elementwise, steps runs of consecutive params as one flat tensor each
        (`drivers.FusedLoop`): each group's trainable params are laid out one after the other in memory for it, in
        buffers of a bounded size; with `flat_master`, in one buffer per group (and device, dtype), for any
        optimizer."""
        fused = steps_param_by_param(core) and elementwise(core)
        self._core = core if fused or self.flat else None
        if self._core is None: return
        lay_out([list(pg) for pg in core.param_lists], opt_state(core), limit=None if self.flat else 0)
        if fused: FUSED[core] = self._loop = FusedLoop()

    def _store_state(self, core):
        """The optimizer's state stored narrow from now to the fit's end, widened around its steps (`state.attach`:
        fastai's loop a run at a time, a torch optimizer's step all of it, `counted_step` any other optimizer's)."""
        self._detach = self.state.attach(self.learn, core) if self.state is not None else None

    @property
    def model_pgs(self) -> list:
        "The trainable params of the optimizer, per group (the optimizer of now: `create_opt` may have made a new one)."
        return [[p for p in pg if p.requires_grad] for pg in innermost(self.learn.opt).param_lists]
    old_param_lists = property(lambda self: [list(pg) for pg in innermost(self.learn.opt).param_lists])
    params = property(lambda self: [p for pg in self.model_pgs for p in pg])
    # the FP32 masters are the model's params themselves
    master_pgs = property(lambda self: self.model_pgs)
    master_params = masters = params

    def _grads(self) -> tuple:
        ps = [p for p in self.params if p.grad is not None]
        return ps, [p.grad for p in ps]

    def backward(self, scale:float=1., loss=None):
        """The backward of the loss-scaled `loss` (scaled by `scale`) is coming: its grads arrive divided by the scale,
        and only its own (others' grads, `torch.autograd.grad` or a backward of other code, are not loss-scaled)."""
        if self.sink is not None: self.sink.begin(scale, loss)

    def prepare_grads(self, scale:float, with_max:bool=False):
        """`[found, (max |grad|)]` on the device (no sync): the grads as they are now (unscaled, whatever wrote into
        them), checked in one fused read-only pass; None when no param has a grad. Stepped in the backward: whether any
        grad its hooks saw held inf/NaN."""
        if self.in_backward: return self._found_in_backward()
        ps, grads = self._grads()
        if not grads: return None
        self.checked, self.stage, self.scale = grads, Stage.CHECKED, scale
        self._steps = self.steps()  # `stepped` compares
        # a loss-scaled fit (fp16) skips now and then, its scale probing the range: the exact check, one read per
        # step; at scale 1 (bf16) a CPU may sum the grads, its rare skip confirmed by the exact check (`recheck`)
        if scale != 1. and len(grads) <= _FEW: return self.check.exact(grads, with_max)
        return self.check(grads, 1., with_max=with_max)

    def _found_in_backward(self):
        found = self._backward.found()
        if found is not None: self.stage, self.scale, self._steps = Stage.CHECKED, 1., self.steps()
        return found

    def recheck(self):
        "`[found]` from the exact check (the sums of a CPU's check overflowed: an inf/NaN, or not)."
        return self.check.exact(self.checked)

    def half_grads(self, dtype) -> list:
        "The grads of the params that computed in `dtype` (at scale 1, their exact 16-bit values, widened)."
        return [p.grad for p in self.computed.get(dtype, ()) if p.grad is not None]

    def clip(self, max_norm:float, global_norm:bool=False):
        """Clip the grads in place as `torch.nn.utils.clip_grad_norm_` would: each param group's norm, or all groups'
        together (`global_norm`); the coefficient stays on the device (no host sync)."""
        for _, gs, coef in self._clip_coefs(max_norm, global_norm):
            with torch.no_grad(): torch._foreach_mul_(gs, coef)

    def _clip_coefs(self, max_norm:float, global_norm:bool, factor:float=1.):
        "`(group indices, their grads, clip coefficient)` per group, or for all of them (the norm times `factor`)."
        groups = [[p.grad for p in pg if p.grad is not None] for pg in self.model_pgs]
        for gis in ([list(range(len(groups)))] if global_norm else [[i] for i in range(len(groups))]):
            gs = [g for i in gis for g in groups[i]]
            real = _real(gs)
            if not real: continue
            dev = real[0].device
            norms = torch._foreach_norm(real, 2, dtype=torch.float32)
            total = torch.linalg.vector_norm(torch.stack([n.to(dev) for n in norms]))
            yield gis, gs, (max_norm / (total * factor + 1e-6)).clamp_(max=1.)

    def skip(self) -> tuple:
        """The step overflowed: its grads go (None), nothing of them reaches the weights. Returns which params' grads
        held inf/NaN, looked at before they go: `(flags on the device, their names)` (no host sync)."""
        if self.in_backward:  # the grads are gone: their hooks' flags
            ps = self.params
            found = self._backward.flags(ps), [self.names.get(id(p), '?') for p in ps]
            self._done(Stage.SKIPPED)
            return found
        ps, grads = self._grads()
        found = nonfinite_flags(grads), [self.names.get(id(p), '?') for p in ps]
        for p in ps: p.grad = None
        if self._core in FUSED: self._loop.forget()
        self._done(Stage.SKIPPED)
        return found

    def _done(self, stage): self.stage, self.checked = stage, ()

    def stepped(self) -> bool:
        "Whether fastai's loop stepped the optimizer since `prepare_grads` (a step whose `after_step` did not come)."
        return self.stage is Stage.CHECKED and self.steps() != getattr(self, '_steps', None)

    def finish(self): self._done(Stage.READY)  # the optimizer's `zero_grad` (fastai calls it) clears the grads
    def cancel(self): self.stage = Stage.READY  # cancelled by another callback: the grads stay, unscaled, as in FP32
    def unscale_grads(self): pass
    def divided(self, scale:float): pass
    def check_linked(self):
        "A param whose dtype changed since the set-up (`model.half()` mid-fit would train it without its FP32 values)."
        for n, p, dt in self._dtypes:
            if p.dtype != dt:
                raise RuntimeError(f"parameter {n} changed dtype since the fit's set-up ({dt} -> {p.dtype}): the model "
                                   f"keeps its FP32 params during a fit, and computes in 16 bits with copies of them; "
                                   f"convert it before `to_fp16()`/`to_bf16()`, or not at all.")
    def stepped_in_backward(self) -> bool:
        "Whether the backward of the step under way has stepped params already (a cancellation cannot undo it)."
        return self.in_backward and (self.stage is Stage.CHECKED or self._backward.stepped())
    def fp32_views(self) -> dict: return {p: p.detach() for p in self.params}
    def restore(self):
        self.checked = ()
        if self.sink is not None: self.sink.unhook()
        if self._core is not None: FUSED.pop(self._core, None)
        if self._backward is not None: self._backward.remove()
        if self.state is None: return
        self._detach()
        self.state.widen_all(opt_state(innermost(self.learn.opt)))  # FP32 between fits

    def own_storage(self):
        """The fit's end: each param, grad and optimizer state tensor laid out for the fused loop gets memory of its own
        again (no copy), so that saving one writes it alone, as FP32's (the next fit lays them out again)."""
        if self._core is None: return
        state = opt_state(self._core)
        for pg in self._core.param_lists:
            for p in pg:
                p.data = shared(p.data)
                if p.grad is not None: p.grad = shared(p.grad)
                if p in state: state[p] = own_storages(state[p])

    def broadcast_from(self, src:int=0):
        """Every rank starts from rank `src`'s weights (the model's params), and its stochastic rounding's generator
        (16- or 8-bit state): the ranks round alike, so they stay identical."""
        broadcast_([p.data for p in self.params], src)
        self._broadcast_generator(src)

    def _broadcast_generator(self, src:int):
        "The stochastic rounding's generator set to rank `src`'s."
        g = self._generator()
        if g is None: return
        st = g.get_state().to(g.device)  # on the generator's device: nccl's collectives take CUDA tensors
        broadcast_([st], src)
        g.set_state(st.cpu())

    def _generator(self): return self.state.generator if self.state is not None else None

    @contextmanager
    def opt_view(self):
        "The optimizer as it is: its params are the model's."
        yield self.learn.opt

    def fp32_state_dict(self, opt, stream) -> dict:
        "`opt.state_dict()` as an FP32 learner's: each tensor alone, 16- or 8-bit state widened by `stream` as written."
        if self.state is None: return own_storages(opt.state_dict())
        return self.state.fp32_state_dict(opt, stream)
