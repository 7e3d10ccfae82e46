"""FP32 master weights: creating them per param group, and the fused copies model <-> master."""
from __future__ import annotations
import operator, warnings
import torch
from torch import nn, Tensor

__all__ = ['get_master', 'to_master_grads', 'to_model_params', 'copy_clone', 'MasterWeights', 'move_opt_state']

def _trainable(pg): return [p for p in pg if getattr(p, 'requires_grad', False) and hasattr(p, 'data')]

def _state_key(state:dict):
    "What must be equal for params to share one flat master: every non-tensor (or 0-dim tensor) state entry."
    key = []
    for k, v in sorted(state.items()):
        if isinstance(v, Tensor):
            if v.dim() == 0: key.append((k, v.item()))
        else: key.append((k, repr(v)))
    return tuple(key)

def _opt_state(opt) -> dict:
    "The per-param state dict of `opt`: a fastai `OptimWrapper` keeps it in the wrapped torch optimizer."
    inner = getattr(opt, 'opt', None)
    return inner.state if isinstance(inner, torch.optim.Optimizer) else opt.state

def _flat_partitions(pg, opt=None):
    "Split the params of a group into runs that can share one flat master: same device and same per-param flags."
    parts = {}
    for p in pg:
        state = _opt_state(opt).get(p, {}) if opt is not None and hasattr(opt, 'state') else {}
        parts.setdefault((p.device, _state_key(state)), []).append(p)
    return [sorted(part, key=lambda p: str(p.dtype)) for part in parts.values()]  # stable: one run per dtype

def _fp32_leaf(t:Tensor) -> Tensor: return t.detach().float()

def get_master(
    opt, # fastai `Optimizer` (or `OptimWrapper`) whose `param_lists` hold the model's params
    flat_master:bool=False, # One flat FP32 master per param group (per run of params with the same flags)
    *,
    fp32_of=None, # `param -> exact FP32 value`; given, masters share these tensors instead of cloning `param.data`
) -> tuple: # `(model_pgs, master_pgs)`: trainable model params per group and their FP32 masters
    "Per param group of `opt`, the trainable model params and FP32 master copies of them."
    model_pgs = [_trainable(pg) for pg in opt.param_lists]
    src = (lambda p: _fp32_leaf(fp32_of(p))) if fp32_of is not None else (lambda p: p.data.detach().clone().float())
    if not flat_master:
        return model_pgs, [[nn.Parameter(src(p), requires_grad=True) for p in pg] for pg in model_pgs]
    master_pgs = []
    for i, pg in enumerate(model_pgs):
        flats, parts = [], _flat_partitions(pg, opt)
        model_pgs[i] = [p for part in parts for p in part]  # params in the order of their flat masters
        for part in parts:
            flat = nn.Parameter(torch.cat([src(p).reshape(-1) for p in part]), requires_grad=True)
            flat.grad = torch.zeros_like(flat)
            flats.append(flat)
        master_pgs.append(flats)
    return model_pgs, master_pgs

def _flat_views(flat:Tensor, params) -> list:
    "Views into `flat` shaped like each of `params`, in order."
    res, o = [], 0
    for p in params:
        res.append(flat[o:o+p.numel()].view_as(p)); o += p.numel()
    return res

def _pairs(model_pgs, master_pgs, flat_master):
    "`(model params, master tensors)` matched one to one (views into the flat masters when flat)."
    models, masters, grads = [], [], []
    for pg, mg in zip(model_pgs, master_pgs):
        if flat_master:
            parts = _split_like(pg, mg)
            for part, flat in zip(parts, mg):
                models += part; masters += _flat_views(flat.data, part)
                if flat.grad is None: flat.grad = torch.zeros_like(flat)
                grads += _flat_views(flat.grad, part)
        else:
            models += pg; masters += [m.data for m in mg]; grads += [None]*len(mg)
    return models, masters, grads

def _split_like(pg, flats):
    "Cut the params `pg` (in flat-master order) into the consecutive runs that each of `flats` holds."
    if len(flats) == 1: return [pg]
    parts, i = [], 0
    for flat in flats:
        part, n = [], 0
        while n < flat.numel(): part.append(pg[i]); n += pg[i].numel(); i += 1
        parts.append(part)
    return parts

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

def copy_clone(d:dict) -> dict:
    "A detached FP32 clone of every tensor of the optimizer-state dict `d`, other values as they are."
    return {k: (v.detach().clone().float() if isinstance(v, Tensor) and torch.is_floating_point(v) else
                v.detach().clone() if isinstance(v, Tensor) else v) for k, v in d.items()}

