"""The weight store, the second module of a training step: what the optimizer steps in a mixed-precision fit and how
a step's gradients get there. FP32 masters (per param, or one flat buffer per param group) and 16-bit storage are
implementations of one interface (`WeightStore`), whose shared part holds the rules for what may be converted.
Also fastai's original master-weight functions (`get_master`, `to_master_grads`, `to_model_params`, `copy_clone`)
and the memory layout of the flat buffers (views that keep each tensor's strides: channels_last survives)."""
from __future__ import annotations
import operator
from contextlib import contextmanager
from enum import Enum
import torch
from torch import nn, Tensor
from fastcore.foundation import L
from fastai.optimizer import Optimizer, OptimWrapper, _BaseOptimizer, _update

from .scaling import OverflowCheck, nonfinite_flags, _real
from .distributed import broadcast_

__all__ = ['MASTERED', 'Stage', 'WeightStore', 'FP32Masters', 'FlatMasters', 'ParamMasters', 'MasterWeights', 'HalfStorage',
           'check_unique_params', 'get_master', 'to_master_grads', 'to_model_params', 'copy_clone', 'move_opt_state',
           'round_stochastic', 'round_to', 'dense_strides', 'flat_views', 'flatten_like', 'with_layout_of', 'owns_storage']

MASTERED = (torch.float32, torch.float16, torch.bfloat16)  # params of other dtypes (float64, complex) train as they are

# ---- memory layout of the flat buffers
def _contiguous_strides(shape) -> tuple:
    res, s = [], 1
    for n in reversed(shape): res.append(s); s *= max(n, 1)
    return tuple(reversed(res))

def dense_strides(t:Tensor) -> tuple:
    """`t`'s strides when its elements fill a span of exactly `t.numel()` (contiguous, channels_last, or any other
    permutation of the dims); else the contiguous strides (an overlapping or gappy tensor gets a dense copy)."""
    expected = 1
    for size, stride in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n != 1), key=lambda o: o[1]):
        if stride != expected: return _contiguous_strides(t.shape)
        expected *= size
    return tuple(t.stride())

def flat_views(flat:Tensor, like:list) -> list:
    "Views into the 1-d `flat`, one per tensor of `like` in order, each with the shape and dense strides of its tensor."
    res, o = [], 0
    for t in like:
        n = t.numel()
        chunk = flat[o:o+n]
        res.append(chunk.as_strided(t.shape, dense_strides(t), chunk.storage_offset()))
        o += n
    return res

def flatten_like(tensors:list, like:list, dtype=None) -> Tensor:
    "One flat buffer holding `tensors` (in `dtype`), each laid out as its counterpart in `like` is (`flat_views` order)."
    ref = like[0] if like else tensors[0]
    flat = torch.empty(sum(t.numel() for t in like), dtype=dtype or ref.dtype, device=ref.device)
    if like:
        with torch.no_grad(): torch._foreach_copy_(flat_views(flat, like), [t.detach() for t in tensors])
    return flat

def owns_storage(t:Tensor) -> bool:
    "Whether `t` is the whole of its storage (not a view into a larger buffer, which `torch.save` would write whole)."
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()

def with_layout_of(t:Tensor, like:Tensor) -> Tensor:
    "`t` itself when it owns its storage and has `like`'s strides; else a copy of it that does, laid out as `like`."
    strides = dense_strides(like)
    if owns_storage(t) and tuple(t.stride()) == strides: return t
    return torch.empty_strided(like.shape, strides, dtype=t.dtype, device=t.device).copy_(t)

# ---- masters: fastai's original functions, and the optimizer's state moved between params
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
    opt = _innermost(opt)
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

def _pairs(model_pgs, master_pgs, flat_master, with_grads:bool=True):
    "`(model params, master tensors, master grads)` matched one to one (views into the flat masters when flat)."
    models, masters, grads = [], [], []
    for pg, mg in zip(model_pgs, master_pgs):
        if flat_master:
            parts = _split_like(pg, mg)
            for part, flat in zip(parts, mg):
                models += part; masters += flat_views(flat.data, part)
                if not with_grads: grads += [None]*len(part); continue
                if flat.grad is None: flat.grad = torch.zeros_like(flat)
                grads += flat_views(flat.grad, part)
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
            for r, view in zip(res, flat_views(v, params)): r[k] = view.clone()
        else:
            for r in res: r[k] = v.clone() if isinstance(v, Tensor) else v
    return res

def _set_param_lists(opt, pgs):
    "Point `opt` (the innermost optimizer) at `pgs`: `L`s for a fastai `Optimizer`, lists for an `OptimWrapper`'s torch optimizer."
    opt.param_lists = [list(pg) for pg in pgs] if isinstance(opt, OptimWrapper) else L(L(pg) for pg in pgs)

def move_opt_state(opt, from_pgs, to_pgs, flat:str|None=None, param_lists=None):
    """Move the per-param state from `from_pgs` to `to_pgs` (no copy when already FP32) and point `opt` at `param_lists`
    (default `to_pgs`). `flat='merge'`: `to_pgs` are flat masters of `from_pgs`; `flat='split'`: the reverse. fastai's
    `Lookahead` keeps slow weights per param: they follow the same way (flat ones are split, per-param ones merged)."""
    core = _innermost(opt)
    slow = _slow_weights(opt, core)
    state = _opt_state(core)
    _set_param_lists(core, param_lists if param_lists is not None else to_pgs)
    for src, dst in zip(from_pgs, to_pgs):
        if flat == 'merge':
            for part, m in zip(_split_like(src, dst), dst):
                state[m] = _merge_states([state.pop(p, {}) for p in part], part)
                if slow is not None: slow[id(m)] = flatten_like([slow.get(id(p), p) for p in part], part, torch.float32)
        elif flat == 'split':
            for part, m in zip(_split_like(dst, src), src):
                for p, s in zip(part, _split_state(state.pop(m, {}), part)): state[p] = s
                if slow is not None and id(m) in slow:
                    slow.update({id(p): v.clone() for p, v in zip(part, flat_views(slow[id(m)], part))})
        else:
            for p, m in zip(src, dst):
                if p is not m: state[m] = _fp32_state(state.pop(p, {}))
                if slow is not None and id(p) in slow: slow[id(m)] = slow[id(p)]
    if slow is not None: opt.slow_weights = L(L(slow.get(id(p), None) if id(p) in slow else p.detach().clone() for p in pg)
                                              for pg in core.param_lists)

