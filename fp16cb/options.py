"""`MixedPrecision`'s options (so `to_fp16`'s and `to_bf16`'s), in three small frozen groups, as Megatron-LM's
`OptimizerConfig` groups its fields: how the loss is scaled (`ScalingOptions`), what the optimizer steps and how its
state is kept (`StoreOptions`), and gradient clipping (`ClipOptions`). Each field has its docstring under it; every
value is checked once, in `__post_init__`, and a bad one is reported under the argument's own name. The live callback
and the declaration of what combines (`compat.Facts.of_options`) both read these, so an option means the same in a fit
and in the compatibility table."""
from __future__ import annotations
from dataclasses import dataclass, fields
import torch

from .dtypes import resolve_state_dtype
from .validation import check_bool, check_real, check_int, check_choice, check_positive, FP32_MAX
from .scaling.scalers import LossScaler, StaticScaler, make_scaler, CALIBRATE, SEED_LOSS_SCALE

__all__ = ['ScalingOptions', 'StoreOptions', 'ClipOptions', 'SCALER_NAMES', 'options_of', 'bf16_defaults']

SCALER_NAMES = ('backoff', 'lognormal', 'static')

def _set(obj, **kw):
    "Fields of a frozen dataclass set to their checked values (in `__post_init__` only)."
    for k, v in kw.items(): object.__setattr__(obj, k, v)

@dataclass(frozen=True)
class ScalingOptions:
    "How the loss is scaled (Micikevicius et al. 2018, section 3.3), and what happens when it cannot go lower."
    loss_scale: float|str = SEED_LOSS_SCALE
    """'calibrate' (and fastai's default 512, with a dynamic scale): the first step runs at scale 1 and its largest
    |grad| sets the scale. Any other number: where the dynamic scale starts, or the static scale."""
    dynamic: bool = True
    "Divide the scale by `div_factor` on an overflow (the step skipped), multiply it after `scale_wait` clean steps."
    max_loss_scale: float = 2.**24
    "The dynamic scale's ceiling."
    min_loss_scale: float = 1.
    "The dynamic scale's floor; needing to go under it is an error (`on_collapse`)."
    div_factor: float = 2.
    "What the dynamic scale is divided by on an overflow and multiplied by after `scale_wait` clean steps (> 1)."
    scale_wait: int = 500
    "Clean steps in a row before the dynamic scale grows."
    max_skipped: int = 50
    "More overflowing steps in a row than this stops training with an error."
    scaler: object = None
    "None (fastai's: 'backoff' if `dynamic`, else 'static'), 'backoff', 'lognormal', 'static', or a `LossScaler`."
    on_collapse: str = 'raise'
    """At the scale's floor: 'raise' (the error names where the overflow starts and the remedy) or 'keep_fp32' (those
    modules kept FP32 from then on, and the fit goes on)."""

    def __post_init__(self):
        dynamic = check_bool('dynamic', self.dynamic)
        # every argument is checked whatever the mode (bf16, `dynamic=False`, a `scaler`): one unused now is still a
        # mistake
        loss_scale = (self.loss_scale if self.loss_scale == CALIBRATE else
                      check_real('loss_scale', self.loss_scale, 0., FP32_MAX, lo_open=True))
        hi = check_real('max_loss_scale', self.max_loss_scale, 0., FP32_MAX, lo_open=True)
        lo = check_real('min_loss_scale', self.min_loss_scale, 0., hi, lo_open=True, hi_name='max_loss_scale')
        scaler = self.scaler
        if not (scaler is None or isinstance(scaler, LossScaler)):
            if not isinstance(scaler, str) or scaler.lower() not in SCALER_NAMES:
                raise ValueError(f"`scaler` must be None, a LossScaler or one of {', '.join(map(repr, SCALER_NAMES))}, "
                                 f"got {scaler!r}")
            scaler = scaler.lower()
        if loss_scale == CALIBRATE and (scaler == 'static' or scaler is None and not dynamic):
            raise ValueError("loss_scale='calibrate' sets a dynamic scale from the first step: use dynamic=True, or "
                             "give a static scale as a number")
        _set(self, dynamic=dynamic, loss_scale=loss_scale, max_loss_scale=hi, min_loss_scale=lo, scaler=scaler,
             div_factor=check_real('div_factor', self.div_factor, 1., lo_open=True),
             scale_wait=check_int('scale_wait', self.scale_wait, 1),
             max_skipped=check_int('max_skipped', self.max_skipped, 1),
             on_collapse=check_choice('on_collapse', self.on_collapse, ('raise', 'keep_fp32')))

    @property
    def unit(self) -> bool:
        "Whether the loss scale is 1 and stays 1 (bf16's default: nothing to scale)."
        if isinstance(self.scaler, LossScaler): return isinstance(self.scaler, StaticScaler) and self.scaler.scale == 1.
        static = self.scaler == 'static' or self.scaler is None and not self.dynamic
        return static and self.loss_scale == 1.

    def make(self, dtype:torch.dtype) -> LossScaler:
        "The loss scaler these options describe, for a model in `dtype`."
        return make_scaler(self.scaler, loss_scale=self.loss_scale, dynamic=self.dynamic,
                           max_loss_scale=self.max_loss_scale, div_factor=self.div_factor, scale_wait=self.scale_wait,
                           min_loss_scale=self.min_loss_scale, max_skipped=self.max_skipped, dtype=dtype)

