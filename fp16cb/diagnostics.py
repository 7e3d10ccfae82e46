"""Diagnostics: the loss-scale history of a fit, where the gradients live relative to fp16's range, warnings, and
`learn.precision_check()`: a few batches in FP32 and in the learner's precision, compared module by module."""
from __future__ import annotations
import math, re
from contextlib import nullcontext
from dataclasses import dataclass, field
import numpy as np
import torch
from torch import Tensor
from .dtypes import FP16_MAX
from .monitor import scale_health

__all__ = ['state_bytes', 'FP16_MAX', 'FP16_MIN_NORMAL', 'FP16_MIN_SUBNORMAL', 'scaling_callback', 'plot_loss_scale',
           'GradientReport', 'gradient_report', 'plot_gradient_range', 'scale_health', 'precision_check',
           'plot_precision_check']

FP16_MIN_NORMAL = 2.**-14  # smallest normal fp16 (full 11-bit precision above it)
FP16_MIN_SUBNORMAL = 2.**-24  # smallest subnormal fp16: anything smaller is lost

def scaling_callback(obj):
    "The callback of `obj` (a `Learner`, or the callback itself) that records `scales` and `skips` per step."
    if hasattr(obj, 'scales') and hasattr(obj, 'skips'): return obj
    for cb in getattr(obj, 'cbs', []):
        if hasattr(cb, 'scales') and hasattr(cb, 'skips'): return cb
    raise ValueError(f"{type(obj).__name__} has no loss-scale history: expected a Learner set up with `to_fp16()` "
                     "(or `to_native_fp16()`), or its `MixedPrecision` callback")

def plot_loss_scale(
    obj, # a `Learner` after a fit in mixed precision, or its `MixedPrecision`/`NativeMixedPrecision` callback
    ax=None, # matplotlib axes to draw on (a new figure when None)
    title:str|None=None, # the axes' title
):
    "Draw the loss scale at each optimizer step (log2 axis) with the skipped (overflowing) steps marked. Returns `ax`."
    import matplotlib.pyplot as plt
    cb = scaling_callback(obj)
    scales, skips = list(cb.scales), list(cb.skips)
    if ax is None: _, ax = plt.subplots(figsize=(6, 3))
    steps = range(len(scales))
    ax.step(steps, scales, where='post', label='loss scale')
    over = [i for i, s in enumerate(skips) if s]
    if over: ax.scatter(over, [scales[i] for i in over], marker='x', color='red', zorder=3,
                        label=f'overflow: step skipped ({len(over)})')
    if scales and min(scales) > 0: ax.set_yscale('log', base=2)
    ax.set_xlabel('optimizer step'); ax.set_ylabel('loss scale')
    ax.set_title(title or f'{type(cb).__name__}: {len(over)} of {len(scales)} steps skipped')
    ax.legend(loc='best', fontsize='small')
    return ax

@dataclass
class GradientReport:
    "Where |gradients| live on a log2 axis, against fp16's normal, subnormal and overflow ranges."
    edges:list # bin `i` counts |g| in [2**edges[i], 2**(edges[i]+1)); the first and last bins also hold what is beyond
    activation:list # counts of nonzero |activation grads| (grads of the loss w.r.t. the outputs of the leaf modules)
    weight:list # counts of nonzero |weight grads|
    zeros:dict # exact zeros (not an underflow: e.g. behind a ReLU), by kind
    max_abs:dict # largest |grad|, by kind
    loss_scale:float # the scale the fractions `at_scale` refer to (the learner's current one)
    at_1:dict # fractions of nonzero grads that fp16 loses (< 2^-24), keeps as subnormals, or overflows: scale 1
    at_scale:dict # the same at `loss_scale`
    suggested_scale:float # largest power of two that keeps the largest |grad| `headroom` times below fp16's max
    at_suggested:dict # the fractions at `suggested_scale`
    per_layer:dict=field(default_factory=dict) # module name -> (min, max) nonzero |activation grad|

    def summary(self) -> str:
        "A few lines of text: the fractions at scale 1, at the current scale and at the suggested scale."
        rows = [f"{'':18}{'kind':>11}{'lost <2^-24':>13}{'subnormal':>11}{'overflow':>10}"]
        scales = [('scale 1', self.at_1)] + ([(f'current {_fmt(self.loss_scale)}', self.at_scale)]
                                             if self.loss_scale != 1 else [])
        for name, fr in scales + [(f'suggested {_fmt(self.suggested_scale)}', self.at_suggested)]:
            for kind in ('activation', 'weight'):
                lost, sub, over = fr[kind]
                rows.append(f"{name:18}{kind:>11}{lost:13.2%}{sub:11.2%}{over:10.2%}")
        mx = ', '.join(f"{k} {v:.3g}" for k, v in self.max_abs.items())
        return '\n'.join(rows + [f"max |grad|: {mx}; suggested loss scale: {_fmt(self.suggested_scale)}"])

    def __repr__(self): return f"GradientReport(suggested_scale={self.suggested_scale:g})\n{self.summary()}"

