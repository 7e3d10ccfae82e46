"""`learn.precision_check()`: a few batches in FP32 and in the learner's precision, compared module by module (inf/NaN
and where it starts, underflow, swallowed updates, outputs far from FP32's), with the advice and the remedy it
checked; `plot_precision_check` draws it."""
from __future__ import annotations
import math, re
from contextlib import nullcontext
import numpy as np
import torch
from torch import Tensor

__all__ = ['precision_check', 'plot_precision_check', 'DIVERGES']
from fastai.learner import Learner
from .overflow import Precision, bare_copy, same_rng, run_batch, find_remedy, unwrap, shown, INPUTS, LOSS, rng_state
from ..dtypes import has_fast_half_math, model_device
from ..policy import PrecisionPolicy, CATEGORIES

def _precision_of(learn) -> tuple:
    """`(Precision, scale_of, floor, label, half_storage, state16)` of the learner's precision callbacks (`to_fp16()`'s
    defaults when it has none): `scale_of(max |FP32 grad|)` is the loss scale that precision would use for these
    batches, `floor` the lowest it can go to (a dynamic scale backs off from gradients that overflow above it),
    `half_storage` how 16-bit storage rounds the updated weights: 'stochastic' or 'nearest' (None: FP32 masters);
    `state16`: whether the optimizer's state is 16-bit already (None: the mode has no such option)."""
    from ..callbacks import MixedPrecision, ModelToHalf
    from ..callbacks import NativeMixedPrecision
    from ..scaling import BackoffScaler
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
    policy = (mth.policy if mth is not None else
              PrecisionPolicy() if not any(isinstance(cb, MixedPrecision) for cb in cbs) else None)
    sc = mp.scaler
    calibrating = isinstance(sc, BackoffScaler) and not sc.calibrated
    return (Precision(mp.dtype, policy), (sc.calibrated_scale if calibrating else (lambda g: sc.scale)),
            min(sc.floor, sc.scale), label,
            ('stochastic' if mp.stochastic_rounding else 'nearest') if mp.half_storage else None,
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
    from ..session import session_of
    from ..options import check_int, check_bool
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
                scale = float(scale_of(max((float(g.abs().max()) for g in r32.grads.values()
                                            if g is not None and g.numel()), default=0.)))
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
    rows = ([o for o in (INPUTS,) if o in overflow] + [n for n in mods if n in rows or n in overflow]
            + [o for o in (LOSS,) if o in overflow])
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
                    keep_fp32=(rem.keep if rem is not None and rem.checked and rem.keep else
                               [div[0]] if div is not None and div[2] else []),
                    advice=_advice(df, overflow, rem, prec, dev, scale, floor, half_storage, state16, div))
    if plot: plot_precision_check(df)
    return df


def _compute_dtype(n, mods, kept, prec) -> str:
    if prec.autocast: return f"{str(prec.dtype)[6:]} autocast"
    if prec.policy is None or n not in mods: return 'float32' if n in mods else '-'
    return 'float32' if n in kept else str(prec.dtype)[6:]

def _flushed(g:Tensor, scale:float, dtype) -> Tensor:
    "Which values of the FP32 gradient `g` are nonzero but 0 once scaled by `scale` and rounded to `dtype`."
    return ((g != 0) & ((g * scale).to(dtype) == 0) if dtype in (torch.float16, torch.bfloat16) else
            torch.zeros_like(g, dtype=torch.bool))

