"""Multi-process training (torch's `DistributedDataParallel`, launched by `torchrun` or `accelerate launch`, wrapped by
hand or by fastai's `to_distributed`/`distrib_ctx`): what the precision callbacks need so that every rank agrees.

- Whether a model's steps must agree between processes (`syncs`: several processes and a DDP or FSDP2 model), and the
  step's stats taking every rank's worst (`all_max_`): the overflow flag and the lognormal scaler's largest |grad| are
  all-reduced (MAX) before the step's one host sync reads them (`step_reducer`, chosen once at a fit's first batch), so
  an inf on one rank skips the step on every rank and the loss scale is the same everywhere.
- At the start of a fit the FP32 masters are broadcast from rank 0 (DDP broadcasts the model's params when it wraps
  it, but the masters are made from each rank's own FP32 values): the masters start, and stay, bit-identical.
- DDP binds its gradient hooks to the params' dtype when it wraps them: a model converted after wrapping would stop
  all-reducing silently. `ModelToHalf` converts a model that is already a DDP and wraps it again (`rewrap`), so that
  DDP's buckets hold 16-bit gradients (half the all-reduce bytes of FP32); fastai's `DistributedTrainer` (order 11)
  wraps after our callbacks (-50 and 10), so the model it wraps is 16-bit already.
- fastai's `DistributedDL` broadcasts its indices through CUDA (nccl); `patch_fastai` makes it use the CPU when the
  process group's backend is gloo, so the same code runs on CPUs (`distrib_ctx(cpu=True, sync_bn=False)`).
Nothing here does anything in a single process (torch.distributed not initialized, or a world of 1)."""
from __future__ import annotations
import functools, inspect, sys, warnings
import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = ['world_size', 'is_multiprocess', 'is_ddp', 'is_dtensor', 'is_fsdp', 'is_sharded', 'local_shard',
           'as_state_of', 'syncs', 'all_max_', 'reduce_max_', 'step_reducer', 'broadcast_', 'rewrap', 'patch_fastai',
           'recording_init']

def world_size() -> int:
    "The number of processes training together (1 when torch.distributed is not initialized)."
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

def is_multiprocess() -> bool: return world_size() > 1

def is_ddp(model) -> bool: return isinstance(model, DDP)

def _loaded(module:str, name:str):
    """`name` of `module` where that module is imported, else None. FSDP2's module and DTensor's are read only where
    something imported them (an FSDP2 module or a DTensor cannot exist before): importing them costs more than the
    rest of fp16cb (1.7 s of 2.2 on an AVX2-only AMD EPYC), in every process that imports fp16cb."""
    return getattr(sys.modules.get(module), name, None)

def is_dtensor(t) -> bool:
    "Whether `t` is a DTensor (an FSDP2 param's or its state's)."
    cls = _loaded('torch.distributed.tensor', 'DTensor')
    return cls is not None and isinstance(t, cls)

def is_fsdp(model) -> bool:
    "Whether `model` is sharded with PyTorch FSDP2 (`fully_shard` was called on it: the root of its units)."
    cls = _loaded('torch.distributed.fsdp', 'FSDPModule')
    return cls is not None and isinstance(model, cls)

def is_sharded(model) -> bool:
    "Whether FSDP2 shards `model` or some of it (the root a unit, or a param a DTensor)."
    return is_fsdp(model) or any(is_dtensor(p) for p in model.parameters())

def local_shard(t):
    "This rank's shard of `t` (a DTensor: the same memory, writing it writes `t`), or `t` itself."
    return t.to_local() if is_dtensor(t) else t

def as_state_of(t:Tensor, p) -> Tensor:
    """The local tensor `t` as the optimizer state of `p`: a DTensor over it for an FSDP2-sharded `p` (no copy), else
    `t` (`local_shard`'s inverse)."""
    if not is_dtensor(p) or is_dtensor(t): return t
    return type(p).from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)

def syncs(model) -> bool:
    """Whether the ranks must agree about `model`'s steps: several processes, and `model` is a DDP or an FSDP2 module
    (a learner that trains a plain model on one rank only, in a multi-process job, stays local: no collective it would
    hang on)."""
    return (is_ddp(model) or is_fsdp(model)) and is_multiprocess()

def all_max_(t:Tensor) -> Tensor:
    "`t` all-reduced in place with MAX across ranks (every rank's worst); no host sync of its own."
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t

def reduce_max_(t:Tensor, model=None) -> Tensor:
    "`t` all-reduced in place with MAX across ranks when `syncs(model)` (else as it is); no host sync of its own."
    return all_max_(t) if syncs(model) else t

