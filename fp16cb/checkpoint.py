"""Checkpoints of mixed-precision learners. `learn.save` writes the exact FP32 master weights and the optimizer state
keyed as for the model's own params (even mid-fit, when the model is 16-bit and the optimizer steps the masters),
so the file also loads into a plain FP32 learner; with the optimizer state it keeps the precision callbacks' state
(loss scaler, GradScaler). `learn.load` restores all of it, before, during or after a fit. `learn.save` (hence
`SaveModelCallback`) writes atomically: a write that fails part-way keeps the previous file (`export`: see `export`)."""
from __future__ import annotations
import warnings
from contextlib import contextmanager
from pathlib import Path
from fastai.learner import Learner, load_model
from fastai.torch_core import rank_distrib, get_model, distrib_barrier
from fastcore.basics import patch
from fastcore.meta import delegates
from fastcore.xtras import join_path_file
import torch

from .callbacks import ModelToHalf, MixedPrecision
from .native import NativeMixedPrecision
from .session import session_of
from .atomic import atomic_write
from .distributed import is_ddp

__all__ = ['PRECISION_KEY', 'precision_state', 'load_precision_state', 'fp32_view', 'save_atomic']

PRECISION_KEY = 'fp16cb'  # where the precision callbacks' state goes, inside the optimizer's state dict
_STATEFUL = (MixedPrecision, NativeMixedPrecision)

def _stateful_cbs(learn): return [cb for cb in learn.cbs if isinstance(cb, _STATEFUL)]

def precision_state(learn) -> dict:
    "`{callback class name: its state_dict()}` for the learner's stateful precision callbacks."
    return {type(cb).__name__: cb.state_dict() for cb in _stateful_cbs(learn)}

def load_precision_state(learn, sd:dict|None):
    "Give each precision callback of `learn` its state from `sd` (a mismatch warns, as fastai does for the optimizer)."
    if not sd: return
    for cb in _stateful_cbs(learn):
        st = sd.get(type(cb).__name__)
        if st is None: continue
        try: cb.load_state_dict(st)
        except (ValueError, KeyError, RuntimeError) as e:
            warnings.warn(f"Could not restore the state of {type(cb).__name__} from the checkpoint: {e}")

@contextmanager
def fp32_view(learn):
    """Within: the model holds its exact FP32 master weights and the optimizer points at the model's own params with
    their state, even in the middle of a mixed-precision fit; on exit the fit's 16-bit model and masters come back
    (re-created from the FP32 values, so nothing is rounded twice and the optimizer state is moved, not copied)."""
    session = session_of(learn)
    if not session.active:
        yield learn; return
    # grads accumulated so far (gradient accumulation across the save: fastai's FP32 save leaves them alone)
    grads = [(p, p.grad) for p in learn.model.parameters() if p.grad is not None]
    with session.suspended(): yield learn
    for p, g in grads:  # the next step copies them into the fit's flat grad buffers, as any replaced grad
        if g.dtype == p.dtype and g.shape == p.shape: p.grad = g

class _OptLoader:
    "Stands in for the optimizer in fastai's `load_model`: takes our key out of the state dict before loading it."
    def __init__(self, opt): self.opt, self.precision = opt, None
    def load_state_dict(self, sd):
        sd = dict(sd)
        self.precision = sd.pop(PRECISION_KEY, None)
        self.opt.load_state_dict(sd)

@patch
def save(self:Learner,
    file, # name in `self.path/self.model_dir` (`.pth` added)
    with_opt:bool=True, # also save the optimizer state and the precision callbacks' state
    pickle_protocol:int=2,
    **torch_save_kwargs
):
    "Save the FP32 model (the masters mid-fit) and, if `with_opt`, the optimizer and loss-scaler state"
    file = join_path_file(file, self.path/self.model_dir, ext='.pth')
    if rank_distrib() and not _ddp_in_fit(self): return file  # don't save if child proc
    opt = getattr(self, 'opt', None)
    with fp32_view(self):
        if rank_distrib(): return file  # every rank took the FP32 view (it wraps DDP again), rank 0 alone writes
        state = get_model(self.model).state_dict()
        if with_opt and opt is not None:
            osd = opt.state_dict()
            ps = precision_state(self)
            state = {'model': state, 'opt': {**osd, PRECISION_KEY: ps} if ps else osd}
        save_atomic(state, file, pickle_protocol=pickle_protocol, **torch_save_kwargs)
    return file

def _ddp_in_fit(learn) -> bool:
    "A mid-fit save of a DDP model: the FP32 view wraps it again (a collective), so every rank must take it."
    return bool(session_of(learn).active) and is_ddp(learn.model)

def save_atomic(obj, file, **kwargs):
    "`torch.save(obj, file)`, atomically when `file` is a path (a file object is written as it is)."
    if not isinstance(file, (str, Path)): return torch.save(obj, file, **kwargs)
    with atomic_write(file) as f: torch.save(obj, f, **kwargs)

@patch
@delegates(load_model, but=['model', 'opt', 'file'])
def load(self:Learner, file, device=None, **kwargs):
    "Load the model and, if `with_opt`, the optimizer and loss-scaler state from `self.path/self.model_dir/file`"
    if device is None and hasattr(self.dls, 'device'): device = self.dls.device
    if self.opt is None: self.create_opt()
    file = join_path_file(file, self.path/self.model_dir, ext='.pth')
    distrib_barrier()
    opt = _OptLoader(self.opt)
    with fp32_view(self): load_model(file, self.model, opt, device=device, **kwargs)
    if kwargs.get('with_opt', True): load_precision_state(self, opt.precision)
    return self
