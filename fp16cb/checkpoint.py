"""Checkpoints of mixed-precision learners. `learn.save` writes the exact FP32 master weights and the optimizer state
keyed as for the model's own params (even mid-fit, when the model is 16-bit and the optimizer steps the masters),
so the file also loads into a plain FP32 learner; with the optimizer state it keeps the precision callbacks' state
(loss scaler, GradScaler). Mid-fit, `learn.save` reads the FP32 view of the weight store and leaves the 16-bit model
and its storages as they are. `learn.load` restores all of it, before, during or after a fit. `learn.save` (hence
`SaveModelCallback`) writes atomically: a write that fails part-way keeps the previous file (`export`: see `export`);
a symlink stays a symlink (the file it points to is replaced), and a device or a FIFO is written through, not
replaced."""
from __future__ import annotations
import os, stat, uuid, warnings
from contextlib import contextmanager
from functools import partial
from pathlib import Path
import cloudpickle
from fastai.learner import Learner, load_model
from fastai.torch_core import rank_distrib, get_model, distrib_barrier
from fastcore.foundation import L
from fastcore.meta import delegates
from fastcore.xtras import join_path_file
import torch

from .callbacks import ModelToHalf, MixedPrecision
from .session import session_of, is_ours, _KEY
from .weights import shared, dense_strides, own_storages
from .storage import Stream
from .monitor import PrecisionValue
from .weights.optstate import opt_state
from .distributed import is_fsdp
from .fsdp import full_state_dict, load_full_state_dict, gathered, shard_state

__all__ = ['PRECISION_KEY', 'precision_state', 'load_precision_state', 'fp32_view', 'fp32_model_state', 'save_atomic',
           'atomic_write', 'without_precision']

PRECISION_KEY = 'fp16cb'  # where the precision callbacks' state goes, inside the optimizer's state dict

# ---- atomic writes: a checkpoint or export that fails part-way leaves the previous file intact
def _fsync_dir(folder:Path):
    "Make the rename itself durable (POSIX); a platform that cannot open a folder (Windows) has nothing to do here."
    try: fd = os.open(folder, os.O_RDONLY)
    except OSError: return
    try: os.fsync(fd)
    except OSError: pass
    finally: os.close(fd)

def _target(path:Path) -> Path:
    "The file a write to `path` must replace: `path`, or the end of its chain of symlinks (which need not exist yet)."
    res = Path(os.path.realpath(path))
    if res.is_symlink():
        raise OSError(f"atomic_write: cannot write {str(path)!r}: its symlinks form a loop ({str(res)!r}); "
                      "point the link at a file, or remove it")
    return res

def _written_through(path:Path) -> bool:
    """Whether `path` exists and is not a regular file (a device such as /dev/null, a FIFO): it is written to, never
    replaced."""
    try: return not stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError: return False

@contextmanager
def atomic_write(
    path, # the file to (over)write: changed only once all the new content is on disk (a symlink: the file it points to)
):
    """Yield a binary file opened on a temporary file next to `path`; on success it is flushed, fsynced and renamed over
    `path`. A symlink stays: the file it points to is replaced. What is not a regular file (a device, a FIFO) is opened
    and written through, as `torch.save` does: it cannot be replaced atomically, and must not be replaced at all."""
    path = _target(Path(path))  # a symlink is kept: the temporary file goes next to its target, and replaces that
    if _written_through(path):
        with open(path, 'wb') as f: yield f
        return
    tmp = path.with_name(f'.{path.name}.{uuid.uuid4().hex[:12]}.tmp')  # same folder: `os.replace` is a rename
    try:
        with open(tmp, 'xb') as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try: os.unlink(tmp)
        except FileNotFoundError: pass
        raise
    _fsync_dir(path.parent)

# ---- checkpoints
def _stateful_cbs(learn): return [cb for cb in learn.cbs if is_ours(cb) and cb.checkpoint_key]

def precision_state(learn) -> dict:
    "`{checkpoint key: state_dict()}` of the learner's precision callbacks that keep state (loss scaler, GradScaler)."
    return {cb.checkpoint_key: cb.state_dict() for cb in _stateful_cbs(learn)}