def _slow_weights(opt, core):
    "`{id(param): slow weight}` of a fastai `Lookahead` that has started (None otherwise)."
    sw = opt.__dict__.get('slow_weights') if opt is not core else None
    if sw is None: return None
    return {id(p): s for pg, sg in zip(core.param_lists, sw) for p, s in zip(pg, sg)}

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
    def __init__(self, params, master:Tensor, keep_none:bool=False,
                 with_grad:bool=True): # False: no grad buffer (each grad is consumed by a step in the backward)
        n = sum(p.numel() for p in params)
        p0 = params[0]
        self.params, self.master, self.keep_none = params, master, keep_none
        self.buf = torch.empty(n, dtype=p0.dtype, device=p0.device)
        self.grad = torch.zeros(n, dtype=p0.dtype, device=p0.device) if with_grad else None
        self.views = flat_views(self.buf, params)
        self.grad_views = flat_views(self.grad, params) if with_grad else [None] * len(params)
        with torch.no_grad(): torch._foreach_copy_(self.views, [p.data for p in params])  # exact current values
        self.pending, self.reached = [], set()  # params with no grad yet; those a backward reached
        for p, v, g in zip(params, self.views, self.grad_views):
            p.data = v
            if g is None: p.grad = None; continue
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
        return t is not None and buf is not None and t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()

    def reattach_grads(self) -> list:
        "Grads that someone replaced go back into the flat grad buffer; returns the params left without grad."
        if self.pending: self._settle_pending()
        if self.grad is None: return []
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

    def linked(self) -> bool:
        "Whether the first param still views the buffers (a `.to()` replaces every param's tensor, and its grad's)."
        p = self.params[0]
        return self._owns(p.data, self.buf) and (p.grad is None or self.grad is None or self._owns(p.grad, self.grad))

    def relink(self):
        "Point the params (and grads) that someone replaced (same device and dtype) at fresh views into the buffers."
        self.views = flat_views(self.buf, self.params)
        if self.grad is not None: self.grad_views = flat_views(self.grad, self.params)
        for p, v, g in zip(self.params, self.views, self.grad_views):
            p.data = v
            if p.grad is not None and g is not None: p.grad = g

    def release(self):
        "Give the params that still view our buffers ordinary tensors of their own (after the fit)."
        if self.pending: self._settle_pending()  # a fit that ended before any step
        for p in self.params:
            if self._owns(p.data, self.buf): p.data = p.data.clone()
            if self._owns(p.grad, self.grad):  # cleared since `before_step`; a 16-bit grad can't go on an FP32 param
                p.grad = p.grad.clone() if p.grad.dtype == p.dtype else None

def _storage_runs(models:list, masters:list, with_grad:bool=True) -> list:
    """Non-flat masters stay one `nn.Parameter` per param (per-param optimizer state and steps), but their data moves
    into one FP32 buffer per device, ordered by the model's dtype: returns the runs. (No FP32 grad buffer: the grads are
    lifted to FP32 a bounded chunk at a time as the optimizer steps, see `FP32Masters`.)"""
    by_dev = {}
    for i in sorted(range(len(models)), key=lambda i: str(models[i].dtype)): by_dev.setdefault(models[i].device, []).append(i)
    runs = []
    for dev, idx in by_dev.items():
        n = sum(models[i].numel() for i in idx)
        data = torch.empty(n, device=dev)
        o = 0
        for i in idx:
            m, k = masters[i], masters[i].numel()
            view = flat_views(data[o:o+k], [models[i]])[0]  # laid out as the model param (channels_last stays)
            view.copy_(m.data)
            m.data, o = view, o + k
            m.grad = None
        o, j = 0, 0
        while j < len(idx):
            k = j
            while k < len(idx) and models[idx[k]].dtype == models[idx[j]].dtype: k += 1
            ps = [models[i] for i in idx[j:k]]
            size = sum(p.numel() for p in ps)
            runs.append(_FlatRun(ps, data[o:o+size], keep_none=True, with_grad=with_grad))
            o, j = o + size, k
    return runs

def _flat_runs(model_pgs:list, master_pgs:list) -> list:
    "A `_FlatRun` per run of consecutive params with the same dtype inside each flat master."
    runs = []
    for pg, mg in zip(model_pgs, master_pgs):
        for part, flat in zip(_split_like(pg, mg), mg):
            data, o, i = flat.detach(), 0, 0
            while i < len(part):
                j = i
                while j < len(part) and part[j].dtype == part[i].dtype: j += 1
                n = sum(p.numel() for p in part[i:j])
                runs.append(_FlatRun(part[i:j], data[o:o+n]))
                o, i = o + n, j
    return runs


# ---- the weight store: one interface, the step's second module
class Stage(Enum):
    "Where a store is in the current optimizer step (as torch's `GradScaler` keeps an `OptState` per optimizer)."
    NEW = 0       # set up for a fit: under DDP, the ranks still have to agree on the weights (at the first batch)
    READY = 1     # between steps: the next backward accumulates into the model's grads
    UNSCALED = 2  # `prepare_grads` checked the grads (unscaling waits for the step); the step may still be cancelled
    STEPPED = 3   # the optimizer stepped (the model follows it already); the model's grads are owed a clearing
    SKIPPED = 4   # the step overflowed and was skipped; the model's grads are owed a clearing

def _innermost(opt):
    "The optimizer that holds the param lists and state: inside fastai's `Lookahead` (and the like), the wrapped one."
    while not isinstance(opt, OptimWrapper) and type(opt) is not Optimizer and isinstance(getattr(opt, 'opt', None), _BaseOptimizer):
        opt = opt.opt
    return opt

