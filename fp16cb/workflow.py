"""The fastai workflow around the precision callbacks, through the learner's `PrecisionSession`: a fit that raises
(fastai then skips `after_fit`) leaves the learner restored at once; two precision setups are never stacked in one
fit; `freeze`/`unfreeze` and `copy.deepcopy(learn)` in the middle of a fit work on the plain FP32 learner. (`lr_find`
needs nothing here: `checkpoint`'s `learn.save`/`load` keep the FP32 learner and the scaler state;
`guards.lr_find_stops_on` ends a diverging search.)"""
from __future__ import annotations
import copy, functools, inspect
from fastai.learner import Learner
from fastcore.foundation import L
from fastcore.basics import patch

from .callbacks import ModelToHalf, MixedPrecision
from .native import NativeMixedPrecision
from .learner import OURS as _OURS, FOREIGN as _FOREIGN
from .session import session_of

__all__ = ['restore_precision', 'check_precision_cbs']

def _unwrapped(f):
    "`f` without the wrapper this module put around it (a reloaded module must not wrap twice; others' wrappers stay)."
    return f.__wrapped__ if getattr(f, '_fp16cb', False) else f

def _ours(cbs): return sorted((cb for cb in cbs if isinstance(cb, _OURS)), key=lambda cb: cb.order)

@patch
def restore_precision(self:Learner):
    "Put the learner back in its between-fits state: exact FP32 model, optimizer on the model's params, no autocast."
    session_of(self).teardown_all()
    return self

def _family(k) -> str:
    "Which precision setup a callback class belongs to (ModelToHalf + its master-weight callback make one setup)."
    if issubclass(k, NativeMixedPrecision): return 'native'
    if issubclass(k, (ModelToHalf, MixedPrecision)): return 'fp16cb'
    return 'fastai AMP' if k.__name__ == 'MixedPrecision' else 'fastai master weights'

def check_precision_cbs(cbs):
    "Raise a `ValueError` unless `cbs` (callbacks or their classes) hold at most one precision setup."
    kinds = [c if isinstance(c, type) else type(c) for c in cbs]
    kinds = [k for k in kinds if issubclass(k, _OURS + _FOREIGN)]
    if len(set(kinds)) < len(kinds) or len({_family(k) for k in kinds}) > 1:
        raise ValueError(f"two precision setups would be stacked in this fit ({', '.join(k.__name__ for k in kinds)}): "
                         f"set the precision once with `learn.to_fp16()`, `to_bf16()`, `to_native_fp16()` or "
                         f"`to_fp32()` (the last call wins) and do not pass precision callbacks to `fit(cbs=...)` as well.")

_fit = _unwrapped(Learner.fit)
_fit_sig = inspect.signature(_fit)

@functools.wraps(_fit)
def _fit_in_session(self, *args, **kwargs):
    check_precision_cbs(list(self.cbs) + list(L(_fit_sig.bind(self, *args, **kwargs).arguments.get('cbs'))))
    # fastai calls `after_fit` only when the fit ends or is cancelled; any other exception (KeyboardInterrupt, an
    # error in a callback, `LossScaleError`) skips it: the session then tears the setup down at once
    with session_of(self).fit(): return _fit(self, *args, **kwargs)
_fit_in_session._fp16cb = True
Learner.fit = _fit_in_session

_remove_cb = _unwrapped(Learner.remove_cb)

@functools.wraps(_remove_cb)
def _remove_cb_restoring(self, cb):
    # a precision callback given to `fit(cbs=...)` is removed when an exception leaves the fit: restore it first
    if isinstance(cb, _OURS) and getattr(cb, 'learn', None) is self: session_of(self).drop(cb)
    return _remove_cb(self, cb)
_remove_cb_restoring._fp16cb = True
Learner.remove_cb = _remove_cb_restoring

_freeze_to = _unwrapped(Learner.freeze_to)

@functools.wraps(_freeze_to)
def _freeze_to_fp32(self, n):
    # mid-fit (a callback unfreezing after an epoch): freeze the model's own params, then make the masters again
    with session_of(self).suspended(): return _freeze_to(self, n)
_freeze_to_fp32._fp16cb = True
Learner.freeze_to = _freeze_to_fp32

def _deepcopy_fp32(self, memo):
    """`copy.deepcopy(learn)` (keep-the-best in a callback): mid-fit, the copy is taken of the plain FP32 learner, so it
    is a learner between fits, with the exact FP32 weights of that moment, that fits and predicts on its own."""
    with session_of(self).suspended():
        res = self.__class__.__new__(self.__class__)
        memo[id(self)] = res
        res.__setstate__(copy.deepcopy(self.__getstate__(), memo))  # fastai's: all but the lock, a new lock
    return res
Learner.__deepcopy__ = _deepcopy_fp32
