"""The current loss scale and the count of skipped steps as columns of fastai's Recorder (no extra host sync): printed
in the table of a fit with a dynamic scale (a static one, or bf16 at scale 1, would only repeat a constant), then
taken out of `learn.recorder.values` at the end of the fit, so that what plots the user's metrics sees only those;
a `learn.validate()` inside the fit (from a callback) returns the loss and the user's metrics only, as in FP32.
The per-step history stays in the callback (`scales`, `skips`; `plot_loss_scale`). Also the health of the loss
scale: warnings (once each) when it sits at its floor or many steps are skipped, at the end of each epoch."""
from __future__ import annotations
import warnings
from fastai.learner import Metric

from .dtypes import range_remedy, model_device

__all__ = ['PrecisionValue', 'add_precision_metrics', 'remove_precision_metrics', 'hide_precision_metrics',
           'show_precision_metrics', 'COLUMNS', 'ScaleColumns', 'scale_health']

COLUMNS = ('loss_scale', 'n_skipped')

class PrecisionValue(Metric):
    "A Recorder column reading attribute `attr` of a precision callback (host-side numbers: reading costs no sync)."
    def __init__(self, cb, attr:str, name:str): self.cb, self.attr, self._name = cb, attr, name
    @property
    def name(self): return self._name
    @property
    def value(self):
        v = getattr(self.cb, self.attr)
        return int(v) if isinstance(v, float) and v.is_integer() and abs(v) < 2**53 else v

def _ours(name:str) -> bool: return any(name in (c, f'train_{c}', f'valid_{c}') for c in COLUMNS)

def _strip_recorder(rec):
    "Take our columns out of the Recorder's names and rows (the printed table keeps them)."
    names = list(getattr(rec, 'metric_names', None) or [])
    drop = {i - 1 for i, n in enumerate(names) if i > 0 and _ours(n)}  # a row is `log[1:]`: no 'epoch'
    if not drop: return
    keep = lambda row: type(row)([v for i, v in enumerate(row) if i not in drop])
    rec.metric_names = type(rec.metric_names)([n for n in names if not _ours(n)])
    last = getattr(rec.learn, 'final_record', None)
    rows = [(r, keep(r)) for r in rec.values]
    rec.values = [new for _, new in rows]
    if last is not None:  # fastai's `final_record` is the last row itself
        rec.learn.final_record = next((new for old, new in rows if old is last), keep(last))

def remove_precision_metrics(learn,
    fit_ends:bool=True, # the fit is over: also take the columns out of the Recorder's names and rows (False: a pause)
):
    """Drop the columns `add_precision_metrics` added, from the metrics and (at the fit's end) the Recorder's names and
    rows."""
    mets = list(learn.metrics)
    if not any(isinstance(m, PrecisionValue) for m in mets): return
    learn.metrics = [m for m in mets if not isinstance(m, PrecisionValue)]
    rec = getattr(learn, 'recorder', None)
    if rec is not None and fit_ends: _strip_recorder(rec)

def hide_precision_metrics(learn) -> tuple|None:
    """For a `validate`/`get_preds` run inside a fit: take the columns out of the metrics, so that it returns what it
    does in FP32 fastai (`loss, acc = learn.validate()`); what `show_precision_metrics` puts back (None: nothing
    hidden)."""
    mets = list(learn.metrics)
    if not any(isinstance(m, PrecisionValue) for m in mets): return None
    rec = getattr(learn, 'recorder', None)
    names = getattr(rec, 'metric_names', None)
    learn.metrics = [m for m in mets if not isinstance(m, PrecisionValue)]
    return mets, names

def show_precision_metrics(learn, hidden:tuple|None):
    "After that run: the fit's columns back in the metrics, and the Recorder's names of the fit's table."
    if hidden is None: return
    mets, names = hidden
    learn.metrics = mets
    rec = getattr(learn, 'recorder', None)
    if rec is not None and names is not None: rec.metric_names = names  # the nested run's `before_fit` set its own

