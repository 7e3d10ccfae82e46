"""Argument checks for the constructors: a bad value raises a `ValueError` that names the argument (at construction,
not at fit time), and numpy scalars are accepted as the Python numbers they stand for. Also the errors whose sentence
stays first when fastai wraps them (`SaidFirst`; `Refused`: a combination `fp16cb.compat` refuses)."""
from __future__ import annotations
import functools, math, numbers, re
import numpy as np

__all__ = ['FP32_MAX', 'INT32_MAX', 'check_bool', 'check_real', 'check_positive', 'check_int', 'check_choice',
           'AMP_ARGS', 'refuses_amp_args', 'SaidFirst', 'Refused']

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

