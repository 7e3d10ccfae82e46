"""torch.amp (autocast + GradScaler) as a fastai callback, on whatever device the model is."""
from __future__ import annotations
import inspect
import torch
from collections import defaultdict
from torch.amp import GradScaler
from torch.amp.grad_scaler import _refresh_per_optimizer_state
from fastai.callback.core import CancelStepException

from ..dtypes import resolve_dtype, warn_slow_half, model_device
from .casts import cast_floats
from ..session import SessionCallback
from ..scaling import (GradScalerAdapter, OverflowCheck, StepRecord, count_skip, lr_find_stops_on,
                      warn_all_skipped, warn_skips, nonfinite_flags)
# warns once: scale stuck at its floor, many skipped steps; the Recorder columns
from ..monitor import scale_health, ScaleColumns
from ..distributed import reduce_max_, is_fsdp
from ..options import check_bool, check_real, check_int, FP32_MAX, INT32_MAX, refuses_amp_args
from ..compat import Facts, check, OPTIONS, FIT

__all__ = ['NativeMixedPrecision']

@refuses_amp_args("Use `dtype=torch.bfloat16` (or `learn.to_native_bf16()`) for bf16.", only=('amp_mode',))
class NativeMixedPrecision(ScaleColumns, SessionCallback):
    "Mixed precision with PyTorch's autocast and GradScaler, on the model's device (CPU included)."
    order = 10
    family, checkpoint_key = 'native', 'NativeMixedPrecision'
    _stateattrs = ('_autocast',)  # not pickled (export): an autocast context belongs to one fit
    def __init__(self,
        init_scale:float=2.**16, # GradScaler's initial scale
        growth_factor:float=2., # multiply the scale by this after `growth_interval` clean steps
        backoff_factor:float=.5, # multiply the scale by this on overflow
        growth_interval:int=2000, # clean steps before the scale grows
        enabled:bool=True, # False: plain FP32 training
        *,
        dtype=torch.float16, # autocast dtype: fp16 (with GradScaler) or bf16 (no scaling needed)
        max_skipped:int=50, # more skipped (inf/NaN) steps in a row than this stops training with `LossScaleError`
    ):
        self.dtype = resolve_dtype(dtype)
        # GradScaler keeps the scale in an FP32 tensor and counts the interval in an int32 one:
        # their limits, checked now
        self.init_scale = check_real('init_scale', init_scale, 0., FP32_MAX, lo_open=True)
        self.growth_factor = check_real('growth_factor', growth_factor, 1., lo_open=True)
        self.backoff_factor = check_real('backoff_factor', backoff_factor, 0., 1., lo_open=True, hi_open=True)
        self.growth_interval = check_int('growth_interval', growth_interval, 1, INT32_MAX)
        self.enabled, self.max_skipped = check_bool('enabled', enabled), check_int('max_skipped', max_skipped, 1)
        check(Facts(native=True, dtype=self.dtype, scaler_args=self._scaler_args()), OPTIONS)
        self.record, self._check, self._names = StepRecord(type(self).__name__), OverflowCheck(), {}
        self.skipped_in_a_row = 0
        self.scaler, self.device_type, self._autocast, self.skipped, self._stepped = None, None, None, False, False

    def _scaler_args(self) -> tuple:
        """GradScaler's arguments given other values than their defaults (bf16 runs no GradScaler: they would do
        nothing)."""
        defaults = inspect.signature(NativeMixedPrecision.__init__).parameters
        return tuple(k for k in ('init_scale', 'growth_factor', 'backoff_factor', 'growth_interval')
                     if getattr(self, k) != defaults[k].default)

    @property
    def loss_scale(self) -> float:
        "The GradScaler's current scale (1. when scaling is off)."
        return self.scaler.get_scale() if self.scaler is not None and self.scaler.is_enabled() else 1.

    @property
    def loss_scaler(self) -> GradScalerAdapter:
        "The GradScaler behind the `LossScaler` interface (health checks, diagnostics)."
        return GradScalerAdapter(self.scaler)

    def _make_scaler(self, device_type):
        return GradScaler(device_type, init_scale=self.init_scale, growth_factor=self.growth_factor,
                          backoff_factor=self.backoff_factor, growth_interval=self.growth_interval,
                          enabled=self.enabled and self.dtype == torch.float16)

    def setup(self):
        check(Facts(native=True, dtype=self.dtype, fsdp=is_fsdp(self.learn.model)), FIT)
        device_type = model_device(self.learn.model).type
        if self.enabled: warn_slow_half(self.dtype, device_type)
        if self.scaler is None or device_type != self.device_type:  # kept across fits: its scale is learned state
            self.scaler, self.device_type = self._make_scaler(device_type), device_type
        if not self.session.suspending: self.record.new_fit(self.learn if self.session.in_fit else None)
        self.record.setup(self.learn.model); self.skipped_in_a_row = 0
        self._names = {id(p): n for n, p in self.learn.model.named_parameters()}
        self.show_scale_columns()  # fp16's dynamic GradScaler: `loss_scale` and `n_skipped` columns (bf16 has none)

    def teardown(self):
        """Leave autocast if an exception interrupted a batch (fastai then skips `after_batch` and `after_fit`); one
        that came between `GradScaler.step` (`before_step`) and its `update` (`after_step`) leaves the scaler ready to
        step; one that came after the backward and before `GradScaler.step` leaves the grads unscaled (what FP32 would
        hold)."""
        # a pause inside a forward
        self._resume_autocast = self._pausing() and getattr(self, '_autocast', None) is not None
        self._exit_autocast()
        self.drop_scale_columns(fit_ends=not self.session.suspending)
        if not self._pausing():
            self._forget_step()
            learn = self.__dict__.get('learn')
            if learn is not None and learn.opt is not None:
                self.record.unscale_left([getattr(p, 'grad', None) for pg in learn.opt.param_lists for p in pg])
        self.record.teardown()
        if not (self.session.suspending or self.session.failing):
            warn_all_skipped(self.record.this_fit, self.skip_label, self.device_type or 'cpu')

    def resume(self):
        "Back from a pause inside a batch (a later callback's `before_batch` saved, loaded or froze): autocast again."
        if not getattr(self, '_resume_autocast', False): return
        self._resume_autocast = False
        self._autocast = torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)
        self._autocast.__enter__()

    def _pausing(self) -> bool:
        """Torn down for a pause mid-fit (`learn.save`...): a step under way goes on after it, its `update` still to
        come."""
        learn = self.__dict__.get('learn')
        return learn is not None and self.session.suspending

    def _forget_step(self):
        "Drop the per-optimizer state of a `GradScaler.step` never followed by `update` (the learned scale is kept)."
        if self.scaler is not None:
            self.scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)  # what `update` leaves
        self._stepped = False

    def before_batch(self):
        if self.training: self.record.snapshot()
        self._autocast = torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)
        self._autocast.__enter__()

    def after_pred(self): self.learn.pred = cast_floats(self.learn.pred, torch.float32)
    def after_loss(self): self._exit_autocast()
    def after_batch(self): self._exit_autocast()
    scales = property(lambda self: self.record.scales, doc="The loss scale of every optimizer step so far.")
    skips = property(lambda self: self.record.skips, doc="Whether each optimizer step so far was skipped.")
    skip_causes = property(lambda self: dict(self.record.causes),
                           doc="Why each skipped step was skipped: `{step: 'inf/NaN'}` (GradScaler's only cause).")
    n_skipped = property(lambda self: self.record.overflows.count, doc="Steps skipped for inf/NaN gradients so far.")
    overflows = property(lambda self: self.record.overflows.read(),
                         doc="The last 100 skipped steps: `{'step', 'scale', 'params'}` (the params whose grads held "
                             "inf/NaN).")
    n_overflows = property(lambda self: self.record.overflows.count,
                           doc="Skipped steps logged in `overflows` so far (the older ones dropped).")
    @property
    def skip_label(self) -> str: return f'{self.dtype} autocast'.replace('torch.', '')
    def after_epoch(self):
        scale_health(self)

    def _exit_autocast(self):
        if getattr(self, '_autocast', None) is not None:
            self._autocast.__exit__(None, None, None)
            self._autocast = None

    def before_backward(self):
        # read only if a fit ends before the step
        if self.scaler.is_enabled(): self.record.scaled(self.scaler.get_scale)
        self.learn.loss_grad = self.scaler.scale(self.learn.loss_grad)

    def before_step(self):
        """`self` poses as the optimizer: GradScaler unscales, checks, and calls `step` only when the grads are finite.
        A skip counts here; a step counts in `after_step`, unless another callback cancels it first (then no step)."""
        self.skipped, self._stepped = True, True
        if self.scaler.is_enabled() or not self.enabled or self._grads_finite(): self.scaler.step(self)
        self.record.unscaled()
        # read after GradScaler's own host sync (its inf check): the device queue is empty, so this read stalls nothing;
        # the scale changes only in `after_step` (`GradScaler.update`), so it is the scale this step used
        self._scale = scale = self.loss_scale
        if not self.skipped: return
        self.record.record(scale, True, self._overflowing())  # BatchNorm's statistics back
        if warn_skips(self.record, self.dtype, self.loss_scaler.is_dynamic, self.device_type or 'cpu') == 'burst':
            self.__dict__.setdefault('_health_warned', set()).add('skips')  # said: not again at the epoch's end
        with lr_find_stops_on(self.learn, self._collapse):
            self.skipped_in_a_row = count_skip(self.skipped_in_a_row, True, self.max_skipped,
                                               f"{self.dtype} autocast, loss scale {scale:g}")
        raise CancelStepException()

    def after_cancel_step(self):
        """Another callback cancelled the step after our `before_step`: as in FP32 nothing happened; GradScaler forgets
        it."""
        if self._stepped and not self.skipped:
            self._forget_step()
            self.record.cancelled()
            self._scale_kept_grads()

    def _scale_kept_grads(self):
        """The cancelled step's grads stay until the optimizer's `zero_grad` (held back: the next backward adds to
        them), as in FP32; GradScaler divided them in our `before_step`, so they get the scale back, which the next adds
        at."""
        if self._scale == 1.: return
        gs = [p.grad for pg in self.learn.opt.param_lists for p in pg if getattr(p, 'grad', None) is not None]
        with torch.no_grad():
            for dev in {g.device for g in gs}: torch._foreach_mul_([g for g in gs if g.device == dev], self._scale)
        self.record.scaled(self.scaler.get_scale)

    def _overflowing(self) -> tuple:
        """A skipped step: which params' FP32 grads (unscaled by GradScaler) hold inf/NaN,
        `(flags on the device, names)`."""
        rank = {k: i for i, k in enumerate(self._names)}  # as `model.named_parameters()` orders them
        params = sorted((p for pg in self.learn.opt.param_lists for p in pg), key=lambda p: rank.get(id(p), len(rank)))
        return (nonfinite_flags([getattr(p, 'grad', None) for p in params]),
                [self._names.get(id(p), '?') for p in params])

    def _grads_finite(self) -> bool:
        """Without GradScaler (bf16) nothing checks the grads: one fused check (one host sync) keeps inf/NaN out of the
        weights."""
        grads = [p.grad for pg in self.learn.opt.param_lists for p in pg if getattr(p, 'grad', None) is not None]
        found = reduce_max_(self._check(grads, 1.), self.learn.model) if grads else None  # DDP: any rank's inf
        return found is None or not found.item() > 0  # inv_scale 1: the grads are left as they are

    def after_step(self): self._end_step()

    def _end_step(self):
        """The step GradScaler took: a clean one counts here (a skip counted in `before_step`), then GradScaler's
        `update`."""
        if not self._stepped: return
        if not self.skipped: self.record.record(self._scale, False); self.skipped_in_a_row = 0
        self.scaler.update()
        self._stepped = False

    def state_dict(self) -> dict:
        "What a checkpoint keeps of this callback: the GradScaler's state (empty when scaling is off)."
        return {'scaler': self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, sd:dict):
        sc = sd.get('scaler')
        if not sc: return
        if self.scaler is None:  # not fitted yet: create it now, on the model's device, so the state is kept
            learn = self.__dict__.get('learn')
            self.device_type = model_device(learn.model).type if learn is not None else 'cpu'
            self.scaler = self._make_scaler(self.device_type)
        if self.scaler.is_enabled(): self.scaler.load_state_dict(sc)

    @property
    def param_groups(self): return self.learn.opt.param_groups
    def step(self, *args, **kwargs): self.skipped = False
