"""`learn.export()` writes the plain FP32 learner, without fp16cb's callbacks (`to_fp16`, `to_bf16`, `to_native_fp16`
alike), so that `load_learner` needs fastai alone and predicts with the FP32 model: to train in mixed precision after
`load_learner`, call `learn.to_fp16()` (or `to_bf16()` ...) again. Mid-fit, the learner is exported as between fits
(the exact FP32 master weights). This wraps whatever `Learner.export` is when fp16cb is imported (an atomic write)."""
from __future__ import annotations
import functools
from contextlib import contextmanager
from fastai.learner import Learner
from fastcore.foundation import L

from .learner import OURS
from .monitor import PrecisionValue
from .session import session_of, _KEY

__all__ = ['without_precision']

@contextmanager
def without_precision(learn):
    "Within: `learn` without fp16cb's callbacks, their attributes, Recorder columns and session (put back on exit)."
    cbs, mets = learn.cbs, learn.metrics
    ours = [cb for cb in cbs if isinstance(cb, OURS)]
    attrs = {n: learn.__dict__.pop(n) for n in [cb.name for cb in ours] + [_KEY] if n in learn.__dict__}
    learn.cbs = L(cb for cb in cbs if not any(cb is o for o in ours))
    learn.metrics = [m for m in mets if not isinstance(m, PrecisionValue)]
    try: yield learn
    finally:
        learn.cbs, learn.metrics = cbs, mets
        learn.__dict__.update(attrs)

_export = getattr(Learner.export, '_fp16cb_wrapped', Learner.export)

@functools.wraps(_export)
def export(self:Learner, *args, **kwargs):
    with session_of(self).suspended(), without_precision(self): return _export(self, *args, **kwargs)
export._fp16cb_wrapped = _export
export.__doc__ = ("Export the FP32 learner for inference without fp16cb's callbacks (`load_learner` needs fastai alone; "
                  "call `learn.to_fp16()` again to train in mixed precision)")
Learner.export = export
