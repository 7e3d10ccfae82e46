"""Diagnostics: the loss-scale history of a fit, where the gradients live relative to fp16's range, warnings, and the
training state's bytes per param. (`learn.precision_check()` is in `precision_check`.)"""
from __future__ import annotations
import math
from dataclasses import dataclass, field
import torch
from torch import Tensor
from ..dtypes import FP16_MAX, FP16_MIN_NORMAL, FP16_MIN_SUBNORMAL
from ..monitor import scale_health
from ..scaling import ScaleHistory

__all__ = ['state_bytes', 'FP16_MAX', 'FP16_MIN_NORMAL', 'FP16_MIN_SUBNORMAL', 'scaling_callback', 'plot_loss_scale',
           'plot_precision_health', 'GradientReport', 'gradient_report', 'plot_gradient_range', 'scale_health']


def _axes(ax, size:tuple):
    """`ax`, or the axes of a new figure of `size` inches whose layout keeps every label, title and legend inside it (a
    script's plain `fig.savefig(path)` crops nothing: notebooks add `bbox_inches='tight'`, scripts do not)."""
    import matplotlib.pyplot as plt
    return ax if ax is not None else plt.subplots(figsize=size, layout='constrained')[1]

def scaling_callback(obj):
    """The callback of `obj` (a `Learner`, or the callback itself) that records `scales` and `skips` per step; a learner
    without one (after `to_fp32()`): the history its last mixed-precision fits left, `learn.loss_scale_history`."""
    if hasattr(obj, 'scales') and hasattr(obj, 'skips'): return obj
    for cb in getattr(obj, 'cbs', []):
        if hasattr(cb, 'scales') and hasattr(cb, 'skips'): return cb
    kept = getattr(obj, '__dict__', {}).get('loss_scale_history')
    if kept is not None: return kept
    raise ValueError(f"{type(obj).__name__} has no loss-scale history: expected a Learner set up with `to_fp16()` "
                     "(or `to_native_fp16()`) or fitted with it, or its `MixedPrecision` callback")

def plot_loss_scale(
    obj, # a `Learner` during or after a mixed-precision fit (`to_fp32()` too), its precision callback, or a history
    ax=None, # matplotlib axes to draw on (a new figure when None)
    title:str|None=None, # the axes' title
):
    "Draw the loss scale at each optimizer step (log2 axis) with the skipped (overflowing) steps marked. Returns `ax`."
    cb = scaling_callback(obj)
    scales, skips = list(cb.scales), list(cb.skips)
    ax = _axes(ax, (6, 3))
    steps = range(len(scales))
    ax.step(steps, scales, where='post', label='loss scale')
    over = [i for i, s in enumerate(skips) if s]
    if over: ax.scatter(over, [scales[i] for i in over], marker='x', color='red', zorder=3,
                        label=f'overflow: step skipped ({len(over)})')
    if scales and min(scales) > 0: ax.set_yscale('log', base=2)
    ax.set_xlabel('optimizer step'); ax.set_ylabel('loss scale')
    name = cb.label if isinstance(cb, ScaleHistory) else type(cb).__name__
    ax.set_title(title or f'{name}: {len(over)} of {len(scales)} steps skipped')
    ax.legend(loc='best', fontsize='small')
    return ax

def plot_precision_health(
    obj, # a `Learner` set up with `to_fp16()`/`to_bf16()` (during or after a fit), or its `MixedPrecision`
    ax=None, # matplotlib axes to draw on (a new figure when None)
):
    """Beside the loss scale's plot: the fit's precision-health checks (`MixedPrecision(health_every=...)`), each
    checked module's output off its FP32 output (relative, log axis) at the step it was checked, the line over which a
    module is named (`DIVERGES`), the named modules labelled, and the skipped steps marked at the foot by cause
    (inf/NaN gradients, or a calibrating step's underflow); with `half_storage`, on a right axis, the share of each
    check step's weight updates under half a 16-bit spacing (`lost_updates`). Returns `ax`."""
    from ..callbacks.health import DIVERGES
    cb = scaling_callback(obj)
    checks, skips = list(getattr(cb, 'health_checks', [])), list(cb.skips)
    ax = _axes(ax, (6, 3))
    finite = [c['rel_diff'] for c in checks if math.isfinite(c['rel_diff']) and c['rel_diff'] > 0]
    top = max(finite + [DIVERGES]) * 4
    ax.scatter([c['step'] for c in checks], [min(c['rel_diff'], top) if c['rel_diff'] > 0 else 1e-6 for c in checks],
               s=12, label='a module checked (its output vs FP32)')
    ax.axhline(DIVERGES, color='red', ls='--', lw=1, label=f'named over {DIVERGES:.0%}')
    for c in checks:
        if c['rel_diff'] > DIVERGES: ax.annotate(c['module'], (c['step'], min(c['rel_diff'], top)), fontsize='small')
    causes = getattr(cb, 'skip_causes', {})
    for why, color in (('inf/NaN', 'red'), ('underflow', 'orange')):
        at = [i for i, s in enumerate(skips) if s and causes.get(i, 'inf/NaN') == why]
        if at: ax.scatter(at, [1e-6] * len(at), marker='|', color=color, label=f'step skipped: {why} ({len(at)})')
    ax.set_yscale('log'); ax.set_xlabel('step'); ax.set_ylabel('relative difference')
    named = sum(c['rel_diff'] > DIVERGES for c in checks)
    ax.set_title(f'precision health: {len(checks)} checks, {named} over the line')
    handles, labels = ax.get_legend_handles_labels()
    lost = list(getattr(cb, 'lost_updates', []))
    if lost:  # `half_storage`: the share of a check step's weight updates that rounded back onto their 16-bit weights
        right = ax.twinx()
        right.plot([r['step'] for r in lost], [100 * r['lost'] for r in lost], color='green', marker='.', lw=1,
                   label='updates under half a 16-bit spacing (%)')
        right.set_ylim(0, 100); right.set_ylabel('% of updates')
        h, l = right.get_legend_handles_labels()
        handles, labels = handles + h, labels + l
    ax.legend(handles, labels, loc='best', fontsize='small')
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
    rep = obj if isinstance(obj, GradientReport) else gradient_report(obj, **kwargs)
    ax = _axes(ax, (7, 3))
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
    # beside the axes, never over the histograms, where the figure's layout makes room for it (ours: constrained); in a
    # figure without a layout engine (axes given) inside, so that a plain `savefig` keeps it
    roomy = ax.figure.get_layout_engine() is not None
    ax.legend(fontsize='x-small', **(dict(loc='upper left', bbox_to_anchor=(1.01, 1)) if roomy else dict(loc='best')))
    return ax

def state_bytes(learn) -> dict:
    """Bytes per trainable parameter, by role, of what a learner holds during a fit: model weights and grads, FP32
    masters, optimizer state (unique storages counted once; the masters' FP32 grads exist only inside the step)."""
    from ..callbacks import MixedPrecision  # a fit's setup, read late: the core never imports this
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
    masters = (mp.store.master_params if mp is not None else None) or []
    res['masters'] = size(m.data for m in masters) + size(getattr(mp.store, '_masters', []) if mp else [])
    st = getattr(learn.opt, 'state', {})
    res['optimizer state'] = size(v for s in st.values() for v in s.values())
    return {k: v / n for k, v in res.items()} | {'total': sum(res.values()) / n}
