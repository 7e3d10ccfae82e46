"""Mixed-precision training for fastai: `learn.to_fp16()`, `learn.to_bf16()`, `learn.to_fp32()`."""
__version__ = "0.1.0"

from .dtypes import convert_network, resolve_dtype, cast_floats
from .master import get_master, to_master_grads, to_model_params, copy_clone, MasterWeights
from .overflow import test_overflow, grad_overflow
from .scalers import LossScaler, StaticScaler, BackoffScaler, LogNormalScaler, LossScaleError
from .callbacks import ModelToHalf, MixedPrecision
from .native import NativeMixedPrecision
from . import learner as _learner  # patches Learner.to_fp16 & co.
from . import workflow as _workflow  # restores after a failed fit; lr_find saves the FP32 learner
from .guards import BNStatsGuard
from . import checkpoint as _checkpoint  # patches Learner.save / load: FP32 masters and loss-scaler state

__all__ = ['convert_network', 'resolve_dtype', 'cast_floats', 'get_master', 'to_master_grads', 'to_model_params',
           'copy_clone', 'MasterWeights', 'test_overflow', 'grad_overflow', 'LossScaler', 'StaticScaler',
           'BackoffScaler', 'LogNormalScaler', 'LossScaleError', 'ModelToHalf', 'MixedPrecision', 'NativeMixedPrecision',
           'BNStatsGuard']