def _sparse_params(model) -> set:
    "ids of the params whose grads come sparse (`nn.Embedding(sparse=True)` and the like)."
    return {id(p) for m in model.modules() if getattr(m, 'sparse', False) is True for p in m.parameters(recurse=False)} if model is not None else set()

def _fastai_update(core, p, hyper:dict, key=None):
    "fastai's `Optimizer.step` for one param `p`: its callbacks in order, on the state kept under `key` (default `p`)."
    key = p if key is None else key
    state = core.state[key]
    for cb in core.cbs: state = _update(state, cb(p, **{**state, **hyper}))
    core.state[key] = state

def _steps_param_by_param(core) -> bool:
    "Whether `core` is a fastai `Optimizer` whose `step` is fastai's own loop over params (so we may run it ourselves)."
    return isinstance(core, Optimizer) and getattr(type(core), 'step', None) is Optimizer.step

class WeightStore:
    """What the optimizer steps in a mixed-precision fit, and how a step's gradients get there (after Megatron-LM's
    mixed-precision optimizer: `prepare_grads`, then `step`). The callback asks; the store decides which tensors, when
    and how. Implementations: FP32 masters (`ParamMasters`, `FlatMasters`) and 16-bit storage (`HalfStorage`).

    The rules for what is converted live here, once, for every implementation:
    - only trainable params (`requires_grad`) are the store's; frozen ones are left as they are;
    - a param in two param groups (or twice in one) is refused, naming it;
    - FP32/fp16/bf16 params are stored by the implementation; any other dtype (float64, complex) trains as it is, in its
      own dtype, its (loss-scaled) grads checked and unscaled with the others (`own_params`);
    - sparse grads (`nn.Embedding(sparse=True)`) are made dense as they come in;
    - the grads stay as the backward left them (16-bit, loss-scaled) until the optimizer steps: they are checked there,
      read-only, and reach FP32 (unscaled, clipped) only as the optimizer consumes them, a bounded part at a time, so a
      step never holds a full-size FP32 copy of them (`lift_chunk`).
    What must hold during a fit: the model's params are the store's (`check_linked`, every step, O(buffers))."""
    flat = False
    master_pgs = None  # FP32 masters per group (None: this store has none)
    lift_chunk = 2**22  # at most this many elements (16 MiB) of grads are in FP32 at once during a step (or one param, if larger)
    in_backward = False  # each param stepped in the backward, as soon as its grad is ready (`arm_in_backward`)
    def __init__(self,
        opt, # the learner's optimizer (fastai `Optimizer`, `OptimWrapper`, `Lookahead` around either)
        names:dict=None, # `{id(param): name}`, for error messages
        model=None, # the model (which of its params get sparse grads)
    ):
        self.opt, self.core, self.names = opt, _innermost(opt), names or {}
        check_unique_params(self.core.param_lists, names)
        self.old_param_lists = [list(pg) for pg in self.core.param_lists]
        self.model_pgs = [_trainable(pg) for pg in self.old_param_lists]
        self.own_pgs = [_trainable(pg, own=True) for pg in self.old_param_lists]  # stepped as they are
        self.own_params = [p for pg in self.own_pgs for p in pg]
        sparse = _sparse_params(model)
        self.sparse = [p for pg in self.model_pgs + self.own_pgs for p in pg if id(p) in sparse]
        self.stage, self.scale, self.cleared, self.check = Stage.NEW, 1., False, OverflowCheck()
        self.grad_factor, self.coefs = 1., {}  # 1/loss scale; clip coefficients per group (device tensors)
        self._prev_step, self._inner_step = vars(opt).get('step'), opt.step  # the optimizer's own, to call and give back
        opt.step = self._step

    # -- the interface the callback uses, in the order of a step
    def prepare_grads(self,
        scale:float, # the loss scale the grads carry
        with_max:bool=False, # also report the largest |unscaled grad|
    ):
        """Check the step's grads for inf/NaN in one fused, read-only pass, as the backward left them: `[found, (max
        |unscaled grad|)]` on the device, or None (no grads). Unscaling happens in FP32, as the optimizer consumes them."""
        if self.in_backward: return self._found_in_backward()
        for p in self.sparse:
            if p.grad is not None and p.grad.is_sparse: p.grad = p.grad.to_dense()
        grads = self._grads_to_check()
        if not grads: return None
        self.stage, self.scale, self.grad_factor, self.coefs, self.cleared = Stage.UNSCALED, scale, 1. / scale, {}, False
        stats = self.check(grads, 1., with_max=with_max)
        return stats if len(stats) == 1 or scale == 1. else stats * stats.new_tensor([1., 1. / scale])

    def clip(self, max_norm:float, global_norm:bool=False):
        """Clip the unscaled grads the optimizer will use: each param group's norm, or (`global_norm`) all groups'
        together, as `torch.nn.utils.clip_grad_norm_`. The norm is taken in FP32 from the 16-bit grads; the coefficient
        stays on the device (no host sync) and joins the unscaling factor applied as the grads reach FP32."""
        groups = [[p.grad for p in a + b if p.grad is not None] for a, b in zip(self.model_pgs, self.own_pgs)]
        for gis in ([list(range(len(groups)))] if global_norm else [[i] for i in range(len(groups))]):
            gs = _real([g for i in gis for g in groups[i]])
            if not gs: continue
            dev = gs[0].device
            norms = torch._foreach_norm(gs, 2, dtype=torch.float32)
            total = torch.linalg.vector_norm(torch.stack([n.to(dev) for n in norms])) * self.grad_factor
            coef = (max_norm / (total + 1e-6)).clamp_(max=1.)
            self.coefs.update(dict.fromkeys(gis, coef))

    def _step(self, *args, **kwargs):
        "The optimizer's `step` during a fit: the optimizer steps once (a `Lookahead` counts one step), the model follows."
        out = None if self.in_backward else self._step_impl(*args, **kwargs)  # in the backward: stepped already
        self.stage = Stage.STEPPED
        return out

    def skip(self) -> tuple:
        """The step overflowed: its grads go, nothing of them reaches the weights. Returns which params' grads held
        inf/NaN, looked at before they go: `(flags on the device, their names)` (one pass per param, no host sync)."""
        params, grads = self._grads_by_param()
        order, names = self._in_model_order(params)
        if self.in_backward: found = self._flags_in_backward([params[i] for i in order]), names  # the grads are gone
        else: found = nonfinite_flags([grads[i] for i in order]), names
        self.zero_model_grads()
        self.cleared, self.stage = True, Stage.SKIPPED
        return found

    def finish(self):
        "After a step (or a skip): the model's grads cleared for the next backward, unless they were already."
        if not self.cleared: self.zero_model_grads()
        self.stage, self.cleared = Stage.READY, False

    def check_linked(self):
        "Raise (or re-link, when safe) if something replaced the tensors of the params the store steps."

    def broadcast_from(self, src:int=0):
        "Give every rank the weights of rank `src` (what the optimizer steps, and the model after it)."
        broadcast_(self._shared())
        self._after_broadcast()

    def own_grads(self) -> list:
        "The grads of the params that train in their own dtype (loss-scaled like the others)."
        return [p.grad for p in self.own_params if p.grad is not None]

    def fp32_views(self) -> dict:
        "`{model param: FP32 tensor holding its current trained value}` (empty: the model's own values are the truth)."
        return {}

    @contextmanager
    def opt_view(self):
        "Within: the optimizer on the model's own params, with their state (FP32), as between fits; the model is untouched."
        yield self.opt

    def restore(self):
        "Give the optimizer its own `step`, params and state back (the end of the fit)."
        for h in getattr(self, '_grad_hooks', []): h.remove()
        if self._prev_step is None: self.opt.__dict__.pop('step', None)
        else: self.opt.step = self._prev_step

    # -- opt-in: the step in the backward
    def arm_in_backward(self):
        """Step each param from a hook as soon as the backward has accumulated its grad, and drop the grad there: no
        param's grad outlives its own step (a fastai `Optimizer`, a loss scale of 1). A grad holding inf/NaN is zeroed on
        the device before its param is stepped (no host sync: that param's optimizer takes a step with a zero grad, its
        momentum and moments decaying, its weight decay applied) and flags the step, which `prepare_grads` reports."""
        if not _steps_param_by_param(self.core) or self.opt is not self.core:
            raise ValueError(f"step_in_backward steps each param with fastai's `Optimizer` loop; this learner's optimizer "
                             f"is {type(self.opt).__name__} (a torch optimizer in `OptimWrapper`, `Lookahead`, or an "
                             f"`Optimizer` with its own `step`): use a plain fastai optimizer (`Adam`, `SGD`, ...) or "
                             f"train without step_in_backward.")
        self.in_backward, self._found, self._bad, self._bad_last = True, {}, {}, {}
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._hooked_params()]
        return self

    def _on_grad(self, p):
        "A param's grad is complete: check it (on the device), step the param with it, drop it."
        g = p.grad
        bad = torch.isfinite(torch.view_as_real(g) if g.is_complex() else g).all().logical_not_()
        f = self._found.get(g.device)
        self._found[g.device] = bad.clone() if f is None else f.logical_or_(bad)
        self._bad[id(p)] = bad  # which params' grads held inf/NaN: a skipped step's attribution
        g.masked_fill_(bad, 0)
        self._step_one(p)
        p.grad = None

    def _flags_in_backward(self, params:list):
        "Whether each of `params`' grads held inf/NaN in the last backward (its hook's flag; none: False), on the device."
        bads = [self._bad_last.get(id(p)) for p in params]
        first = next((b for b in bads if b is not None), None)
        if first is None: return None
        return torch.stack([b.to(first.device) if b is not None else torch.zeros((), dtype=torch.bool, device=first.device) for b in bads])

    def _found_in_backward(self):
        "`[found]`: whether any grad of this backward held inf/NaN (None: the backward reached no param)."
        found, self._found = list(self._found.values()), {}
        self._bad_last, self._bad = self._bad, {}
        if not found: return None
        self.stage, self.scale, self.cleared = Stage.UNSCALED, 1., True
        dev = found[0].device
        return torch.stack([f.to(dev) for f in found]).any().float().reshape(1)

    # -- shared by the kinds
    def _factor(self, gi:int):
        "What group `gi`'s grads are multiplied by as they reach FP32: 1/scale times its clip coefficient (None: by 1)."
        c = self.coefs.get(gi)
        if c is None: return None if self.grad_factor == 1. else self.grad_factor
        return c if self.grad_factor == 1. else c * self.grad_factor

    def _through_core(self, core_step, *args, **kwargs):
        """Step the optimizer once, `core_step` (`(step, *args)`) doing the innermost optimizer's part: through a wrapper
        (fastai's `Lookahead`), the wrapper's `step` runs once and calls the wrapped optimizer's, which is ours then."""
        if self.opt is self.core: return core_step(self._inner_step, *args, **kwargs)
        core, inner = self.core, self.core.step
        core.step = lambda *a, **k: core_step(inner, *a, **k)
        try: return self._inner_step(*args, **kwargs)
        finally: core.__dict__.pop('step', None)

    def _in_model_order(self, params:list) -> tuple:
        "`(order, names)`: `params` as `model.named_parameters()` orders and names them (made once per store)."
        if getattr(self, '_order', None) is None or len(self._order[0]) != len(params):
            rank = {k: i for i, k in enumerate(self.names)}
            order = sorted(range(len(params)), key=lambda i: rank.get(id(params[i]), len(rank)))
            self._order = order, [self.names.get(id(params[i]), f"<param of shape {tuple(params[i].shape)}>") for i in order]
        return self._order

    # -- what each kind does its own way
    def _grads_to_check(self) -> list:
        "The step's grads as the backward left them (after any re-attaching), for the overflow check."
        raise NotImplementedError
    def _grads_by_param(self) -> tuple:
        "`(params, their grads as the backward left them)`: what a skipped step's attribution looks at."
        raise NotImplementedError
    def _shared(self) -> list: return [p.data for pg in self.model_pgs + self.own_pgs for p in pg]
    def _hooked_params(self) -> list: return [p for pg in self.model_pgs + self.own_pgs for p in pg]
    def _step_one(self, p): raise NotImplementedError
    def _after_broadcast(self): pass
    def _step_impl(self, *args, **kwargs): raise NotImplementedError
    def zero_model_grads(self): raise NotImplementedError

