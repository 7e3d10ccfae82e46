"""Guards for the fastai workflow: BatchNorm statistics that survive a skipped step, callbacks that cannot work."""
from __future__ import annotations
from contextlib import contextmanager
import torch
from torch import nn

__all__ = ['BNStatsGuard', 'reject_gradient_clip', 'count_skip', 'lr_find_stops_on', 'in_fit', 'fit_begins', 'fit_ends']

class BNStatsGuard:
    "Snapshot BatchNorm running statistics before a step's forward pass; put them back when the step is skipped."
    def __init__(self,
        model:nn.Module, # the model whose BatchNorm layers (tracking running stats) are guarded
    ):
        self.bufs = [b for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                     for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]
        self.snaps = [torch.empty_like(b) for b in self.bufs]
        self.armed = True  # a snapshot is due: nothing was accumulated since the last optimizer step

    def snapshot(self):
        "Copy the statistics aside (one fused copy) when a new step starts; micro-batches of an accumulated step keep the first."
        if not self.armed or not self.bufs: return
        torch._foreach_copy_(self.snaps, self.bufs)
        self.armed = False

    def restore(self):
        "Put back the statistics of the snapshot: the skipped step's forward passes leave no trace in them."
        if self.bufs and not self.armed: torch._foreach_copy_(self.bufs, self.snaps)
        self.armed = True

    def arm(self):
        "An optimizer step (or skip) happened: the next training batch takes a new snapshot."
        self.armed = True

def reject_gradient_clip(learn):
    "fastai's `GradientClip` would clip the model's 16-bit grads, not the FP32 masters the optimizer steps: refuse it."
    from fastai.callback.training import GradientClip
    clips = [cb for cb in learn.cbs if isinstance(cb, GradientClip)]
    if clips:
        raise ValueError(f"fastai's GradientClip(max_norm={clips[0].max_norm}) cannot be used with `to_fp16`/`to_bf16`: "
                         f"it would clip the model's 16-bit gradients, which MixedPrecision has already copied (unscaled) "
                         f"into the FP32 masters that the optimizer steps, and cleared. Use "
                         f"`learn.to_fp16(clip={clips[0].max_norm}, clip_global=True)` instead: the same global L2 norm as "
                         f"GradientClip, of the unscaled FP32 master gradients (without `clip_global`, each param group's "
                         f"norm is clipped, as in seed 001). Or use `to_native_fp16`, with which GradientClip works.")

def count_skip(n_in_a_row:int, skipped:bool, max_skipped:int, what:str) -> int:
    "Consecutive skipped steps after this one; past `max_skipped` the scalers' loud `LossScaleError`."
    n = n_in_a_row + 1 if skipped else 0
    if n > max_skipped:
        from .scalers import LossScaleError, _HINT
        raise LossScaleError(f"Mixed-precision training stopped: {n} steps in a row had inf/NaN gradients "
                             f"and were skipped ({what}). {_HINT}")
    return n

@contextmanager
def lr_find_stops_on(learn):
    "In `lr_find`, steps that keep overflowing mean the growing lr diverged: end the search (as `stop_div` does), not raise."
    from fastai.callback.core import CancelFitException
    from fastai.callback.schedule import LRFinder
    from .scalers import LossScaleError
    try: yield
    except LossScaleError:
        if any(isinstance(cb, LRFinder) for cb in learn.cbs): raise CancelFitException()
        raise

def in_fit(learn) -> bool:
    "Whether `learn` is inside `Learner.fit` (a flag set by `workflow`'s patch of `fit`), not a bare `validate`/`get_preds`."
    return learn is not None and learn.__dict__.get('_fp16cb_fitting', False)

def fit_begins(cb, set_up:bool) -> bool:
    '''In `before_fit`: False for the `before_fit` that `get_preds`/`validate` fire inside a running fit, while `cb` is
    `set_up` for it (then `after_fit` must not restore either); True when `cb` must set itself up: a fit begins, or
    `cb` was restored in the middle of one to be set up again (`checkpoint.fp32_view`: `learn.save` mid-fit, lr_find).'''
    fitting = in_fit(getattr(cb, 'learn', None))
    n = cb.__dict__.get('_fits', 0)
    if fitting and set_up:
        cb._fits = n + 1
        return False
    cb._fits = max(n, 1) if fitting else 1  # outside `fit` nothing can be nested
    return True

def fit_ends(cb) -> bool:
    "In `after_fit`: True when the outermost fit ends (then restore), False at the end of a nested `get_preds`/`validate`."
    cb._fits = max(cb.__dict__.get('_fits', 0) - 1, 0)
    return cb._fits == 0
