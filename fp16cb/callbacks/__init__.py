"""The recipe of Micikevicius et al. as two fastai callbacks, the first room of a training step (the events):
`ModelToHalf` (a 16-bit model, `model_to_half`), `MixedPrecision` (FP32 masters and loss scaling, `mixed`), the
torch.amp alternative (`NativeMixedPrecision`: autocast and GradScaler, `native`), and the forward casts they rely on
(`casts`, which the diagnostics' copies of the model use too)."""
from ..dtypes import model_device  # noqa: F401 (imported from here by callers)
from .casts import cast_floats, IslandHooks, to_half
from .model_to_half import ModelToHalf
from .mixed import MixedPrecision
from .native import NativeMixedPrecision

__all__ = ['ModelToHalf', 'MixedPrecision', 'NativeMixedPrecision', 'cast_floats', 'IslandHooks', 'model_device',
           'to_half']
