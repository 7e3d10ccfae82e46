"""The weight store's interface and its stage: what the optimizer steps in a mixed-precision fit and how a step's
gradients get there, the callback asking and the store deciding. Its kinds: FP32 masters (`masters`) and 16-bit
storage (`half`)."""
from __future__ import annotations
from contextlib import contextmanager
from enum import Enum
import torch
from fastai.optimizer import OptimWrapper

from ..scaling import OverflowCheck, nonfinite_flags, _real
from ..scaling.check import _by_device
from ..distributed import broadcast_
from .functional import check_unique_params, trainable
from .optstate import innermost, opt_state
from .state_storage import StateStorage
from .lazy import lazy_state
from .lift import chunk_limit
from .route import Route
from .backward import BackwardSteps

__all__ = ['Stage', 'WeightStore', 'check_same_kind']

class Stage(Enum):
    "Where a store is in the current optimizer step (as torch's `GradScaler` keeps an `OptState` per optimizer)."
    NEW = 0       # set up for a fit: under DDP, the ranks still have to agree on the weights (at the first batch)
    READY = 1     # between steps: the next backward accumulates into the model's grads
    CHECKED = 2   # `prepare_grads` checked the grads for inf/NaN; they stay loss-scaled (unscaled as the step consumes
                  # them, or at once for a later callback's `before_step`); the step may still be cancelled
    STEPPED = 3   # the optimizer stepped (the model follows it already); the model's grads are owed a clearing
    SKIPPED = 4   # the step overflowed and was skipped; the model's grads are owed a clearing


def _sparse_params(model) -> set:
    "ids of the params whose grads come sparse (`nn.Embedding(sparse=True)` and the like)."
    return ({id(p) for m in model.modules() if getattr(m, 'sparse', False) is True for p in m.parameters(recurse=False)}
            if model is not None else set())


