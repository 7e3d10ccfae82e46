"""`Learner.to_fp16 / to_bf16 / to_fp32 / to_native_fp16 / to_native_fp32`, replacing fastai's own patches."""
from __future__ import annotations
import torch
from fastai.learner import Learner
import fastai.callback.fp16 as _fastai_fp16  # loaded first, so that its own patches can never override ours
from fastcore.basics import patch
from fastcore.meta import delegates

from .callbacks import ModelToHalf, MixedPrecision
from .native import NativeMixedPrecision

from .session import session_of

__all__ = ['precision_callbacks', 'OURS', 'FOREIGN']

FOREIGN = tuple(getattr(_fastai_fp16, n) for n in ('MixedPrecision', 'NonNativeMixedPrecision', 'ModelToHalf')
                if hasattr(_fastai_fp16, n))  # fastai's own precision callbacks
OURS = (ModelToHalf, MixedPrecision, NativeMixedPrecision)

@patch
def precision_callbacks(self:Learner) -> list:
    "The mixed-precision callbacks of this learner (ours and fastai's)."
    return [cb for cb in self.cbs if isinstance(cb, OURS + FOREIGN)]

@patch
def _set_precision(self:Learner, cbs:list):
    "Replace whatever precision callbacks the learner has with `cbs`, restoring the FP32 model and optimizer first."
    if session_of(self).in_fit:
        raise RuntimeError("the precision of a learner cannot change during a fit (`to_fp16`/`to_bf16`/`to_fp32`/"
                           "`to_native_fp16` was called from a callback or in a fit): set it before `fit`, or after it.")
    old = self.precision_callbacks()
    for cb in old:
        if hasattr(cb, 'restore'): cb.restore()
    self.remove_cbs(old)
    if cbs: self.add_cbs(cbs)
    return self

@patch
@delegates(MixedPrecision)
def to_fp16(self:Learner, **kwargs):
    "Train in mixed precision: an fp16 model (BatchNorm FP32), FP32 master weights, dynamic loss scaling."
    dtype, keep_fp32 = kwargs.pop('dtype', torch.float16), kwargs.pop('keep_fp32', None)  # keep_fp32: `ModelToHalf`'s
    return self._set_precision([ModelToHalf(dtype, keep_fp32=keep_fp32), MixedPrecision(dtype=dtype, **kwargs)])

@patch
@delegates(MixedPrecision)
def to_bf16(self:Learner, **kwargs):
    "Train in mixed precision with bfloat16: FP32 master weights; no loss scaling unless asked (bf16 has FP32's range)."
    kwargs = {'dynamic': False, 'loss_scale': 1., **kwargs}
    return self.to_fp16(dtype=torch.bfloat16, **kwargs)

@patch
def to_fp32(self:Learner):
    "Back to plain FP32 training: removes the precision callbacks; the model holds the exact FP32 master weights."
    return self._set_precision([])

@patch
@delegates(NativeMixedPrecision)
def to_native_fp16(self:Learner, **kwargs):
    "Train with PyTorch's autocast + GradScaler (fp16 by default; `dtype=torch.bfloat16` for bf16)."
    return self._set_precision([NativeMixedPrecision(**kwargs)])

@patch
@delegates(NativeMixedPrecision)
def to_native_bf16(self:Learner, **kwargs):
    "Train with PyTorch's autocast in bfloat16 (no loss scaling)."
    return self.to_native_fp16(dtype=torch.bfloat16, **kwargs)

@patch
def to_native_fp32(self:Learner):
    "Back to plain FP32 training (removes any precision callback)."
    return self._set_precision([])
