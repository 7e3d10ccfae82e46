"""`learn.export()` writes the plain FP32 learner, without fp16cb's callbacks (`to_fp16`, `to_bf16`, `to_native_fp16`
alike), so that `load_learner` needs fastai alone and predicts with the FP32 model: to train in mixed precision after
`load_learner`, call `learn.to_fp16()` (or `to_bf16()` ...) again. Mid-fit, the learner is exported as between fits
(the exact FP32 master weights). The file is written atomically: an export that fails part-way keeps the previous one."""
from __future__ import annotations
import warnings
from contextlib import contextmanager
import cloudpickle
from fastai.learner import Learner
from fastai.torch_core import rank_distrib
from fastcore.basics import patch
from fastcore.foundation import L

from .monitor import PrecisionValue
from .session import session_of, is_ours, _KEY
from .checkpoint import save_atomic

__all__ = ['without_precision']

@contextmanager
def without_precision(learn):
    "Within: `learn` without fp16cb's callbacks, their attributes, Recorder columns and session (put back on exit)."
    cbs, mets = learn.cbs, learn.metrics
    ours = [cb for cb in cbs if is_ours(cb)]
    attrs = {n: learn.__dict__.pop(n) for n in [cb.name for cb in ours] + [_KEY] if n in learn.__dict__}
    learn.cbs = L(cb for cb in cbs if not any(cb is o for o in ours))
    learn.metrics = [m for m in mets if not isinstance(m, PrecisionValue)]
    try: yield learn
    finally:
        learn.cbs, learn.metrics = cbs, mets
        learn.__dict__.update(attrs)

@patch
def export(self:Learner,
    fname='export.pkl', # file name in `self.path`
    pickle_module=cloudpickle,
    pickle_protocol:int=2,
):
    """Export the FP32 learner for inference, without fp16cb's callbacks (`load_learner` needs fastai alone; call
    `learn.to_fp16()` again to train in mixed precision), atomically; mid-fit, as between fits"""
    with session_of(self).suspended(), without_precision(self):  # every rank (mid-fit DDP: a collective re-wrap)
        if rank_distrib(): return  # rank 0 alone writes
        self._end_cleanup()
        old_dls, state = self.dls, (self.opt.state_dict() if self.opt is not None else None)
        self.dls, self.opt = self.dls.new_empty(), None
        try:
            with warnings.catch_warnings():  # torch's warning that the model's source is not checked
                warnings.simplefilter('ignore')
                save_atomic(self, self.path/fname, pickle_module=pickle_module, pickle_protocol=pickle_protocol)
        finally:  # even when the write fails: the learner keeps its data and optimizer
            self.create_opt()
            if state is not None: self.opt.load_state_dict(state)
            self.dls = old_dls