def _fp32_state(d:dict) -> dict:
    "`d` itself when its floating tensors are FP32 already (moved, not copied), else its FP32 clone."
    if all(not isinstance(v, Tensor) or not torch.is_floating_point(v) or v.dtype == torch.float32 for v in d.values()):
        return d
    return copy_clone(d)

def _merge_states(states:list, params:list) -> dict:
    "One flat state from per-param states (tensors shaped like their param are concatenated; flags are shared)."
    keys = dict.fromkeys(k for s in states for k in s)
    out = {}
    for k in keys:
        vals = [s.get(k) for s in states]
        if any(isinstance(v, Tensor) and v.dim() > 0 for v in vals):
            out[k] = torch.cat([(v if v is not None else torch.zeros_like(p, dtype=torch.float32)).detach().float().reshape(-1)
                                for v, p in zip(vals, params)])
        else: out[k] = next(v for v in vals if v is not None)
    return out

def _split_state(state:dict, params:list) -> list:
    "Per-param states from a flat one (flat tensors are cut and cloned; other entries copied to each)."
    n = sum(p.numel() for p in params)
    res = [{} for _ in params]
    for k, v in state.items():
        if isinstance(v, Tensor) and v.dim() == 1 and v.numel() == n:
            for r, view in zip(res, _flat_views(v, params)): r[k] = view.clone()
        else:
            for r in res: r[k] = v.clone() if isinstance(v, Tensor) else v
    return res

def _set_param_lists(opt, pgs):
    try:
        from fastcore.foundation import L
        opt.param_lists = L(L(pg) for pg in pgs) if not hasattr(opt, 'opt') else [list(pg) for pg in pgs]
    except ImportError: opt.param_lists = [list(pg) for pg in pgs]

def move_opt_state(opt, from_pgs, to_pgs, flat:str|None=None):
    """Point `opt` at `to_pgs` and move the per-param state from `from_pgs` along (no copy when already FP32).
    `flat='merge'`: `to_pgs` are flat masters of `from_pgs`; `flat='split'`: the reverse."""
    state = _opt_state(opt)
    _set_param_lists(opt, to_pgs)
    for src, dst in zip(from_pgs, to_pgs):
        if flat == 'merge':
            for part, m in zip(_split_like(src, dst), dst):
                state[m] = _merge_states([state.pop(p, {}) for p in part], part)
        elif flat == 'split':
            for part, m in zip(_split_like(dst, src), src):
                for p, s in zip(part, _split_state(state.pop(m, {}), part)): state[p] = s
        else:
            for p, m in zip(src, dst):
                if p is not m: state[m] = _fp32_state(state.pop(p, {}))

_grad_of = operator.attrgetter('grad')

class _FlatRun:
    "Params of one dtype inside one flat master: their data and grads are views into two flat buffers of that dtype."
    def __init__(self, params, master:Tensor, master_grad:Tensor):
        n = sum(p.numel() for p in params)
        p0 = params[0]
        self.params, self.master, self.master_grad = params, master, master_grad
        self.buf = torch.empty(n, dtype=p0.dtype, device=p0.device)
        self.grad = torch.zeros(n, dtype=p0.dtype, device=p0.device)
        self.views, self.grad_views = _flat_views(self.buf, params), _flat_views(self.grad, params)
        with torch.no_grad(): torch._foreach_copy_(self.views, [p.data for p in params])  # exact current values
        for p, v, g in zip(params, self.views, self.grad_views):
            if p.grad is not None: g.copy_(p.grad)
            p.data, p.grad = v, g

    def _owns(self, t:Tensor, buf:Tensor) -> bool:
        return t is not None and t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()

    def reattach_grads(self):
        "Grads that someone replaced (or set to None) go back into the flat grad buffer (None -> zero)."
        if all(map(operator.is_, map(_grad_of, self.params), self.grad_views)): return  # the usual case, ~50ns/param
        for p, g in zip(self.params, self.grad_views):
            if p.grad is g: continue
            if p.grad is None: g.zero_()
            else: g.copy_(p.grad)
            p.grad = g

    def release(self):
        "Give the params that still view our buffers ordinary tensors of their own (after the fit)."
        for p in self.params:
            if self._owns(p.data, self.buf): p.data = p.data.clone()
            if self._owns(p.grad, self.grad):  # zero since `after_step`; a 16-bit grad can't go on an FP32 param
                p.grad = p.grad.clone() if p.grad.dtype == p.dtype else None

def _flat_runs(model_pgs:list, master_pgs:list) -> list:
    "A `_FlatRun` per run of consecutive params with the same dtype inside each flat master."
    runs = []
    for pg, mg in zip(model_pgs, master_pgs):
        for part, flat in zip(_split_like(pg, mg), mg):
            data, grad, o, i = flat.detach(), flat.grad, 0, 0
            while i < len(part):
                j = i
                while j < len(part) and part[j].dtype == part[i].dtype: j += 1
                n = sum(p.numel() for p in part[i:j])
                runs.append(_FlatRun(part[i:j], data[o:o+n], grad[o:o+n]))
                o, i = o + n, j
    return runs

