"""fastai and fp16cb both have a `MixedPrecision` (and a `ModelToHalf`): after `from fastai.vision.all import *` the
name is fastai's AMP callback. Arguments given to the wrong class end in a message that names the right one."""
from __future__ import annotations
import functools, inspect
import fastai.callback.fp16 as _fastai_fp16
from torch.amp import GradScaler

from .callbacks import MixedPrecision
from .native import NativeMixedPrecision
from .learner import AMP_ARGS

__all__ = ['refuse_arguments']

_OURS = [n for n in inspect.signature(MixedPrecision).parameters if n != 'self']
_SCALER = [n for n in inspect.signature(GradScaler).parameters if n != 'device']  # what fastai's AMP callback passes on

def refuse_arguments(cls, check):
    "Wrap `cls.__init__` so that `check(kwargs)` may raise before it runs (once: a reload does not wrap twice)."
    init = getattr(cls.__init__, '_fp16cb_wrapped', cls.__init__)
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        check(kwargs)
        init(self, *args, **kwargs)
    __init__._fp16cb_wrapped = init
    cls.__init__ = __init__

def _check_fastai_amp(kwargs):
    ours = [k for k in kwargs if k in _OURS and k not in _SCALER]
    if ours:
        raise TypeError(f"{', '.join(map(repr, ours))}: arguments of fp16cb's `MixedPrecision`, given to fastai's "
                        f"(`fastai.callback.fp16.MixedPrecision`, PyTorch AMP, which `from fastai.vision.all import *` "
                        f"exports). Import ours after fastai's star import: `from fp16cb import MixedPrecision, "
                        f"ModelToHalf`, or call `learn.to_fp16({ours[0]}=...)`.")
    bad = [k for k in kwargs if k not in _SCALER and k != 'amp_mode']
    if bad:
        raise TypeError(f"fastai's `MixedPrecision` (PyTorch AMP) got {bad[0]!r}; it takes `amp_mode` and GradScaler's "
                        f"arguments: {', '.join(_SCALER)}")

def _check_ours(cls_name, other):
    def check(kwargs):
        amp = [k for k in kwargs if k in AMP_ARGS]
        if amp:
            raise TypeError(f"{', '.join(map(repr, amp))}: arguments of fastai's AMP `MixedPrecision` "
                            f"(`fastai.callback.fp16`), not of fp16cb's `{cls_name}`. {other}")
    return check

refuse_arguments(_fastai_fp16.MixedPrecision, _check_fastai_amp)
refuse_arguments(MixedPrecision, _check_ours('MixedPrecision', "fp16cb's autocast + GradScaler is "
                 "`NativeMixedPrecision(init_scale=...)` (`learn.to_native_fp16(...)`); fastai's is "
                 "`fastai.callback.fp16.MixedPrecision`."))
refuse_arguments(NativeMixedPrecision, lambda kw: 'amp_mode' in kw and _check_ours('NativeMixedPrecision',
                 "Use `dtype=torch.bfloat16` (or `learn.to_native_bf16()`) for bf16.")(kw))