def load_precision_state(learn, sd:dict|None):
    "Give each precision callback of `learn` its state from `sd` (a mismatch warns, as fastai does for the optimizer)."
    if not sd: return
    for cb in _stateful_cbs(learn):
        st = sd.get(cb.checkpoint_key)
        if st is None: continue
        try: cb.load_state_dict(st)
        except (ValueError, KeyError, RuntimeError) as e:
            warnings.warn(f"Could not restore the state of {type(cb).__name__} from the checkpoint: {e}")

@contextmanager
def fp32_view(learn):
    """Within: the model holds its exact FP32 master weights and the optimizer points at the model's own params with
    their state, even in the middle of a mixed-precision fit (a pause of the session: `load` writes into it); on exit
    the fit's 16-bit model and masters come back, made from the FP32 values (nothing rounded twice)."""
    with session_of(learn).suspended(): yield learn

def _active(learn, cls):
    return next((cb for cb in session_of(learn).active if isinstance(cb, cls)), None)

def fp32_model_state(learn, stream:Stream=None) -> dict:
    """The model's `state_dict` with the exact FP32 values, read without touching the model and without a copy of them
    all: mid-fit, a master is there over its own memory (`shared`), and a 16-bit value without one (`half_storage`) is
    widened by `stream` as the file is written, one at a time (None: widened now)."""
    model = get_model(learn.model)
    mth = _active(learn, ModelToHalf)
    # the file holds each tensor alone (a fit's params are laid out in buffers for the fused step)
    if mth is None or not mth.converted: return own_storages(model.state_dict())
    sd = model.state_dict()
    vals = mth.fp32_tensors(None if stream is None else partial(_widened, stream))
    alone = {}  # a tensor held in two places (a head tied to the embedding): one value under each of its keys
    for prefix, mod in model.named_modules(remove_duplicate=False):
        for name, cur in list(mod._parameters.items()) + list(mod._buffers.items()):
            key, v = f'{prefix}.{name}' if prefix else name, vals.get(id(cur))
            if v is None or key not in sd: continue
            if id(cur) not in alone:  # the file holds it alone, once
                alone[id(cur)] = shared(v.detach(), cur) if isinstance(v, torch.Tensor) else v
            sd[key] = alone[id(cur)]
    return sd

def _widened(stream:Stream, cur:torch.Tensor, dtype) -> torch.Tensor:
    "`cur` in `dtype`, laid out as it is, made by `stream` as the file is written."
    return stream.tensor(cur.shape, dense_strides(cur), cur.device, lambda out: out.copy_(cur), dtype, key=id(cur))

@contextmanager
def _fp32_opt_state(learn, stream:Stream):
    """Within: a function giving the optimizer's state dict keyed as for the model's own params, its state FP32
    (mid-fit, the model untouched; 16-bit state widened by `stream` as the file is written, one tensor at a time)."""
    mp = _active(learn, MixedPrecision)
    if mp is None or mp.store is None: yield lambda: learn.opt.state_dict()  # (no optimizer yet: not called)
    else:
        with mp.store.opt_view() as opt: yield partial(mp.store.fp32_state_dict, opt, stream)

class _OptLoader:
    """Stands in for the optimizer in fastai's `load_model`: takes our key out of the state dict before loading it
    (`sharded`: the whole state then made this rank's shards, as its FSDP2 params are)."""
    def __init__(self, opt, sharded:bool=False): self.opt, self.precision, self.sharded = opt, None, sharded
    def load_state_dict(self, sd):
        sd = dict(sd)
        self.precision = sd.pop(PRECISION_KEY, None)
        self.opt.load_state_dict(sd)
        if self.sharded: shard_state(opt_state(self.opt))

class _ShardedModel:
    "Stands in for an FSDP2 model in fastai's `load_model`: the whole tensors of the file loaded as this rank's shards."
    def __init__(self, model): self.model = model
    def load_state_dict(self, sd, strict=True): return load_full_state_dict(self.model, sd, strict=strict)

