"""FP32 master weights: creating them per param group, and the fused copies model <-> master."""
from __future__ import annotations
import operator
import torch
from torch import nn, Tensor
from fastcore.foundation import L
from fastai.optimizer import Optimizer

from .layout import flat_views as _flat_views, flatten_like, dense_strides

__all__ = ['MASTERED', 'check_unique_params', 'get_master', 'to_master_grads', 'to_model_params', 'copy_clone', 'MasterWeights', 'FlatMasters', 'ParamMasters', 'move_opt_state']

MASTERED = (torch.float32, torch.float16, torch.bfloat16)  # params of other dtypes (float64, complex) train as they are

def _trainable(pg, own:bool=False):
    "The trainable params of `pg` that get FP32 masters (`own`: those that train in their own dtype, without)."
    return [p for p in pg if getattr(p, 'requires_grad', False) and hasattr(p, 'data') and (p.dtype not in MASTERED) == own]

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
    model_pgs = [_trainable(pg) for pg in opt.param_lists]  # float64 and complex params train as they are: no master
    src = (lambda p: _fp32_leaf(fp32_of(p)).to(p.device)) if fp32_of is not None else (lambda p: p.data.detach().clone().float())
    if not flat_master:
        return model_pgs, [[nn.Parameter(src(p), requires_grad=True) for p in pg] for pg in model_pgs]
    master_pgs = []
    for i, pg in enumerate(model_pgs):
        flats, parts = [], _flat_partitions(pg, opt)
        model_pgs[i] = [p for part in parts for p in part]  # params in the order of their flat masters
        for part in parts:
            flat = nn.Parameter(flatten_like([src(p) for p in part], part, torch.float32), requires_grad=True)
            flat.grad = torch.zeros_like(flat)
            flats.append(flat)
        master_pgs.append(flats)
    return model_pgs, master_pgs

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
            out[k] = flatten_like([v if v is not None else torch.zeros_like(p, dtype=torch.float32) for v, p in zip(vals, params)],
                                  params, torch.float32)
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
    "Point `opt` at `pgs`: `L`s for a fastai `Optimizer`, lists for the torch optimizer inside an `OptimWrapper`."
    opt.param_lists = [list(pg) for pg in pgs] if hasattr(opt, 'opt') else L(L(pg) for pg in pgs)

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

def _stock_zero_grad(opt) -> bool:
    "Whether `opt.zero_grad` is fastai's `Optimizer.zero_grad` itself (so it only zeroes grads: dropping them is the same)."
    return 'zero_grad' not in vars(opt) and getattr(type(opt), 'zero_grad', None) is Optimizer.zero_grad

class _FlatRun:
    """Params of one dtype whose masters are consecutive in one FP32 buffer: their data and grads become views into two
    flat buffers of their dtype, so each copy between them and the masters is one vectorised op.
    `keep_none`: a param without grad keeps none (non-flat semantics); else it gets a zero grad (flat semantics).
    With `keep_none`, a param without grad still gets its view at once (else autograd would allocate a grad of its own
    for the first backward, on top of the buffer: a peak of 2 bytes/param more on each fit's first step); a hook
    notes which of them the backward reaches, and the others lose the view again at the first `reattach_grads`."""
    def __init__(self, params, master:Tensor, master_grad:Tensor, keep_none:bool=False):
        n = sum(p.numel() for p in params)
        p0 = params[0]
        self.params, self.master, self.master_grad, self.keep_none = params, master, master_grad, keep_none
        self.buf = torch.empty(n, dtype=p0.dtype, device=p0.device)
        self.grad = torch.zeros(n, dtype=p0.dtype, device=p0.device)
        self.views, self.grad_views = _flat_views(self.buf, params), _flat_views(self.grad, params)
        with torch.no_grad(): torch._foreach_copy_(self.views, [p.data for p in params])  # exact current values
        self.pending, self.reached = [], set()  # params with no grad yet; those a backward reached
        for p, v, g in zip(params, self.views, self.grad_views):
            p.data = v
            if p.grad is not None: g.copy_(p.grad)
            elif keep_none: self.pending.append(p)
            p.grad = g
        self._hooks = [p.register_post_accumulate_grad_hook(self._reach) for p in self.pending]

    def _reach(self, p): self.reached.add(id(p))

    def _settle_pending(self):
        "After the first backward(s): a param without grad before the fit that no backward reached goes back to None."
        for p in self.pending:
            if id(p) not in self.reached and p.grad is not None and self._owns(p.grad, self.grad): p.grad = None
        for h in self._hooks: h.remove()
        self.pending, self.reached, self._hooks = [], set(), []

    def _owns(self, t:Tensor, buf:Tensor) -> bool:
        return t is not None and t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()

    def reattach_grads(self) -> list:
        "Grads that someone replaced go back into the flat grad buffer; returns the params left without grad."
        if self.pending: self._settle_pending()
        if all(map(operator.is_, map(_grad_of, self.params), self.grad_views)): return []  # the usual case, ~50ns/param
        missing = []
        for p, g in zip(self.params, self.grad_views):
            if p.grad is g: continue
            if p.grad is None:
                g.zero_()
                if self.keep_none: missing.append(p); continue
            else: g.copy_(p.grad)
            p.grad = g
        return missing

    def release(self):
        "Give the params that still view our buffers ordinary tensors of their own (after the fit)."
        if self.pending: self._settle_pending()  # a fit that ended before any step
        for p in self.params:
            if self._owns(p.data, self.buf): p.data = p.data.clone()
            if self._owns(p.grad, self.grad):  # cleared since `before_step`; a 16-bit grad can't go on an FP32 param
                p.grad = p.grad.clone() if p.grad.dtype == p.dtype else None