def step_reducer(model):
    """What a step's stats go through before they are read, for `model` as the learner calls it: `all_max_` when the
    ranks must agree about its steps (`syncs`), else None (one process: nothing to call, every step)."""
    return all_max_ if syncs(model) else None

def broadcast_(tensors:list, src:int=0):
    "Every tensor of `tensors` set in place to its value on rank `src` (no-op in a single process)."
    if not is_multiprocess(): return
    for t in tensors:
        if t.numel(): dist.broadcast(t, src)

def recording_init(init):
    """`DistributedDataParallel.__init__` that also keeps the arguments each DDP was made with (`_fp16cb_args`), so
    that a re-wrap gives the new one exactly the user's (`broadcast_buffers=False` included). `fp16cb.patches` installs
    it."""
    init = getattr(init, '__wrapped__', init) if getattr(init, '_fp16cb', False) else init  # once, even on a reload
    sig = inspect.signature(init)
    @functools.wraps(init)
    def __init__(self, module, *args, **kwargs):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter('always')
            init(self, module, *args, **kwargs)
        # torch's warnings (`broadcast_buffers` is deprecated) point at the line that made the DDP, not at this wrapper
        for w in said: warnings.warn(w.message, w.category, stacklevel=2)
        bound = sig.bind(self, module, *args, **kwargs).arguments
        self.__dict__['_fp16cb_args'] = {k: v for k, v in bound.items() if k not in ('self', 'module')}
    __init__._fp16cb = True
    return __init__

def _ddp_kwargs(ddp:DDP) -> dict:
    """The arguments `ddp` was made with (recorded), or, for one made before fp16cb was imported, those it keeps as
    attributes."""
    if '_fp16cb_args' in ddp.__dict__: return dict(ddp.__dict__['_fp16cb_args'])
    names = [k for k in inspect.signature(DDP.__init__).parameters if k not in ('self', 'module')]
    kw = {k: ddp.__dict__[k] for k in names if k in ddp.__dict__}
    if getattr(ddp, 'bucket_bytes_cap', None): kw['bucket_cap_mb'] = ddp.bucket_bytes_cap / 2**20
    return kw

# torch's `FutureWarning`s about DDP arguments a user may have passed (2.14: `broadcast_buffers`, `check_reduction`)
_DEPRECATED = (r'`broadcast_buffers` is deprecated', r'Both `broadcast_buffers` and `forward_sync_buffers`',
               r'The `check_reduction` argument')

def rewrap(ddp:DDP) -> DDP:
    """A new `DistributedDataParallel` around `ddp.module`, with `ddp`'s arguments and comm hooks: for a model whose
    params changed dtype since `ddp` wrapped it (its gradient hooks and buckets are bound to the old dtype, and
    silently stop all-reducing). A collective: every rank must call it. The user's arguments are passed as they were,
    `broadcast_buffers` too, which torch 2.14 deprecates for `forward_sync_buffers`: `forward_sync_buffers=False` still
    syncs the buffers when DDP wraps, where `broadcast_buffers=False` keeps them rank-local (torch says to keep it
    until an `init_sync_buffers` comes). Its `FutureWarning` went to the user's own line when they made `ddp`; a re-wrap
    does not say it again."""
    with warnings.catch_warnings():
        for said in _DEPRECATED: warnings.filterwarnings('ignore', message=said, category=FutureWarning)
        new = DDP(ddp.module, **_ddp_kwargs(ddp))
    if getattr(ddp, 'static_graph', False): new._set_static_graph()
    for hook, state in getattr(ddp, '_comm_hooks', []): new.register_comm_hook(state, hook)
    return new

def _broadcast_idxs(self, t, rank):
    "`DistributedDL._broadcast` on the process group's device: CUDA for nccl, the CPU for gloo (fastai assumes CUDA)."
    device = 'cuda' if dist.get_backend() == 'nccl' else 'cpu'
    t = torch.tensor(t, dtype=torch.long, device=device)
    dist.broadcast(t, rank)
    return t.cpu().tolist()

def patch_fastai():
    "Let fastai's `DistributedDL` run on gloo (CPU) as well as nccl; a no-op unless `fastai.distributed` is imported."
    mod = sys.modules.get('fastai.distributed')
    dl = getattr(mod, 'DistributedDL', None)
    if dl is not None and dl._broadcast is not _broadcast_idxs: dl._broadcast = _broadcast_idxs