def _fmt(s:float) -> str:
    "A loss scale as text: powers of two as `2^k`."
    e = math.log2(s) if s > 0 else 0.
    return f"2^{e:g}" if e == int(e) and abs(e) >= 4 else f"{s:g}"

def _log2_hist(t:torch.Tensor, lo:int, hi:int) -> torch.Tensor:
    "Counts of the nonzero |t| in the log2 bins `lo..hi` (clamped), and the number of zeros, as one tensor."
    a = t.detach().abs().float().flatten()
    nz = a[a > 0]
    b = torch.floor(torch.log2(nz)).clamp_(lo, hi).long() - lo
    return torch.cat([torch.bincount(b, minlength=hi - lo + 1).cpu(), torch.tensor([a.numel() - nz.numel()])])

def _fractions(edges, counts, scale) -> tuple:
    "(lost, subnormal, overflow) fractions of the nonzero counts once multiplied by `scale`."
    n = sum(counts)
    if n == 0: return (0., 0., 0.)
    shift = math.log2(scale)
    lost = sum(c for e, c in zip(edges, counts) if e + 1 + shift <= -24)
    sub = sum(c for e, c in zip(edges, counts) if e + shift >= -24 and e + 1 + shift <= -14)
    over = sum(c for e, c in zip(edges, counts) if e + shift >= 16)
    return (lost / n, sub / n, over / n)

def _current_scale(learn) -> float:
    try: return float(scaling_callback(learn).loss_scale)
    except (ValueError, AttributeError): return 1.

def _batches(dl, n):
    for i, b in enumerate(dl):
        if i >= n: break
        yield b

