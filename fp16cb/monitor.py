"""The current loss scale and the count of skipped steps as columns of fastai's Recorder (no extra host sync)."""
from __future__ import annotations
from fastai.learner import Metric

__all__ = ['PrecisionValue', 'add_precision_metrics', 'remove_precision_metrics']

class PrecisionValue(Metric):
    "A Recorder column reading attribute `attr` of a precision callback (host-side numbers: reading costs no sync)."
    def __init__(self, cb, attr:str, name:str): self.cb, self.attr, self._name = cb, attr, name
    @property
    def name(self): return self._name
    @property
    def value(self):
        v = getattr(self.cb, self.attr)
        return int(v) if isinstance(v, float) and v.is_integer() and abs(v) < 2**53 else v

def remove_precision_metrics(learn):
    "Drop the columns `add_precision_metrics` added (a fit interrupted by an exception left them)."
    mets = list(learn.metrics)
    if any(isinstance(m, PrecisionValue) for m in mets):
        learn.metrics = [m for m in mets if not isinstance(m, PrecisionValue)]

def add_precision_metrics(learn, cb):
    "Show `cb.loss_scale` and `cb.n_skipped` as the Recorder columns `loss_scale` and `n_skipped` during a fit."
    remove_precision_metrics(learn)
    learn.metrics = list(learn.metrics) + [PrecisionValue(cb, 'loss_scale', 'loss_scale'),
                                           PrecisionValue(cb, 'n_skipped', 'n_skipped')]
