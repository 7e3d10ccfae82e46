"""Every change `import fp16cb` makes to fastai's and torch's classes, in one place: what is set on which class, and
what it replaces. The functions live with what they serve (`learner`, `session`, `checkpoint`, `diagnostics`,
`distributed`); this module only installs them, once, when `fp16cb` is imported (a reload installs them again, never
wrapped twice). One change comes later, where its cause is: fastai's `DistributedDL` broadcasts its indices on the
CPU too (`distributed.patch_fastai`, when `fastai.distributed` is loaded)."""
from __future__ import annotations
from typing import NamedTuple
from fastai.learner import Learner
from fastai.optimizer import Optimizer, OptimWrapper
from torch.nn.parallel import DistributedDataParallel as DDP

from torch import nn
from . import learner, session, distributed, checkpoint, dtypes, weights, storage
from .diagnostics import precision_check

__all__ = ['Change', 'CHANGES', 'install']

class Change(NamedTuple):
    "One attribute set on a class at import: `cls.name = value`, and what it replaces (or adds)."
    cls: type
    name: str
    value: object
    replaces: str

CHANGES = (
    # the precision of a learner (fastai patches its own `to_fp16` & co. onto Learner: these replace them)
    Change(Learner, 'to_fp16', learner.to_fp16,
           "fastai's `to_fp16` (PyTorch AMP): a 16-bit model, FP32 master weights, loss scaling"),
    Change(Learner, 'to_bf16', learner.to_bf16, "fastai's `to_bf16` (AMP in bf16): a bf16 model, FP32 master weights"),
    Change(Learner, 'to_fp32', learner.to_fp32, "fastai's `to_fp32`: also gives back the exact FP32 weights"),
    Change(Learner, 'to_native_fp16', learner.to_native_fp16, "new: autocast + GradScaler (`NativeMixedPrecision`)"),
    Change(Learner, 'to_native_bf16', learner.to_native_bf16, "new: autocast in bf16"),
    Change(Learner, 'to_native_fp32', learner.to_native_fp32, "new: the same as `to_fp32`"),
    Change(Learner, 'to_non_native_fp16', learner.to_non_native_fp16,
           "fastai's: also removes fp16cb's callbacks first"),
    Change(Learner, 'to_channelslast', learner.to_channelslast, "fastai's: keeps fp16cb's precision (no AMP on top)"),
    Change(Learner, 'precision_callbacks', learner.precision_callbacks, "new: the learner's precision callbacks"),
    Change(Learner, '_set_precision', learner._set_precision, "new: replace the precision callbacks, FP32 first"),
    Change(Learner, 'precision_check', precision_check, "new: `learn.precision_check()`"),
    # the lifecycle of a fit (`session`): set up once, torn down once, paused for what must see the FP32 learner
    Change(Learner, 'fit', session.fit_in_session, "fastai's `fit`, run inside the learner's `PrecisionSession`"),
    Change(Learner, 'remove_cb', session.remove_cb_restoring, "fastai's: a precision callback goes with its setup"),
    Change(Learner, 'freeze_to', session.freeze_to_fp32, "fastai's: mid-fit, applied to the FP32 learner"),
    Change(Learner, '__deepcopy__', session.deepcopy_fp32,
           "new: `copy.deepcopy(learn)` mid-fit copies the FP32 learner"),
    Change(Learner, 'restore_precision', session.restore_precision, "new: back to the between-fits state"),
    Change(Learner, '_step', weights.counted_step,
           "fastai's `_step` (`opt.step()`), counted: a step whose `after_step` never came is still finished"),
    Change(Optimizer, 'step', weights.fastai_step,
           "fastai's loop over the params; a fit's laid-out params step a run at a time, as one flat tensor each, "
           "its state widened around each run when it is stored in 16 or 8 bits (`state_dtype`)"),
    Change(Optimizer, 'zero_grad', weights.fastai_zero_grad,
           "fastai's: the same in-place zeroing; a fit's laid-out params' grads a run at a time, one pass each"),
    Change(OptimWrapper, 'step', weights.wrapper_step,
           "new (fastai delegates it to the torch optimizer): the same call; while a fit stores the state in 16 or 8 "
           "bits, the torch optimizer steps a chunk of params at a time, their state widened around it"),
    Change(Optimizer, 'state_dict', storage.fastai_state_dict,
           "fastai's; while a fit stores the state in 16 or 8 bits, FP32 copies of it, as an FP32 learner's"),
    # checkpoints (`checkpoint`): the FP32 file of plain fastai, written atomically; mid-fit as between fits
    Change(Learner, 'save', checkpoint.save,
           "fastai's `save`: the FP32 masters' values, the precision callbacks' state, written atomically"),
    Change(Learner, 'load', checkpoint.load, "fastai's `load`: also the loss scaler's state, into 16-bit or FP32"),
    Change(Learner, 'export', checkpoint.export, "fastai's `export`: the FP32 learner without fp16cb's callbacks"),
    # torch's modules: a deep copy mid-fit (an EMA's, keep-the-best) is the plain FP32 model, without our hooks
    Change(nn.Module, '__deepcopy__', dtypes.deepcopy_module,
           "new (Python's default copy): fp16cb's hooks on the model stay behind"),
    # torch's DDP: a re-wrap after the model's conversion takes the user's arguments
    Change(DDP, '__init__', distributed.recording_init(DDP.__init__), "torch's, which also keeps its arguments"),
)

def install():
    "Set every `CHANGES` row (and fastai's `DistributedDL` on gloo, if `fastai.distributed` is loaded already)."
    for c in CHANGES:
        # named as a method of its class (`Learner.to_fp16`)
        if getattr(c.value, '__module__', '').startswith('fp16cb'):
            c.value.__qualname__ = f"{c.cls.__name__}.{c.name}"
        setattr(c.cls, c.name, c.value)
    distributed.patch_fastai()
