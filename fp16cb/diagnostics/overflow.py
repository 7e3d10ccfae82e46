"""Where an overflow starts, and what to do about it. A batch is run again on copies of the model (the live model, its
BatchNorm statistics and the RNG are left as they were) with hooks on every module: the first module, in forward order,
whose output holds inf/NaN while its inputs are finite; or, when the forward is finite, the modules where the gradient
turns inf/NaN (finite at their output, not at their input or in their own parameters' gradients), not the modules that
only inherit it. The remedy, modules to keep FP32 (each the smallest module around the overflow whose FP32 output is in
the 16-bit range again), is checked on that batch. Used on the failing step of a collapsed loss scale
(`MixedPrecision`, `NativeMixedPrecision`, imported there and then) and by `learn.precision_check`; never on a clean
step."""
from __future__ import annotations
import copy, math, random, re, warnings
from contextlib import contextmanager, nullcontext
from typing import NamedTuple
import numpy as np
import torch
from torch import nn, Tensor

from ..dtypes import has_fast_half_math, model_device, user_stacklevel, bare_copy, _HALF
from ..callbacks.casts import cast_floats, to_half
from ..policy import PrecisionPolicy, is_compiled, uncompiled, CATEGORIES
from ..scaling import LossScaleError
from ..distributed import is_ddp, syncs

__all__ = ['INPUTS', 'LOSS', 'MODEL', 'unwrap', 'bare_copy', 'rng_state', 'same_rng', 'Precision', 'Run', 'run_batch',
           'Remedy', 'find_remedy', 'where_text', 'remedy_text', 'Diagnosis', 'diagnose_collapse', 'shown']

INPUTS, LOSS, MODEL = '(inputs)', '(loss)', '(model)'  # where an inf/NaN can start besides a module ('' is the model)

def shown(name:str) -> str:
    "A module's name as messages show it: quoted; the model itself is '(model)'."
    return MODEL if name == '' else name if name in (INPUTS, LOSS) else repr(name)

def unwrap(model:nn.Module) -> nn.Module:
    "The module a DDP wrapper or `torch.compile` wraps (the copies run eagerly, named as the original model)."
    while is_ddp(model) or is_compiled(model): model = model.module if is_ddp(model) else uncompiled(model)
    return model

# ---- copies of the model, the RNG
def rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda

def _set_rng_state(s:tuple):
    torch.set_rng_state(s[0])
    if s[1] is not None: torch.cuda.set_rng_state_all(s[1])

@contextmanager
def same_rng(dl=None):
    """Within: draw at will; after, torch's (CPU and CUDA), Python's and numpy's RNG are as before, and so is `dl` (a
    fastai `DataLoader` that was iterated: its own RNG and state)."""
    state, py, npy = rng_state(), random.getstate(), np.random.get_state()
    dl_state = ((dict(dl.__dict__), dl.rng, dl.rng.getstate()) if isinstance(getattr(dl, 'rng', None), random.Random)
                else None)
    try: yield
    finally:
        _set_rng_state(state); random.setstate(py); np.random.set_state(npy)
        if dl_state is not None:
            d, rng, st = dl_state
            dl.__dict__.clear(); dl.__dict__.update(d); rng.setstate(st)

# ---- how a copy runs in the precision under test
class Precision(NamedTuple):
    "How a copy of the FP32 model runs a batch in 16-bit: converted by `policy` (ours: `ModelToHalf`), or autocast."
    dtype: torch.dtype = torch.float16
    policy: PrecisionPolicy|None = None  # None (and not autocast): the model as it is (no `ModelToHalf`)
    autocast: bool = False

    @property
    def label(self) -> str: return str(self.dtype).replace('torch.', '') + (' autocast' if self.autocast else '')

    @property
    def ours(self) -> Precision:
        "The precision a `keep_fp32` remedy is checked in: this one, or ours in its dtype (autocast has no keep_fp32)."
        return self if self.policy is not None and not self.autocast else Precision(self.dtype, PrecisionPolicy())

    def make(self, m32:nn.Module, keep=()) -> tuple:
        "A copy of `m32` as this precision runs it, `keep` FP32 besides the policy's: `(model, names of FP32 modules)`."
        m = bare_copy(m32)
        if self.policy is None or self.autocast: return m, set()
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')  # the policy's own warnings were given at the set-up
            res = to_half(m, self.dtype, self.policy.adding(keep))
        return m, {res.names[k] for k in res.kept if k in res.names}

    def context(self, device):
        return torch.autocast(torch.device(device).type, dtype=self.dtype) if self.autocast else nullcontext()

    def call(self, keep:list) -> str:
        "The call that trains with the modules `keep` FP32 (the user's other name specs kept)."
        pol = self.ours.policy
        # a module named 'norm' is not the category
        named = ['re:' + re.escape(k) if k in CATEGORIES else k for k in keep]
        specs = [s for s in pol.user_specs() if isinstance(s, str)] + [k for k in named if k not in pol.specs]
        meth = 'to_bf16' if self.dtype == torch.bfloat16 else 'to_fp16'
        more = ' with your other keep_fp32 specs' if any(not isinstance(s, str) for s in pol.user_specs()) else ''
        return f"learn.{meth}(keep_fp32={specs!r}){more}"

