"""Guards for the fastai workflow: BatchNorm statistics that survive a skipped step, callbacks that cannot work."""
from __future__ import annotations
from contextlib import contextmanager
import torch
from torch import nn

__all__ = ['BNStatsGuard', 'reject_gradient_clip', 'count_skip', 'lr_find_stops_on', 'warn_all_skipped']

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
                         f"norm is clipped, as fastai v2's original `MixedPrecision(clip=...)` did). Or use `to_native_fp16`, with which GradientClip works.")

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

def warn_all_skipped(skips:list, what:str):
    "At the end of a fit: warn when every optimizer step of it was skipped for inf/NaN gradients (the weights never moved)."
    if skips and all(skips):
        import warnings
        warnings.warn(f"all {len(skips)} optimizer steps of this fit were skipped for inf/NaN gradients ({what}): the "
                      f"weights did not change. Check the data and the loss for NaN/inf, lower the learning rate, or try "
                      f"`learn.to_bf16()` if the forward pass overflows in fp16.", RuntimeWarning, stacklevel=2)
