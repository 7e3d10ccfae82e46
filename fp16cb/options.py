"""The arguments of fp16cb's callbacks and `to_*` methods: the checks every value goes through (a bad one raises a
`ValueError` naming the argument, at construction, not at fit time; numpy scalars are accepted as the Python numbers
they stand for), the errors whose sentence stays first when fastai wraps them (`SaidFirst`; `Refused`: a combination
`fp16cb.compat` refuses), and `MixedPrecision`'s options (so `to_fp16`'s and `to_bf16`'s) in three small frozen
groups, as Megatron-LM's `OptimizerConfig` groups its fields: how the loss is scaled (`ScalingOptions`), what the
optimizer steps and how its state is kept (`StoreOptions`), and gradient clipping (`ClipOptions`). Each field has its
docstring under it; every value is checked once, in `__post_init__`, under the argument's own name. The live callback
and the declaration of what combines (`compat.Facts.of_options`) both read these, so an option means the same in a fit
and in the compatibility table."""
from __future__ import annotations
import functools, math, numbers, re
from dataclasses import dataclass, fields
import numpy as np
import torch

from .dtypes import resolve_state_dtype

__all__ = ['FP32_MAX', 'INT32_MAX', 'check_bool', 'check_real', 'check_positive', 'check_int', 'check_choice',
           'AMP_ARGS', 'refuses_amp_args', 'SaidFirst', 'Refused',
           'ScalingOptions', 'StoreOptions', 'ClipOptions', 'SCALER_NAMES', 'options_of', 'bf16_defaults',
           'SEED_LOSS_SCALE', 'CALIBRATE']


FP32_MAX = 3.4028234663852886e38  # the largest finite float32 (`torch.finfo(torch.float32).max`)
INT32_MAX = 2**31 - 1

class SaidFirst(Exception):
    """An error of fp16cb's whose sentence stays first in `str()` (a traceback's last line): fastai's
    `Callback.__call__` replaces the args of an error raised in an event with "Exception occured in `X` when calling
    event `Y`:" and the sentence (`modify_exception`); here the sentence comes first, where it was raised after it."""
    def __init__(self, *args):
        super().__init__(*args)
        self.said = str(args[0]) if args else ''
    def __str__(self):
        now = super().__str__()
        if not self.said or self.said == now or self.said not in now: return now
        m = re.search(r"in `(\w+)` when calling event `(\w+)`", now)
        return f"{self.said}\n({f'raised in `{m[1]}.{m[2]}`' if m else now.replace(self.said, '').strip()})"

class Refused(SaidFirst, ValueError):
    "A combination a rule of `fp16cb.compat` refuses (`rule`: its name), its sentence first (`SaidFirst`)."
    def __init__(self, sentence:str, rule:str=''): super().__init__(sentence); self.rule = rule

def _fmt(x) -> str: return str(x) if isinstance(x, int) else f'{x:g}'

def _range(lo, hi, lo_open, hi_open, hi_name) -> str:
    "The allowed range in words: '> 0', '>= 1 and <= 2147483647', '> 0 and <= `max_loss_scale` (1024)'."
    parts = []
    if lo is not None: parts.append(f"{'>' if lo_open else '>='} {_fmt(lo)}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} " + (f"`{hi_name}` ({_fmt(hi)})" if hi_name else _fmt(hi)))
    return ' and '.join(parts)

def _in_range(x, lo, hi, lo_open, hi_open) -> bool:
    if lo is not None and (x <= lo if lo_open else x < lo): return False
    return hi is None or (x < hi if hi_open else x <= hi)

def _is_bool(v) -> bool: return isinstance(v, (bool, np.bool_))

def check_bool(
    name:str, # the argument's name, for the error
    v, # the value: `True`/`False` (or a numpy bool); not a truthy string or number
) -> bool:
    "`v` as a Python bool; a `ValueError` naming `name` for anything else ('False', 'yes', 1, None)."
    if not _is_bool(v): raise ValueError(f"`{name}` must be True or False, got {v!r}")
    return bool(v)

def check_real(
    name:str, # the argument's name, for the error
    v, # the value: a real number (Python or numpy), not a bool
    lo=None, # lower bound (None: none)
    hi=None, # upper bound (None: none)
    *,
    lo_open:bool=False, # `v > lo` (else `v >= lo`)
    hi_open:bool=False, # `v < hi` (else `v <= hi`)
    hi_name:str=None, # the name of the argument `hi` comes from (the error then names both)
    allow_none:bool=False, # None is accepted (and returned)
) -> float:
    """`v` as a finite Python float within the bounds; a `ValueError` naming `name` otherwise (overflow and inf
    included)."""
    if v is None and allow_none: return v
    rng = _range(lo, hi, lo_open, hi_open, hi_name)
    err = ValueError(f"`{name}` must be a finite number{' ' + rng if rng else ''}, got {v!r}")
    if not isinstance(v, numbers.Real) or _is_bool(v): raise err
    try: x = float(v)
    except OverflowError: raise err from None  # an int beyond the float range (10**400)
    if not math.isfinite(x) or not _in_range(x, lo, hi, lo_open, hi_open): raise err
    return x