# ---- one batch, traced
def _tensors(b) -> list:
    "The floating tensors of `b` (tensors, lists, tuples, dicts)."
    if isinstance(b, Tensor): return [b] if torch.is_floating_point(b) else []
    if isinstance(b, dict): return [t for v in b.values() for t in _tensors(v)]
    if isinstance(b, (list, tuple)): return [t for v in b for t in _tensors(v)]
    return []

def _viewed(b):
    "`b` with each floating tensor that requires grad replaced by a view of it (a module's own handle on its inputs)."
    if isinstance(b, Tensor): return b.view_as(b) if b.requires_grad and torch.is_floating_point(b) else b
    if isinstance(b, dict): return type(b)({k: _viewed(v) for k, v in b.items()})
    if isinstance(b, tuple) and hasattr(b, '_fields'): return type(b)(*(_viewed(v) for v in b))
    if isinstance(b, (list, tuple)): return type(b)(_viewed(v) for v in b)
    return b

def _finite(ts:list):
    "Whether every tensor of `ts` is finite: a bool tensor on the device (None: no tensor)."
    ts = [t for t in ts if t is not None]
    if not ts: return None
    return torch.stack([torch.isfinite(t.detach()).all().to(ts[0].device) for t in ts]).all()

def _amax(ts:list):
    "Largest |value| over `ts` (inf when one holds inf/NaN) as an FP32 0-dim tensor (None: nothing)."
    ts = [t.detach() for t in ts if t.numel()]
    if not ts: return None
    m = torch.stack([t.abs().amax().float().to(ts[0].device) for t in ts]).amax()
    return torch.where(torch.isnan(m), torch.full_like(m, math.inf), m)

def _flat(ts:list) -> Tensor: return torch.cat([t.detach().reshape(-1).float() for t in ts])

def _read(vals:list) -> list:
    "Device scalars of one dtype (or None) as Python values (bool, float), one host read."
    idx = [i for i, v in enumerate(vals) if v is not None]
    res = [None] * len(vals)
    if idx:
        dev = vals[idx[0]].device
        for i, v in zip(idx, torch.stack([vals[i].to(dev) for i in idx]).tolist()): res[i] = v
    return res

class Run:
    """What one forward (and backward) of a batch showed. `kind`: where the first inf/NaN is, 'inputs', 'forward',
    'loss', 'gradient' or None (none); `origins`: the module names (or `INPUTS`/`LOSS`) where it starts."""
    def __init__(self):
        self.kind, self.origins, self.loss, self.grads_finite = None, [], math.nan, True
        self.out_max, self.types, self.rel_diff, self.outputs, self.grads = {}, {}, {}, {}, {}
        self.out_grads = {}  # with `keep_outputs`: each module's output gradient (flat, FP32, unscaled)

    origin = property(lambda self: self.origins[0] if self.origins else None, doc="The first of `origins`.")
    @property
    def overflowed(self) -> bool: return self.kind is not None or not self.grads_finite