@dataclass(frozen=True)
class StoreOptions:
    "What the optimizer steps, and how the weights and the optimizer's state are kept between steps."
    flat_master: bool = False
    """One flat FP32 master buffer per param group, cut at the lift's chunk (fewer, bigger tensors; refused with an
    optimizer not known to be elementwise: LAMB's and LARS's per-param norms)."""
    half_storage: bool = False
    "No FP32 masters: one 16-bit copy of the weights, updated in FP32 math and rounded back (`HalfStorage`)."
    stochastic_rounding: bool = True
    "Round 16-bit weights and 16-bit optimizer state stochastically (False: to nearest even)."
    step_in_backward: bool = False
    """Step each param inside the backward, as soon as its grad is complete, and drop the grad (bf16, scale 1, a
    fastai optimizer: less memory)."""
    state_dtype: torch.dtype|str|None = None
    """The optimizer's moving averages between steps: `torch.bfloat16`, '8bit' (torchao's block-wise codes), or None
    (FP32)."""

    def __post_init__(self):
        _set(self, **{k: check_bool(k, getattr(self, k))
                      for k in ('flat_master', 'half_storage', 'stochastic_rounding', 'step_in_backward')},
             state_dtype=resolve_state_dtype(self.state_dtype))

@dataclass(frozen=True)
class ClipOptions:
    "Gradient clipping, on the unscaled FP32 grads (the masters' or, with `half_storage`, the lifted ones)."
    clip: float|None = None
    "Clip the global norm of each param group's grads to this (None: no clipping)."
    clip_global: bool = False
    "Clip the norm of all param groups together (as fastai's `GradientClip` does), not of each group."

    def __post_init__(self):
        _set(self, clip=check_positive('clip', self.clip, allow_none=True),
             clip_global=check_bool('clip_global', self.clip_global))

GROUPS = (ScalingOptions, StoreOptions, ClipOptions)

def options_of(**kw) -> tuple:
    """`(ScalingOptions, StoreOptions, ClipOptions)` of `MixedPrecision`'s keyword arguments `kw` (the others: their
    defaults; `dtype` and names no group has are left to the caller)."""
    return tuple(g(**{f.name: kw[f.name] for f in fields(g) if f.name in kw}) for g in GROUPS)

def bf16_defaults(kw:dict) -> dict:
    """`to_bf16`'s arguments with its defaults: no dynamic scale unless asked, and then a scale of 1 (bf16 has FP32's
    range); asked for a dynamic scale, it is calibrated from the first step, as fp16's."""
    kw = {'dynamic': False, **kw}
    if not kw['dynamic']: kw.setdefault('loss_scale', 1.)
    return kw