def gradient_report(
    learn, # a `Learner` (outside a fit: its model is FP32, so the grads measured are the true ones)
    n_batches:int=1, # training batches to measure
    headroom:float=8., # the suggested scale keeps the largest |grad| this many times below fp16's max
    lo:int=-40, hi:int=17, # the log2 range of the bins (values beyond go to the end bins)
    loss_scale:float|None=None, # the scale to evaluate (default: the learner's current loss scale, else 1)
) -> GradientReport:
    "Measure |activation grads| and |weight grads| of a few FP32 training batches against fp16's range."
    model = learn.model
    edges = list(range(lo, hi + 1))
    hists = {'activation': torch.zeros(len(edges) + 1, dtype=torch.long),
             'weight': torch.zeros(len(edges) + 1, dtype=torch.long)}
    per_layer, handles = {}, []
    def fwd_hook(name):
        def hook(mod, inp, out):
            if isinstance(out, torch.Tensor) and out.requires_grad and torch.is_floating_point(out):
                def grad_hook(g):
                    hists['activation'].add_(_log2_hist(g, lo, hi))
                    nz = g.detach().abs()[g != 0]
                    if nz.numel():
                        mn, mx = per_layer.get(name, (math.inf, 0.))
                        per_layer[name] = (min(mn, nz.min().item()), max(mx, nz.max().item()))
                out.register_hook(grad_hook)
        return hook
    for name, m in model.named_modules():
        if not any(True for _ in m.children()): handles.append(m.register_forward_hook(fwd_hook(name)))
    buffers = {k: v.clone() for k, v in model.state_dict().items() if k not in dict(model.named_parameters())}
    old_grads = {p: p.grad for p in model.parameters()}
    was_training, mx = model.training, {'activation': 0., 'weight': 0.}
    try:
        model.train()
        for b in _batches(learn.dls.train, n_batches):
            xb, yb = b[:learn.dls.n_inp], b[learn.dls.n_inp:]
            for p in model.parameters(): p.grad = None
            loss = learn.loss_func(model(*xb), *yb)
            loss.backward()
            for p in model.parameters():
                if p.grad is None: continue
                hists['weight'].add_(_log2_hist(p.grad, lo, hi))
                mx['weight'] = max(mx['weight'], p.grad.detach().abs().max().item())
    finally:
        for h in handles: h.remove()
        for p, g in old_grads.items():  # a grad left in another dtype (a 16-bit fit) cannot go back
            p.grad = g if g is None or g.dtype == p.dtype else None
        model.load_state_dict(buffers, strict=False)
        model.train(was_training)
    counts = {k: v[:-1].tolist() for k, v in hists.items()}
    mx['activation'] = max([v[1] for v in per_layer.values()], default=0.)
    biggest = max(mx.values())
    scale = _current_scale(learn) if loss_scale is None else float(loss_scale)
    suggested = 1. if biggest == 0 else 2.**min(24, max(0, math.floor(math.log2(FP16_MAX / (biggest * headroom)))))
    frac = lambda s: {k: _fractions(edges, counts[k], s) for k in counts}
    return GradientReport(edges, counts['activation'], counts['weight'], {k: int(v[-1]) for k, v in hists.items()},
                          mx, scale, frac(1.), frac(scale), suggested, frac(suggested), per_layer)

def plot_gradient_range(
    obj, # a `GradientReport`, or a `Learner` to measure with `gradient_report`
    ax=None, # matplotlib axes to draw on (a new figure when None)
    **kwargs, # passed to `gradient_report` when `obj` is a learner
):
    "Histograms of log2|grad| (activation and weight grads) over fp16's lost, subnormal, normal and overflow ranges."
    import matplotlib.pyplot as plt
    rep = obj if isinstance(obj, GradientReport) else gradient_report(obj, **kwargs)
    if ax is None: _, ax = plt.subplots(figsize=(7, 3))
    lo, hi = rep.edges[0], rep.edges[-1] + 1
    cut = -24 - math.log2(rep.suggested_scale)  # what the suggested scale still loses: below 2^cut
    left = min(lo, math.floor(cut) - 2)  # the axis shows that line too (the first bin holds everything below 2^lo)
    ax.axvspan(left, -24, color='red', alpha=.12, label='lost in fp16 (< 2^-24)')
    ax.axvspan(-24, -14, color='orange', alpha=.15, label='subnormal')
    ax.axvspan(-14, 16, color='green', alpha=.07, label='normal')
    ax.axvspan(16, hi, color='purple', alpha=.12, label='overflow (> 65504)')
    for kind, counts in (('activation', rep.activation), ('weight', rep.weight)):
        n = max(1, sum(counts))
        ax.stairs([c / n for c in counts], rep.edges + [hi], label=f'|{kind} grad|', linewidth=1.5)
    if rep.suggested_scale != 1:
        ax.axvline(cut, color='k', ls='--', lw=1,
                   label=f'lost below this at scale {_fmt(rep.suggested_scale)}')
    ax.set_xlabel('log2 |grad|  (FP32, unscaled)'); ax.set_ylabel('fraction'); ax.set_xlim(left, hi)
    ax.set_title(f"lost at scale 1: act {rep.at_1['activation'][0]:.1%}, weight {rep.at_1['weight'][0]:.1%}; "
                 f"suggested scale {_fmt(rep.suggested_scale)}", fontsize='small')
    ax.legend(fontsize='x-small', loc='upper left', bbox_to_anchor=(1.01, 1))  # outside: never over the histograms
    return ax

