"""The recipe of Micikevicius et al. as two fastai callbacks: a 16-bit model, and FP32 masters with loss scaling."""
from __future__ import annotations
import torch
from torch import nn
from fastai.callback.core import Callback, CancelStepException

from .dtypes import resolve_dtype, convert_network_keeping, cast_floats, warn_slow_half
from .master import MasterWeights
from .layout import with_layout_of
from .overflow import OverflowCheck
from .scalers import make_scaler, check_positive
from .health import scale_health  # warns once: scale stuck at its floor, many skipped steps
from .guards import BNStatsGuard, reject_gradient_clip, lr_find_stops_on, warn_all_skipped
from .monitor import add_precision_metrics, remove_precision_metrics
from .devices import model_device
from .session import session_of
from .validation import check_bool, check_real, check_int, FP32_MAX
from .policy import PrecisionPolicy, IslandHooks, policy_report
from .storage import HalfStorage
from .distributed import is_ddp, rewrap, reduce_max_, sync_masters, patch_fastai

__all__ = ['ModelToHalf', 'MixedPrecision', 'model_device', 'SessionCallback']

class SessionCallback(Callback):
    "A precision callback whose `setup`/`teardown` the learner's `PrecisionSession` calls (once per fit, not per event)."
    fit_start = 0  # callbacks that record `skips` per optimizer step: the index of the current fit's first one
    @property
    def session(self): return session_of(self.learn)
    def before_fit(self):
        patch_fastai()  # fastai's `DistributedDL` on gloo (CPU) too, if it is in use
        if not self.session.is_active(self): self.new_fit()  # not the nested before_fit of a validate()
        self.session.begin(self)
    def new_fit(self): self.fit_start = len(getattr(self, 'skips', ()))
    def after_fit(self):
        skips = getattr(self, 'skips', None)
        if skips is not None and self.session.depth.get(id(self)) == 1: warn_all_skipped(skips[self.fit_start:], self.skip_label)
        self.session.end(self)
    skip_label = property(lambda self: type(self).__name__, doc="How the all-steps-skipped warning names this setup.")
    def setup(self): pass
    def teardown(self): pass
    def restore(self):
        "Tear this callback's setup down now (the learner is FP32 again as far as this callback is concerned)."
        learn = self.__dict__.get('learn')
        if learn is not None: session_of(learn).drop(self)
        else: self.teardown()

def _cast_inputs(dtype):
    "A forward pre-hook: the model's floating inputs in `dtype`, whatever the callbacks did to `learn.xb` (MixUp)."
    def hook(module, args, kwargs): return cast_floats(args, dtype), cast_floats(kwargs, dtype)
    return hook

