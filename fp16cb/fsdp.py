"""Models sharded with PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`): its `MixedPrecisionPolicy` is fp16cb's
compute precision there. The sharded FP32 params are the masters (FSDP2 keeps them so: "no extra memory for a
high-precision copy"); a forward all-gathers each unit's params in 16 bits, and the grads are reduce-scattered in FP32.

- `ShardPolicy`: the policies of a fit, set on every FSDP2 unit of the model and the user's given back after it. A unit
  computes in the fit's 16-bit dtype, or in FP32 where the precision policy keeps its modules FP32 (BatchNorm,
  `keep_fp32`): a kept module must be a unit of its own, since FSDP2 casts all the params of a unit together. Each unit
  casts its floating outputs to what its parent computes in; the root's come out FP32 (the loss, fastai's Recorder).
- `ReduceSink`: the loss scale divided out as the grads are reduce-scattered, in FP32 (FSDP2's gradient divide factor,
  the ranks' mean times the scale), so that each sharded `p.grad` is unscaled as FP32 fastai holds it, and micro-batches
  that accumulate add unscaled grads.
- `shard_model`: a fastai-shaped way to shard before the learner is made (each kept module, then the given layers, then
  the root), and `full_state_dict` / `load_full_state_dict`: the whole model on every rank, as a one-process learner's.
Nothing here runs for a model that is not an FSDP2 module."""
from __future__ import annotations
import torch
import torch.distributed as dist
from torch import nn

from fastai.callback.core import Callback
from fastai.torch_core import rank_distrib
from fastcore.basics import noop

from .distributed import is_fsdp, is_dtensor, patch_fastai

__all__ = ['is_fsdp', 'fsdp_units', 'ShardPolicy', 'ReduceSink', 'shard_model', 'full_state_dict',
           'load_full_state_dict', 'full_tensor', 'shard_like', 'DistributedData', 'gathered',
           'shard_state']

def fsdp_units(model:nn.Module) -> list:
    "The FSDP2 units of `model` (the modules `fully_shard` was called on), in `model.modules()`' order."
    return [m for m in model.modules() if is_fsdp(m)]

def _groups(unit) -> list: return list(unit._get_fsdp_state()._fsdp_param_groups)

def _owners(model:nn.Module) -> dict:
    "`{id(module): the FSDP2 unit whose all-gather holds its params}` (the module itself, or its nearest unit above)."
    res = {}
    def walk(m, unit):
        unit = m if is_fsdp(m) else unit
        res[id(m)] = unit
        for c in m.children(): walk(c, unit)
    walk(model, None)
    return res

def check_sharded(model:nn.Module, kept:dict, names:dict):
    """Every param of `model` is sharded (the root is a unit: a param outside every unit would train on each rank
    alone), and every module kept FP32 that holds params is a unit of its own: FSDP2 casts all the params of a unit
    together."""
    if not is_fsdp(model) or any(not is_dtensor(p) for p in model.parameters()):
        raise ValueError("this model is sharded with FSDP2 only in part: call `fully_shard(model)` on the root too "
                         "(after its layers), so that every param is sharded and its grads reduced across ranks.")
    owner = _owners(model)
    for m in model.modules():
        if not any(True for _ in m.parameters(recurse=False)): continue
        unit = owner[id(m)]
        if (id(m) in kept) != (id(unit) in kept):
            name, what = names.get(id(m), type(m).__name__), 'stays FP32' if id(m) in kept else 'computes in 16 bits'
            raise ValueError(f"`{name or 'the model'}` ({type(m).__name__}) {what}, but FSDP2 casts all the params "
                             f"of a unit together, and it shares its unit with modules that do not: call `fully_shard` "
                             f"on it alone before its parent's (`fp16cb.shard_model` does so for BatchNorm and "
                             f"`keep_fp32`).")