def save(self:Learner,
    file, # name in `self.path/self.model_dir` (`.pth` added)
    with_opt:bool=True, # also save the optimizer state and the precision callbacks' state
    pickle_protocol:int=2,
    **torch_save_kwargs
):
    """Save the FP32 model (the masters mid-fit, the 16-bit model left as it is) and, if `with_opt`, the optimizer and
    loss-scaler state"""
    file = join_path_file(file, self.path/self.model_dir, ext='.pth')
    if is_fsdp(get_model(self.model)): return _save_gathered(self, file, with_opt, pickle_protocol, **torch_save_kwargs)
    if rank_distrib(): return file  # don't save if child proc
    # mid-fit, nothing FP32 is made for the file but one tensor at a time, as torch.save writes it (its legacy format,
    # which writes a storage without asking its size first, gets them made before it starts)
    with Stream(eager=torch_save_kwargs.get('_use_new_zipfile_serialization', True) is False) as stream:
        state = fp32_model_state(self, stream)
        with _fp32_opt_state(self, stream) as opt_state_dict:
            if with_opt and getattr(self, 'opt', None) is not None:
                osd, ps = opt_state_dict(), precision_state(self)
                state = {'model': state, 'opt': {**osd, PRECISION_KEY: ps} if ps else osd}
            save_atomic(state, file, pickle_protocol=pickle_protocol, **torch_save_kwargs)
    return file

def _save_gathered(learn, file, with_opt:bool, pickle_protocol:int, **kwargs):
    """`save` of an FSDP2 learner: every rank gathers the whole model (and optimizer state) with the others, rank 0
    writes the file of a one-process FP32 learner. Every rank must call it (`SaveModelCallback` does, on each)."""
    state = full_state_dict(get_model(learn.model))
    if with_opt and getattr(learn, 'opt', None) is not None:
        with _fp32_opt_state(learn, Stream(eager=True)) as opt_state_dict: osd = gathered(opt_state_dict())
        ps = precision_state(learn)
        state = {'model': state, 'opt': {**osd, PRECISION_KEY: ps} if ps else osd}
    if not rank_distrib(): save_atomic(state, file, pickle_protocol=pickle_protocol, **kwargs)
    distrib_barrier()
    return file

def save_atomic(obj, file, **kwargs):
    """`torch.save(obj, file)`, atomically when `file` is a regular file or a new path (a file object, a device or a
    FIFO: written through)."""
    if not isinstance(file, (str, Path)): return torch.save(obj, file, **kwargs)
    with atomic_write(file) as f: torch.save(obj, f, **kwargs)

@delegates(load_model, but=['model', 'opt', 'file'])
def load(self:Learner, file, device=None, **kwargs):
    "Load the model and, if `with_opt`, the optimizer and loss-scaler state from `self.path/self.model_dir/file`"
    if device is None and hasattr(self.dls, 'device'): device = self.dls.device
    if self.opt is None: self.create_opt()
    file = join_path_file(file, self.path/self.model_dir, ext='.pth')
    distrib_barrier()
    sharded = is_fsdp(get_model(self.model))  # FSDP2: the whole file, each rank taking its shards
    opt, model = _OptLoader(self.opt, sharded), _ShardedModel(get_model(self.model)) if sharded else self.model
    with fp32_view(self): load_model(file, model, opt, device=device, **kwargs)
    if kwargs.get('with_opt', True): load_precision_state(self, opt.precision)
    return self

# ---- export
# `learn.export()` writes the plain FP32 learner, without fp16cb's callbacks (`to_fp16`, `to_bf16`, `to_native_fp16`
# alike), so that `load_learner` needs fastai alone and predicts with the FP32 model: to train in mixed precision after
# `load_learner`, call `learn.to_fp16()` (or `to_bf16()` ...) again. Mid-fit, the learner is exported as between fits
# (the exact FP32 master weights). The file is written atomically: an export that fails part-way keeps the previous one.

@contextmanager
def without_precision(learn):
    """Within: `learn` without fp16cb's callbacks, their attributes, Recorder columns, session and loss-scale history
    (put back on exit)."""
    cbs, mets = learn.cbs, learn.metrics
    ours = [cb for cb in cbs if is_ours(cb)]
    attrs = {n: learn.__dict__.pop(n) for n in [cb.name for cb in ours] + [_KEY, 'loss_scale_history']
             if n in learn.__dict__}
    learn.cbs = L(cb for cb in cbs if not any(cb is o for o in ours))
    learn.metrics = [m for m in mets if not isinstance(m, PrecisionValue)]
    try: yield learn
    finally:
        learn.cbs, learn.metrics = cbs, mets
        learn.__dict__.update(attrs)

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