class ModelToHalf(SessionCallback):
    """Run the model in 16-bit during a fit (BatchNorm stays FP32); predictions come out FP32. Floating inputs are cast
    to 16-bit as they enter the model (a forward pre-hook): `learn.xb` stays as the data gave it, so callbacks that
    transform it (fastai's `MixUp`) work on FP32 inputs."""
    order = -50  # before every other callback: the model is 16-bit when they see it
    def __init__(self,
        dtype=torch.float16, # the 16-bit dtype: `torch.float16` or `torch.bfloat16` (or 'fp16' / 'bf16')
        keep_fp32=None, # what stays FP32 besides BatchNorm: a `PrecisionPolicy`, or spec(s) for one (see `fp16cb.policy`)
    ):
        self.dtype, self.policy = resolve_dtype(dtype), PrecisionPolicy.make(keep_fp32)
        self.originals, self.masters, self._hook, self.islands = None, {}, None, None

    @property
    def converted(self) -> bool:
        "Whether the model is in 16-bit now (set up by the session for a fit, until its end)."
        return self.originals is not None

    def setup(self):
        # on the data's device first (fastai's TrainEvalCallback moves it there only later, at order -10): the exact
        # FP32 originals, and so the masters made from them, must live where the model trains
        model, device = self.learn.model, getattr(self.learn.dls, 'device', None)
        if device is not None: model.to(device)
        warn_slow_half(self.dtype, model_device(model))
        res = self.policy.resolve(model)
        self.originals = convert_network_keeping(model, self.dtype, keep=set(res.kept))
        self.islands = IslandHooks(model, res.islands, self.dtype)  # no hooks by default: BatchNorm takes 16-bit inputs
        in_dtype = torch.float32 if id(model) in res.kept else self.dtype
        self._rewrap_ddp()  # before the hook: the hook goes on the model the learner calls
        self._hook = self.learn.model.register_forward_pre_hook(_cast_inputs(in_dtype), with_kwargs=True, prepend=True)

    def teardown(self):
        if self._hook is not None: self._hook.remove()
        if self.islands is not None: self.islands.remove()
        self._hook = self.islands = None
        was_converted = self.converted
        self._restore_model()
        if was_converted: self._rewrap_ddp()

    def _rewrap_ddp(self):
        "A model that is already a `DistributedDataParallel` changed dtype under it: wrap it again (every rank does)."
        if is_ddp(self.learn.model): self.learn.model = rewrap(self.learn.model)

    def policy_report(self,
        model:nn.Module=None, # the model to report on (default: the learner's)
        leaves:bool=False, # only the modules without children (and the FP32 islands)
    ):
        "Each module's storage and compute dtype during a fit and the casts inserted at its edges (a DataFrame)."
        model = model if model is not None else self.learn.model
        return policy_report(model, self.policy, self.dtype, leaves=leaves)

    def after_pred(self):
        if self.converted: self.learn.pred = cast_floats(self.learn.pred, torch.float32)

    def fp32_of(self, p) -> torch.Tensor:
        "The exact FP32 value `p` had when it was converted (`p.data` for what was not; its master once linked)."
        rec = self.originals.get(id(p)) if self.converted else None
        return p.data if rec is None else rec.original

    def link_masters(self, fp32_views:dict):
        "Register `{param: FP32 tensor}` holding the trained master values: `restore` gives them back to the model."
        self.masters = {id(p): t for p, t in fp32_views.items()}
        self._drop_originals_of_masters()

    def _drop_originals_of_masters(self):
        "An original that a master copied (flat masters) is never used again (`restore` takes the master): free it."
        for k, t in self.masters.items():
            rec = self.originals.get(k) if self.originals else None
            if rec is not None and rec.original.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
                self.originals[k] = rec._replace(original=t)

    def _restore_model(self):
        "Give the model back its exact FP32 values: the masters for trained params, the originals for the rest."
        if not self.converted: return
        for module, name, is_param, orig in self.originals.values():
            cur = (module._parameters if is_param else module._buffers).get(name)
            if cur is None: continue
            master = self.masters.get(id(cur)) if is_param else None
            # each in the layout the model has now (e.g. channels_last set during the fit), in storage of its own
            if master is not None: new = with_layout_of(master, cur)
            elif cur.dtype != orig.dtype and torch.equal(cur, orig.to(cur.dtype)): new = with_layout_of(orig, cur)  # unchanged: exact original
            else: new = cur.to(orig.dtype)  # trained in 16-bit without master: nothing better than its value
            if is_param:
                if cur.grad is not None and cur.grad.dtype != new.dtype: cur.grad = None  # no 16-bit grad on an FP32 param
                cur.data = new
            else: module._buffers[name] = new
        for m in self.learn.model.modules():
            if isinstance(m, nn.RNNBase): m.flatten_parameters()
        self.originals, self.masters = None, {}

def _check_clip(clip):
    return check_positive('clip', clip, allow_none=True)

