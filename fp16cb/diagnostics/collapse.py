"""What a precision callback does when the loss scale cannot go lower (the failing step only, never a clean one): the
error names the module where the overflow starts and the remedy, found on copies of the model (`overflow`); with
`on_collapse='keep_fp32'`, `MixedPrecision` keeps those modules FP32 and goes on. Registered in `session.COLLAPSE`,
which the callbacks' `_collapse` reads, so that the core of a step never imports the diagnostics (arrows one way: the
diagnostics use the callbacks' forward casts)."""
from __future__ import annotations

from ..callbacks import MixedPrecision, NativeMixedPrecision
from ..session import COLLAPSE
from .overflow import Precision, diagnose_collapse

__all__ = ['masters_collapse', 'native_collapse']

def masters_collapse(self:MixedPrecision, err:Exception):
    """The scale cannot go lower: the error naming where the overflow starts and the remedy, found on copies of the
    model; or, with `on_collapse='keep_fp32'`, those modules kept FP32 from now on (None)."""
    mth = self._model_to_half()
    half = mth is not None and mth.computing
    prec = Precision(self.dtype, mth.policy if half else None)
    diag = diagnose_collapse(self.learn, prec, self.record.scales[-1], err, self.record.overflows,
                             fp32_of=self.store.fp32_views(), fixable=self.on_collapse == 'keep_fp32' and half)
    if not diag.applicable: return diag.error
    mth.keep_too(diag.keep)  # the model set up again, those modules FP32 (the masters stay exact)
    self.scaler.skipped_in_a_row = 0
    diag.warn()

def native_collapse(self:NativeMixedPrecision, err:Exception):
    "Training stops: the error naming where the overflow starts and the remedy."
    return diagnose_collapse(self.learn, Precision(self.dtype, autocast=True), self.record.scales[-1], err,
                             self.record.overflows).error

COLLAPSE.update({MixedPrecision: masters_collapse, NativeMixedPrecision: native_collapse})