def _check_same_kind(p, buf, what:str, name:str):
    "`p`, no longer a view of `buf`, can be re-linked to it (same device and dtype), or this is a clear error."
    if p.device != buf.device or p.dtype != buf.dtype:
        raise RuntimeError(
            f"mixed precision: the model's parameter {name} was replaced during the fit by a tensor on {p.device} in "
            f"{p.dtype} (it was on {buf.device} in {buf.dtype}): something after the setup moved or converted the model "
            f"(a callback calling `learn.model.to(...)`/`.float()`, a wrapper). Training on would never change the "
            f"weights the optimizer steps ({what}). Move or convert the model before `learn.to_fp16()`/`to_bf16()` "
            f"(or before the fit), or order that callback before fp16cb's (order < -50).")

class _LiftPlan:
    """How one chunk's masters get their FP32 grads, made once: an FP32 scratch buffer viewed as each master's grad,
    whose memory is given back between steps (`resize_(0)` of its storage, as FSDP frees its flat buffers: the views
    stay, the bytes go), and the 16-bit grads copied from. Valid while those are still the params' grads."""
    def __init__(self, items:list):
        # the scratch is laid out in the order of the 16-bit grads' memory, so that the copy coalesces into one per buffer
        items = sorted([it for it in items if it[2] is not None], key=lambda it: _region(it[2][0][0].grad)[:2])
        self.items = [(m, gi) for m, gi, _ in items]
        self.objs, pairs, self.groups = [], [], {}
        scratch = torch.empty(sum(m.numel() for m, _ in self.items), dtype=torch.float32, device=self.items[0][0].device)
        self.views = flat_views(scratch, [m for m, _ in self.items])
        for (m, gi, sources), v in zip(items, self.views):
            for o, off in sources:
                g = o.grad
                self.objs.append(o)
                pairs.append((v if off == 0 and g.shape == v.shape else v.view(-1)[off:off + g.numel()], g))
            self.groups.setdefault(gi, []).append(v)
        self.srcs = [g for _, g in pairs]  # what each source's grad must still be (`valid`)
        self.dsts, self.copy_srcs = _coalesce(pairs)
        self.storage = scratch.untyped_storage()
        self.nbytes = self.storage.nbytes()
        self.storage.resize_(0)

    @classmethod
    def make(cls, items:list):
        "The plan of `items`, or None when it has no master or one of their sources has no grad now."
        objs = [o for _, _, sources in items if sources is not None for o, _ in sources]
        return cls(items) if objs and all(o.grad is not None for o in objs) else None

    def valid(self) -> bool: return all(map(operator.is_, map(_grad_of, self.objs), self.srcs))

    def lift(self) -> dict:
        "The scratch's memory back, the 16-bit grads copied in (one fused copy), each master's grad its view: `{group: views}`."
        self.storage.resize_(self.nbytes)
        torch._foreach_copy_(self.dsts, self.copy_srcs)
        for (m, _), v in zip(self.items, self.views): m.grad = v
        return self.groups

    def free(self):
        for m, _ in self.items: m.grad = None
        self.storage.resize_(0)