def add_precision_metrics(learn, cb):
    """Show `cb.loss_scale` and `cb.n_skipped` as the Recorder columns `loss_scale` and `n_skipped` when the scale is
    dynamic."""
    remove_precision_metrics(learn, fit_ends=False)
    if not cb.loss_scaler.is_dynamic: return
    learn.metrics = list(learn.metrics) + [PrecisionValue(cb, a, a) for a in COLUMNS]

class ScaleColumns:
    """For a precision callback (a `SessionCallback` with `loss_scale`, `n_skipped`, `loss_scaler`): its loss scale and
    skipped steps as the Recorder columns `loss_scale` and `n_skipped` while a fit runs with a dynamic scale, none in a
    `validate`/`get_preds` run inside the fit (its result as in FP32). Its `setup` calls `show_scale_columns`, its
    `teardown` `drop_scale_columns`."""
    log_scale = True  # show `loss_scale` and `n_skipped` as Recorder columns during a fit (False: don't)
    def before_fit(self):
        nested = self.session.in_fit and self.session.is_active(self)  # a `validate`/`get_preds` inside the fit
        super().before_fit()
        if nested: self._hidden = hide_precision_metrics(self.learn)  # its result as in FP32: no loss-scale columns

    def after_fit(self):
        super().after_fit()
        show_precision_metrics(self.learn, self.__dict__.pop('_hidden', None))

    def show_scale_columns(self):
        if self.log_scale and self.session.in_fit: add_precision_metrics(self.learn, self)  # not in validate()'s result

    def drop_scale_columns(self, fit_ends:bool):
        if self.__dict__.get('learn') is not None: remove_precision_metrics(self.learn, fit_ends=fit_ends)

# ---- health of the loss scale
def _calibration_end(skips) -> int:
    "Steps at the start of the history spent finding the scale (the leading overflows of a dynamic scale)."
    i = 0
    while i < len(skips) and skips[i]: i += 1
    return i

def scale_health(
    cb, # a callback with `loss_scaler` that records `scales` and `skips` (`MixedPrecision`, `NativeMixedPrecision`)
    window:int=200, # how many of the latest steps to judge
    max_skip_frac:float=.1, # warn when more of the window's steps than this were skipped
) -> list:
    "Warn (once per callback and kind) when the loss scale sits at its floor or many steps are skipped; the warnings."
    scales, skips = list(cb.scales), list(cb.skips)
    start = _calibration_end(skips)
    scales, skips = scales[start:][-window:], skips[start:][-window:]
    warned, out = cb.__dict__.setdefault('_health_warned', set()), []
    scaler = cb.loss_scaler  # a `LossScaler`, or torch's GradScaler behind `GradScalerAdapter`
    floor, dynamic = scaler.floor, scaler.is_dynamic
    learn = cb.__dict__.get('learn')
    device = 'cpu' if getattr(learn, 'model', None) is None else model_device(learn.model)
    if len(skips) >= 10 and sum(skips) > max(5, max_skip_frac * len(skips)) and 'skips' not in warned:
        causes = (["the dynamic loss scale grows again too soon (raise `scale_wait`/`growth_interval`)"]
                  if dynamic else [])
        causes.append("some batches hold NaN/inf (check the inputs and targets)")
        if str(getattr(cb, 'dtype', '')) != 'torch.bfloat16':
            causes.append(f"the forward pass overflows in fp16: train in {range_remedy(device)}")
        out.append(f"{sum(skips)} of the last {len(skips)} optimizer steps were skipped for inf/NaN gradients. Likely: "
                   + '; or '.join(causes) + '.')
        warned.add('skips')
    if dynamic and len(scales) >= 10 and sum(s <= floor for s in scales) > len(scales) / 2 and 'floor' not in warned:
        out.append(f"the dynamic loss scale sits at its floor ({floor:g}) for most of the last {len(scales)} steps: "
                   "the gradients (or the loss) are too large for fp16 even unscaled. Check the learning rate and "
                   f"the inputs, or train in {range_remedy(device)}.")
        warned.add('floor')
    for msg in out: warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return out
