"""fastai's original master-weight functions (fastai's docs, "Callback and utility functions to allow mixed precision
training"): `get_master`, `to_master_grads`, `to_model_params`, `copy_clone`, and the rules they share with the
weight store: which params get FP32 masters, and that a param is in one param group only."""
from __future__ import annotations
import torch
from torch import nn, Tensor

from .layout import flat_views, flatten_like, split_like
from .optstate import copy_clone, opt_state

__all__ = ['MASTERED', 'get_master', 'to_master_grads', 'to_model_params', 'copy_clone', 'check_unique_params',
           'trainable']

MASTERED = (torch.float32, torch.float16, torch.bfloat16)  # params of other dtypes (float64, complex) train as they are

def trainable(pg, own:bool=False, keep=()):
    """The trainable params of `pg` that get FP32 masters (`own`: those that train in their own dtype, without);
    `keep`: ids of params the fit trained so far, kept though frozen since (FP32 fastai steps a frozen param that has a
    grad)."""
    return [p for p in pg if (getattr(p, 'requires_grad', False) or id(p) in keep) and hasattr(p, 'data')
            and (p.dtype not in MASTERED) == own]

def check_unique_params(param_lists, names:dict|None=None):
    "A `ValueError` naming the param and its groups when a param is in two param groups (or twice in one)."
    where = {}
    for i, pg in enumerate(param_lists):
        for p in pg:
            if id(p) in where:
                name = (names or {}).get(id(p), f'of shape {tuple(p.shape)}')
                raise ValueError(f"parameter {name} is in param groups {where[id(p)]} and {i} of the optimizer: mixed "
                                 f"precision keeps one FP32 master per parameter, so it must be in exactly one group "
                                 f"(check the learner's `splitter`).")
            where[id(p)] = i

def _state_key(state:dict):
    "What must be equal for params to share one flat master: every non-tensor (or 0-dim tensor) state entry."
    key = []
    for k, v in sorted(state.items()):
        if isinstance(v, Tensor):
            if v.dim() == 0: key.append((k, v.item()))
        else: key.append((k, repr(v)))
    return tuple(key)

def _flat_partitions(pg, opt=None):
    "Split the params of a group into runs that can share one flat master: same device and same per-param flags."
    parts = {}
    for p in pg:
        state = opt_state(opt).get(p, {}) if opt is not None and hasattr(opt, 'state') else {}
        parts.setdefault((p.device, _state_key(state)), []).append(p)
    return [sorted(part, key=lambda p: str(p.dtype)) for part in parts.values()]  # stable: one run per dtype

def _cut(part:list, limit) -> list:
    """`part` cut into consecutive runs of at most `limit` elements (`limit(device)` when callable; a bigger param
    alone)."""
    if limit is None or not part: return [part]
    n_max = limit(part[0].device) if callable(limit) else limit
    res, n = [[]], 0
    for p in part:
        if res[-1] and n + p.numel() > n_max: res.append([]); n = 0
        res[-1].append(p); n += p.numel()
    return res

def _fp32_leaf(t:Tensor) -> Tensor: return t.detach().float()

def get_master(
    opt, # fastai `Optimizer` (or `OptimWrapper`) whose `param_lists` hold the model's params
    flat_master:bool=False, # One flat FP32 master per param group (per run of params with the same flags)
    *,
    fp32_of=None, # `param -> exact FP32 value`; given, masters share these tensors instead of cloning `param.data`
    limit=None, # flat: most elements per flat master (int or `device -> int`), a bigger param alone; None: one per run
    keep=(), # ids of params kept though frozen (`trainable`)
) -> tuple: # `(model_pgs, master_pgs)`: trainable model params per group and their FP32 masters
    "Per param group of `opt`, the trainable model params and FP32 master copies of them."
    # float64 and complex params train as they are: no master
    model_pgs = [trainable(pg, keep=keep) for pg in opt.param_lists]
    src = ((lambda p: _fp32_leaf(fp32_of(p)).to(p.device)) if fp32_of is not None else
           (lambda p: p.data.detach().clone().float()))
    if not flat_master:
        return model_pgs, [[nn.Parameter(src(p), requires_grad=True) for p in pg] for pg in model_pgs]
    master_pgs = []
    for i, pg in enumerate(model_pgs):
        flats, parts = [], [c for part in _flat_partitions(pg, opt) for c in _cut(part, limit)]
        model_pgs[i] = [p for part in parts for p in part]  # params in the order of their flat masters
        for part in parts:
            flat = nn.Parameter(flatten_like([src(p) for p in part], part, torch.float32), requires_grad=True)
            flat.grad = torch.zeros_like(flat)
            flats.append(flat)
        master_pgs.append(flats)
    return model_pgs, master_pgs

def _pairs(model_pgs, master_pgs, flat_master, with_grads:bool=True):
    "`(model params, master tensors, master grads)` matched one to one (views into the flat masters when flat)."
    models, masters, grads = [], [], []
    for pg, mg in zip(model_pgs, master_pgs):
        if flat_master:
            parts = split_like(pg, mg)
            for part, flat in zip(parts, mg):
                models += part; masters += flat_views(flat.data, part)
                if not with_grads: grads += [None]*len(part); continue
                if flat.grad is None: flat.grad = torch.zeros_like(flat)
                grads += flat_views(flat.grad, part)
        else:
            models += pg; masters += [m.data for m in mg]; grads += [None]*len(mg)
    return models, masters, grads

def to_master_grads(
    model_pgs:list, # 16-bit model params, per group
    master_pgs:list, # their FP32 masters, per group
    flat_master:bool=False, # whether `master_pgs` were flattened
):
    "Copy the model's gradients into the FP32 masters' gradients (a missing gradient stays missing, or zero when flat)."
    models, masters, grads = _pairs(model_pgs, master_pgs, flat_master)
    if flat_master:
        with_grad = [(g, p.grad) for g, p in zip(grads, models) if p.grad is not None]
        if with_grad: torch._foreach_copy_([g for g, _ in with_grad], [s for _, s in with_grad])
        missing = [g for g, p in zip(grads, models) if p.grad is None]
        if missing: torch._foreach_zero_(missing)
        return
    for p, m in zip(models, (m for mg in master_pgs for m in mg)):
        if p.grad is None: m.grad = None
        elif m.grad is None: m.grad = p.grad.detach().float().clone()
        else: m.grad.copy_(p.grad)

def to_model_params(
    model_pgs:list, # 16-bit model params to copy into, per group
    master_pgs:list, # FP32 masters to copy from, per group
    flat_master:bool=False, # whether `master_pgs` were flattened
)->None:
    "Copy the FP32 master weights into the (16-bit) model params, rounding once."
    models, masters, _ = _pairs(model_pgs, master_pgs, flat_master)
    if models:
        with torch.no_grad(): torch._foreach_copy_(models, masters)