def check_positive(name:str, v, strict_min:float=0., allow_none:bool=False) -> float:
    "`v` as a Python float; a `ValueError` naming `name` unless it is a finite number > `strict_min`."
    return check_real(name, v, strict_min, lo_open=True, allow_none=allow_none)

def check_int(
    name:str, # the argument's name, for the error
    v, # the value: an integer (Python or numpy), not a bool nor a float such as 2.0
    lo:int=None, # smallest value allowed (None: none)
    hi:int=None, # largest value allowed (None: none)
) -> int:
    "`v` as a Python int in `[lo, hi]`; a `ValueError` naming `name` otherwise."
    if not isinstance(v, numbers.Integral) or _is_bool(v) or not _in_range(int(v), lo, hi, False, False):
        rng = _range(lo, hi, False, False, None)
        raise ValueError(f"`{name}` must be an integer{' ' + rng if rng else ''}, got {v!r}")
    return int(v)

def check_choice(
    name:str, # the argument's name, for the error
    v, # the value: one of `choices` (a string is compared as it is: no case folding)
    choices:tuple, # the values allowed
):
    "`v` if it is one of `choices`; a `ValueError` naming `name` and the choices otherwise."
    if not any(v == c and type(v) is type(c) for c in choices):
        raise ValueError(f"`{name}` must be one of {', '.join(map(repr, choices))}, got {v!r}")
    return v

# fastai's AMP `to_fp16`
AMP_ARGS = ('amp_mode', 'init_scale', 'growth_factor', 'backoff_factor', 'growth_interval', 'enabled')

def refuses_amp_args(
    hint:str, # what to use instead, said after the arguments are named
    only=AMP_ARGS, # the arguments refused (fastai's AMP `MixedPrecision`'s, by default)
):
    """Class decorator: the class's `__init__` refuses fastai's AMP arguments (`AMP_ARGS`) with a `TypeError` that says
    they are fastai's and what to use instead (Python's own error would only say 'unexpected keyword')."""
    def deco(cls):
        init = cls.__init__
        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            amp = [k for k in kwargs if k in only]
            if amp: raise TypeError(f"{', '.join(map(repr, amp))}: arguments of fastai's AMP `MixedPrecision` "
                                    f"(`fastai.callback.fp16`), not of fp16cb's `{cls.__name__}`. {hint}")
            init(self, *args, **kwargs)
        cls.__init__ = __init__
        return cls
    return deco

# ---- the options of `MixedPrecision`
SEED_LOSS_SCALE = 512.  # `MixedPrecision`'s default `loss_scale` (fastai's): with a dynamic scale it means CALIBRATE
CALIBRATE = 'calibrate'  # `loss_scale=CALIBRATE`: the first step runs at scale 1 and its largest |grad| sets the scale
# (with a dynamic scale, fastai's default 512 means the same; any other number is where the dynamic scale starts)

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
        scaler = self.scaler  # an object: `scaling.make_scaler` checks that it is a `LossScaler`
        if isinstance(scaler, str):
            if scaler.lower() not in SCALER_NAMES:
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
        if self.scaler is not None and not isinstance(self.scaler, str):  # a `LossScaler`
            return not self.scaler.is_dynamic and self.scaler.scale == 1.
        static = self.scaler == 'static' or self.scaler is None and not self.dynamic
        return static and self.loss_scale == 1.

    @property
    def scaler_kwargs(self) -> dict:
        "`scaling.make_scaler`'s keyword arguments (the scaler itself its first argument, the dtype the callback's)."
        return {k: getattr(self, k) for k in ('loss_scale', 'dynamic', 'max_loss_scale', 'div_factor', 'scale_wait',
                                              'min_loss_scale', 'max_skipped')}

@dataclass(frozen=True)
class StoreOptions:
    "What the optimizer steps, and how the weights and the optimizer's state are kept between steps."
    flat_master: bool = False
    """One flat FP32 master buffer per param group, cut at the lift's chunk (fewer, bigger tensors; refused with an
    optimizer not known to be elementwise: LAMB's and LARS's per-param norms)."""
    half_storage: bool = False
    "No FP32 masters: one 16-bit copy of the weights, updated in FP32 math and rounded back (`HalfStorage`)."
    stochastic_rounding: bool = True
    "Round 16-bit weights and 16-bit or 8-bit optimizer state stochastically (False: to nearest)."
    step_in_backward: bool = False
    """Step each param inside the backward, as soon as its grad is complete, and drop the grad (bf16, scale 1, a
    fastai optimizer: less memory)."""
    state_dtype: torch.dtype|str|None = None
    """The optimizer's moving averages between steps: `torch.bfloat16`, '8bit' (torchao's block-wise codes), or None
    (FP32)."""

    @property
    def copies(self) -> bool:
        """Whether the model keeps its FP32 params for the fit and its forward computes with 16-bit copies of them, the
        optimizer stepping the params themselves (no storage option that needs a store: `flat_master` is a layout of
        the params, `state_dtype` is stored inside the optimizer's step)."""
        return not self.half_storage

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