def _storage_runs(models:list, masters:list) -> tuple:
    """Non-flat masters stay one `nn.Parameter` per param (per-param optimizer state and steps), but their data and
    grads move into one FP32 buffer per device, ordered by the model's dtype: returns `(runs, FP32 grad buffers)`."""
    by_dev = {}
    for i in sorted(range(len(models)), key=lambda i: str(models[i].dtype)): by_dev.setdefault(models[i].device, []).append(i)
    runs, grad_bufs = [], []
    for dev, idx in by_dev.items():
        n = sum(models[i].numel() for i in idx)
        data, grad = torch.empty(n, device=dev), torch.zeros(n, device=dev)
        o = 0
        for i in idx:
            m, k = masters[i], masters[i].numel()
            view = _flat_views(data[o:o+k], [models[i]])[0]  # laid out as the model param (channels_last stays)
            view.copy_(m.data)
            m.data, o = view, o + k
            m.grad = None
        o, j = 0, 0
        while j < len(idx):
            k = j
            while k < len(idx) and models[idx[k]].dtype == models[idx[j]].dtype: k += 1
            ps = [models[i] for i in idx[j:k]]
            size = sum(p.numel() for p in ps)
            runs.append(_FlatRun(ps, data[o:o+size], grad[o:o+size], keep_none=True))
            o, j = o + size, k
        grad_bufs.append(grad)
    return runs, grad_bufs

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
    """FP32 masters of an optimizer's trainable params, and the fused copies between them and the model.
    The model's params and grads become views into one flat buffer per (device, dtype) run of the masters, so that
    grad->master, master->model and zeroing are one vectorised op per buffer (`restore_opt` gives the params ordinary
    tensors back). Two kinds behind this one interface: `FlatMasters` (one flat FP32 master per group) and
    `ParamMasters` (one FP32 master per param, whose data and grad are views into one FP32 buffer per device; the
    optimizer still sees and steps per-param masters). `MasterWeights(opt, flat)` makes the right one.
    During the fit, the optimizer's `step` copies the masters into the model right after stepping them, and (for
    fastai's stock `Optimizer`) its `zero_grad` drops the master grads, which the next step overwrites anyway."""
    flat = None
    def __new__(cls, opt=None, flat:bool=False, *args, **kwargs):
        if cls is MasterWeights: cls = FlatMasters if flat else ParamMasters
        return super().__new__(cls)

    def __init__(self,
        opt, # the learner's optimizer
        flat:bool=False, # one flat FP32 master per group (per run of params with equal flags)
        fp32_of=None, # `param -> exact FP32 value` (from `ModelToHalf`); masters are made from these tensors
        names:dict=None, # `{id(param): name}` for error messages
    ):
        self.opt = opt
        check_unique_params(opt.param_lists, names)
        self.old_param_lists = list(opt.param_lists)
        self.model_pgs, self.master_pgs = get_master(opt, self.flat, fp32_of=fp32_of)
        self.own_pgs = [_trainable(pg, own=True) for pg in opt.param_lists]  # stepped as they are, outside the masters
        self.own_params = [p for pg in self.own_pgs for p in pg]
        self.master_params = [m for mg in self.master_pgs for m in mg]
        self.runs = self._make_runs()
        # per model param: its master and (flat) master-grad view
        self.models, self.masters, self.grad_views = _pairs(self.model_pgs, self.master_pgs, self.flat)
        move_opt_state(opt, self.model_pgs, self.master_pgs, 'merge' if self.flat else None)
        self.opt_pgs = [list(mg) + own for mg, own in zip(self.master_pgs, self.own_pgs)]  # what the optimizer steps
        if self.own_params: _set_param_lists(opt, self.opt_pgs)
        self._run_bufs = [r.buf for r in self.runs]
        self._run_grads = [r.grad for r in self.runs]
        self._run_masters = [r.master for r in self.runs]
        self._run_master_grads = [r.master_grad for r in self.runs]
        self._own_zero_grad = _stock_zero_grad(opt)
        if self._own_zero_grad: opt.zero_grad = self.drop_master_grads
        self.stepped, self._prev_step, self._inner_step = False, vars(opt).get('step'), opt.step
        opt.step = self._step_then_copy

    # what the two kinds do differently
    def _make_runs(self) -> list: raise NotImplementedError
    def _attach_master_grads(self, missing:list): raise NotImplementedError
    def _master_grads(self) -> list: raise NotImplementedError

    def _step_then_copy(self, *args, **kwargs):
        """The optimizer's `step` during a fit: step the masters, then copy them into the model at once, so the model
        follows the masters whatever a callback raises in `after_step`."""
        out = self._inner_step(*args, **kwargs)
        self.master_to_model()
        self.stepped = True
        return out

    def drop_master_grads(self):
        """The optimizer's `zero_grad` during a fit (fastai calls it after every step): the next `grads_to_master`
        overwrites every master grad, so zeroing them is a wasted pass (and, non-flat, a Python loop of `detach_` and
        `zero_` per param): drop them (None), as torch's `zero_grad(set_to_none=True)` does."""
        for m in self.master_params: m.grad = None
        for p in self.own_params: p.grad = None

    def buffers(self) -> list:
        "The flat buffers behind the model's 16-bit params and grads and the FP32 masters and grads (memory accounting)."
        return self._run_bufs + self._run_grads + self._run_masters + self._run_master_grads

    def fp32_views(self) -> dict:
        "`{model param: the FP32 tensor that holds its current master value}`."
        return dict(zip(self.models, self.masters))

    def grads_to_master(self) -> list:
        "Copy model grads into master grads in one fused pass; returns the FP32 grads to check and unscale."
        if not self.runs: return []
        self._attach_master_grads([p for r in self.runs for p in r.reattach_grads()])
        torch._foreach_copy_(self._run_master_grads, self._run_grads)
        return self._master_grads()

    def own_grads(self) -> list:
        "The grads of the params that train in their own dtype (loss-scaled like the others: check and unscale them too)."
        return [p.grad for p in self.own_params if p.grad is not None]

    @property
    def model_grads(self) -> list:
        "The model's grads, as one flat buffer per run: after `grads_to_master`, exactly the values of the FP32 grads."
        return self._run_grads

    def master_to_model(self):
        "Copy the master weights into the model params (rounding to 16-bit once), one fused pass."
        if self.runs: torch._foreach_copy_(self._run_bufs, self._run_masters)

    def zero_model_grads(self,
        reattach:bool=True, # first put grads that someone replaced back into the flat buffers (False: just did)
    ):
        "Zero the model's 16-bit grads, ready for the next backward to accumulate into."
        if reattach:
            for r in self.runs: r.reattach_grads()
        if self.runs: torch._foreach_zero_(self._run_grads)

    def restore_opt(self):
        "Point the optimizer at the model's params again, moving (splitting, when flat) the state back."
        for r in self.runs: r.release()
        if self._own_zero_grad: self.opt.__dict__.pop('zero_grad', None)
        if self._prev_step is None: self.opt.__dict__.pop('step', None)
        else: self.opt.step = self._prev_step
        move_opt_state(self.opt, self.master_pgs, self.model_pgs, 'split' if self.flat else None)
        _set_param_lists(self.opt, self.old_param_lists)