class _Tracer:
    "Forward hooks on every module of a model: per call, its inputs' and output's finiteness, |output|, the tensors."
    def __init__(self, model:nn.Module, grads:bool, ref:dict|None, keep_outputs:bool):
        self.model, self.grads, self.ref, self.keep = model, grads, ref, keep_outputs
        self.names = {id(m): n for n, m in model.named_modules()}
        self.calls, self.events, self.stack, self.handles = [], [], [], []
        self.outputs, self.rel = {}, {}

    def __enter__(self):
        for m in self.model.modules():  # around ours: an island's casts are part of what the module gets and gives
            self.handles.append(m.register_forward_pre_hook(self.pre, with_kwargs=True, prepend=True))
            self.handles.append(m.register_forward_hook(self.post))
        return self

    def __exit__(self, *exc):
        for h in self.handles: h.remove()
        self.handles = []

    def pre(self, m, args, kwargs):
        if self.grads: args, kwargs = _viewed(args), _viewed(kwargs)
        ts = _tensors((args, kwargs))
        self.calls.append(dict(name=self.names.get(id(m), '?'), type=type(m).__name__, in_fin=_finite(ts),
                               parent=self.stack[-1] if self.stack else None, ins=[t for t in ts if t.requires_grad]))
        self.events.append(('pre', len(self.calls) - 1)); self.stack.append(len(self.calls) - 1)
        return (args, kwargs) if self.grads else None

    def post(self, m, args, out):
        i = self.stack.pop()
        c, ts = self.calls[i], _tensors(out)
        c.update(out_fin=_finite(ts), out_max=_amax(ts), outs=[t for t in ts if t.requires_grad])
        self.events.append(('post', i))
        name = c['name']
        if ts and self.keep and name not in self.outputs: self.outputs[name] = _flat(ts)
        if ts and self.ref is not None and name not in self.rel and name in self.ref:
            y, r = _flat(ts), self.ref[name]
            if y.shape == r.shape: self.rel[name] = (y - r).norm() / r.norm().clamp_min(1e-30)

    def resolve(self, run:Run):
        "Read the device flags (one host read each) into `run`: types, |output| per module, the forward's origin."
        cs = self.calls
        for c, v in zip(cs, _read([c['in_fin'] for c in cs])): c['in_fin'] = v
        for c, v in zip(cs, _read([c.get('out_fin') for c in cs])): c['out_fin'] = v
        for c, v in zip(cs, _read([c.get('out_max') for c in cs])):
            if v is not None: run.out_max[c['name']] = max(run.out_max.get(c['name'], 0.), v)
        for c in cs: run.types.setdefault(c['name'], c['type'])
        rel = list(self.rel.items())
        run.rel_diff = dict(zip([k for k, _ in rel], _read([v for _, v in rel])))
        run.outputs = self.outputs
        for kind, i in self.events:
            c = cs[i]
            if kind == 'pre' and c['in_fin'] is False:  # made inside the module running it (or the data's)
                run.kind, run.origins = (('inputs', [INPUTS]) if c['parent'] is None else
                                         ('forward', [cs[c['parent']]['name']]))
                return
            if kind == 'post' and c['out_fin'] is False and c['in_fin'] is not False:
                run.kind, run.origins = 'forward', [c['name']]
                return

    def grad_origins(self, gmap:dict, own_bad:set) -> list:
        """The modules where the gradient turns inf/NaN: finite at their output, not at their input or in their own
        params' grads (the innermost such modules, in backward order); `LOSS` if it already is at the model's output."""
        def fin(ts): return _finite([gmap.get(id(t)) for t in ts])
        cs = self.calls
        outs, ins = _read([fin(c['outs']) for c in cs]), _read([fin(c['ins']) for c in cs])
        post_at = {i: k for k, (kind, i) in enumerate(self.events) if kind == 'post'}
        found = {}
        for i, c in enumerate(cs):
            if outs[i] is False: continue  # inherited
            if ins[i] is False or c['name'] in own_bad: found.setdefault(c['name'], post_at.get(i, 0))
        names = [n for n in found if not any(o != n and _inside(o, n) for o in found)]
        res = sorted(names, key=lambda n: -found[n])
        root = [i for i, c in enumerate(cs) if c['parent'] is None]
        if not res and any(outs[i] is False for i in root): res = [LOSS]
        return res

def _inside(a:str, b:str) -> bool:
    "Whether module `a` is `b` or inside it ('' is the model)."
    return a == b or b == '' or a.startswith(b + '.')

def _scalar(loss:Tensor) -> Tensor: return loss if loss.dim() == 0 else loss.float().mean()

