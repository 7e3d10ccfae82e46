"""Across ranks: whether a model's steps must agree between processes, and the step's one sync taking every rank's
worst (an all-reduce with MAX)."""
from __future__ import annotations
from torch import Tensor
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = ['world_size', 'is_multiprocess', 'is_ddp', 'syncs', 'reduce_max_', 'read_stats']

def world_size() -> int:
    "The number of processes training together (1 when torch.distributed is not initialized)."
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

def is_multiprocess() -> bool: return world_size() > 1

def is_ddp(model) -> bool: return isinstance(model, DDP)

def syncs(model) -> bool:
    """Whether the ranks must agree about `model`'s steps: several processes, and `model` is a DDP (a learner that
    trains a plain model on one rank only, in a multi-process job, stays local: no collective it would hang on)."""
    return is_ddp(model) and is_multiprocess()

def reduce_max_(t:Tensor, model=None) -> Tensor:
    "`t` all-reduced in place with MAX across ranks when `syncs(model)` (else as it is); no host sync of its own."
    if syncs(model): dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t

def read_stats(stats:Tensor, model=None) -> tuple:
    """The step's one host sync (after every rank's worst is taken, under DDP): `(found_inf, max |grad| or None,
    underflow)`; `underflow` (any rank's) is read where `underflow_flag` added it, the calibrating step; else False."""
    s = reduce_max_(stats, model).tolist()
    return s[0] > 0, (s[1] if len(s) > 1 else None), len(s) > 2 and s[2] > 0

