"""Loss scaling, the third room of a training step (after the callback's events and the weight store): the scalers that
pick the loss scale (`scalers`), the fused inf/NaN check and the step's one host sync (`check`; DDP's all-reduce of
it is `fp16cb.distributed`'s), and the accounting of skipped steps with what a skip must undo (`record`)."""
from .scalers import (LossScaler, StaticScaler, BackoffScaler, LogNormalScaler, LossScaleError, make_scaler,
                      GradScalerAdapter, SEED_LOSS_SCALE, CALIBRATE, FP16_MAX, FP16_MIN_NORMAL,
                      check_positive)  # noqa: F401 (callers' imports)
from .check import (test_overflow, grad_overflow, OverflowCheck, check_and_unscale_, fused_supported, nonfinite_flags,
                    underflow_flag, read_stats, _real)  # noqa: F401 (`_real`: the store's)
from .record import (BNStatsGuard, count_skip, lr_find_stops_on, warn_all_skipped, OverflowLog, ScaleHistory,
                     StepRecord, warn_skips, BURST)

__all__ = ['LossScaler', 'StaticScaler', 'BackoffScaler', 'LogNormalScaler', 'LossScaleError', 'make_scaler',
           'GradScalerAdapter', 'SEED_LOSS_SCALE', 'CALIBRATE', 'FP16_MAX', 'test_overflow', 'grad_overflow',
           'OverflowCheck', 'check_and_unscale_', 'fused_supported', 'BNStatsGuard', 'count_skip', 'lr_find_stops_on',
           'warn_all_skipped', 'ScaleHistory', 'StepRecord', 'warn_skips', 'BURST',
           'nonfinite_flags', 'OverflowLog', 'underflow_flag', 'read_stats', 'FP16_MIN_NORMAL']