def _region(t:Tensor) -> tuple:
    "`(storage, first element, element count, strides)` of the dense tensor `t` (a grad view, a scratch view)."
    return t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), tuple(t.stride())

def _coalesce(pairs:list) -> tuple:
    """`(dsts, srcs)` copying what the `(dst, src)` pairs copy, with neighbours merged: where a pair continues the previous
    one in both memories (same strides: element order is memory order), the two become one 1-d copy."""
    merged = []  # [dst, src, dst region, src region, mergeable]
    for d, s in pairs:
        rd, rs = _region(d), _region(s)
        ok = rd[3] == rs[3]  # the same strides: copying the pair is copying its memory in order
        last = merged[-1] if merged else None
        if (ok and last is not None and last[4] and last[2][0] == rd[0] and last[3][0] == rs[0]
                and last[2][1] + last[2][2] == rd[1] and last[3][1] + last[3][2] == rs[1]):
            last[2], last[3] = (rd[0], last[2][1], last[2][2] + rd[2]), (rs[0], last[3][1], last[3][2] + rs[2])
            last[0], last[1] = _flat_region(last[0], last[2]), _flat_region(last[1], last[3])
        else: merged.append([d, s, rd[:3], rs[:3], ok])
    return [m[0] for m in merged], [m[1] for m in merged]

def _flat_region(t:Tensor, region:tuple) -> Tensor:
    "The 1-d tensor over `region` (`(storage, first, count)`) of `t`'s storage."
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), region[1], (region[2],))

def _lift_chunks(items:list, limit:int) -> list:
    """`items` (`(param, group, sources)` in the optimizer's order) cut into consecutive chunks of one device whose
    masters hold at most `limit` elements together (a bigger master is a chunk of its own)."""
    chunks, cur, n = [], [], 0
    for it in items:
        k = it[0].numel() if it[2] is not None else 0
        if cur and (n + k > limit or it[0].device != cur[0][0].device): chunks.append(cur); cur, n = [], 0
        cur.append(it); n += k
    return chunks + ([cur] if cur else [])

