"""16-bit storage (`half_storage`): the model's params are 16-bit for the fit, the one copy of the weights, and what
other code sees (NVIDIA's "Training with mixed precision", NVCaffe, 2017; the pure-bf16 training of optimi and
torchao). The optimizer is the user's, on the model's params: its step lifts each 16-bit param to FP32, steps it with
its own code and FP32 state, and rounds it back (`lifted.LiftedSteps`), reached through fastai's `Optimizer.step` and
`OptimWrapper.step` rows (`weights.loop.HALF`) or fastai's `Learner._step` (`weights.params.AROUND`).
fp16's grads stay loss-scaled in 16 bits until the step and are unscaled in FP32 as each is lifted (unscaled in 16 bits
those under fp16's smallest subnormal would flush to zero); for a callback after ours that reads them in `before_step`
they are unscaled in place first, as FP32 fastai shows them (`unscale_grads`)."""
from __future__ import annotations
import torch
from fastcore.foundation import L

from ..scaling.check import _by_device
from ..weights.params import ModelParams, AROUND
from .lifted import LiftedSteps, HALF_DTYPES
from ..weights.loop import HALF
from ..weights.optstate import innermost, opt_states, steps_param_by_param
from .state_storage import StateStorage

__all__ = ['HalfStorage']

class HalfStorage(ModelParams):
    """What a step needs of a 16-bit model's params: `ModelParams`' interface, with fp16's grads loss-scaled until the
    step (`grad_factor`: 1/scale, times each group's clip coefficient, applied in FP32 as the grads are lifted)."""
    master_pgs = master_params = masters = None  # no FP32 masters: the 16-bit params are the weights
    grads_final = True  # set by the callback: False when a callback after ours reads the grads (`unscale_grads`)
    scratch = property(lambda self: self.lifted.scratch, doc="The FP32 memory a chunk is lifted into (for the fit).")
    def __init__(self,
        learn, # the learner: its optimizer steps the model's (16-bit) params
        names:dict=None, # `{id(param): name}`, for the overflow log and error messages
        state:StateStorage=None, # the optimizer's state between steps (`state_dtype`: 16 or 8 bits; None: FP32)
        in_backward:bool=False, # `step_in_backward`: each trainable param stepped by a hook as its grad completes
        stochastic:bool=True, # round the weights back stochastically (False: to nearest even)
        generator=None, # the stochastic rounding's own `torch.Generator`
        fp32_of=None, # `param -> exact FP32 value` (`ModelToHalf`): fastai `Lookahead`'s slow weights start from these
    ):
        self.grad_factor, self.coefs, self._rescale = 1., {}, None
        self.lifted = LiftedSteps(self._factor, state or StateStorage(), stochastic, generator, self._stepped)
        self.core = innermost(learn.opt)
        _fp32_slow_weights(learn.opt, self.core, fp32_of)
        super().__init__(learn, None, names, state=state, in_backward=in_backward)
        self.lifted.size_for(self.params)
        self._adopt(self.core)
        # params whose grads come sparse (`nn.Embedding(sparse=True)`): made dense as they come in
        self._sparse = [p for m in learn.model.modules() if getattr(m, 'sparse', False) is True
                        for p in m.parameters(recurse=False)]

    def _fuse(self, core): self._core = None  # the 16-bit params are lifted, not laid out

    def _adopt(self, core):
        """The optimizer `core` steps the 16-bit params lifted: its step rows (or, with a `step` of its own, `_step`,
        in place of the state's widening around it that `ModelParams._store_state` set: the lift widens it too)."""
        self.core = core
        if steps_param_by_param(core) or isinstance(getattr(core, 'opt', None), torch.optim.Optimizer):
            HALF[core] = self.lifted
        else: AROUND[self.learn] = lambda step: self.lifted.swapped_step(core.param_lists, opt_states(core), step,
                                                                         chunked=False)

    def _step_one(self, core, p, hyper:dict): self.lifted.step_one(core, p, hyper)

    def _stepped(self, params:list):
        "These params were stepped (the callback lets the FP32 originals it kept for them go)."
        if self.stepped_hook is not None: self.stepped_hook(params)

    def _factor(self, gi:int):
        "What group `gi`'s grads are multiplied by as they reach FP32: 1/scale times its clip coefficient (None: by 1)."
        c = self.coefs.get(gi)
        if c is None: return None if self.grad_factor == 1. else self.grad_factor
        return c if self.grad_factor == 1. else c * self.grad_factor

    def backward(self, scale:float=1., loss=None): pass  # the grads arrive loss-scaled, as the backward makes them

    def prepare_grads(self, scale:float, with_max:bool=False):
        "`[found, (max |unscaled grad|)]` of the loss-scaled grads (`ModelParams.prepare_grads`); the step unscales."
        self.grad_factor, self.coefs, self._rescale = 1. / scale, {}, None
        for p in self._sparse:
            if p.grad is not None and p.grad.is_sparse: p.grad = p.grad.to_dense()
        stats = super().prepare_grads(scale, with_max)
        if stats is None or len(stats) == 1 or scale == 1.: return stats
        return torch.cat((stats[:1], stats[1:] / scale))  # by a Python number: no host copy

    def clip(self, max_norm:float, global_norm:bool=False):
        "The clip coefficients of the unscaled grads' norms, applied with the unscaling as each grad is lifted."
        for gis, _, coef in self._clip_coefs(max_norm, global_norm, self.grad_factor):
            self.coefs.update(dict.fromkeys(gis, coef))

    def half_grads(self, dtype) -> list: return [g for g in self.checked if g.dtype == dtype]

    def unscale_grads(self):
        """Divide the checked grads by the loss scale in place, now: a callback after ours reads or changes them before
        the step, and sees them as FP32 would, unscaled (fp16 values under 2^-24 flush to zero). The step divides
        nothing then."""
        if self.grad_factor == 1. or not self.checked: return
        with torch.no_grad():
            for gs in _by_device(self.checked).values(): torch._foreach_mul_(gs, self.grad_factor)
        self.divided(self.scale)

    def divided(self, scale:float):
        "The checked grads are divided by `scale` already (`scale` stays the step's loss scale): the step divides none."
        self._rescale, self.grad_factor = scale, 1.

    def cancel(self):
        """Another callback cancelled the step: its grads stay until the optimizer's `zero_grad`, as in FP32, at the
        scale the next backward adds at (multiplied back if a callback was shown them unscaled)."""
        rescale, self._rescale = self._rescale, None
        if rescale is not None and self.checked:
            with torch.no_grad():
                for gs in _by_device(self.checked).values(): torch._foreach_mul_(gs, rescale)
        super().cancel()

    def check_linked(self):
        """A param whose dtype changed since the set-up; an optimizer made since (`create_opt` by a callback) steps
        the 16-bit params lifted too."""
        super().check_linked()
        core = innermost(self.learn.opt)
        if core is not self.core: self._adopt(core)

    def count_lost(self):
        "This step's landings tally the updates that round back onto their 16-bit weights (`lost_updates`)."
        self.lifted.tally = []

    def lost_updates(self):
        """`[updates lost, updates]` of the landings since `count_lost` (a device tensor; None: not counted, or
        nothing landed), and the tally stops."""
        tally, self.lifted.tally = self.lifted.tally, None
        return torch.stack(tally).sum(0) if tally else None

    def fp32_views(self) -> dict: return {p: p.detach() for p in self.params if p.dtype not in HALF_DTYPES}
    def _generator(self): return self.lifted.generator

    def restore(self):
        HALF.pop(self.core, None); AROUND.pop(self.learn, None)
        self.lifted.release()
        super().restore()

def _fp32_slow_weights(opt, core, fp32_of):
    """fastai's `Lookahead` keeps a slow copy of each param, which would be 16-bit here and outlive the fit: it is FP32
    instead (made from the exact FP32 values; the sync reads the 16-bit weights into FP32 and rounds once back)."""
    if opt is core or 'slow_weights' not in vars(opt): return
    half = lambda p: p.dtype in HALF_DTYPES
    if opt.slow_weights is None:
        val = (lambda p: fp32_of(p).to(p.device)) if fp32_of is not None else (lambda p: p.detach())
        opt.slow_weights = L(L(val(p).float().clone() if half(p) else p.detach().clone() for p in pg)
                             for pg in core.param_lists)
    else: opt.slow_weights = L(L(s.float() if half(s) else s for s in sg) for sg in opt.slow_weights)