def state_bytes(learn) -> dict:
    """Bytes per trainable parameter, by role, of what a learner holds during a fit: model weights and grads, FP32
    masters, optimizer state (unique storages counted once; the masters' FP32 grads exist only inside the step)."""
    from .callbacks import MixedPrecision  # diagnostics reads a fit's setup: imported late, the core never imports this
    mp = next((cb for cb in learn.cbs if isinstance(cb, MixedPrecision)), None)
    params = [p for p in learn.model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    seen = set()
    def size(ts):
        tot = 0
        for t in ts:
            if t is None or not isinstance(t, Tensor) or t.dim() == 0: continue
            k = t.untyped_storage().data_ptr()
            if k in seen: continue
            seen.add(k); tot += t.untyped_storage().nbytes()
        return tot
    res = {'weights': size(p.data for p in params), 'grads': size(p.grad for p in params)}
    masters = mp.store.master_params if mp is not None and hasattr(mp.store, 'master_params') else []
    res['masters'] = size(m.data for m in masters) + size(getattr(mp.store, '_masters', []) if mp else [])
    st = getattr(learn.opt, 'state', {})
    res['optimizer state'] = size(v for s in st.values() for v in s.values())
    return {k: v / n for k, v in res.items()} | {'total': sum(res.values()) / n}

# ---- precision_check: a few batches in FP32 and in the learner's precision, module by module
from fastai.learner import Learner
from fastcore.basics import patch
from .overflow import Precision, bare_copy, same_rng, run_batch, find_remedy, unwrap, shown, INPUTS, LOSS, rng_state
from .dtypes import has_fast_half_math, model_device
from .policy import PrecisionPolicy, CATEGORIES

def _precision_of(learn) -> tuple:
    """`(Precision, scale_of, floor, label, half_storage, state16)` of the learner's precision callbacks (`to_fp16()`'s
    defaults when it has none): `scale_of(max |FP32 grad|)` is the loss scale that precision would use for these batches,
    `floor` the lowest it can go to (a dynamic scale backs off from gradients that overflow above it), `half_storage` how
    16-bit storage rounds the updated weights: 'stochastic' or 'nearest' (None: FP32 masters); `state16`: whether the
    optimizer's state is 16-bit already (None: the mode has no such option)."""
    from .callbacks import MixedPrecision, ModelToHalf
    from .native import NativeMixedPrecision
    from .scaling import BackoffScaler
    cbs = learn.cbs
    mp = next((cb for cb in cbs if isinstance(cb, MixedPrecision)), None)
    nat = next((cb for cb in cbs if isinstance(cb, NativeMixedPrecision)), None)
    if nat is not None:
        on = nat.enabled and nat.dtype == torch.float16
        scale = nat.loss_scale if nat.scaler is not None else nat.init_scale if on else 1.
        return (Precision(nat.dtype, autocast=True), (lambda g: scale), min(scale, 1.),
                f"to_native_{'fp16' if nat.dtype == torch.float16 else 'bf16'}()", None, None)
    if mp is None: mp, label = MixedPrecision(), "to_fp16() (the learner has no precision set: fp16cb's default)"
    else: label = f"to_{'bf16' if mp.dtype == torch.bfloat16 else 'fp16'}()"
    mth = next((cb for cb in cbs if isinstance(cb, ModelToHalf)), None)
    policy = mth.policy if mth is not None else PrecisionPolicy() if not any(isinstance(cb, MixedPrecision) for cb in cbs) else None
    sc = mp.scaler
    calibrating = isinstance(sc, BackoffScaler) and not sc.calibrated
    return (Precision(mp.dtype, policy), (sc.calibrated_scale if calibrating else (lambda g: sc.scale)),
            min(sc.floor, sc.scale), label, ('stochastic' if mp.stochastic_rounding else 'nearest') if mp.half_storage else None,
            mp.state_dtype is not None)

def _lrs(learn, model) -> dict:
    "`{param name: lr}`: the optimizer's per group, else the learner's `lr`."
    names = {id(p): n for n, p in model.named_parameters()}
    opt, res = learn.opt, {}
    if opt is not None and hasattr(opt, 'hypers'):
        for pg, h in zip(opt.param_lists, opt.hypers):
            for p in pg:
                if id(p) in names and 'lr' in h: res[names[id(p)]] = float(h['lr'])
    lr = learn.lr.stop if isinstance(learn.lr, slice) else learn.lr
    lr = float(np.max(lr))
    return {n: res.get(n, lr) for n in names.values()}

def _first_batches(dl, n:int) -> list:
    "The first `n` batches of `dl` (in one process: no workers started)."
    ctx = dl.fake_l.no_multiproc() if hasattr(getattr(dl, 'fake_l', None), 'no_multiproc') else nullcontext()
    res = []
    with ctx:
        it = iter(dl)
        try:
            for b in it:
                res.append(b)
                if len(res) >= n: break
        finally:
            if hasattr(it, 'close'): it.close()
    return res

class _Sums:
    "Per-module counts over the batches, on the device until the end (one host read)."
    def __init__(self): self.t = {}
    def add(self, key, v):
        self.t[key] = self.t[key] + v if key in self.t else v
    def read(self) -> dict:
        keys = list(self.t)
        if not keys: return {}
        dev = self.t[keys[0]].device
        return dict(zip(keys, torch.stack([self.t[k].to(dev).double() for k in keys]).tolist()))

@patch
def precision_check(self:Learner,
    n_batches:int=8, # training batches to run, each in FP32 and in the learner's precision, from the current weights
    plot:bool=True, # draw the per-module figures (as `lr_find` draws its curve)
):
    """Run a few training batches in FP32 and in the learner's precision (its `to_fp16`/`to_bf16`/`to_native_fp16`
    settings; `to_fp16()`'s defaults if it has none), each from the current weights (no step is taken), and report
    per module (those with parameters, and any where an overflow starts) a pandas DataFrame: `overflow` (batches in
    which inf/NaN starts at this module), `underflow` (share of its parameters' nonzero FP32 gradients that flush to
    zero in 16-bit at the loss scale that precision uses), `underflow_act` (the same of the gradient of its output,
    which flows in 16-bit), `swallowed` (share of its SGD updates, at the optimizer's lr, that
    16-bit storage of the weight would round to nothing: FP32 masters keep them), `max_fp32` (largest |output| in
    FP32) and `rel_diff` (relative difference of its output from FP32's: over `DIVERGES` the advice names the first such
    module, with the `keep_fp32` it checked, even where nothing is inf/NaN). `df.attrs`: 'advice' (a sentence: 'safe',
    "keep_fp32=[...]", 'use to_bf16', ...), 'loss_fp32', 'loss_16bit', 'loss_scale', 'mode', 'keep_fp32'. Works on
    copies of the model: the learner (weights, optimizer, callbacks, RNG, BatchNorm statistics) is left as it was."""
    import pandas as pd
    from .session import session_of
    from .validation import check_int, check_bool
    n_batches, plot = check_int('n_batches', n_batches, 1), check_bool('plot', plot)
    prec, scale_of, floor, label, half_storage, state16 = _precision_of(self)
    dl = self.dls.train
    with same_rng(dl):
        with session_of(self).suspended(): m32 = bare_copy(unwrap(self.model))  # mid-fit: the FP32 model of now
        m32.train()
        m16, kept = prec.make(m32)
        m16.train()
        dev, lrs = model_device(m32), _lrs(self, unwrap(self.model))
        params32, params16 = dict(m32.named_parameters()), dict(m16.named_parameters())
        sums, overflow, rel, fp32_max, losses, scale, first_bad, first = _Sums(), {}, {}, {}, [], None, None, None
        for b in _first_batches(dl, n_batches):
            n_inp = getattr(self.dls, 'n_inp', 1 if len(b) == 1 else len(b) - 1)  # as fastai's `Learner._split`
            xb, yb, rng = tuple(b[:n_inp]), tuple(b[n_inp:]), rng_state()
            r32 = run_batch(m32, xb, yb, self.loss_func, keep_outputs=True, rng=rng)
            if scale is None:
                scale = float(scale_of(max((float(g.abs().max()) for g in r32.grads.values() if g is not None and g.numel()), default=0.)))
            r16 = run_batch(m16, xb, yb, self.loss_func, scale, prec.context(dev), ref=r32.outputs, rng=rng)
            if first is None: first = (xb, yb, rng, r32.outputs)  # what a divergence's remedy is checked on
            losses.append((r32.loss, r16.loss))
            for n, v in r32.out_max.items(): fp32_max[n] = max(fp32_max.get(n, 0.), v)
            for n, v in r16.rel_diff.items():
                if v is not None: rel.setdefault(n, []).append(v)
            for o in r16.origins: overflow[o] = overflow.get(o, 0) + 1
            if r16.overflowed and first_bad is None: first_bad = (xb, yb, self.loss_func, rng)
            _count(sums, r32, r16, params32, params16, lrs, prec, scale, half_storage)
        counts = sums.read()
        # what keeps the first overflowing batch clean at the lowest scale (above it, a dynamic scale backs off)
        rem = find_remedy(m32, prec, first_bad[:3], floor, rng=first_bad[3]) if first_bad is not None else None
        mods = dict(m32.named_modules())
        div = None if first is None else _divergence(m32, prec, mods, rel, first, self.loss_func, scale, dev)
    rows = [n for n, m in mods.items() if any(True for _ in m.parameters(recurse=False))]
    rows = [o for o in (INPUTS,) if o in overflow] + [n for n in mods if n in rows or n in overflow] + [o for o in (LOSS,) if o in overflow]
    def share(n, k):
        d = counts.get((n, k + '_of'), 0.)
        return counts.get((n, k), 0.) / d if d else float('nan')
    df = pd.DataFrame({
        'type': [type(mods[n]).__name__ if n in mods else '-' for n in rows],
        'dtype': [_compute_dtype(n, mods, kept, prec) for n in rows],
        'overflow': [overflow.get(n, 0) for n in rows],
        'underflow': [share(n, 'underflow') for n in rows],
        'underflow_act': [share(n, 'underflow_act') for n in rows],
        'swallowed': [share(n, 'swallowed') for n in rows],
        'max_fp32': [fp32_max.get(n, float('nan')) for n in rows],
        'rel_diff': [float(np.mean(rel[n])) if rel.get(n) else float('nan') for n in rows],
    }, index=pd.Index([n if n else '(model)' for n in rows], name='module'))
    l32, l16 = (float(np.mean([l[i] for l in losses])) if losses else float('nan') for i in (0, 1))
    df.attrs.update(mode=f"learn.{label}", loss_scale=scale, loss_fp32=l32, loss_16bit=l16, n_batches=len(losses),
                    keep_fp32=rem.keep if rem is not None and rem.checked and rem.keep else [div[0]] if div is not None and div[2] else [],
                    advice=_advice(df, overflow, rem, prec, dev, scale, floor, half_storage, state16, div))
    if plot: plot_precision_check(df)
    return df

precision_check = Learner.precision_check  # `@patch` leaves the name unbound here: the function, for `fp16cb.precision_check(learn)`

def _compute_dtype(n, mods, kept, prec) -> str:
    if prec.autocast: return f"{str(prec.dtype)[6:]} autocast"
    if prec.policy is None or n not in mods: return 'float32' if n in mods else '-'
    return 'float32' if n in kept else str(prec.dtype)[6:]

def _flushed(g:Tensor, scale:float, dtype) -> Tensor:
    "Which values of the FP32 gradient `g` are nonzero but 0 once scaled by `scale` and rounded to `dtype`."
    return (g != 0) & ((g * scale).to(dtype) == 0) if dtype in (torch.float16, torch.bfloat16) else torch.zeros_like(g, dtype=torch.bool)

def _count(sums, r32, r16, params32, params16, lrs, prec, scale, half_storage):
    "Add one batch's underflowing gradients and swallowed updates, per module, to `sums` (on the device)."
    for n, g in r32.out_grads.items():  # activation gradients: 16-bit between the modules
        sums.add((n, 'underflow_act'), _flushed(g, scale, prec.dtype).sum()); sums.add((n, 'underflow_act_of'), (g != 0).sum())
    for n, g32 in r32.grads.items():
        if g32 is None: continue
        mod, p16 = n.rpartition('.')[0], params16.get(n)
        sd = prec.dtype if prec.autocast or p16 is None else p16.dtype  # the dtype the mode holds this weight (and grad) in
        sums.add((mod, 'underflow'), _flushed(g32, scale, sd).sum()); sums.add((mod, 'underflow_of'), (g32 != 0).sum())
        w = params32[n].detach()
        if sd not in (torch.float16, torch.bfloat16, torch.float32): continue
        u = lrs.get(n, 0.) * g32
        ws = w.to(sd)
        kept = (ws.float() - u).to(sd) == ws  # the update rounds to nothing
        nz = u != 0
        sums.add((mod, 'swallowed'), (nz & kept).sum()); sums.add((mod, 'swallowed_of'), nz.sum())

DIVERGES = .2  # a module's output this far from FP32's (relative difference) is named, even with no inf/NaN anywhere

def _divergence(m32, prec, mods:dict, rel:dict, first:tuple, loss_func, scale, device):
    """`(module, its rel_diff, whether keeping it FP32 fixes the outputs)` for the first module, in the model's order,
    whose output is over `DIVERGES` off FP32's (a value overflowing inside it that nothing reports: `x**2` in a
    hand-written norm gives inf, `rsqrt(inf)` 0); None when none is. The fix is tried on the first batch, as the
    overflow's remedy is: that module kept FP32, every module's output within `DIVERGES` of FP32's."""
    name = next((n for n in mods if n and np.mean(rel.get(n) or [0.]) > DIVERGES), None)
    if name is None: return None
    xb, yb, rng, ref = first
    spec = name if name not in CATEGORIES else 're:' + re.escape(name)  # 'norm' alone is the category
    m16, _ = prec.ours.make(m32, [name])  # by its name (`PrecisionPolicy.adding` tells it from the category)
    m16.train()
    run = run_batch(m16, xb, yb, loss_func, scale, prec.ours.context(device), ref=ref, rng=rng)
    after = [v for v in run.rel_diff.values() if v is not None]
    return spec, float(np.mean(rel[name])), not run.overflowed and bool(after) and max(after) <= DIVERGES

def _advice(df, overflow:dict, rem, prec, device, scale, floor, half_storage, state16=None, div=None) -> str:
    "One sentence: what to do (the first word says which: safe, keep_fp32=[...], differs, use to_bf16, check, underflow, swallowed)."
    bf16 = prec.dtype == torch.float16 and has_fast_half_math(torch.bfloat16, device)
    if div is not None and not (overflow and rem is not None and rem.keep and rem.checked):  # a wrong output, said first
        name, v, fixed = div
        what = (f"{name!r}'s output is {v:.0%} off FP32's in {prec.label}, finite (a value that overflows inside it and "
                f"comes out finite, as `x**2` in a hand-written norm)")
        if fixed: return (f"keep_fp32={[name]!r}: `{prec.call([name])}` ({what}; kept FP32, every module's output follows "
                          f"FP32's)" + (", or `learn.to_bf16()`" if bf16 else '') + '.')
        return (f"differs: {what}, and keeping it FP32 does not bring the outputs back: "
                + ("`learn.to_bf16()`, or train in FP32." if prec.dtype == torch.float16 else "train in FP32."))
    if overflow:
        starts = ', '.join(shown(o) for o in overflow)
        if rem is not None and rem.checked and not rem.keep and scale > floor:
            return (f"safe: the gradients overflow at loss scale {scale:g} (in {starts}) but not at {floor:g}: the dynamic "
                    f"loss scale backs off from it (those first steps are skipped).")
        if rem is not None and rem.keep and rem.checked:
            return (f"keep_fp32={rem.keep!r}: `{prec.call(rem.keep)}` (inf/NaN starts in {starts}; with those modules FP32 "
                    f"the first overflowing batch runs clean)" + (", or `learn.to_bf16()`" if bf16 else '') + '.')
        if set(overflow) <= {INPUTS, LOSS}:
            return f"check the data: inf/NaN starts in {starts} (the inputs, or the loss for finite predictions), not in the model."
        if prec.dtype == torch.float16:
            return (f"use to_bf16: inf/NaN starts in {starts} and keeping modules FP32 does not remove it"
                    + ('' if bf16 else ' (bf16 is not native on this device: or train in FP32)') + '.')
        return f"train in FP32: inf/NaN starts in {starts} even in {prec.label}."
    uf = df[['underflow', 'underflow_act']].fillna(0.).max(axis=1)
    if len(uf) and uf.max() > .01:
        m = uf.idxmax()
        return (f"underflow: {m!r} loses {uf.max():.1%} of its nonzero gradients at loss scale {scale:g}: a higher "
                f"(dynamic) loss scale" + (", or `learn.to_bf16()`" if bf16 else '') + " keeps them.")
    sw = df['swallowed'].fillna(0.)
    if half_storage and len(sw) and sw.max() > .1:
        if half_storage == 'stochastic':  # already on: only FP32 masters would do more
            return (f"swallowed: rounded to nearest, 16-bit storage would round {sw.max():.0%} of the updates of "
                    f"{sw.idxmax()!r} to nothing; stochastic rounding (on) keeps them on average only, with noise: FP32 "
                    "master weights (half_storage=False) keep them exactly.")
        return (f"swallowed: 16-bit storage rounds {sw.max():.0%} of the updates of {sw.idxmax()!r} to nothing: keep FP32 "
                "master weights (half_storage=False), or stochastic_rounding=True.")
    return (f"safe: no overflow, no underflow over 1% at loss scale {scale:g}"
            + (f" (FP32 masters keep the {sw.max():.0%} of updates 16-bit storage would swallow)" if not half_storage and len(sw) and sw.max() > 0 else '')
            + ("; short of memory, `state_dtype=torch.bfloat16` stores the optimizer's state (Adam's moments, momentum) "
               "in bf16 between steps: 4 bytes/param less with Adam" if state16 is False else '') + '.')

def plot_precision_check(
    df, # what `learn.precision_check()` returned
    axs=None, # four matplotlib axes (a new figure when None)
):
    "Bars per module: batches where inf/NaN starts, underflowed gradients, swallowed updates, output difference from FP32."
    import matplotlib.pyplot as plt, textwrap
    from matplotlib.ticker import LogLocator, LogFormatterSciNotation, NullFormatter
    if axs is None: _, axs = plt.subplots(1, 4, figsize=(12, 1.6 + .3 * len(df)), sharey=True, layout='constrained')
    names = list(df.index)[::-1]
    d = df.iloc[::-1]
    panels = [('overflow', 'overflow (batches)', 'tab:red'), ('underflow', 'underflow (share of grads)', 'tab:orange'),
              ('swallowed', 'swallowed (share of updates)', 'tab:purple'), ('rel_diff', 'output vs FP32 (rel. diff.)', 'tab:blue')]
    for ax, (col, title, color) in zip(axs, panels):
        v = d[col].astype(float).replace([np.inf, -np.inf], np.nan)
        if col == 'rel_diff' and d[col].isin([np.inf]).any(): v = v.fillna(v.max() * 10 if v.notna().any() else 1.)
        ax.barh(names, v.fillna(0.), color=color)
        ax.set_title(title, fontsize='small')
        if col in ('underflow', 'swallowed'): ax.set_xlim(0, 1)  # shares
        elif col == 'overflow': ax.set_xlim(0, max(1, v.max()) * 1.05 if v.notna().any() else 1)
        if col == 'rel_diff' and (v > 0).any():  # whole decades, labelled at the decades only: no crowded labels
            ax.set_xscale('log')
            lo, hi = v[v > 0].min(), v.max()
            ax.set_xlim(10. ** math.floor(math.log10(lo)), 10. ** max(math.ceil(math.log10(hi)), math.floor(math.log10(lo)) + 1))
            ax.xaxis.set_major_locator(LogLocator(numticks=4)); ax.xaxis.set_major_formatter(LogFormatterSciNotation())
            ax.xaxis.set_minor_formatter(NullFormatter())
    axs[0].figure.suptitle(textwrap.fill(df.attrs.get('advice', ''), 150), fontsize='small')
    return axs