class WeightStore:
    """What the optimizer steps in a mixed-precision fit, and how a step's gradients get there (after Megatron-LM's
    mixed-precision optimizer: `prepare_grads`, then `step`). The callback asks; the store decides which tensors, when
    and how. Implementations: FP32 masters (`ParamMasters`) and 16-bit storage (`HalfStorage`).

    The rules for what is converted live here, once, for every implementation:
    - only trainable params (`requires_grad`) are the store's; frozen ones are left as they are;
    - a param in two param groups (or twice in one) is refused, naming it;
    - FP32/fp16/bf16 params are stored by the implementation; any other dtype (float64, complex) trains as it is, in its
      own dtype, its (loss-scaled) grads checked and unscaled with the others (`own_params`);
    - sparse grads (`nn.Embedding(sparse=True)`) are made dense as they come in;
    - the grads stay as the backward left them (16-bit, loss-scaled) until the optimizer steps: they are checked there,
      read-only, and reach FP32 (unscaled, clipped) only as the optimizer consumes them, a bounded part at a time, so a
      step never holds a full-size FP32 copy of them (`lift_chunk`).
    What must hold during a fit: the model's params are the store's (`check_linked`, every step, O(buffers))."""
    flat = False
    checked = ()  # the grads the last `prepare_grads` checked, as the backward left them (16-bit, loss-scaled)
    master_pgs = None  # FP32 masters per group (None: this store has none)
    # at most this many elements of grads are in FP32 at once during a step (or one param, if larger); None: by device
    # (`chunk_limit`: 2^19 on a CPU, 2^25 elsewhere)
    lift_chunk = None
    in_backward = False  # each param stepped in the backward, as soon as its grad is ready (`arm_in_backward`)
    # set by the callback: nothing runs between `prepare_grads` and the step that could replace a grad
    grads_final = False
    # the optimizer's state in FP32 (`StateStorage(torch.bfloat16, ...)`: stored in 16-bit between steps)
    state_storage = StateStorage()
    # called with params as each is stepped (16-bit storage: the callback lets their FP32 originals go)
    stepped_hook = None
    def __init__(self,
        opt, # the learner's optimizer (fastai `Optimizer`, `OptimWrapper`, `Lookahead` around either)
        names:dict=None, # `{id(param): name}`, for error messages
        model=None, # the model (which of its params get sparse grads)
        keep=(), # ids of params this fit trained so far: still the store's if frozen since (FP32 steps them with grads)
    ):
        self.opt, self.core, self.names, self.keep = opt, innermost(opt), names or {}, frozenset(keep)
        self.none_after_step = isinstance(self.core, OptimWrapper)  # torch's `zero_grad` sets grads to None
        check_unique_params(self.core.param_lists, names)
        self.old_param_lists = [list(pg) for pg in self.core.param_lists]
        self.model_pgs = [trainable(pg, keep=self.keep) for pg in self.old_param_lists]
        self.own_pgs = [trainable(pg, own=True, keep=self.keep) for pg in self.old_param_lists]  # stepped as they are
        ours = {id(p) for pg in self.model_pgs + self.own_pgs for p in pg}
        self.frozen = [p for pg in self.old_param_lists for p in pg if id(p) not in ours]  # not the store's (yet)
        self.own_params = [p for pg in self.own_pgs for p in pg]
        sparse = _sparse_params(model)
        self.sparse = [p for pg in self.model_pgs + self.own_pgs for p in pg if id(p) in sparse]
        self.stage, self.scale, self.cleared, self.check = Stage.NEW, 1., False, OverflowCheck()
        # the model's grads are zero and no backward ran since (`finish`, then fastai's `zero_grad`)
        self._fresh = False
        self.grad_factor, self.coefs = 1., {}  # 1/loss scale; clip coefficients per group (device tensors)
        self.route = Route(opt, self.core, self)  # `learn.opt.step()` and `zero_grad()` reach the store (`route`)

    # -- the interface the callback uses, in the order of a step
    def prepare_grads(self,
        scale:float, # the loss scale the grads carry
        with_max:bool=False, # also report the largest |unscaled grad|
    ):
        """Check the step's grads for inf/NaN in one fused, read-only pass, as the backward left them: `[found, (max
        |unscaled grad|)]` on the device, or None (no grads). Unscaling happens in FP32, as the optimizer consumes
        them."""
        if self.in_backward: return self._found_in_backward()
        for p in self.sparse:
            if p.grad is not None and p.grad.is_sparse: p.grad = p.grad.to_dense()
        grads = self.checked = self._grads_to_check()
        if not grads: return None
        self.stage, self.scale, self.grad_factor, self.coefs, self.cleared = Stage.CHECKED, scale, 1. / scale, {}, False
        self._rescale = None
        stats = self.check(grads, 1., with_max=with_max)
        if len(stats) == 1 or scale == 1.: return stats
        # by a Python number: a tensor made from a list is a host copy (a sync)
        return torch.cat((stats[:1], stats[1:] / scale))

    def recheck(self):
        "`[found]` from the exact check of the grads `prepare_grads` checked (its sums overflowed: an inf/NaN, or not)."
        return self.check.exact(self.checked)

    def clip(self, max_norm:float, global_norm:bool=False):
        """Clip the unscaled grads the optimizer will use: each param group's norm, or (`global_norm`) all groups'
        together, as `torch.nn.utils.clip_grad_norm_`. The norm is taken in FP32 from the 16-bit grads; the coefficient
        stays on the device (no host sync) and joins the unscaling factor applied as the grads reach FP32."""
        groups = [[p.grad for p in a + b if p.grad is not None] for a, b in zip(self.model_pgs, self.own_pgs)]
        for gis in ([list(range(len(groups)))] if global_norm else [[i] for i in range(len(groups))]):
            gs = _real([g for i in gis for g in groups[i]])
            if not gs: continue
            dev = gs[0].device
            norms = torch._foreach_norm(gs, 2, dtype=torch.float32)
            total = torch.linalg.vector_norm(torch.stack([n.to(dev) for n in norms])) * self.grad_factor
            coef = (max_norm / (total + 1e-6)).clamp_(max=1.)
            self.coefs.update(dict.fromkeys(gis, coef))

    def _step(self, *args, **kwargs):
        """The optimizer's `step` during a fit: the optimizer steps once (a `Lookahead` counts one step), the model
        follows."""
        out = None if self.in_backward else self._step_impl(*args, **kwargs)  # in the backward: stepped already
        self.stage = Stage.STEPPED
        return out

    def zero_grad(self):
        """The optimizer's `zero_grad` during the fit (fastai's, after each step; a callback's): the model's grads are
        cleared, as FP32 fastai's `zero_grad` clears them. Called between a backward and its step (a callback dropping a
        batch's grads), a torch optimizer's grads go (None: nothing is stepped, as in FP32), a fastai one's are zeroed.
        fastai's own call right after the step finds them cleared by `finish` already: nothing to do again."""
        if self._fresh and self.stage is Stage.READY: return
        self.zero_model_grads()
        if self.stage is Stage.CHECKED and self.none_after_step and not self.in_backward:
            for p in self._hooked_params(): p.grad = None
            self._trusted = False
        if self.stage in (Stage.STEPPED, Stage.SKIPPED): self.cleared = True

    def skip(self) -> tuple:
        """The step overflowed: its grads go, nothing of them reaches the weights. Returns which params' grads held
        inf/NaN, looked at before they go: `(flags on the device, their names)` (one pass per param, no host sync)."""
        params, grads = self._grads_by_param()
        order, names = self._in_model_order(params)
        if self.in_backward: found = self._backward.flags([params[i] for i in order]), names  # the grads are gone
        else: found = nonfinite_flags([grads[i] for i in order]), names
        self.zero_model_grads()
        self.cleared, self.stage = True, Stage.SKIPPED
        return found

    def unscale_grads(self):
        """Divide the checked grads by the loss scale in place, now: a callback after ours reads or changes them before
        the step (a clip of its own, a probe), and sees them as FP32 would, unscaled. The step then unscales nothing."""
        if self.grad_factor == 1. or not self.checked: return
        with torch.no_grad():
            for gs in _by_device(self.checked).values(): torch._foreach_mul_(gs, self.grad_factor)
        self.divided(self.scale)

    def divided(self, scale:float):
        """The checked grads are divided by `scale` already (`scale` stays the step's loss scale): the step divides
        nothing."""
        self._rescale, self.grad_factor = scale, 1.

    def cancel(self):
        """Another callback cancelled the step: as in FP32 its grads stay until the optimizer's `zero_grad` (held back,
        the next backward adds to them: accumulation), at the scale the next backward adds at."""
        rescale, self._rescale = getattr(self, '_rescale', None), None
        if rescale is not None and self.checked:
            with torch.no_grad():
                for gs in _by_device(self.checked).values(): torch._foreach_mul_(gs, rescale)
        self.stage, self.cleared, self._fresh, self._trusted = Stage.READY, False, False, False

    def finish(self):
        "After a step (or a skip): the model's grads cleared for the next backward, unless they were already."
        if not self.cleared: self.zero_model_grads()
        self.stage, self.cleared, self._fresh = Stage.READY, False, True

    def backward(self, scale:float=1.):
        "A backward is coming: the model's grads will hold something again (`zero_grad` clears them then)."
        self._fresh = False

    def became_trainable(self) -> bool:
        "Whether a param of the optimizer that this store left out (frozen at its set-up) is trainable now."
        return any(getattr(p, 'requires_grad', False) for p in self.frozen)

    def check_linked(self):
        "Raise (or re-link, when safe) if something replaced the tensors of the params the store steps."

    def broadcast_from(self, src:int=0):
        """Give every rank the weights of rank `src` (what the optimizer steps, and the model after it), and its
        stochastic rounding's generator: the ranks round alike (their global seeds may differ), so they stay
        identical."""
        broadcast_(self._shared())
        self._after_broadcast()
        g = self.state_storage.generator
        if g is not None:
            st = g.get_state().to(g.device)  # on the generator's device: nccl's collectives take CUDA tensors
            broadcast_([st], src)
            g.set_state(st.cpu())

    def clear_own_grads(self):
        "The own-dtype params' grads cleared as the optimizer's `zero_grad` would: zeroed, or None (a torch optimizer)."
        for p in self.own_params:
            if p.grad is None: continue
            if self.none_after_step: p.grad = None
            else: p.grad.zero_()

    def own_grads(self) -> list:
        "The grads of the params that train in their own dtype (loss-scaled like the others)."
        return [p.grad for p in self.own_params if p.grad is not None]

    def fp32_views(self) -> dict:
        "`{model param: FP32 tensor holding its current trained value}` (empty: the model's own values are the truth)."
        return {}

    @contextmanager
    def opt_view(self):
        """Within: the optimizer on the model's own params, as between fits, the model untouched; nothing copied or
        widened: the state as the fit stores it (16-bit state in 16-bit: `fp32_state_dict` widens it as it is written;
        flat masters' state split into views of the flat state, which comes back as it was on exit). For reading."""
        stash = {}
        self._point_opt(to_model=True, stash=stash)
        try: yield self.opt
        finally: self._point_opt(to_model=False, stash=stash)

    def fp32_state_dict(self, opt, stream) -> dict:
        """Within `opt_view`: `opt.state_dict()` with its 16-bit state in FP32, each entry made by `stream` (a
        `Stream`) as `torch.save` writes it (one at a time, never the whole FP32 state at once)."""
        return lazy_state(opt.state_dict(), opt_state(self.core), self.state_storage, stream)

    def _point_opt(self, to_model:bool, stash:dict=None):
        """Move the optimizer (params, state) between what it steps during the fit and the model's params (here: the
        same); `stash`: a view, undone by the move back with the same dict (`opt_view`)."""

    def restore(self):
        "Give the optimizer its own `step`, params and state (FP32) back (the end of the fit)."
        self.state_storage.widen_all(opt_state(self.core))
        if getattr(self, '_backward', None) is not None: self._backward.remove()
        self.route.remove()
        self._let_go()

    def _let_go(self):
        """The fit's end: what the store holds for its steps is let go now (the store itself goes when the garbage
        collector finds it: its methods, kept as attributes, hold it in a cycle)."""
        self.checked = ()
        if getattr(self, 'scratch', None) is not None: self.scratch.release()

    # -- opt-in: the step in the backward
    def arm_in_backward(self):
        """Step each param from a hook as soon as the backward has accumulated its grad, and drop the grad there
        (`backward.BackwardSteps`): no param's grad outlives its own step."""
        self.in_backward = True
        self._backward = BackwardSteps(self._hooked_params(), self._step_one)
        return self

    def stepped_in_backward(self) -> bool:
        "Whether the backward of the step under way has stepped params already (a cancellation cannot undo it)."
        return self.in_backward and (self.stage is Stage.CHECKED or self._backward.stepped())

    def _found_in_backward(self):
        "`[found]`: whether any grad of this backward held inf/NaN (None: the backward reached no param)."
        found = self._backward.found()
        if found is not None: self.stage, self.scale, self.cleared = Stage.CHECKED, 1., True
        return found

    # -- shared by the kinds
    def chunk_limit(self, device) -> int:
        "The most elements of grads one chunk lifts to FP32 on `device` (`lift_chunk`, or by the device's type)."
        return chunk_limit(device, self.lift_chunk)

    def _factor(self, gi:int):
        "What group `gi`'s grads are multiplied by as they reach FP32: 1/scale times its clip coefficient (None: by 1)."
        c = self.coefs.get(gi)
        if c is None: return None if self.grad_factor == 1. else self.grad_factor
        return c if self.grad_factor == 1. else c * self.grad_factor

    def _through_core(self, core_step, *args, **kwargs):
        "Step the optimizer once, `core_step` (`(step, *args)`) doing the innermost optimizer's part (`Route.through`)."
        return self.route.through(core_step, *args, **kwargs)

    def _in_model_order(self, params:list) -> tuple:
        "`(order, names)`: `params` as `model.named_parameters()` orders and names them (made once per store)."
        if getattr(self, '_order', None) is None or len(self._order[0]) != len(params):
            rank = {k: i for i, k in enumerate(self.names)}
            order = sorted(range(len(params)), key=lambda i: rank.get(id(params[i]), len(rank)))
            self._order = order, [self.names.get(id(params[i]), f"<param of shape {tuple(params[i].shape)}>")
                                  for i in order]
        return self._order

    # -- what each kind does its own way
    def _grads_to_check(self) -> list:
        "The step's grads as the backward left them (after any re-attaching), for the overflow check."
        raise NotImplementedError
    def _grads_by_param(self) -> tuple:
        "`(params, their grads as the backward left them)`: what a skipped step's attribution looks at."
        raise NotImplementedError
    def _shared(self) -> list: return [p.data for pg in self.model_pgs + self.own_pgs for p in pg]
    def _hooked_params(self) -> list: return [p for pg in self.model_pgs + self.own_pgs for p in pg]
    def _stepped(self, params:list):
        if self.stepped_hook is not None: self.stepped_hook(params)
    def _step_one(self, p): raise NotImplementedError
    def _after_broadcast(self): pass
    def _step_impl(self, *args, **kwargs): raise NotImplementedError
    def zero_model_grads(self): raise NotImplementedError

def check_same_kind(p, buf, what:str, name:str):
    "`p`, no longer a view of `buf`, can be re-linked to it (same device and dtype), or this is a clear error."
    if p.device != buf.device or p.dtype != buf.dtype:
        raise RuntimeError(
            f"mixed precision: the model's parameter {name} was replaced during the fit by a tensor on {p.device} in "
            f"{p.dtype} (it was on {buf.device} in {buf.dtype}): something after the setup moved or converted the "
            f"model (a callback calling `learn.model.to(...)`/`.float()`, a wrapper). Training on would never change "
            f"the weights the optimizer steps ({what}). Move or convert the model before `learn.to_fp16()`/`to_bf16()` "
            f"(or before the fit), or order that callback before fp16cb's (order < -50).")