class FP32Masters(WeightStore):
    """FP32 master weights stepped by the optimizer (Micikevicius et al. 2018). The model's params and grads become views
    into one flat buffer per (device, dtype) run of the masters, so that master->model, the overflow check and zeroing
    are one vectorised op per buffer. The masters get FP32 grads only while the optimizer steps them, a chunk of at most
    `lift_chunk` elements at a time: copied from the 16-bit grads, unscaled and clipped there (memory at the step's
    peak: 2 bytes/param of 16-bit weights, 2 of 16-bit grads, 4 of masters, the optimizer's state, and one chunk).
    Two kinds: `FlatMasters` (one flat FP32 master per group) and `ParamMasters` (one FP32 master per param, viewing one
    FP32 buffer per device; the optimizer steps per-param masters).
    A fastai `Optimizer` is stepped once, its loop run a chunk at a time; a torch optimizer (`OptimWrapper`) once per
    chunk, only that chunk's masters having grads (torch skips the others); a fused one that takes `grad_scale` (torch's
    `fused=True` Adam/AdamW/SGD) unscales inside its kernel, as under torch's `GradScaler`."""
    def __init__(self, opt,
        fp32_of=None, # `param -> exact FP32 value` (from `ModelToHalf`); masters are made from these tensors
        names:dict=None, # `{id(param): name}` for error messages
        model=None, # the model (sparse grads)
        in_backward:bool=False, # step each param in the backward (`arm_in_backward`): no 16-bit grad buffer
    ):
        super().__init__(opt, names, model)
        self._with_grads = not in_backward
        self.model_pgs, self.master_pgs = get_master(self.core, self.flat, fp32_of=fp32_of)
        self.master_params = [m for mg in self.master_pgs for m in mg]
        for m in self.master_params: m.grad = None  # FP32 grads exist only for the chunk being stepped
        self.runs = self._make_runs()
        self.models, self.masters, _ = _pairs(self.model_pgs, self.master_pgs, self.flat, with_grads=False)
        self.opt_pgs = [list(mg) + own for mg, own in zip(self.master_pgs, self.own_pgs)]  # what the optimizer steps
        move_opt_state(opt, self.model_pgs, self.master_pgs, 'merge' if self.flat else None, self.opt_pgs)
        self._bufs, self._masters = [r.buf for r in self.runs], [r.master for r in self.runs]
        self._grads = [r.grad for r in self.runs if r.grad is not None]  # none when stepping in the backward
        own, self._plans, self._lifting = {id(p) for p in self.own_params}, {}, {}  # plans kept; those of this step
        sources = self._sources()
        self._chunks = _lift_chunks([(p, gi, None if id(p) in own else sources[id(p)])
                                     for gi, pg in enumerate(self.opt_pgs) for p in pg], self.lift_chunk)
        self._master_of = {id(p): (m, gi) for gi, (pg, mg) in enumerate(zip(self.model_pgs, self.master_pgs)) for p, m in zip(pg, mg)}
        self._master_of.update({id(p): (p, gi) for gi, pg in enumerate(self.own_pgs) for p in pg})
        if in_backward: self.arm_in_backward()

    # -- the interface
    def _grads_to_check(self) -> list:
        if not self.runs and not self.own_params: return []
        for r in self.runs: r.reattach_grads()
        return self._grads + self.own_grads()

    def _step_impl(self, *args, **kwargs):
        out = self._through_core(self._step_chunks, *args, **kwargs)
        self.master_to_model()
        return out

    def _step_chunks(self, step, *args, **kwargs):
        "The innermost optimizer's step (`step`), on the masters with FP32 grads, a chunk at a time."
        if _steps_param_by_param(self.core):  # fastai's loop, run here chunk by chunk (once per param)
            hypers = self.core.hypers
            for chunk in self._chunks:
                for p, gi in self._lift(chunk): _fastai_update(self.core, p, hypers[gi])
                self._drop(chunk)
            return None
        chunks = self._chunks if isinstance(self.core, OptimWrapper) else [[it for c in self._chunks for it in c]]
        inner = getattr(self.core, 'opt', None)
        fused = self._fused_scale(inner)
        own, out = {p: p.grad for p in self.own_params}, None  # torch steps every param with a grad: each in one chunk
        for p in own: p.grad = None
        try:
            for chunk in chunks:
                self._lift(chunk, own, unscale=fused is None)
                if fused is not None: inner.grad_scale, inner.found_inf = fused
                try: out = step(*args, **kwargs)
                finally:
                    if fused is not None: del inner.grad_scale, inner.found_inf
                self._drop(chunk)
        finally:
            for p, g in own.items(): p.grad = g
        return out

    def _fused_scale(self, inner):
        """`(grad_scale, found_inf)` for a torch optimizer whose kernel unscales (`_step_supports_amp_scaling`: torch's
        fused Adam/AdamW/SGD), so the grads are only copied to FP32: one pass less. None where one factor cannot serve
        every group (per-group clipping of several groups), or the optimizer cannot."""
        if inner is None or not getattr(inner, '_step_supports_amp_scaling', False) or not self._masters: return None
        coefs = list({id(c): c for c in self.coefs.values()}.values())
        if len(coefs) > 1 or (coefs and len(self.coefs) < len(self.opt_pgs)): return None
        dev = self._masters[0].device
        scale = torch.full((), self.scale, dtype=torch.float32, device=dev)
        return (scale / coefs[0] if coefs else scale), torch.zeros((), dtype=torch.float32, device=dev)

    def _lift(self, chunk:list, own:dict=None, unscale:bool=True) -> list:
        """Give the masters of `chunk` FP32 grads: one scratch buffer, the 16-bit grads copied in (one fused copy),
        unscaled and clipped (one fused multiply per group); own params' grads unscaled in place (`own`: their grads, set
        aside). Returns `[(param, group)]` of those with a grad, in order."""
        live, by_group = [], {}
        plan = self._lifting[id(chunk)] = self._plan(chunk)
        if plan is not None: by_group = {gi: list(vs) for gi, vs in plan.lift().items()}
        for p, gi, sources in chunk:
            if sources is not None:
                if p.grad is not None: live.append((p, gi))
                continue
            if own is not None: p.grad = own.get(p)
            if p.grad is None: continue
            by_group.setdefault(gi, []).append(p.grad); live.append((p, gi))
        if unscale:
            for gi, ts in by_group.items():
                f = self._factor(gi)
                if f is not None: torch._foreach_mul_(ts, f)
        return live

    def _step_one(self, p):
        "In the backward: `p`'s master gets its grad in FP32, fastai's optimizer steps it, `p` follows (rounded once)."
        m, gi = self._master_of[id(p)]
        if m is not p: m.grad = p.grad.float()
        _fastai_update(self.core, m, self.core.hypers[gi])
        if m is not p:
            m.grad = None
            p.detach().copy_(m)

    def _plan(self, chunk:list):
        """The chunk's `_LiftPlan`: made once and kept while its sources' grads are the same tensors; when a master's
        param has no grad this step (no backward reached it), a plan of the others for this step only (None: no master
        has a grad)."""
        plan = self._plans.get(id(chunk))
        if plan is not None and plan.valid(): return plan
        plan = self._plans[id(chunk)] = _LiftPlan.make(chunk)
        if plan is not None: return plan
        return _LiftPlan.make([it for it in chunk if it[2] is not None and all(o.grad is not None for o, _ in it[2])])

    def _drop(self, chunk:list):
        "The chunk was stepped: its masters' FP32 grads go (the next chunk reuses the memory)."
        plan = self._lifting.pop(id(chunk), None)
        if plan is not None: plan.free()
        for p, _, sources in chunk:
            if sources is not None: p.grad = None

    def zero_model_grads(self, reattach:bool=True):
        "Zero the model's 16-bit grads (grads someone replaced go back into the flat buffers first, unless just done)."
        if reattach:
            for r in self.runs: r.reattach_grads()
        if self._grads: torch._foreach_zero_(self._grads)
        for g in self.own_grads(): g.zero_()

    def check_linked(self):
        "Each run's first param still views the run's buffer (a `.to()` or `.float()` replaces every param's tensor)."
        for r in self.runs:
            if r.linked(): continue
            p = r.params[0]
            _check_same_kind(p, r.buf, 'the FP32 masters', self.names.get(id(p), tuple(p.shape)))
            r.relink()

    def fp32_views(self) -> dict: return dict(zip(self.models, self.masters))
    def _shared(self) -> list: return self._masters + [p.data for p in self.own_params]

    def _grads_by_param(self) -> tuple:
        "The model's grads (16-bit, loss-scaled, before any clearing), one per param; own params' grads."
        pairs = [(p, p.grad) for p in self.models] + [(p, p.grad) for p in self.own_params]
        return [p for p, _ in pairs], [g for _, g in pairs]
    def _after_broadcast(self): self.master_to_model()

    @contextmanager
    def opt_view(self):
        self._point_opt(to_model=True)
        try: yield self.opt
        finally: self._point_opt(to_model=False)

    def _point_opt(self, to_model:bool):
        "Move the optimizer (params, state, Lookahead's slow weights) between the masters and the model's params."
        if to_model: move_opt_state(self.opt, self.master_pgs, self.model_pgs, 'split' if self.flat else None, self.old_param_lists)
        else: move_opt_state(self.opt, self.model_pgs, self.master_pgs, 'merge' if self.flat else None, self.opt_pgs)

    def restore(self):
        for r in self.runs: r.release()
        super().restore()
        self._point_opt(to_model=True)

    # -- helpers
    def master_to_model(self):
        "Copy the master weights into the model params (rounding to 16-bit once), one fused pass."
        if self.runs: torch._foreach_copy_(self._bufs, self._masters)

    def buffers(self) -> list:
        "The flat buffers behind the model's 16-bit params and grads and the FP32 masters (memory accounting)."
        return self._bufs + self._grads + self._masters

    @property
    def model_grads(self) -> list: return self._grads

    def _make_runs(self) -> list: raise NotImplementedError
    def _sources(self) -> dict:
        "`{id(master): [(object whose .grad feeds it, offset in the master)]}`."
        raise NotImplementedError

