"""`MixedPrecision`: FP32 master weights (or 16-bit storage) stepped by the optimizer, loss scaling, the overflow skip,
clipping of the unscaled grads. The events of a step; the weight store (`weights`) checks the grads, clips and steps;
loss scaling (`scaling`) picks the scale, reads the step's one host sync and accounts for skipped steps."""
from __future__ import annotations
import math, warnings
import torch
from fastai.callback.core import CancelStepException

from ..dtypes import resolve_dtype, model_device
from ..weights import Stage, ModelParams, ShardedParams
from ..storage import HalfStorage, StateStorage
from ..options import ScalingOptions, StoreOptions, ClipOptions, refuses_amp_args, check_int
from ..compat import Facts, check, learner_facts, OPTIONS, FIT, BATCH, STEP
from ..scaling import (StaticScaler, make_scaler, read_stats, underflow_flag, StepRecord, lr_find_stops_on,
                      warn_all_skipped, warn_skips)
from ..monitor import ScaleColumns, scale_health
from ..session import SessionCallback
from ..distributed import patch_fastai, is_ddp, is_fsdp, syncs, step_reducer
from .model_to_half import ModelToHalf
from .health import PrecisionWatch
from .copies import GradSink
from ..fsdp import ReduceSink

__all__ = ['MixedPrecision']

def _option(group:str, name:str) -> property:
    "An option read as the callback's attribute `name` (`self.clip` is `self.clipping.clip`)."
    return property(lambda self: getattr(getattr(self, group), name), doc=f"`{group}.{name}` (`fp16cb.options`)")

@refuses_amp_args("fp16cb's autocast + GradScaler is `NativeMixedPrecision(init_scale=...)` "
                  "(`learn.to_native_fp16(...)`); fastai's is `fastai.callback.fp16.MixedPrecision`.")