class MasterWeights:
    """FP32 masters of an optimizer's trainable params, and the fused (foreach) copies between them and the model.
    Flat: the model's params and grads become views into one flat buffer per (flat master, dtype), so each copy is one
    vectorised op per buffer; `restore_opt` gives the params ordinary tensors back. Non-flat: lists cached per fit."""
    def __init__(self,
        opt, # the learner's optimizer
        flat:bool=False, # one flat FP32 master per group (per run of params with equal flags)
        fp32_of=None, # `param -> exact FP32 value` (from `ModelToHalf`); masters then share these tensors
    ):
        self.opt, self.flat = opt, flat
        self.old_param_lists = list(opt.param_lists)
        self.model_pgs, self.master_pgs = get_master(opt, flat, fp32_of=fp32_of)
        models, masters, grads = _pairs(self.model_pgs, self.master_pgs, flat)
        self.models, self.masters, self.grad_views = models, masters, grads
        self.flats = [m for mg in self.master_pgs for m in mg] if flat else []
        self.flat_grads = [m.grad for m in self.flats]
        self.master_params = [m for mg in self.master_pgs for m in mg]
        move_opt_state(opt, self.model_pgs, self.master_pgs, 'merge' if flat else None)
        self.runs = _flat_runs(self.model_pgs, self.master_pgs) if flat else []
        self._run_bufs = [r.buf for r in self.runs]
        self._run_grads = [r.grad for r in self.runs]
        self._run_masters = [r.master for r in self.runs]
        self._run_master_grads = [r.master_grad for r in self.runs]
        # non-flat: pairs that really need a copy (a BatchNorm master shares its FP32 param's storage)
        pairs = [(p, m) for p, m in zip(models, masters) if p.data_ptr() != m.data_ptr() or p.dtype != m.dtype]
        self._copy_models, self._copy_masters = [p for p, _ in pairs], [m for _, m in pairs]
        self._src_all = self._dst_all = None  # non-flat: every model grad and master grad as of the cached step

    def fp32_views(self) -> dict:
        "`{model param: the FP32 tensor that holds its current master value}`."
        return dict(zip(self.models, self.masters))

    def grads_to_master(self) -> list:
        "Copy model grads into master grads in one fused pass; returns the master grads to check and unscale."
        if self.flat:
            for m, g in zip(self.flats, self.flat_grads):
                if m.grad is not g: m.grad = g  # an optimizer's zero_grad(set_to_none) dropped it
            for r in self.runs: r.reattach_grads()
            if self.runs: torch._foreach_copy_(self._run_master_grads, self._run_grads)
            return self.flat_grads
        src, dst = [p.grad for p in self.models], [m.grad for m in self.master_params]
        if not (_all_same(src, self._src_all) and _all_same(dst, self._dst_all)): self._pair_grads(src)
        if self._src: torch._foreach_copy_(self._dst, self._src)
        return self._dst

    def _pair_grads(self, src):
        "Cache this step's (model grad, master grad) lists; a master grad is created once and then kept."
        self._src, self._dst = [], []
        for g, m in zip(src, self.master_params):
            if g is None: m.grad = None; continue
            if m.grad is None: m.grad = torch.empty_like(m)
            self._src.append(g); self._dst.append(m.grad)
        self._src_all, self._dst_all = src, [m.grad for m in self.master_params]

    def master_to_model(self):
        "Copy the master weights into the model params (rounding to 16-bit once), one fused pass."
        if self.flat:
            if self.runs: torch._foreach_copy_(self._run_bufs, self._run_masters)
            return
        if self._copy_models:
            with torch.no_grad(): torch._foreach_copy_(self._copy_models, self._copy_masters)

    def zero_model_grads(self):
        if self.flat:
            for r in self.runs: r.reattach_grads()
            if self.runs: torch._foreach_zero_(self._run_grads)
            return
        grads = [p.grad for p in self.models if p.grad is not None]
        if grads: torch._foreach_zero_(grads)

    def restore_opt(self):
        "Point the optimizer at the model's params again, moving (splitting, when flat) the state back."
        for r in self.runs: r.release()
        move_opt_state(self.opt, self.master_pgs, self.model_pgs, 'split' if self.flat else None)
        _set_param_lists(self.opt, self.old_param_lists)

def _all_same(a:list, b) -> bool:
    return b is not None and len(a) == len(b) and all(map(operator.is_, a, b))