class MixedPrecision(SessionCallback):
    """FP32 master weights stepped by the optimizer, loss scaling, overflow skip, clipping of the unscaled FP32 grads.
    From its `before_step` on, a step's gradients are in the masters (the optimizer's params, unscaled); the model's
    16-bit grads are cleared for the next backward there (in cache), or in `after_step` when a later callback has a
    `before_step` (it could cancel the batch to accumulate them)."""
    order = 10
    bn_stats = None  # a `BNStatsGuard` during a fit
    log_scale = True  # show `loss_scale` and `n_skipped` as Recorder columns during a fit (False: don't)
    sync_pending = False  # a DDP model: the masters are still to be broadcast from rank 0 (at the fit's first batch)
    def __init__(self,
        loss_scale:float=512, # the scale when not `dynamic`; with `dynamic`, any other value is the starting scale
        flat_master:bool=False, # keep one flat FP32 master per param group (the optimizer steps fewer, bigger tensors)
        dynamic:bool=True, # dynamic loss scaling: the first step (at scale 1) picks the scale from its largest |grad|, halve on overflow, grow back
        max_loss_scale:float=2.**24, # ceiling of the dynamic scale
        div_factor:float=2., # the dynamic scale is divided by this on overflow and multiplied after `scale_wait` clean steps
        scale_wait:int=500, # clean steps in a row before the dynamic scale grows
        clip:float=None, # clip each param group's global norm of unscaled FP32 master grads to this
        *,
        dtype=torch.float16, # the model's 16-bit dtype (bf16 has FP32's range: use loss_scale=1, dynamic=False)
        scaler=None, # None (seed behaviour), 'backoff', 'lognormal', 'static' or a `LossScaler`
        min_loss_scale:float=1., # the dynamic scale never falls under this; needing to is an error
        max_skipped:int=50, # more overflowing steps in a row than this stops training with an error
        clip_global:bool=False, # clip the norm over all param groups together (as fastai's `GradientClip`), not per group
        half_storage:bool=False, # no FP32 masters: one 16-bit copy of the weights, updated in FP32 math (`fp16cb.storage`)
        stochastic_rounding:bool=True, # with `half_storage`: round the updated weights stochastically (False: to nearest)
    ):
        self.dtype, self.clip_global = resolve_dtype(dtype), check_bool('clip_global', clip_global)
        self.half_storage = check_bool('half_storage', half_storage)
        self.stochastic_rounding = check_bool('stochastic_rounding', stochastic_rounding)
        self.flat_master, self.clip = check_bool('flat_master', flat_master), _check_clip(clip)
        dynamic = check_bool('dynamic', dynamic)
        # every argument is checked whatever the mode (bf16, `dynamic=False`, a `scaler`): one unused now is still a mistake
        loss_scale = check_real('loss_scale', loss_scale, 0., FP32_MAX, lo_open=True)  # the FP32 loss is multiplied by it
        max_loss_scale = check_real('max_loss_scale', max_loss_scale, 0., FP32_MAX, lo_open=True)
        min_loss_scale = check_real('min_loss_scale', min_loss_scale, 0., max_loss_scale, lo_open=True, hi_name='max_loss_scale')
        div_factor, scale_wait = check_real('div_factor', div_factor, 1., lo_open=True), check_int('scale_wait', scale_wait, 1)
        max_skipped = check_int('max_skipped', max_skipped, 1)
        self.scaler = make_scaler(scaler, loss_scale=loss_scale, dynamic=dynamic, max_loss_scale=max_loss_scale,
                                  div_factor=div_factor, scale_wait=scale_wait, min_loss_scale=min_loss_scale,
                                  max_skipped=max_skipped, dtype=self.dtype)
        self.master, self.check, self.skipped, self.grads_cleared, self.owed = None, OverflowCheck(), False, False, False
        self.scales, self.skips = [], []  # per optimizer step: the loss scale used, and whether the step was skipped

    @property
    def loss_scale(self) -> float: return self.scaler.scale
    @property
    def loss_scaler(self): return self.scaler
    @property
    def model_pgs(self): return None if self.master is None else self.master.model_pgs
    @property
    def master_pgs(self): return None if self.master is None else self.master.master_pgs
    @property
    def n_skipped(self) -> int: return self.scaler.n_skipped

    def _model_to_half(self):
        return next((cb for cb in self.learn.cbs if isinstance(cb, ModelToHalf)), None)

    def policy_report(self, leaves:bool=False):
        "The learner's `ModelToHalf.policy_report`: each module's storage and compute dtype, and the casts inserted."
        mth = self._model_to_half()
        if mth is None: raise ValueError("policy_report: this learner has no ModelToHalf (use `learn.to_fp16()` or `to_bf16()`)")
        return mth.policy_report(leaves=leaves)

    def new_fit(self):
        super().new_fit()
        self.sync_pending = True

    def _sync_ranks(self):
        "A DDP model in several processes: all ranks start from rank 0's masters (DDP wraps after our `before_fit`)."
        self.sync_pending = False
        if self.half_storage:  # no masters: the 16-bit weights are what every rank must agree on
            sync_masters(self.learn.model, [p.data for p in self.learn.model.parameters()]); return
        if sync_masters(self.learn.model, self.master._run_masters): self.master.master_to_model()

    def setup(self):
        "Masters for the optimizer's params (made from the exact FP32 originals `ModelToHalf` kept), Recorder columns."
        reject_gradient_clip(self.learn)
        if self.learn.opt is None: self.learn.create_opt()
        mth = self._model_to_half()
        half = mth is not None and mth.converted
        names = {id(p): n for n, p in self.learn.model.named_parameters()}
        if self.half_storage: self.master = HalfStorage(self.learn.opt, self.stochastic_rounding)
        else: self.master = MasterWeights(self.learn.opt, self.flat_master, fp32_of=mth.fp32_of if half else None, names=names)
        if half and not self.half_storage: mth.link_masters(self.master.fp32_views())
        if self.log_scale and self.session.in_fit: add_precision_metrics(self.learn, self)  # not in validate()'s result
        self.bn_stats, self.owed = BNStatsGuard(self.learn.model), False

    def teardown(self):
        "Point the optimizer at the model's own params again, with its state (and drop the Recorder columns)."
        if self.__dict__.get('learn') is not None: remove_precision_metrics(self.learn, fit_ends=not self.session.suspending)
        self.bn_stats = None
        if self.master is None: return
        self.master.restore_opt()
        self.master, self.check = None, OverflowCheck()  # a fresh check: the old one cached this fit's grads

    def before_batch(self):
        if self.sync_pending and self.master is not None: self._sync_ranks()
        # a callback before us raised in `after_step`, so ours did not run: finish that step's work now
        if self.owed or (self.master is not None and self.master.stepped): self._settle()
        # a skipped step must leave no trace in BatchNorm's running statistics: snapshot them (restored on a skip)
        if self.training and self.bn_stats is not None: self.bn_stats.snapshot()

    def before_backward(self):
        self.grads_cleared = False  # this backward's 16-bit grads: cleared in `before_step`, or else in `after_step`
        if self.loss_scale != 1.: self.learn.loss_grad = self.learn.loss_grad * self.loss_scale

    def before_step(self):
        self.skipped = False
        scale = self.loss_scale
        if self.half_storage:
            stats, clear = self._check_half(scale), False
            if stats is None: return
        else:
            grads = self.master.grads_to_master()
            if not grads and not self.master.own_params: return
            clear = self._may_clear_early()
            stats = self._check_and_clear(grads, scale) if clear else self._check(grads, scale)
            stats = reduce_max_(stats, self.learn.model).tolist()  # the one sync; DDP: all ranks' worst (one inf skips all)
        self.grads_cleared = clear
        found = stats[0] > 0
        if found:
            if clear: self.master.zero_model_grads(reattach=False)  # `_check_and_clear` may have left NaN for an inf
            self.bn_stats.restore()  # before the scaler may stop training: the statistics stay clean either way
        self.scales.append(scale); self.skips.append(found)
        self.skipped = self.owed = found  # a skip is a finished step: its `after_step` work is owed from here on
        with lr_find_stops_on(self.learn): self.scaler.update(found, stats[1] if len(stats) > 1 else None)
        if found: raise CancelStepException()
        if self.clip is not None: self._clip()

    def _check_half(self, scale:float):
        "`half_storage`: check the 16-bit grads as they are (unscaling in 16-bit could underflow: `HalfStorage` unscales in FP32)."
        grads = self.master.grads()
        if not grads: return None
        self.master.grad_factor, self.master.factors = 1. / scale, {}
        stats = reduce_max_(self.check(grads, 1., with_max=self.scaler.needs_max_grad), self.learn.model).tolist()  # DDP: all ranks'
        return stats[:1] + [s / scale for s in stats[1:]]

    def _clip(self):
        "Clip the unscaled FP32 master grads: each param group's norm (as fastai v2's original `MixedPrecision`), or their global norm."
        if self.half_storage: return self._clip_half()
        pgs = self.master.opt_pgs
        for pg in ([[m for pg in pgs for m in pg]] if self.clip_global else pgs):
            if pg: nn.utils.clip_grad_norm_(pg, self.clip, foreach=True)

    def _clip_half(self):
        "`half_storage`: the clip coefficient joins the unscaling factor that `HalfStorage` applies in FP32."
        pgs = [list(pg) for pg in self.learn.opt.param_lists]
        norm = torch.stack(self.master.unscaled_norms([[p for pg in pgs for p in pg]] if self.clip_global else pgs)).max()
        if self.clip_global or len(pgs) == 1: self.master.grad_factor *= float((self.clip / (norm + 1e-6)).clamp(max=1.))
        else:  # per group: each group's coefficient joins the FP32 lift of its grads
            for pg, n in zip(pgs, self.master.unscaled_norms(pgs)):
                c = float((self.clip / (n + 1e-6)).clamp(max=1.))
                self.master.factors.update({id(p): c for p in pg})

    def _may_clear_early(self) -> bool:
        """Whether no callback after this one has a `before_step`: one could raise `CancelBatchException` there, and
        fastai then skips `after_step` and `zero_grad` so that the grads accumulate into the next batch (gradient
        accumulation ordered after us). They must then still be in the 16-bit grads: clearing waits for `after_step`."""
        return not any(cb.order > self.order and callable(getattr(cb, 'before_step', None)) for cb in self.learn.cbs)

    def _check(self, grads:list, scale:float) -> torch.Tensor:
        "The check alone: unscale the FP32 grads; at scale 1 a read-only pass over the 16-bit ones (exact copies)."
        needs_max = self.scaler.needs_max_grad
        grads = (self.master.model_grads if scale == 1. else grads) + self.master.own_grads()
        return self.check(grads, 1. / scale, with_max=needs_max)

    def _check_and_clear(self, grads:list, scale:float) -> torch.Tensor:
        """Check the grads for inf/NaN (unscaling the FP32 ones), and clear the 16-bit ones for the next backward: the
        masters hold the grads now, and the 16-bit ones are still in cache. At scale 1 nothing needs unscaling: the
        16-bit grads (the FP32 ones are exact copies) are checked and cleared in ONE fused pass, by "unscaling" them
        by 0 (an inf or NaN becomes NaN: on such a step the caller zeroes them again)."""
        if scale == 1. and not self.scaler.needs_max_grad and not self.master.own_params:
            return self.check(self.master.model_grads, 0.)
        stats = self._check(grads, scale)
        self.master.zero_model_grads(reattach=False)
        return stats

    def after_step(self):
        """fastai calls this even for a cancelled step. The model already follows the masters: `MasterWeights` copies
        them in right after the optimizer's `step` (a callback before us that raises here cannot make it miss that)."""
        self._settle()

    def _settle(self):
        "After a step (or skip): clear the 16-bit grads unless already done, and arm BatchNorm's snapshot for the next."
        if not self.grads_cleared: self.master.zero_model_grads()  # not cleared early, or the step was cancelled before us
        self.skipped = self.grads_cleared = self.owed = self.master.stepped = False
        self.bn_stats.arm()

    def after_epoch(self):
        scale_health(self)

    def state_dict(self) -> dict:
        "What a checkpoint keeps of this callback: the loss scaler's state."
        return {'scaler': self.scaler.state_dict()}

    def load_state_dict(self, sd:dict):
        self.scaler.load_state_dict(sd['scaler'])
