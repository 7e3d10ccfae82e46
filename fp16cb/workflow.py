"""The fastai workflow around the precision callbacks: a fit that raises (fastai then skips `after_fit`) leaves the
learner restored at once, and two precision setups are never stacked in one fit. (`lr_find` needs nothing here:
`checkpoint`'s `learn.save`/`load` keep the FP32 learner and the scaler state; `guards.lr_find_stops_on` ends a
diverging search.)"""
from __future__ import annotations
import functools, inspect
from fastai.learner import Learner
from fastcore.foundation import L
from fastcore.basics import patch

from .callbacks import ModelToHalf, MixedPrecision
from .native import NativeMixedPrecision
from .learner import _FOREIGN

__all__ = ['restore_precision', 'check_precision_cbs']

_OURS = (ModelToHalf, MixedPrecision, NativeMixedPrecision)

def _unwrapped(f):
    "`f` without the wrapper this module put around it (a reloaded module must not wrap twice; others' wrappers stay)."
    return f.__wrapped__ if getattr(f, '_fp16cb', False) else f

def _ours(cbs): return sorted((cb for cb in cbs if isinstance(cb, _OURS)), key=lambda cb: cb.order)

@patch
def restore_precision(self:Learner):
    "Put the learner back in its between-fits state: exact FP32 model, optimizer on the model's params, no autocast."
    for cb in _ours(self.cbs): cb.restore(); cb._fits = 0
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
def _fit_restoring(self, *args, **kwargs):
    check_precision_cbs(list(self.cbs) + list(L(_fit_sig.bind(self, *args, **kwargs).arguments.get('cbs'))))
    # fastai calls `after_fit` only when the fit ends or is cancelled; any other exception (KeyboardInterrupt, an
    # error in a callback, `LossScaleError`) skips it. Restore right away, so that the learner is consistent at once.
    outer = not self.__dict__.get('_fp16cb_fitting', False)
    if outer: self.restore_precision()  # whatever a fit that ended without `after_fit` (and without us) left behind
    self._fp16cb_fitting = True
    try: return _fit(self, *args, **kwargs)
    except BaseException:
        self.restore_precision()
        raise
    finally:
        if outer: self._fp16cb_fitting = False
_fit_restoring._fp16cb = True
Learner.fit = _fit_restoring

_remove_cb = _unwrapped(Learner.remove_cb)

@functools.wraps(_remove_cb)
def _remove_cb_restoring(self, cb):
    # a precision callback given to `fit(cbs=...)` is removed when an exception leaves the fit: restore it first
    if isinstance(cb, _OURS) and getattr(cb, 'learn', None) is self: cb.restore()
    return _remove_cb(self, cb)
_remove_cb_restoring._fp16cb = True
Learner.remove_cb = _remove_cb_restoring