def run_batch(
    model:nn.Module, # a copy to run (hooks are added and removed)
    xb:tuple, yb:tuple, # the batch
    loss_func=None, # None: the forward only
    scale:float=1., # the loss scale of the backward
    ctx=None, # the context of the forward and the loss (autocast)
    grads:bool=True, # run the backward too (when the forward and the loss are finite)
    ref:dict|None=None, # `{module: FP32 output}` to compare each module's output with (`rel_diff`)
    keep_outputs:bool=False, # keep each module's output and its gradient (flat, FP32) in `outputs`, `out_grads`
    rng:tuple|None=None, # torch's RNG state to start from (the same dropout in two runs)
) -> Run:
    "Run `model` on the batch with hooks on every module: where the first inf/NaN appears, and what each module gave."
    run, tracer = Run(), _Tracer(model, grads, ref, keep_outputs)
    if rng is not None: _set_rng_state(rng)
    with torch.set_grad_enabled(grads), tracer, (ctx or nullcontext()):
        pred = model(*xb)
        loss = _scalar(loss_func(cast_floats(pred, torch.float32), *yb)) if loss_func is not None else None
    tracer.resolve(run)
    if loss is None: return run
    run.loss = float(loss.detach().float())
    if run.kind is None and not math.isfinite(run.loss): run.kind, run.origins = 'loss', [LOSS]
    if run.kind is not None or not grads or not loss.requires_grad: return run
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    extra = list({id(t): t for c in tracer.calls for t in c['ins'] + c.get('outs', [])}.values())
    gs = torch.autograd.grad(loss * scale, [p for _, p in params] + extra, allow_unused=True)
    run.grads = {n: None if g is None else g.float() / scale for (n, _), g in zip(params, gs)}
    gmap = {id(t): g for t, g in zip(extra, gs[len(params):])}
    if keep_outputs:
        for c in tracer.calls:
            gs_out = [gmap[id(t)] for t in c.get('outs', []) if gmap.get(id(t)) is not None]
            if gs_out and c['name'] not in run.out_grads: run.out_grads[c['name']] = _flat(gs_out) / scale
    bad = _read([_finite([g]) for g in run.grads.values()])
    own_bad = {n.rpartition('.')[0] for n, b in zip(run.grads, bad) if b is False}
    run.grads_finite = not own_bad
    if own_bad or any(v is False for v in _read([_finite([g]) for g in gmap.values()])):
        run.origins = tracer.grad_origins(gmap, own_bad)
        run.kind = 'gradient'
    return run

# ---- the remedy: modules to keep FP32, checked on the batch
class Remedy(NamedTuple):
    keep: list  # modules to keep FP32 besides the policy's
    checked: bool  # the batch runs without inf/NaN with them FP32
    fp32_max: dict  # each module's largest |output| in FP32

def _in_range(name:str, fp32_max:dict, limit:float) -> str|None:
    "The smallest module around `name` (itself first, not the whole model) whose FP32 output fits in the 16-bit range."
    parts = name.split('.')
    for k in range(len(parts), 0, -1):
        a = '.'.join(parts[:k])
        v = fp32_max.get(a)
        if v is not None and math.isfinite(v) and v <= limit: return a
    return None

def _merged(keep:list, new:list) -> list:
    "`keep` and `new`, a module inside another one of them dropped."
    res = [k for k in keep if not any(_inside(k, n) for n in new)]
    return res + [n for n in new if not any(_inside(n, k) for k in res)]

def find_remedy(m32:nn.Module, prec:Precision, batch:tuple, scale:float, rounds:int=4, rng=None) -> Remedy:
    """Modules to keep FP32 so that `batch` (`xb, yb, loss_func`) runs without inf/NaN in `prec` (autocast: in ours):
    the smallest module around each overflow whose FP32 output is in range again, or where the gradient turns inf/NaN;
    run again with them kept until the batch is clean (at most `rounds` times)."""
    prec, (xb, yb, loss_func) = prec.ours, batch
    with torch.no_grad(): fp32_max = run_batch(m32, xb, yb, None, grads=False, rng=rng).out_max
    limit, keep = torch.finfo(prec.dtype).max, []
    for _ in range(rounds):
        m16, kept = prec.make(m32, keep)
        run = run_batch(m16, xb, yb, loss_func, scale, rng=rng)
        if not run.overflowed: return Remedy(keep, True, fp32_max)
        new = ([_in_range(run.origin, fp32_max, limit)] if run.kind == 'forward' else
               run.origins if run.kind == 'gradient' else [])
        new = [n for n in new if n and n not in (INPUTS, LOSS) and n not in kept]
        if not new: break
        keep = _merged(keep, new)
    return Remedy(keep, False, fp32_max)

# ---- the collapse of the loss scale
def _fmt(x:float) -> str: return f"{x:.3g}" if math.isfinite(x) else 'inf/NaN'

