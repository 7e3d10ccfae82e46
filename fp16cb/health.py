"""Health of the loss scale during training: warnings (once each) when it sits at its floor or many steps are skipped.
Used by the callbacks at the end of each epoch from the host-side history they keep (no host sync)."""
from __future__ import annotations
import warnings

__all__ = ['scale_health']

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
    if len(skips) >= 10 and sum(skips) > max(5, max_skip_frac * len(skips)) and 'skips' not in warned:
        causes = (["the dynamic loss scale grows again too soon (raise `scale_wait`/`growth_interval`)"] if dynamic else [])
        causes.append("some batches hold NaN/inf (check the inputs and targets)")
        if str(getattr(cb, 'dtype', '')) != 'torch.bfloat16':
            causes.append("the forward pass overflows in fp16 (try `learn.to_bf16()`, which has FP32's range)")
        out.append(f"{sum(skips)} of the last {len(skips)} optimizer steps were skipped for inf/NaN gradients. Likely: "
                   + '; or '.join(causes) + '.')
        warned.add('skips')
    if dynamic and len(scales) >= 10 and sum(s <= floor for s in scales) > len(scales) / 2 and 'floor' not in warned:
        out.append(f"the dynamic loss scale sits at its floor ({floor:g}) for most of the last {len(scales)} steps: "
                   "the gradients (or the loss) are too large for fp16 even unscaled. Check the learning rate and "
                   "the inputs, or train with `learn.to_bf16()`.")
        warned.add('floor')
    for msg in out: warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return out