class FlatMasters(FP32Masters):
    "One flat FP32 master per param group (per run of params with equal optimizer flags): the optimizer steps few tensors."
    flat = True
    def _make_runs(self): return _flat_runs(self.model_pgs, self.master_pgs)
    def _sources(self) -> dict:
        "A flat master is fed by the grad buffers of its runs (a param without grad reads as zeros: flat semantics)."
        res, runs = {}, iter(self.runs)
        for m in self.master_params:
            n, src = 0, []
            while n < m.numel():
                r = next(runs); src.append((r, n)); n += r.buf.numel()
            res[id(m)] = src
        return res

class ParamMasters(FP32Masters):
    "One FP32 master per param (per-param optimizer state and steps), their data in one buffer per device."
    def _make_runs(self): return _storage_runs([p for pg in self.model_pgs for p in pg], self.master_params, self._with_grads)
    def _sources(self) -> dict:
        "Each master is fed by its param's grad (a param without grad leaves its master without one, as in FP32)."
        return {id(m): [(p, 0)] for p, m in zip((p for pg in self.model_pgs for p in pg), self.master_params)}

def MasterWeights(opt, flat:bool=False, **kwargs) -> FP32Masters:
    "FP32 masters for `opt`: `FlatMasters` when `flat`, else `ParamMasters` (kwargs: `fp32_of`, `names`, `model`, `in_backward`)."
    if flat and kwargs.get('in_backward'):
        raise ValueError("step_in_backward steps each param on its own: flat masters step a whole param group at once "
                         "(use flat_master=False)")
    return (FlatMasters if flat else ParamMasters)(opt, **kwargs)

# ---- 16-bit storage
def round_stochastic(x:Tensor, dtype:torch.dtype, generator=None) -> Tensor:
    """`x` (FP32) rounded to `dtype`, up or down at random with the probabilities that make the result exact on
    average: E[round(x)] = x, so updates smaller than half a 16-bit spacing still move the weights in expectation."""
    y = x.to(dtype)  # nearest
    d = x - y.float()  # exact: y is one of the two neighbours of x
    other = torch.nextafter(y, torch.where(d > 0, torch.inf, -torch.inf).to(dtype))  # the neighbour on x's other side
    gap = other.float() - y.float()
    prob = torch.where(d != 0, d / gap, torch.zeros_like(d)).nan_to_num_(0.)  # in [0, 1/2]
    u = torch.rand(x.shape, generator=generator, device=x.device)
    return torch.where(u < prob, other, y)