def where_text(run:Run, prec:Precision, scale:float, fp32_max:dict, params:list) -> str:
    "Where the inf/NaN of `run` starts, in words."
    at = f"(this batch run again on a copy of the model, in {prec.label} at loss scale {scale:g})"
    if run.kind == 'inputs':
        return (f"Where it starts {at}: the batch's inputs (`learn.xb`) hold inf/NaN: check the data (fastai's "
                "`FillMissing`, or drop those rows).")
    if run.kind == 'loss':
        return (f"Where it starts {at}: the model's output is finite but the loss (or its gradient) is inf/NaN: "
                "check the targets (`learn.yb`) and the loss function.")
    if run.kind == 'forward':
        o = run.origin
        big = fp32_max.get(o)
        fp32 = (f"; in FP32 it reaches {_fmt(big)}, {prec.label.split()[0]}'s largest is "
                f"{torch.finfo(prec.dtype).max:g}" if big is not None else '')
        return (f"Where it starts {at}: the output of {shown(o)} ({run.types.get(o, '?')}) holds inf/NaN in the "
                f"forward pass, its inputs finite{fp32}; the modules after it only inherit it.")
    if run.kind == 'gradient' and run.origins:
        mods = ', '.join(f"{shown(o)} ({run.types.get(o, '?')})" if o != LOSS else LOSS for o in run.origins)
        return (f"Where it starts {at}: the forward pass is finite; the gradient turns inf/NaN first in {mods}: "
                f"finite at the output, inf/NaN at the input or in the module's own parameters' gradients; the modules "
                f"before it only inherit it.")
    seen = (f" The parameters whose gradients held inf/NaN at the last skipped step: {', '.join(params)}." if params
            else '')
    return (f"Where it starts {at}: nowhere: this batch runs without inf/NaN on a copy of the model, so the inf/NaN "
            f"came from outside its forward and backward (a callback changing the loss or the gradients?).{seen}")

def remedy_text(rem:Remedy|None, prec:Precision, device, ours:bool) -> str:
    "What to do: keep the modules of `rem` FP32 (and how), or bf16 where this device has it, or FP32."
    alts = []
    if rem is not None and rem.keep:
        how = "checked on this batch: no inf/NaN left" if rem.checked else "not enough on this batch by itself"
        alts.append(f"`{prec.call(rem.keep)}` ({how})")
    if prec.dtype == torch.float16 and has_fast_half_math(torch.bfloat16, device):
        alts.append(f"`learn.to_bf16()` (bfloat16 has FP32's range; native on this {torch.device(device).type})")
    if not alts: alts.append("training in FP32 (`learn.to_fp32()`)")
    tail = (" `learn.to_fp16(on_collapse='keep_fp32')` (`MixedPrecision(on_collapse='keep_fp32')`) applies such a "
            "remedy during the fit." if ours and rem is not None and rem.keep and rem.checked else '')
    return "Remedy: " + ', or '.join(alts) + '.' + tail

class Diagnosis(NamedTuple):
    "What a collapse of the loss scale showed: the error to raise, and the modules to keep FP32 (checked on the batch)."
    error: Exception  # the original error, its message followed by where the overflow starts and the remedy
    keep: list
    applicable: bool  # `on_collapse='keep_fp32'` may apply `keep`
    where: str

    def warn(self):
        warnings.warn(f"fp16cb: the loss scale collapsed. {self.where} on_collapse='keep_fp32': {self.keep} are kept "
                      f"FP32 from now on (checked on the failing batch) and training goes on.", RuntimeWarning,
                      stacklevel=user_stacklevel())

def diagnose_collapse(
    learn, # the learner, in the failing step: `learn.xb`, `learn.yb` are its batch
    prec:Precision, # the precision the fit runs in
    scale:float, # the loss scale of the failing step
    err:LossScaleError, # the error of the scaler
    log=None, # the callback's `OverflowLog` (the last skipped step's params)
    fp32_of:dict|None=None, # `{param: FP32 master}` (exact FP32 values of a 16-bit model)
    fixable:bool=False, # `on_collapse='keep_fp32'`: `applicable` when a checked remedy is found
) -> Diagnosis:
    """Where the overflow of the failing step starts and the remedy, from copies of the model (the live one is
    untouched)."""
    keep, checked = [], False
    try:
        model = unwrap(learn.model)
        dev, batch = model_device(model), (tuple(learn.xb), tuple(learn.yb), learn.loss_func)
        with same_rng():
            rng = rng_state()
            m32 = bare_copy(model, fp32_of)
            m16, _ = prec.make(m32)
            run = run_batch(m16, *batch, scale, prec.context(dev), rng=rng)
            rem = find_remedy(m32, prec, batch, scale, rng=rng) if run.kind in ('forward', 'gradient') else None
        params = (log.read()[-1]['params'] if log is not None and len(log) else [])
        where = where_text(run, prec, scale, rem.fp32_max if rem else {}, params)
        text = where + ' ' + (remedy_text(rem, prec, dev, not prec.autocast)
                              if run.kind in ('forward', 'gradient', None) else '')
        if rem is not None: keep, checked = rem.keep, rem.checked
    except Exception as e:  # the diagnosis must never hide the error it explains
        where = text = f"(fp16cb could not find where the overflow starts: {type(e).__name__}: {e})"
    applicable = fixable and bool(keep) and checked and not syncs(learn.model)
    return Diagnosis(LossScaleError(f"{err}\n{text.rstrip()}"), keep, applicable, where)