class MixedPrecision(ScaleColumns, SessionCallback):
    """FP32 master weights stepped by the optimizer, loss scaling, overflow skip, clipping of the unscaled FP32 grads.
    The weight store owns the step: `before_step` asks it to check the grads (one fused, read-only pass), reads the one
    host sync, skips or clips; the optimizer's `step` steps the store (the grads reach FP32, unscaled and clipped, a
    bounded chunk at a time as the optimizer consumes them), which the model follows.
    With `dynamic` and `loss_scale='calibrate'` (or fastai's default 512, which means the same) the scale is
    calibrated: the first step runs at scale 1 and its largest |grad| sets the scale (`BackoffScaler`); if that step's
    gradients underflowed (more than half of the nonzero 16-bit grads under the dtype's smallest normal, or all of them
    zero for a nonzero loss) it is skipped, counted in `n_skipped`, instead of applied. A number is the dynamic scale's
    start."""
    order = 10
    checkpoint_key = 'MixedPrecision'
    _reduce = None  # the step's stats across ranks (`distributed.step_reducer`), chosen at a fit's first batch
    def __init__(self,
        loss_scale:float=512, # 'calibrate'/512: step 1's max |grad| at scale 1 sets it; a number: dynamic start/static
        flat_master:bool=False, # the FP32 params laid out in one buffer per param group (fewer, bigger steps)
        dynamic:bool=True, # dynamic scale: divided by `div_factor` on overflow (skip), up after `scale_wait` good steps
        max_loss_scale:float=2.**24, # ceiling of the dynamic scale
        div_factor:float=2., # the dynamic scale: divided by this on overflow, multiplied after `scale_wait` clean steps
        scale_wait:int=500, # clean steps in a row before the dynamic scale grows
        clip:float=None, # clip each param group's global norm of unscaled FP32 master grads to this
        *,
        dtype=torch.float16, # the model's 16-bit dtype (bf16 has FP32's range: use loss_scale=1, dynamic=False)
        scaler=None, # None (fastai's behaviour), 'backoff', 'lognormal', 'static' or a `LossScaler`
        min_loss_scale:float=1., # the dynamic scale never falls under this; needing to is an error
        max_skipped:int=50, # more overflowing steps in a row than this stops training with an error
        clip_global:bool=False, # clip the norm of all param groups together (as fastai's `GradientClip`), not per group
        half_storage:bool=False, # no FP32 masters: one 16-bit copy of the weights, each update computed in FP32
        stochastic_rounding:bool=True, # round 16-bit weights and optimizer state stochastically (False: to nearest)
        on_collapse:str='raise', # at the scale's floor: 'raise' (naming where overflow starts, the fix) or 'keep_fp32'
        step_in_backward:bool=False, # step in backward, drop each grad (bf16, scale 1, fastai optimizer: less memory)
        state_dtype=None, # the optimizer's state between steps: torch.bfloat16, '8bit' (torchao's codes), None: FP32
        health_every:int=100, # every so many steps some 16-bit modules run again in FP32: one far off is said (0: off)
    ):
        self.dtype = resolve_dtype(dtype)
        self.scaling = ScalingOptions(loss_scale, dynamic, max_loss_scale, min_loss_scale, div_factor, scale_wait,
                                      max_skipped, scaler, on_collapse)
        self.storage = StoreOptions(flat_master, half_storage, stochastic_rounding, step_in_backward, state_dtype)
        self.clipping = ClipOptions(clip, clip_global)
        self.health_every, self.health = check_int('health_every', health_every, 0), None
        self.scaler = make_scaler(self.scaling.scaler, dtype=self.dtype, **self.scaling.scaler_kwargs)
        check(self.facts, OPTIONS)
        self.store, self.max_grad, self._rng, self._rng_state = None, None, None, None
        self.record = StepRecord(type(self).__name__)  # the loss scale of each step: `learn.loss_scale_history` too

    @property
    def facts(self) -> Facts:
        "What this callback's options tell the declaration of what combines (`fp16cb.compat`)."
        return Facts.of_options(self.dtype, self.scaling, self.storage, self.clipping)

    # the options by their argument's name (read-only: the options are frozen; `learn.to_fp16(...)` makes new ones)
    flat_master, half_storage, stochastic_rounding, step_in_backward, state_dtype = (
        _option('storage', k) for k in ('flat_master', 'half_storage', 'stochastic_rounding', 'step_in_backward',
                                        'state_dtype'))
    clip, clip_global, on_collapse = _option('clipping', 'clip'), _option('clipping', 'clip_global'), _option(
        'scaling', 'on_collapse')

    keeps_fp32_params = property(lambda self: self.storage.copies,
                                 doc="The model keeps its FP32 params for a fit (`ModelToHalf` makes the copies).")
    loss_scale = property(lambda self: self.scaler.scale, doc="The current loss scale.")
    loss_scaler = property(lambda self: self.scaler, doc="The `LossScaler` (health checks, diagnostics).")
    n_skipped = property(lambda self: self.scaler.n_skipped, doc="Steps skipped for inf/NaN gradients so far.")
    scales = property(lambda self: self.record.scales, doc="The loss scale of every optimizer step so far.")
    skips = property(lambda self: self.record.skips, doc="Whether each optimizer step so far was skipped.")
    skip_causes = property(lambda self: dict(self.record.causes),
                           doc="Why each skipped step was skipped: `{step: 'inf/NaN' or 'underflow'}`.")
    health_checks = property(lambda self: [] if self.health is None else list(self.health.checks),
                             doc="The precision-health checks so far: `{'step', 'module', 'rel_diff'}`.")
    lost_updates = property(lambda self: [] if self.health is None else list(self.health.lost),
                            doc="`half_storage`, at each precision-health check: the share of that step's weight "
                                "updates under half a 16-bit spacing (`{'step', 'lost', 'updates'}`): to nearest they "
                                "round back onto their weights; stochastic rounding keeps them on average.")
    skipped = property(lambda self: bool(self.record.skips) and self.record.skips[-1],
                       doc="Whether the last step was skipped.")
    model_pgs = property(lambda self: None if self.store is None else self.store.model_pgs,
                         doc="The params the store steps, per group.")
    master_pgs = property(lambda self: None if self.store is None else self.store.master_pgs,
                          doc="Their FP32 masters, per group.")
    skip_label = property(lambda self: type(self).__name__, doc="How the all-steps-skipped warning names this setup.")
    overflows = property(lambda self: self.record.overflows.read(),
                         doc="The last 100 skipped steps: `{'step', 'scale', 'params'}` (the params whose grads held "
                             "inf/NaN).")
    n_overflows = property(lambda self: self.record.overflows.count,
                           doc="Skipped steps logged in `overflows` so far (the older ones dropped).")

    def _model_to_half(self):
        return next((cb for cb in self.learn.cbs if isinstance(cb, ModelToHalf)), None)

    def policy_report(self, leaves:bool=False):
        "The learner's `ModelToHalf.policy_report`: each module's storage and compute dtype, and the casts inserted."
        mth = self._model_to_half()
        if mth is None:
            raise ValueError("policy_report: this learner has no ModelToHalf (use `learn.to_fp16()` or `to_bf16()`)")
        return mth.policy_report(leaves=leaves)

    # -- the lifecycle (called by the session)
    def setup(self):
        """The weight store for the optimizer's params (masters made from the exact FP32 originals `ModelToHalf` kept),
        made when a fit sets up. A `validate`/`get_preds`/`predict` outside a fit needs the 16-bit model only: no store
        (no masters, no optimizer moves), so that inference costs what it costs in 16-bit; events fired by other code
        that then trains get theirs at the first training batch."""
        self.store = None
        if self.session.in_fit: self._make_store()

    def _make_store(self):
        self._fit_facts = learner_facts(self.learn, self.facts).knowing(grads_read=self._runs_after('before_step'))
        check(self._fit_facts, FIT)
        patch_fastai()  # fastai's `DistributedDL` on gloo (CPU) too, if it is in use
        if self.learn.opt is None: self.learn.create_opt()
        mth, model = self._model_to_half(), self.learn.model
        names = {id(p): n for n, p in model.named_parameters()}
        if not self.session.suspending:  # a new fit
            self.record.new_fit(self.learn)
        copies = mth.copies if mth is not None else None
        if not self.half_storage:  # the model keeps its FP32 params: the optimizer steps them (grads arrive unscaled)
            self._own_params(copies, names, model)  # (without `ModelToHalf`: an FP32 model, loss-scaled)
            self._remembered = {}
        else: self._store_beside(mth, model, names)
        self.show_scale_columns()
        # a static fp16 scale that flushes every gradient trains nothing: the fit's first step looks (in its one sync)
        self._watch_flush = isinstance(self.scaler, StaticScaler) and self.dtype == torch.float16
        self.record.setup(model)
        # (FSDP2: re-running one unit outside the model's forward would all-gather on one rank alone)
        if mth is not None and mth.computing and self.health_every and not is_fsdp(model) and (self.health is None or
                                                                          self.health.model is not model):
            self.health = PrecisionWatch(model, mth.policy.resolve(model, warn=False).kept, self.dtype,
                                         self.health_every, sources=copies.sources if copies is not None else None)

    def _own_params(self, copies, names:dict, model):
        """The model's own FP32 params as what the optimizer steps (`ModelParams`): its forward computes with `copies`,
        whose grads arrive on them (none: an FP32 forward, its grads unscaled on their way in all the same)."""
        unit = isinstance(self.scaler, StaticScaler) and self.scaler.scale == 1.  # bf16's: nothing to divide
        state = (StateStorage(self.state_dtype, self.stochastic_rounding, self.rng(model))
                 if self.state_dtype is not None else None)  # (FP32 state: nothing of storage precision)
        sink, computed = (copies.sink, {self.dtype: copies.computed_in(self.dtype)}) if copies else (GradSink(), {})
        kind = ShardedParams if is_fsdp(model) else ModelParams  # FSDP2: its policy computes, the grads come sharded
        if kind is ShardedParams: sink = ReduceSink(model)
        self.store = kind(self.learn, sink, names, computed, scaled=not unit, flat=self.flat_master, state=state,
                          in_backward=self.step_in_backward)

    def _store_beside(self, mth, model, names:dict):
        """The store of a 16-bit model (`half_storage`): its params are 16-bit for the fit, the optimizer steps them
        lifted to FP32 (fastai `Lookahead`'s slow weights made from the exact FP32 originals `ModelToHalf` kept)."""
        half = mth is not None and mth.converted
        state = StateStorage(self.state_dtype, self.stochastic_rounding, self.rng(model))
        self.store = HalfStorage(self.learn, names, state=state, in_backward=self.step_in_backward,
                                 stochastic=self.stochastic_rounding, generator=self.rng(model),
                                 fp32_of=mth.fp32_of if half else None)
        # FP32 originals still kept
        self._remembered = {id(p): p for p in self.store.params if p.requires_grad} if half else {}
        if self._remembered: self.store.stepped_hook = self._forget_originals

    def teardown(self):
        """The mirror of `setup`: the optimizer on the model's own params again, with its state; the Recorder columns
        off. A fit that ends leaves no loss-scaled grad: a step the optimizer took is finished (its grads cleared),
        grads made for a step that never came are divided by the scale (BatchNorm's, FP32 islands'; the 16-bit ones
        go)."""
        fit_ends = not self.session.suspending
        if self.health is not None:
            self.health.disarm()
            if fit_ends and not self.session.failing: self.health.read(final=True)
        if fit_ends and self.store is not None and (self.store.stage in (Stage.STEPPED, Stage.SKIPPED)
                                                    or self.store.stepped()): self._end_step(False)
        self.record.teardown()
        self.drop_scale_columns(fit_ends)
        if self.store is None: return
        self._was_checked = self.store.stage is Stage.CHECKED and not fit_ends  # a paused step keeps its grads
        # ... divided by the scale already (`_unscale_for_others`)
        self._divided = getattr(self.store, '_rescale', None)
        self.store.restore()
        if fit_ends: self.store.own_storage()
        if fit_ends: self.record.unscale_left([p.grad for pg in self.store.old_param_lists for p in pg])
        self.store = None
        # an error says more
        if fit_ends and not self.session.failing:
            warn_all_skipped(self.record.this_fit, self.skip_label, model_device(self.learn.model))

    def resume(self):
        """Back from a pause in the middle of a step (a `before_step` after ours saved or froze): its grads are brought
        in again."""
        if getattr(self, '_was_checked', False):
            divided = getattr(self, '_divided', None)
            self.store.prepare_grads(self.scaler.scale)
            if divided is not None: self.store.divided(divided)  # a cancel after the pause multiplies them back
        self._was_checked, self._divided = False, None

    def rng(self, model) -> torch.Generator:
        "The stochastic rounding's own generator (not torch's global one: dropout and augmentation draw as without it)."
        dev = model_device(model)
        if self._rng is None or self._rng.device.type != dev.type:
            self._rng = torch.Generator(dev).manual_seed(torch.initial_seed() % 2**63)
        # a checkpoint's, loaded before the device was known
        state, self._rng_state = getattr(self, "_rng_state", None), None
        if state is not None:
            try: self._rng.set_state(state)
            except RuntimeError:
                warnings.warn(f"the checkpoint's stochastic-rounding generator was saved on another kind of "
                              f"device than {dev.type}: its random stream starts afresh here (the run "
                              f"goes on, but not bit for bit as it would have).", RuntimeWarning)
        return self._rng

    # -- the events of one step
    def before_batch(self):
        if not self.training: return
        if self.store is None:
            if not self.session.is_active(self): return
            self._make_store()
        if self.store.stage is Stage.NEW: self._sync_ranks()
        elif self.store.stage in (Stage.STEPPED, Stage.SKIPPED): self._end_step()  # our after_step did not run
        elif self.store.stage is Stage.CHECKED:  # a step whose `after_step` did not come
            self._end_step(cancelled=not self.store.stepped())  # (cancelled by `CancelBatchException`: not stepped)
        self.store.check_linked()  # the model's params kept their dtype (a `.half()` since the setup?)
        self.record.snapshot()  # BatchNorm's statistics, put back if this step is skipped
        if self.health is not None and self.health.due(self.learn.train_iter):
            self.health.read(); self.health.arm(self.learn.train_iter)
            if isinstance(self.store, HalfStorage): self.store.count_lost()

    def after_loss(self):
        if self.health is not None and self.health.armed: self.health.compare()  # the check step's forward is done

    def before_backward(self):
        if self.loss_scale != 1.: self.learn.loss_grad = self.learn.loss_grad * self.loss_scale
        if self.store is not None: self.store.backward(self.loss_scale, self.learn.loss_grad)
        # what the grads carry until the step (a fit ending before it divides them); none when they arrive unscaled
        if isinstance(self.store, HalfStorage): self.record.scaled(self.loss_scale)

    def before_step(self):
        self._step_cancelled = False
        scale, calibrating = self.loss_scale, self.scaler.calibrating
        self.store.grads_final = not self._runs_after('before_step')  # then the grads it checks are the ones stepped
        watch, self._watch_flush = getattr(self, '_watch_flush', False), False
        stats = self.store.prepare_grads(scale, with_max=self.scaler.needs_max_grad or watch)
        if stats is None: return
        if calibrating: stats = underflow_flag(stats, self._half_grads(), self.learn.loss_grad, self.scaler.min_normal)
        # the one host sync; DDP: any rank's inf skips all
        found, self.max_grad, under = read_stats(stats, self._reduce)
        # the grads' sums said so (a CPU): the exact check decides, on such steps only
        if found and self.store.check.approx:
            found, self.max_grad, under = read_stats(self.store.recheck(), self._reduce)
        if not (found or under):
            if watch: self._warn_flushed(scale)
            if self.clip is not None: self.store.clip(self.clip, self.clip_global)
            if not self.store.grads_final and scale != 1.: self._unscale_for_others()
            return
        # which params overflowed; BatchNorm's statistics back
        self.record.record(scale, True, self.store.skip(), 'underflow' if under and not found else 'inf/NaN')
        self.record.unscaled()
        if warn_skips(self.record, self.dtype, self.scaler.is_dynamic, model_device(self.learn.model)) == 'burst':
            self.__dict__.setdefault('_health_warned', set()).add('skips')  # said: not again at the epoch's end
        with lr_find_stops_on(self.learn, self._collapse): self.scaler.update(found, self.max_grad, underflow=under)
        raise CancelStepException()

    def _unscale_for_others(self):
        """A callback after ours handles `before_step` (a clip of its own, a probe of the grads, a skip): it reads the
        grads as FP32 fastai would show them, unscaled (divided in place now; fp16 values under 2^-24 flush to zero)."""
        self.store.unscale_grads()
        self.record.unscaled()

    def _warn_flushed(self, scale:float):
        """The first step of a static fp16 scale: every 16-bit gradient zero for a nonzero loss means they all
        underflowed."""
        if self.max_grad != 0: return
        loss = float(self.learn.loss.detach())  # a second read, on this rare step only
        if loss == 0 or not math.isfinite(loss): return
        warnings.warn(f"every fp16 gradient of this fit's first step is zero while its loss is {loss:g}: at the static "
                      f"loss scale {scale:g} they all underflowed (flushed to zero), so nothing trains. Raise "
                      f"`loss_scale`, or use the dynamic scale (`dynamic=True`, the default), which sets it from the "
                      f"gradients.",
                      RuntimeWarning, stacklevel=2)

    def _runs_after(self, event:str) -> bool:
        "Whether another callback of the learner handles `event` after this one (a higher `order`)."
        return any(cb is not self and cb.order > self.order and any(event in vars(k) for k in type(cb).__mro__[:-1])
                   for cb in self.learn.cbs)

    def _cancelled(self, exc:str):
        "Another callback cancelled a step that the backward already took (`step_in_backward`): say so, naming `exc`."
        if self.store is not None and self.store.stepped_in_backward():
            check(self.facts.knowing(cancels_steps=exc), STEP)

    def after_cancel_step(self):
        self._cancelled('CancelStepException')
        self._step_cancelled = True  # by us (a skip) or another callback: the optimizer did not step
    def after_cancel_batch(self): self._cancelled('CancelBatchException')  # a batch dropped after its backward

    def _half_grads(self) -> list:
        "The model's 16-bit grads as the backward left them (the calibrating step's underflow check)."
        return self.store.half_grads(self.dtype)

    def after_step(self):
        """fastai calls this even for a cancelled step. The model already follows the store (it copies right after
        stepping)."""
        self._end_step()

    def _end_step(self, cancelled:bool=None):
        """A step the optimizer took counts here (the micro-batches of an accumulated step share one scale); one that
        another callback cancelled after our `before_step` changes nothing, as in FP32: the scaler sees nothing of
        it."""
        stage = self.store.stage
        if cancelled is None: cancelled, self._step_cancelled = self.__dict__.get('_step_cancelled', False), False
        if stage is Stage.CHECKED and not cancelled: stage = Stage.STEPPED  # fastai's `_step` ran (`stepped`)
        # in the backward: stepped there
        lost = self.store.lost_updates() if isinstance(self.store, HalfStorage) else None
        if stage is Stage.STEPPED or (stage is Stage.CHECKED and self.store.in_backward):
            if lost is not None and self.health is not None: self.health.note_lost(self.learn.train_iter, lost)
            self.record.record(self.store.scale, False)
            with lr_find_stops_on(self.learn): self.scaler.update(False, self.max_grad)
        elif stage is not Stage.SKIPPED:  # cancelled: its grads stay until the optimizer's `zero_grad`, as in FP32
            self.record.cancelled()
            self.store.cancel()
            self.record.scaled(self.loss_scale)
            return
        self.store.finish()
        self.record.unscaled()

    def _forget_originals(self, params:list):
        """16-bit storage has just stepped these params: the FP32 originals `ModelToHalf` kept for them are stale, let
        them go (4 bytes/param), one param or batch at a time as the step goes, so that the first step's peak holds no
        more than the others'. A param never stepped keeps its original (a step another callback cancelled after our
        `before_step` steps nothing): after the fit it gets its exact FP32 value back."""
        gone = [p for p in params if id(p) in self._remembered]
        if not gone: return
        self._model_to_half().forget_originals(gone)
        for p in gone: del self._remembered[id(p)]
        if not self._remembered: self.store.stepped_hook = None

    def _sync_ranks(self):
        """The first batch: the model as the learner calls it is known (DDP wraps it after our `before_fit`). Several
        processes: every rank starts from rank 0's weights."""
        check(self._fit_facts.knowing(ddp=self._fit_facts.ddp or is_ddp(self.learn.model)), BATCH)
        self.store.stage = Stage.READY
        self._reduce = step_reducer(self.learn.model)
        if syncs(self.learn.model): self.store.broadcast_from(0)

    def after_epoch(self):
        scale_health(self)
        if self.health is not None: self.health.read()

    def state_dict(self) -> dict:
        "What a checkpoint keeps of this callback: the loss scaler's state, and the stochastic rounding's generator."
        pending = getattr(self, '_rng_state', None)
        rng = pending if pending is not None else self._rng.get_state() if self._rng is not None else None
        return {'scaler': self.scaler.state_dict(), **({'rng': rng} if rng is not None else {})}

    def load_state_dict(self, sd:dict):
        self.scaler.load_state_dict(sd['scaler'])
        if 'rng' in sd:  # set on the generator of the model's device at the next set-up (`rng`)
            # a generator's state is a CPU tensor; `learn.load` maps it to the model's device
            self._rng_state = sd['rng'].cpu()
            if self.store is not None: self.rng(self.learn.model)