def _count(sums, r32, r16, params32, params16, lrs, prec, scale, half_storage):
    "Add one batch's underflowing gradients and swallowed updates, per module, to `sums` (on the device)."
    for n, g in r32.out_grads.items():  # activation gradients: 16-bit between the modules
        sums.add((n, 'underflow_act'), _flushed(g, scale, prec.dtype).sum())
        sums.add((n, 'underflow_act_of'), (g != 0).sum())
    for n, g32 in r32.grads.items():
        if g32 is None: continue
        mod, p16 = n.rpartition('.')[0], params16.get(n)
        # the dtype the mode holds this weight (and grad) in
        sd = prec.dtype if prec.autocast or p16 is None else p16.dtype
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
    """One sentence: what to do (the first word says which: safe, keep_fp32=[...], differs, use to_bf16, check,
    underflow, swallowed)."""
    bf16 = prec.dtype == torch.float16 and has_fast_half_math(torch.bfloat16, device)
    # a wrong output, said first
    if div is not None and not (overflow and rem is not None and rem.keep and rem.checked):
        name, v, fixed = div
        what = (f"{name!r}'s output is {v:.0%} off FP32's in {prec.label}, finite (a value that overflows inside it "
                f"and comes out finite, as `x**2` in a hand-written norm)")
        if fixed:
            return (f"keep_fp32={[name]!r}: `{prec.call([name])}` ({what}; kept FP32, every module's output follows "
                    f"FP32's)" + (", or `learn.to_bf16()`" if bf16 else '') + '.')
        return (f"differs: {what}, and keeping it FP32 does not bring the outputs back: "
                + ("`learn.to_bf16()`, or train in FP32." if bf16 else "train in FP32."))
    if overflow:
        starts = ', '.join(shown(o) for o in overflow)
        if rem is not None and rem.checked and not rem.keep and scale > floor:
            return (f"safe: the gradients overflow at loss scale {scale:g} (in {starts}) but not at {floor:g}: the "
                    f"dynamic loss scale backs off from it (those first steps are skipped).")
        if rem is not None and rem.keep and rem.checked:
            return (f"keep_fp32={rem.keep!r}: `{prec.call(rem.keep)}` (inf/NaN starts in {starts}; with those modules "
                    f"FP32 the first overflowing batch runs clean)" + (", or `learn.to_bf16()`" if bf16 else '') + '.')
        if set(overflow) <= {INPUTS, LOSS}:
            return (f"check the data: inf/NaN starts in {starts} (the inputs, or the loss for finite predictions), not "
                    "in the model.")
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
                    f"{sw.idxmax()!r} to nothing; stochastic rounding (on) keeps them on average only, with noise: "
                    "FP32 master weights (half_storage=False) keep them exactly.")
        return (f"swallowed: 16-bit storage rounds {sw.max():.0%} of the updates of {sw.idxmax()!r} to nothing: keep "
                "FP32 master weights (half_storage=False), or stochastic_rounding=True.")
    return (f"safe: no overflow, no underflow over 1% at loss scale {scale:g}"
            + (f" (FP32 masters keep the {sw.max():.0%} of updates 16-bit storage would swallow)"
               if not half_storage and len(sw) and sw.max() > 0 else '')
            + ("; short of memory, `state_dtype=torch.bfloat16` stores the optimizer's state (Adam's moments, "
               "momentum) in bf16 between steps: 4 bytes/param less with Adam (`state_dtype='8bit'`, torchao's "
               "block-wise 8-bit codes: 6 less)" if state16 is False else '') + '.')

def plot_precision_check(
    df, # what `learn.precision_check()` returned
    axs=None, # four matplotlib axes (a new figure when None)
):
    """Bars per module: batches where inf/NaN starts, underflowed gradients, swallowed updates, output difference from
    FP32."""
    import matplotlib.pyplot as plt, textwrap
    from matplotlib.ticker import LogLocator, LogFormatterSciNotation, NullFormatter
    if axs is None: _, axs = plt.subplots(1, 4, figsize=(12, 1.6 + .3 * len(df)), sharey=True, layout='constrained')
    names = list(df.index)[::-1]
    d = df.iloc[::-1]
    panels = [('overflow', 'overflow (batches)', 'tab:red'), ('underflow', 'underflow (share of grads)', 'tab:orange'),
              ('swallowed', 'swallowed (share of updates)', 'tab:purple'),
              ('rel_diff', 'output vs FP32 (rel. diff.)', 'tab:blue')]
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
            ax.set_xlim(10. ** math.floor(math.log10(lo)),
                        10. ** max(math.ceil(math.log10(hi)), math.floor(math.log10(lo)) + 1))
            ax.xaxis.set_major_locator(LogLocator(numticks=4)); ax.xaxis.set_major_formatter(LogFormatterSciNotation())
            ax.xaxis.set_minor_formatter(NullFormatter())
    axs[0].figure.suptitle(textwrap.fill(df.attrs.get('advice', ''), 150), fontsize='small')
    return axs