class FlatMasters(MasterWeights):
    "One flat FP32 master per param group (per run of params with equal optimizer flags): the optimizer steps few tensors."
    flat = True
    def _make_runs(self):
        runs = _flat_runs(self.model_pgs, self.master_pgs)
        self.flat_grads = [m.grad for m in self.master_params]
        return runs

    def _attach_master_grads(self, missing:list):
        "A param without grad gets a zero grad (flat semantics); a flat grad an optimizer dropped is attached again."
        for m, g in zip(self.master_params, self.flat_grads):
            if m.grad is not g: m.grad = g

    def _master_grads(self): return self.flat_grads

class ParamMasters(MasterWeights):
    "One FP32 master per param (per-param optimizer state and steps), their data and grads in one buffer per device."
    flat = False
    def _make_runs(self):
        runs, self._grad_bufs = _storage_runs([p for pg in self.model_pgs for p in pg], self.master_params)
        self._master_grad_views = self._master_grads_of_runs(runs)
        return runs

    def _master_grads_of_runs(self, runs) -> list:
        "The view into the FP32 grad buffers that each master's grad is, in `master_params` order."
        views = {}
        for r in runs:
            o = r.master_grad.storage_offset()
            for p in r.params:  # aliases, not autograd views: fastai's `zero_grad` calls `grad.detach_()`
                views[p] = torch.empty(0, device=p.device).set_(r.master_grad.untyped_storage(), o, p.shape, dense_strides(p))
                o += p.numel()
        return [views[p] for p in (p for pg in self.model_pgs for p in pg)]

    def _attach_master_grads(self, missing:list):
        "Each master's grad is its view into the FP32 grad buffer, or None when its param has no grad."
        views = self._master_grad_views
        if not missing:  # the usual case: all attached, or all dropped by `drop_master_grads`
            if not all(map(operator.is_, map(_grad_of, self.master_params), views)):
                for m, v in zip(self.master_params, views): m.grad = v
            return
        drop = {id(p) for p in missing}
        for p, m, v in zip(self.models, self.master_params, views):
            m.grad = None if id(p) in drop else v

    def _master_grads(self): return self._grad_bufs