class ShardPolicy:
    """The `MixedPrecisionPolicy` of each FSDP2 unit of `model` for a fit in `dtype` (units in `kept` FP32), set now;
    `restore` gives the user's back. The units are resharded first, and their all-gather buffers made again in the new
    dtype."""
    def __init__(self, model:nn.Module, kept:dict, dtype:torch.dtype, names:dict=None):
        from torch.distributed.fsdp import MixedPrecisionPolicy  # (imported already: the model is sharded)
        check_sharded(model, kept, names or {})
        self.units, self.dtype = fsdp_units(model), dtype
        self.saved = [(u, u._get_fsdp_state()._mp_policy) for u in self.units]
        parent = _parents(model)
        compute = lambda u: torch.float32 if u is None or id(u) in kept else dtype
        for u in self.units:
            up = parent.get(id(u))
            out = torch.float32 if u is model else (None if compute(up) == compute(u) else compute(up))
            _set_policy(u, MixedPrecisionPolicy(param_dtype=compute(u), reduce_dtype=torch.float32, output_dtype=out))

    def restore(self):
        for u, policy in self.saved: _set_policy(u, policy)
        self.saved = []

def _parents(model:nn.Module) -> dict:
    "`{id(unit): the unit above it}` (none above the root)."
    owner, res = _owners(model), {}
    for m in model.modules():
        for c in m.children():
            if is_fsdp(c): res[id(c)] = owner[id(m)]
    return res

def _set_policy(unit, policy):
    """`policy` on the FSDP2 unit `unit` and its param groups (torch has no public call to change a unit's policy
    after `fully_shard`): resharded, its params' dtypes set again, their all-gather buffers made anew at the next
    forward. A unit that has `policy` already is left as it is."""
    state = unit._get_fsdp_state()
    if getattr(state, '_mp_policy', None) == policy: return
    unit.reshard()
    try:
        groups = state._fsdp_param_groups
        state._mp_policy = policy
        for g in groups:
            g.mp_policy = policy
            for fp in g.fsdp_params:
                fp.mp_policy = policy
                fp.all_gather_outputs = []
                if hasattr(fp, '_unsharded_param'): del fp._unsharded_param
            g._init_mp_dtypes()
    except AttributeError as e:
        raise RuntimeError(f"fp16cb cannot set the mixed precision of this torch's FSDP2 units ({torch.__version__}: "
                           f"{e}). Shard the model with the policy itself: `fully_shard(module, mp_policy="
                           f"{policy!r})` on each unit, then `learn.to_bf16()`/`to_fp16()` finds it set.") from e

class ReduceSink:
    """Where a sharded model's grads arrive: reduce-scattered in FP32 and divided by the ranks' count times the loss
    scale of their backward (`begin`), so each `p.grad` shard is unscaled. The interface of the copies' `GradSink`."""
    scaled = False
    def __init__(self, model:nn.Module):
        self.units = fsdp_units(model)
        self._saved = [(g, g.gradient_divide_factor, g.force_sum_reduction_for_comms)
                       for u in self.units for g in _groups(u)]
        self._gloo = dist.is_initialized() and dist.get_backend() == 'gloo'  # gloo has no pre-multiplied sum

    def hook(self, params): self.scaled = True

    def begin(self, scale:float, loss=None):
        "A backward (of `loss`) at loss scale `scale` is coming: FSDP2 divides its grads by it as it reduces them."
        for g, factor, force in self._saved:
            g.gradient_divide_factor = None if scale == 1. else g.mesh_info.mesh.size() * scale
            g.force_sum_reduction_for_comms = force or (self._gloo and scale != 1.)

    def unhook(self):
        for g, factor, force in self._saved: g.gradient_divide_factor, g.force_sum_reduction_for_comms = factor, force
        self.scaled = False

