"""Mixed-precision training for fastai: `learn.to_fp16()`, `learn.to_bf16()`, `learn.to_fp32()`."""
__version__ = "0.1.0"

import warnings as _warnings
# fastai.layers calls the deprecated `torch.jit.script` at import: not our users' concern
with _warnings.catch_warnings():
    _warnings.filterwarnings('ignore', message='`torch.jit.script` is deprecated', category=FutureWarning)
    import fastai.basics as _fastai_basics

from .dtypes import convert_network, resolve_dtype
from .weights import get_master, to_master_grads, to_model_params, copy_clone
from .scaling import (test_overflow, grad_overflow, LossScaler, StaticScaler, BackoffScaler, LogNormalScaler,
                      LossScaleError, BNStatsGuard)
from .callbacks import ModelToHalf, MixedPrecision, NativeMixedPrecision, cast_floats
from . import patches as _patches  # every change to fastai's and torch's classes, listed there
_patches.install()

__all__ = ['convert_network', 'resolve_dtype', 'cast_floats', 'get_master', 'to_master_grads', 'to_model_params',
           'copy_clone', 'test_overflow', 'grad_overflow', 'LossScaler', 'StaticScaler',
           'BackoffScaler', 'LogNormalScaler', 'LossScaleError', 'ModelToHalf', 'MixedPrecision',
           'NativeMixedPrecision', 'BNStatsGuard']

from .diagnostics import (plot_loss_scale, plot_precision_health, gradient_report, plot_gradient_range, GradientReport,
                          precision_check,
                          plot_precision_check)
__all__ += ['plot_loss_scale', 'plot_precision_health', 'gradient_report', 'plot_gradient_range', 'GradientReport',
            'precision_check',
            'plot_precision_check']

from .fsdp import shard_model, DistributedData, full_state_dict, load_full_state_dict
__all__ += ['shard_model', 'DistributedData', 'full_state_dict', 'load_full_state_dict']