def round_to(x:Tensor, dtype:torch.dtype, stochastic:bool=False, generator=None) -> Tensor:
    "`x` in `dtype`: to nearest (even), or stochastically."
    return round_stochastic(x, dtype, generator) if stochastic and dtype != x.dtype else x.to(dtype)

class HalfStorage(WeightStore):
    """FP16 master-weight storage (NVIDIA's "Training with mixed precision" NVCaffe slides, 2017): one 16-bit copy of
    the weights and no FP32 masters. Each param is lifted to FP32 as the optimizer reaches it (weights, and grads
    unscaled there, never in 16-bit), stepped by the optimizer's own code with FP32 state, and rounded back (to nearest,
    or stochastically: updates under half a 16-bit spacing then still move the weights on average). A fastai
    `Optimizer` is stepped once, one param lifted at a time; a torch optimizer (`OptimWrapper`) is stepped once per
    chunk of at most `lift_chunk` elements, that chunk's params lifted (their state moved to the FP32 copies and back).
    Params that are not 16-bit (BatchNorm's FP32, float64, complex) are stepped in their own dtype."""
    def __init__(self, opt,
        stochastic:bool=True, # round the stored weights stochastically (False: to nearest even)
        generator=None, # a `torch.Generator` of its own for the stochastic rounding (not the global RNG)
        names:dict=None, model=None,
        in_backward:bool=False, # step each param in the backward (`arm_in_backward`)
    ):
        super().__init__(opt, names, model)
        self.stochastic, self.generator = stochastic, generator
        self.params = [p for pg in self.model_pgs + self.own_pgs for p in pg]
        self._group_of = {id(p): gi for gi, (a, b) in enumerate(zip(self.model_pgs, self.own_pgs)) for p in a + b}
        self._dtypes = {id(p): p.dtype for p in self.params}
        if in_backward: self.arm_in_backward()

    def _step_one(self, p):
        "In the backward: `p` lifted to FP32 with its grad, stepped by fastai's optimizer (state keyed by `p`), stored back."
        q = self._lift(p)
        _fastai_update(self.core, q, self.core.hypers[self._group_of[id(p)]], key=p)
        self._store(p, q)

    def grads(self) -> list: return [p.grad for p in self.params if p.grad is not None]
    def _grads_to_check(self) -> list: return self.grads()
    def _grads_by_param(self) -> tuple: return self.params, [p.grad for p in self.params]

    def _lift(self, p):
        """What the optimizer steps for `p`: a 16-bit param's FP32 copy with its grad unscaled in FP32 (the param itself is
        never touched: DDP's hooks, and autograd's, stay on it); another dtype's param itself, its grad unscaled in place."""
        f = self._factor(self._group_of.get(id(p), 0))
        if p.dtype not in (torch.float16, torch.bfloat16):
            if f is not None: p.grad.mul_(f)
            return p
        q = p.detach().float()
        q.grad = p.grad.float() if f is None else p.grad.float().mul_(f)
        return q

    def _store(self, p, q):
        "`p`'s stepped FP32 value `q` back into its 16-bit storage, rounded once (to nearest, or stochastically)."
        if q is p: return
        with torch.no_grad(): p.copy_(round_to(q, p.dtype, self.stochastic, self.generator))

    def _step_impl(self, *args, **kwargs):
        return self._through_core(self._step_torch if isinstance(self.core, OptimWrapper) else self._lifted_loop, *args, **kwargs)

    def _lifted_loop(self, step, *args, **kwargs):
        "fastai's `Optimizer.step` loop, on one lifted param at a time (the state stays keyed by the model's param)."
        core = self.core
        for p, pg, state, hyper in core.all_params(with_grad=True):
            q = self._lift(p)
            _fastai_update(core, q, hyper, key=p)
            self._store(p, q)

    def _step_torch(self, step, *args, **kwargs):
        """A torch optimizer (`OptimWrapper`): stepped once per chunk of params, those lifted and their state moved to
        the lifted copies and back; the other params' grads are set aside meanwhile (torch skips params without one)."""
        groups, state = self.core.opt.param_groups, self.core.opt.state
        with_grad = [(p, (gi, i), True) for gi, g in enumerate(groups) for i, p in enumerate(g['params']) if p.grad is not None]
        grads, out = {p: p.grad for p, _, _ in with_grad}, None
        for p in grads: p.grad = None
        try:
            for chunk in _lift_chunks(with_grad, self.lift_chunk):
                lifted = []
                for p, (gi, i), _ in chunk:
                    p.grad = grads[p]
                    q = self._lift(p)
                    groups[gi]['params'][i] = q
                    if q is not p:
                        p.grad = None
                        if p in state: state[q] = state.pop(p)
                    lifted.append((gi, i, p, q))
                try: out = step(*args, **kwargs)
                finally:
                    for gi, i, p, q in lifted:
                        groups[gi]['params'][i] = p
                        if q is not p:
                            if q in state: state[p] = state.pop(q)
                            self._store(p, q)
                        p.grad = None
        finally:
            for p, g in grads.items(): p.grad = g
        return out

    def zero_model_grads(self):
        gs = self.grads()
        if gs: torch._foreach_zero_(gs)

    def check_linked(self):
        "The optimizer steps the model's own params: only a change of their dtype (`.float()`) would go unnoticed."
        for p in self.params[:1] + self.params[-1:]:
            if p.dtype != self._dtypes[id(p)]:
                raise RuntimeError(f"mixed precision (half_storage): the model's parameter {self.names.get(id(p), tuple(p.shape))} "
                                   f"changed dtype during the fit ({self._dtypes[id(p)]} -> {p.dtype}): something after the setup "
                                   f"converted the model. Convert it before `learn.to_fp16()`/`to_bf16()`, or after the fit.")
