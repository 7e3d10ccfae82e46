"""The model's own FP32 params sharded with PyTorch FSDP2 as what the optimizer steps: each is a DTensor whose shard
this rank holds, its grad reduce-scattered in FP32 and unscaled on the way (`fsdp.ReduceSink`). A step reads this
rank's shards (the check, its flags all-reduced with the step's stats) and clips by the norm of the whole grads, summed
over the ranks; the optimizer steps the DTensors as FP32 fastai would."""
from __future__ import annotations
import torch
import torch.distributed as dist

from ..scaling import _real
from ..distributed import is_multiprocess, local_shard, all_max_
from .params import ModelParams

__all__ = ['ShardedParams']

class ShardedParams(ModelParams):
    """`ModelParams` of a model sharded with FSDP2: the grads this rank holds are its shards, whole params are the
    ranks' together. Nothing is laid out (FSDP2 keeps a unit's shards in one buffer of its own), and nothing is
    broadcast at the start (each rank holds its own shards)."""
    def _fuse(self, core): self._core = None

    def _grads(self) -> tuple:
        ps = [p for p in self.params if p.grad is not None]
        return ps, [local_shard(p.grad) for p in ps]

    def _clip_coefs(self, max_norm:float, global_norm:bool, factor:float=1.):
        """`(group indices, their grads' shards, clip coefficient)` per group (or all together): the norm of the whole
        grads, the squares of every rank's shards summed (one all-reduce for all groups, no host sync)."""
        groups = [[local_shard(p.grad) for p in pg if p.grad is not None] for pg in self.model_pgs]
        sets = [list(range(len(groups)))] if global_norm else [[i] for i in range(len(groups))]
        ps = self.params
        dev = local_shard(ps[0]).device if ps else torch.device('cpu')
        sq = torch.zeros(len(sets), device=dev)
        for k, gis in enumerate(sets):
            real = _real([g for i in gis for g in groups[i]])
            if real: sq[k] = torch.stack(torch._foreach_norm(real, 2, dtype=torch.float32)).to(dev).square().sum()
        if is_multiprocess(): dist.all_reduce(sq)
        for k, gis in enumerate(sets):
            yield gis, [g for i in gis for g in groups[i]], (max_norm / (sq[k].sqrt() * factor + 1e-6)).clamp_(max=1.)

    def skip(self) -> tuple:
        """The step overflowed on some rank: its grads go. Which params held inf/NaN is every rank's together (each
        flag all-reduced with MAX: the param is named on every rank, whichever rank's shard overflowed)."""
        flags, names = super().skip()
        if flags is not None and is_multiprocess():
            flags = all_max_(flags.to(torch.uint8)).bool()
        return flags, names

    def fp32_state_dict(self, opt, stream) -> dict:
        "`opt.state_dict()` in FP32: this rank's shards, as DTensors (a save gathers them whole)."
        return opt.state_dict()

    def broadcast_from(self, src:int=0):
        "Each rank holds its own shards: only the stochastic rounding's generator is rank `src`'s."
        self._broadcast_generator(src)