def shard_model(
    model:nn.Module, # the FP32 model, the same on every rank (the same seed, or loaded weights)
    layers=(), # module classes sharded as units of their own (a transformer's blocks, a ResNet's stages), in order
    keep_fp32=None, # what computes in FP32 besides BatchNorm: a `PrecisionPolicy` or its spec(s), as `to_bf16`'s
    mesh=None, # FSDP2's device mesh (default: every rank, on the default process group)
    **kwargs, # more of `fully_shard`'s arguments (`reshard_after_forward`, ...)
) -> nn.Module:
    """`model` sharded with FSDP2 as fp16cb computes with it: each module kept FP32 (BatchNorm, `keep_fp32`) a unit of
    its own, then each module of a class in `layers`, then the root. Call it before the learner makes its
    optimizer."""
    from torch.distributed.fsdp import fully_shard  # (late: importing FSDP2 costs a second and more, `_loaded`)
    from .policy import PrecisionPolicy
    kept = PrecisionPolicy.make(keep_fp32).resolve(model, warn=False).kept
    if mesh is not None: kwargs['mesh'] = mesh
    layers, bounds = tuple(layers), set()
    def visit(m, above_kept:bool):  # where the dtype changes: a unit of its own
        k = id(m) in kept
        if k != above_kept: bounds.add(id(m))
        for c in m.children(): visit(c, k)
    visit(model, False)
    for m in list(model.modules())[:0:-1]:  # the innermost first, the root last
        if is_fsdp(m) or not any(True for _ in m.parameters()): continue
        if id(m) in bounds or (layers and isinstance(m, layers)): fully_shard(m, **kwargs)
    return fully_shard(model, **kwargs)

def full_tensor(t):
    "The whole of `t` (a DTensor: gathered from every rank, a collective), or `t`."
    return t.full_tensor() if is_dtensor(t) else t

def shard_like(t:torch.Tensor, like):
    "The FP32 whole tensor `t` as `like`'s shards (a DTensor of its mesh and placements: this rank's part), or `t`."
    if not is_dtensor(like): return t
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(t.to(like.device), like.device_mesh, like.placements, src_data_rank=None)

def gathered(obj):
    """`obj` (a state dict: dicts, lists and tuples of tensors and values) with every DTensor whole, on every rank (a
    collective: every rank calls it, on the same structure)."""
    if isinstance(obj, dict): return type(obj)((k, gathered(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, '_fields'): return type(obj)(gathered(v) for v in obj)
    return full_tensor(obj).detach() if is_dtensor(obj) else obj

def full_state_dict(model:nn.Module) -> dict:
    "`model.state_dict()` with every sharded tensor whole, on every rank (a collective: every rank calls it)."
    return gathered(model.state_dict())

def shard_state(state:dict):
    """An optimizer's state (`{param: {key: value}}`) loaded whole made this rank's shards: each tensor shaped like its
    sharded param becomes a DTensor of the param's placements (no communication: every rank read the whole file)."""
    for p, st in state.items():
        if not is_dtensor(p): continue
        for k, v in st.items():
            if torch.is_tensor(v) and not is_dtensor(v) and v.shape == p.shape: st[k] = shard_like(v, p)

def load_full_state_dict(model:nn.Module, sd:dict, strict:bool=True):
    "A whole state dict (`full_state_dict`, or a one-process learner's) into the sharded `model`: each rank its part."
    own = model.state_dict()
    return model.load_state_dict({k: shard_like(v, own[k]) if k in own else v for k, v in sd.items()}, strict=strict)

class DistributedData(Callback):
    """fastai's `DistributedDL` around the learner's loaders during a fit, so that each rank takes its part of every
    batch (its own rows of `bs`, as under `learn.distrib_ctx()`), the model left as FSDP2 sharded it: fastai's
    `DistributedTrainer` without its DDP wrap. Needs fastai's distributed extras (`accelerate`)."""
    order = 11  # as fastai's `DistributedTrainer`
    def before_fit(self):
        from fastai.distributed import DistributedDL
        patch_fastai()  # its index broadcast on gloo too
        self._wrap = lambda dl: dl if isinstance(dl, DistributedDL) else DistributedDL(dl)
        self.old = list(self.dls.loaders)
        self.learn.dls.loaders = [self._wrap(dl) for dl in self.old]
        if rank_distrib(): self.learn.logger = noop  # one rank reports, as fastai's

    def before_train(self): self.learn.dl = self._wrap(self.learn.dl)
    def before_validate(self): self.learn.dl = self._wrap(self.learn.dl)
    def after_fit(self): self.learn.dls.loaders = self.old
