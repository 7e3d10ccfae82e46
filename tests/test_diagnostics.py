"""Diagnostics: loss-scale plots, the gradient range report against fp16's range, and the scale-health warnings (a
scale at its floor, every step of a fit skipped)."""
import math, warnings
from types import SimpleNamespace
import matplotlib; matplotlib.use('Agg')
import matplotlib.pyplot as plt
import pytest
import torch
from torch import nn
from fastai.basics import Learner, DataLoaders, SGD, MSELossFlat
from fastai.callback.core import Callback
from fp16cb import BackoffScaler, StaticScaler, LogNormalScaler
from fp16cb.diagnostics import (plot_loss_scale, gradient_report, plot_gradient_range, scale_health, scaling_callback,
                                GradientReport)
from conftest import DEVICE, make_learner, weights, Record
from conftest import quiet_fit as fit_quietly  # this module's `quiet_fit` hides warnings

def synth_learner(factor=1., n=64, bs=16, seed=0):
    "y = 2x + 1 with a small MLP (with BatchNorm); the loss is multiplied by `factor`."
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g); y = x.sum(1, keepdim=True) * 2 + 1
    dls = DataLoaders.from_dsets(list(zip(x[:-16], y[:-16])), list(zip(x[-16:], y[-16:])), bs=bs, num_workers=0,
                                 device=DEVICE)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)).to(DEVICE)
    mse = MSELossFlat()
    return Learner(dls, model, loss_func=lambda p, t: mse(p, t) * factor, opt_func=SGD, lr=1e-2 / max(factor, 1e-30))

def quiet_fit(learn, n=1):
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit(n)

def test_plot_loss_scale_marks_the_overflows():
    learn = synth_learner().to_fp16(loss_scale=2.**24)
    quiet_fit(learn, 2)
    mp = learn.mixed_precision
    assert len(mp.scales) == len(mp.skips) == 6 and any(mp.skips)  # a start at 2^24 overflows at first
    ax = plot_loss_scale(learn)
    xs = ax.collections[0].get_offsets()
    assert len(xs) == sum(mp.skips) and [int(i) for i, _ in xs] == [i for i, s in enumerate(mp.skips) if s]
    assert ax.get_yscale() == 'log' and f"{sum(mp.skips)} of 6 steps skipped" in ax.get_title()
    plt.close('all')
    assert scaling_callback(mp) is mp

def test_plot_loss_scale_native_and_errors():
    learn = synth_learner().to_native_fp16(init_scale=2.**24)
    quiet_fit(learn)
    cb = scaling_callback(learn)
    assert len(cb.scales) == 3 and cb.skips[0] and cb.scales[1] == cb.scales[0] / 2  # GradScaler backed off
    plot_loss_scale(learn); plt.close('all')
    with pytest.raises(ValueError, match="no loss-scale history"): plot_loss_scale(synth_learner())

def test_gradient_report_finds_underflow_and_suggests_a_scale():
    tiny = synth_learner(factor=2.**-30)
    state = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    rep = gradient_report(tiny, n_batches=2)
    # the report leaves the model as it was: no grads, same weights and BatchNorm statistics
    assert all(p.grad is None for p in tiny.model.parameters())
    assert all(torch.equal(v, tiny.model.state_dict()[k]) for k, v in state.items())
    n_params = sum(p.numel() for p in tiny.model.parameters())
    assert sum(rep.weight) + rep.zeros['weight'] == 2 * n_params
    assert rep.at_1['activation'][0] > .9 and rep.at_1['weight'][0] > .5  # loss x 2^-30: nearly all lost at scale 1
    assert rep.loss_scale == 1 and rep.at_scale == rep.at_1
    assert 2.**20 <= rep.suggested_scale <= 2.**24
    assert rep.at_suggested['activation'][0] < .05 and rep.at_suggested['activation'][2] == 0
    assert rep.max_abs['weight'] * rep.suggested_scale * 8 <= 65504
    plain = gradient_report(synth_learner())
    assert plain.at_1['activation'][0] < .01 and plain.suggested_scale < rep.suggested_scale
    assert 'suggested loss scale' in plain.summary() and isinstance(plain, GradientReport)
    assert 'current' not in plain.summary()  # at scale 1 there is no separate 'current scale' row
    fixed = synth_learner(); fixed.dls.train.shuffle = False  # the same first batch for both
    assert gradient_report(fixed).max_abs['weight'] == max(p.grad.abs().max().item() for p in _grads_of(fixed))

def _grads_of(learn):
    xb, yb = learn.dls.train.one_batch()
    learn.loss_func(learn.model(xb), yb).backward()
    return [p for p in learn.model.parameters()]

def test_gradient_report_uses_the_current_scale():
    learn = synth_learner(factor=2.**-30).to_fp16(max_loss_scale=2.**24)
    quiet_fit(learn)
    rep = gradient_report(learn)
    assert rep.loss_scale == learn.mixed_precision.loss_scale > 1
    assert rep.at_scale['activation'][0] < rep.at_1['activation'][0]
    assert gradient_report(learn, loss_scale=1.).at_scale == rep.at_1
    assert f"current 2^{int(math.log2(rep.loss_scale))}" in rep.summary()
    ax = plot_gradient_range(rep)
    assert len(ax.patches) >= 2 and 'suggested scale' in ax.get_title()
    plot_gradient_range(learn, n_batches=1); plt.close('all')

def _fake(scales, skips, scaler):
    return SimpleNamespace(scales=scales, skips=skips, loss_scaler=scaler)

def test_scale_health_warns_once_about_skips():
    cb = _fake([2.**10] * 100, [False, True] * 50, BackoffScaler(2.**10, wait=2))
    with pytest.warns(RuntimeWarning, match="50 of the last 100 optimizer steps were skipped"): scale_health(cb)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert scale_health(cb) == []  # once
    # the leading overflows of a dynamic scale finding its level are not a problem
    ok = _fake([2.**(24 - min(i, 10)) for i in range(100)], [i < 10 for i in range(100)], BackoffScaler(wait=500))
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert scale_health(ok) == []

def test_scale_health_warns_about_a_scale_at_its_floor():
    cb = _fake([1.] * 50, [False] * 50, BackoffScaler(1., wait=500))
    with pytest.warns(RuntimeWarning, match="sits at its floor"): scale_health(cb)
    static = _fake([1.] * 50, [False] * 50, StaticScaler(1.))  # a static scale of 1 is not stuck
    assert scale_health(static) == []

def test_scale_health_knows_every_dynamic_scaler():
    "The floor warning fires for any dynamic strategy (it never did for LogNormalScaler), from `is_dynamic`/`floor`."
    cb = _fake([2.] * 50, [False] * 50, LogNormalScaler(2., min_scale=2.))
    with pytest.warns(RuntimeWarning, match=r"sits at its floor \(2\)"): scale_health(cb)

def test_mixed_precision_warns_during_a_fit():
    "A scale that keeps growing back into overflow (scale_wait=1) makes MixedPrecision warn at the end of the epoch."
    learn = synth_learner(n=400).to_fp16(max_loss_scale=2.**24, scale_wait=1)
    with learn.no_bar(), learn.no_logging(), pytest.warns(RuntimeWarning, match="optimizer steps were skipped"):
        learn.fit(1)

def test_no_16bit_grads_left_on_fp32_params():
    "A 16-bit fit must not leave fp16 `.grad`s on the restored FP32 params: later FP32 training would accumulate in fp16."
    learn = synth_learner().to_fp16()
    quiet_fit(learn)
    assert all(p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32)
               for p in learn.model.parameters())
    learn.to_fp32()
    quiet_fit(learn)
    assert all(p.grad.dtype == torch.float32 for p in learn.model.parameters())

# ---- the floor warning for LogNormalScaler --------------------------------------------------------------------

def test_scale_health_floor_warning_for_lognormal_scaler():
    "Before the fix: `health` took a scaler without a `wait` attribute for a static one: LogNormalScaler never warned."
    cb = SimpleNamespace(scales=[1.] * 50, skips=[False] * 50, loss_scaler=LogNormalScaler(init_scale=1., min_scale=1.))
    with pytest.warns(RuntimeWarning, match='sits at its floor'): scale_health(cb)

# ---- a fit whose every step was skipped -----------------------------------------------------------------------

class NaNLoss(Callback):
    "Every training loss NaN: every step is skipped."
    order = 5
    def after_loss(self):
        if self.training: self.learn.loss_grad = self.learn.loss_grad * float('nan')

@pytest.mark.parametrize('call', ['to_fp16', 'to_bf16', 'to_native_fp16'])
def test_fit_with_every_step_skipped_warns(call):
    """Before the fix: no error and no warning (the skip warning counted the leading skips as the dynamic scale's
    calibration)."""
    learn = getattr(make_learner(), call)(max_skipped=100)
    w0 = weights(learn)
    with pytest.warns(RuntimeWarning, match='skipped'): fit_quietly(learn, 1, lr=1e-2, cbs=NaNLoss())
    for a, b in zip(weights(learn), w0): assert torch.equal(a, b)

# ---- overflow attribution, the collapse's origin and remedy, precision_check ------------------------------------------

import random
import numpy as np
from fastai.basics import Adam
from fp16cb import MixedPrecision, NativeMixedPrecision, LossScaleError
from fp16cb.scaling import OverflowLog
from fp16cb.policy import PrecisionPolicy
from fp16cb.dtypes import has_fast_half_math
from fp16cb.diagnostics.overflow import Precision, diagnose_collapse
from conftest import count_host_reads

class Amplify(nn.Module):
    "Multiplies by `k`: activations beyond fp16's range (an unscaled attention logit, a residual stream that grows)."
    def __init__(self, k:float): super().__init__(); self.k = k
    def forward(self, x): return x * self.k

class _Boost(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x): return x.view_as(x)
    @staticmethod
    def backward(ctx, g): return g * 1e6

class GradBoost(nn.Module):
    "The identity forward; its backward multiplies the gradient by 1e6 (beyond fp16's range at any loss scale >= 1)."
    def forward(self, x): return _Boost.apply(x)

def amplified(k=1e5):
    "'1.0' overflows fp16 in the forward; '1.1' (LayerNorm) brings it back in range in FP32; '1' holds both."
    return nn.Sequential(nn.Linear(4, 8), nn.Sequential(Amplify(k), nn.LayerNorm(8)), nn.ReLU(), nn.Linear(8, 1))

def boosted(): return nn.Sequential(nn.Linear(4, 8), GradBoost(), nn.ReLU(), nn.Linear(8, 1))

class WriteInto(Callback):
    "Before our precision callbacks see the grads (order 5): `value` into the grad of param `name` at the steps `steps`."
    order = 5
    def __init__(self, param, steps, value=float('inf')): self.param, self.steps, self.value, self.n = param, set(steps), value, 0
    def after_backward(self):
        if self.n in self.steps:
            g = dict(self.learn.model.named_parameters())[self.param].grad
            g.view(-1)[0] = self.value
        self.n += 1

def _precision_cb(learn): return scaling_callback(learn)

ATTRIBUTION = {'masters': ('to_fp16', dict(max_loss_scale=2.**8), float('inf')),
               'flat': ('to_fp16', dict(max_loss_scale=2.**8, flat_master=True), float('inf')),
               'half_storage': ('to_fp16', dict(max_loss_scale=2.**8, half_storage=True), float('inf')),
               'bf16': ('to_bf16', {}, float('nan')), 'bf16_half_storage': ('to_bf16', dict(half_storage=True), float('nan')),
               'native_fp16': ('to_native_fp16', dict(init_scale=2.**8), float('inf')),
               'native_bf16': ('to_native_bf16', {}, float('nan'))}

@pytest.mark.parametrize('mode', list(ATTRIBUTION))
def test_a_skipped_step_names_the_param_whose_grad_overflowed(mode, monkeypatch):
    "Each skipped step is logged with its step index, its scale and exactly the param we wrote inf/NaN into; no host read more."
    meth, kw, value = ATTRIBUTION[mode]
    learn = getattr(make_learner(), meth)(**kw)
    cb = _precision_cb(learn)
    calls = count_host_reads(monkeypatch, type(cb))
    fit_quietly(learn, 1, lr=1e-2, cbs=WriteInto('3.weight', [2], value))
    monkeypatch.undo()
    assert cb.skips == [False, False, True, False]
    assert cb.overflows == [{'step': 2, 'scale': cb.scales[2], 'params': ['3.weight']}] and cb.n_overflows == 1
    per_step = 2 if mode == 'native_fp16' else 1  # GradScaler's own read, then the scale (test_native_host_reads_per_step)
    confirm = meth == 'to_bf16' and DEVICE.type == 'cpu'  # a CPU's summed check: the overflow step reads the exact one too
    # the attribution is read later, not in the step; but a bf16 fit's first skip, never normal, is said at once,
    # naming the params: one read more on that step (test_a_bf16_skip_is_said_at_once_naming_the_params)
    said = meth in ('to_bf16', 'to_native_bf16')
    assert len(calls) == 4 * per_step + confirm + said, calls

@pytest.mark.parametrize('meth', ['to_bf16', 'to_fp16', 'to_native_bf16'])
def test_a_bf16_skip_is_said_at_once_naming_the_params(meth):
    """bf16 has FP32's range: a step skipped for inf/NaN is never normal. Before the fix a bf16 fit said nothing unless
    every step was skipped (or 51 in a row). Now the fit's first bf16 skip warns at that step, naming the params whose
    grads held inf/NaN and their modules; once a fit. fp16's skips stay quiet: its dynamic scale backs off by skipping."""
    said = lambda w: [str(o.message) for o in w if 'a bf16 step was skipped' in str(o.message)]
    kw = dict(max_loss_scale=2.**8) if meth == 'to_fp16' else {}
    learn = getattr(make_learner(), meth)(**kw)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        seen = Record(after_batch=lambda l: len(said(w)))
        for _ in range(2): fit_quietly(learn, 1, lr=1e-2, cbs=[WriteInto('3.weight', [1, 2], float('nan')), seen])
    assert sum(_precision_cb(learn).skips) == 4
    if meth == 'to_fp16': assert said(w) == []; return
    train = seen.log['after_batch']  # the training batches: 4 a fit (before, `to_native_bf16` said nothing: [0]*8)
    assert train == [0, 1, 1, 1, 1, 2, 2, 2], train  # at the first skipped step of each fit, not at its end
    assert "in the grads of '3.weight' (modules '3')" in said(w)[0] and 'keep_fp32' in said(w)[0]

BURSTS = {'to_fp16': dict(max_loss_scale=2.**8), 'to_native_fp16': dict(init_scale=2.**8)}

@pytest.mark.parametrize('meth', list(BURSTS))
@pytest.mark.parametrize('steps,burst', [((4, 5, 6, 7), True), ((4, 6, 9), False)])
def test_an_fp16_fit_that_skips_more_than_a_healthy_one_is_told_at_once(meth, steps, burst):
    """4 of 8 steps skipped once the scale has settled: no healthy fp16 fit measured skips so often (at most 3 of 8
    with the scale trying to grow every 20 steps: `python -m bench.skip_rates`). Said at the 4th skip, naming the param,
    once a fit; 3 of 8 stays quiet. Before, only the epoch's end said it (more than 5 and 10% of 200 steps), or the
    51st skip in a row."""
    burst_said = lambda w: [str(o.message) for o in w if 'no healthy fp16 fit skips so often' in str(o.message)]
    learn = getattr(make_learner(), meth)(**BURSTS[meth])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        seen = Record(after_batch=lambda l: len(burst_said(w)))
        fit_quietly(learn, 3, lr=1e-2, cbs=[WriteInto('3.weight', steps), seen])
    assert [i for i, s in enumerate(_precision_cb(learn).skips) if s] == list(steps)
    if not burst: assert burst_said(w) == []; return
    assert seen.log['after_batch'] == [0] * 7 + [1] * 5  # at the 4th skip, not at the epoch's end, and once
    assert "'3.weight' (modules '3')" in burst_said(w)[0] and 'keep_fp32' in burst_said(w)[0]

def test_attribution_spans_fits_and_names_several_params():
    learn = make_learner().to_fp16(max_loss_scale=2.**8)
    fit_quietly(learn, 1, lr=1e-2, cbs=[WriteInto('0.bias', [1]), WriteInto('1.weight', [1])])
    fit_quietly(learn, 1, lr=1e-2, cbs=WriteInto('3.bias', [0]))
    steps = [(o['step'], o['params']) for o in learn.mixed_precision.overflows]
    assert steps == [(1, ['0.bias', '1.weight']), (4, ['3.bias'])]  # names as `model.named_parameters()`, in its order

def test_the_overflow_log_is_bounded():
    assert OverflowLog().entries.maxlen == 100
    learn = make_learner().to_fp16(max_skipped=100)
    learn.mixed_precision.record.overflows = OverflowLog(keep=3)
    fit_quietly(learn, 1, lr=1e-2, cbs=NaNLoss())
    mp = learn.mixed_precision
    assert [o['step'] for o in mp.overflows] == [1, 2, 3] and mp.n_overflows == 4
    assert all(o['params'] == ['0.weight', '0.bias', '1.weight', '1.bias', '3.weight', '3.bias'] for o in mp.overflows)

# -- the collapse: where the overflow starts, and the remedy

@pytest.mark.parametrize('fast_bf16', [True, False], ids=['bf16-native', 'bf16-emulated'])
@pytest.mark.parametrize('meth', ['to_fp16', 'to_native_fp16'])
def test_the_collapse_names_the_module_whose_output_overflows(meth, fast_bf16, monkeypatch):
    """The first module whose output is inf (its input finite), not those after it; the remedy checked on the batch.
    `learn.to_bf16()` is advised only where this machine runs bf16 fast (on a CPU without native bf16, an AVX2-only
    one, it ran 2.3x slower than FP32 on a ResNet-18): before the fix the scaler's own sentence named it on any CPU.
    Both kinds of CPU are checked on any machine, as `cpu_has_native` would answer on each."""
    import fp16cb.dtypes
    if DEVICE.type == 'cpu': monkeypatch.setattr(fp16cb.dtypes, 'cpu_has_native', lambda dtype: fast_bf16)
    elif not fast_bf16: pytest.skip("a GPU runs bf16 natively")
    learn = getattr(make_learner(model=amplified()), meth)(max_skipped=2)
    with pytest.raises(LossScaleError) as e: fit_quietly(learn, 1, lr=1e-2)
    msg = str(e.value)
    assert msg.index("Mixed-precision training stopped: 3 steps in a row") < msg.index('Where it starts')  # the scaler's first
    assert "the output of '1.0' (Amplify) holds inf/NaN in the forward pass" in msg
    assert "'1.1'" not in msg and "'2'" not in msg and "'3'" not in msg  # LayerNorm, ReLU, head: they inherit it
    # '1.0' alone would give its FP32 output back to fp16 (inf again): '1' holds the LayerNorm that brings it in range
    assert "`learn.to_fp16(keep_fp32=['1'])` (checked on this batch: no inf/NaN left)" in msg
    assert ("`learn.to_bf16()`" in msg) == has_fast_half_math(torch.bfloat16, DEVICE)
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())  # torn down as after any failed fit

def test_the_collapse_names_where_the_gradient_overflows():
    "A finite forward: the module where the gradient turns inf, not the layer before it that inherits it."
    learn = make_learner(model=boosted()).to_fp16(max_skipped=2)
    with pytest.raises(LossScaleError) as e: fit_quietly(learn, 1, lr=1e-2)
    msg = str(e.value)
    assert "the forward pass is finite; the gradient turns inf/NaN first in '1' (GradBoost)" in msg
    assert "'0'" not in msg and "'3'" not in msg

def test_the_collapse_from_outside_the_model_says_so_with_the_params():
    learn = make_learner().to_bf16(max_skipped=2)
    with pytest.raises(LossScaleError) as e: fit_quietly(learn, 1, lr=1e-2, cbs=WriteInto('3.bias', range(9), float('nan')))
    msg = str(e.value)
    assert "came from outside its forward and backward" in msg and "held inf/NaN at the last skipped step: 3.bias" in msg

def test_the_diagnosis_leaves_the_live_model_and_the_rng_untouched():
    "On copies: the model's weights, BatchNorm statistics, mode, hooks and grads, and the RNG, are as they were."
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(.5), nn.Sequential(Amplify(1e5), nn.LayerNorm(8)),
                          nn.Linear(8, 1))
    learn = make_learner(model=model, splitter=lambda m: [list(m.parameters())])
    learn.xb, learn.yb = (torch.randn(16, 4, device=DEVICE),), (torch.randn(16, 1, device=DEVICE),)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    rng, py, npy = torch.get_rng_state(), random.getstate(), np.random.get_state()
    d = diagnose_collapse(learn, Precision(torch.float16, PrecisionPolicy()), 1., LossScaleError('stopped'))
    assert "'3.0' (Amplify)" in str(d.error) and d.keep == ['3'] and not d.applicable  # not asked to apply it
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in sd.items())
    assert model.training and all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert torch.equal(torch.get_rng_state(), rng) and random.getstate() == py and np.array_equal(np.random.get_state()[1], npy[1])

def test_on_collapse_keep_fp32_promotes_the_module_and_the_fit_finishes():
    learn = make_learner(model=amplified(), n_train=128).to_fp16(max_skipped=2, on_collapse='keep_fp32')
    with pytest.warns(RuntimeWarning, match=r"'1\.0' \(Amplify\).*on_collapse='keep_fp32': \['1'\] are kept FP32 from now on"):
        with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
    mp = learn.mixed_precision
    assert mp.skips == [True] * 3 + [False] * 5 and mp.scaler.skipped_in_a_row == 0
    assert learn.model_to_half.policy.specs == ('batchnorm', '1') and len(learn.recorder.values) == 1
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in learn.model.parameters())
    fit_quietly(learn, 1, lr=1e-2)  # the next fit starts with '1' FP32: no step skipped
    assert not any(mp.skips[8:]) and len(mp.skips) == 16

def test_on_collapse_is_checked_and_shown():
    import inspect
    from fastai.basics import Learner
    for bad in ('promote', True, None):
        with pytest.raises(ValueError, match='on_collapse'): MixedPrecision(on_collapse=bad)
    with pytest.raises(ValueError, match='on_collapse'): make_learner().to_bf16(on_collapse='Keep_FP32')
    with pytest.raises(TypeError, match=r"to_fp16\(\)"): make_learner().to_native_fp16(on_collapse='keep_fp32')
    for meth in ('to_fp16', 'to_bf16'):
        assert inspect.signature(getattr(Learner, meth)).parameters['on_collapse'].default == 'raise'
    assert MixedPrecision(on_collapse='keep_fp32').on_collapse == 'keep_fp32'

# -- precision_check

def _state(learn):
    "Everything precision_check must leave as it is."
    mp = scaling_callback(learn) if learn.precision_callbacks() else None
    return dict(sd={k: v.clone() for k, v in learn.model.state_dict().items()},
                opt={k: (v.clone() if isinstance(v, torch.Tensor) else v) for s in learn.opt.state.values() for k, v in s.items()}
                    if learn.opt is not None else None,
                opt_keys=[id(p) for p in learn.opt.state] if learn.opt is not None else None,
                cbs=[id(cb) for cb in learn.cbs], training=learn.model.training,
                scaler=dict(mp.loss_scaler.state_dict()) if mp is not None else None,
                scales=list(mp.scales) if mp is not None else None,
                policy=repr(learn.model_to_half.policy) if hasattr(learn, 'model_to_half') else None,
                recorder=[list(v) for v in learn.recorder.values],
                rng=torch.get_rng_state(), py=random.getstate(), np=np.random.get_state()[1].copy(),
                dl=learn.dls.train.rng.getstate(), hooks=sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in learn.model.modules()))

def _same(a, b):
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            assert x.keys() == y.keys(), k
            for kk in x: assert (torch.equal(x[kk], y[kk]) if isinstance(x[kk], torch.Tensor) else x[kk] == y[kk]), (k, kk)
        elif isinstance(x, (torch.Tensor, np.ndarray)): assert (x == y).all(), k
        else: assert x == y, k

def _bn_dropout_learner(shuffle=True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(.2), nn.ReLU(), nn.Linear(8, 1))
    learn = make_learner(model=model, opt_func=Adam, splitter=lambda m: [list(m.parameters())])
    learn.dls.train.shuffle = shuffle
    return learn

@pytest.mark.parametrize('meth', ['to_fp16', 'to_bf16', 'to_native_fp16', None])
def test_precision_check_leaves_the_learner_exactly_as_it_was(meth):
    """Weights, BatchNorm statistics, optimizer state, callbacks and their order, the precision set-up, the RNGs (and
    the data's shuffling), the recorder, the model's mode: as before; and training on gives bit-identical weights."""
    learns = [_bn_dropout_learner(), _bn_dropout_learner()]
    for l in learns:
        if meth: getattr(l, meth)()
        torch.manual_seed(1); fit_quietly(l, 1, lr=1e-3)  # the same dropout in both
        l.model.eval()
    before = _state(learns[0])
    df = learns[0].precision_check(n_batches=3, plot=False)
    assert len(df) and df.attrs['n_batches'] == 3
    _same(before, _state(learns[0]))
    for l in learns: torch.manual_seed(2); fit_quietly(l, 1, lr=1e-3)  # the data's own shuffling as it was, too
    for a, b in zip(learns[0].model.state_dict().values(), learns[1].model.state_dict().values()): assert torch.equal(a, b)

def test_precision_check_flags_the_module_where_the_overflow_starts():
    learn = make_learner(model=amplified()).to_fp16()
    df = learn.precision_check(n_batches=4, plot=False)
    assert {'overflow', 'underflow', 'swallowed', 'rel_diff', 'max_fp32'} <= set(df.columns)
    assert list(df.index) == ['0', '1.0', '1.1', '3']  # the modules with params, and where the overflow starts
    assert df['overflow'].to_dict() == {'0': 0, '1.0': 4, '1.1': 0, '3': 0}
    assert df.loc['1.0', 'max_fp32'] > 65504 and df.loc['1.0', 'rel_diff'] == float('inf')
    assert df.attrs['advice'].startswith("keep_fp32=['1']: `learn.to_fp16(keep_fp32=['1'])`")
    assert df.attrs['keep_fp32'] == ['1'] and math.isfinite(df.attrs['loss_fp32']) and math.isnan(df.attrs['loss_16bit'])
    learn.to_fp16(keep_fp32=['1'])  # the advice followed: nothing overflows
    ok = learn.precision_check(n_batches=4, plot=False)
    assert ok['overflow'].sum() == 0 and ok.loc['1.1', 'dtype'] == 'float32' and ok.attrs['advice'].startswith('safe')
    assert abs(ok.attrs['loss_16bit'] / ok.attrs['loss_fp32'] - 1) < 1e-2

def test_precision_check_on_a_safe_model_and_the_gradient_origin():
    df = make_learner().precision_check(n_batches=2, plot=False)  # no precision set: fp16cb's default to_fp16()
    assert df.attrs['advice'].startswith('safe') and df['overflow'].sum() == 0 and (df['underflow'] == 0).all()
    assert 'default' in df.attrs['mode'] and df.attrs['loss_scale'] > 1 and (df['rel_diff'] < 1e-2).all()
    g = make_learner(model=boosted()).precision_check(n_batches=2, plot=False)
    assert g['overflow'].to_dict() == {'0': 0, '1': 2, '3': 0}  # GradBoost, not the Linear before it
    assert g.attrs['advice'].startswith('use to_bf16')

def test_precision_check_advice_names_16bit_state_for_memory():
    "Safe in 16-bit: the advice says where memory is to be had (the optimizer's state in bf16), unless it is taken."
    df = make_learner().to_bf16().precision_check(n_batches=2, plot=False)
    assert df.attrs['advice'].startswith('safe') and '`state_dtype=torch.bfloat16`' in df.attrs['advice']
    df = make_learner().to_bf16(state_dtype=torch.bfloat16).precision_check(n_batches=2, plot=False)
    assert df.attrs['advice'].startswith('safe') and 'state_dtype' not in df.attrs['advice']
    assert 'state_dtype' not in make_learner().to_native_bf16().precision_check(n_batches=2, plot=False).attrs['advice']

def test_precision_check_measures_underflow_and_swallowed_updates():
    tiny = synth_learner(factor=2.**-30).to_fp16(loss_scale=1., dynamic=False)  # gradients under fp16's smallest at scale 1
    df = tiny.precision_check(n_batches=2, plot=False)
    assert df.loc['0', 'underflow'] > .5 and df.attrs['advice'].startswith('underflow')
    slow = synth_learner().to_fp16(half_storage=True)
    slow.lr = 1e-9  # updates far under half a 16-bit spacing of the weights
    df = slow.precision_check(n_batches=2, plot=False)
    assert df.loc['0', 'swallowed'] == 1. and df.loc['1', 'swallowed'] < 1. and df.attrs['advice'].startswith('swallowed')

@pytest.mark.parametrize('sr', [True, False])
def test_precision_check_advice_takes_the_current_settings_into_account(sr):
    """Before the fix: with `half_storage=True` (stochastic rounding on by default), the advice for swallowed updates
    was `stochastic_rounding=True`, already set. The advice names only what would change something."""
    slow = synth_learner().to_fp16(half_storage=True, stochastic_rounding=sr)
    slow.lr = 1e-9  # updates far under half a 16-bit spacing of the weights
    advice = slow.precision_check(n_batches=2, plot=False).attrs['advice']
    assert advice.startswith('swallowed') and 'half_storage=False' in advice
    assert ('stochastic_rounding=True' in advice) == (not sr)

def test_precision_check_plots():
    from fp16cb import precision_check, plot_precision_check
    df = precision_check(make_learner(model=amplified()), n_batches=2)  # plot=True by default, as lr_find
    axs = plt.gcf().axes
    assert len(axs) == 4 and [a.get_title() for a in axs][0] == 'overflow (batches)'
    assert [b.get_width() for b in axs[0].patches] == [0, 0, 2, 0]  # bottom-up: '3', '1.1', '1.0' (2 batches), '0'
    plt.close('all')
    assert len(plot_precision_check(df)) == 4; plt.close('all')

# ---- the loss-scale history outlives the callbacks; figures saved from a script keep all their text

@pytest.mark.parametrize('meth', ['to_fp16', 'to_native_fp16'])
def test_the_loss_scale_history_outlives_to_fp32(meth):
    """Before the fix: after the quick start's closing `learn.to_fp32()` the callbacks were gone, and with them the
    history (`learn.mixed_precision.scales`) and `plot_loss_scale(learn)` ('no loss-scale history'). It stays on the
    learner, as fastai's `Recorder` keeps its values; a second fit of the same setup adds to it (the scale goes on),
    a new setup's first fit replaces it; the learner still copies and exports."""
    import copy, pickle
    from fp16cb.checkpoint import without_precision
    learn = make_learner(n_train=48)  # 3 steps a fit
    getattr(learn, meth)(**({'loss_scale': 2.**24} if meth == 'to_fp16' else {'init_scale': 2.**24}))
    quiet_fit(learn, 1); quiet_fit(learn, 1)
    cb = scaling_callback(learn)
    scales, skips = list(cb.scales), list(cb.skips)
    assert len(scales) == 6 and any(skips)
    learn.to_fp32()
    h = learn.loss_scale_history
    assert (h.scales, h.skips, h.n_skipped) == (scales, skips, sum(skips))
    ax = plot_loss_scale(learn)
    assert len(ax.collections[0].get_offsets()) == sum(skips) and f"of 6 steps skipped" in ax.get_title()
    plt.close('all')
    quiet_fit(learn, 1)  # an FP32 fit keeps it
    assert learn.loss_scale_history.scales == scales
    assert copy.deepcopy(learn).loss_scale_history.scales == scales
    assert pickle.loads(pickle.dumps(learn)).loss_scale_history.scales == scales
    with without_precision(learn):  # what `learn.export` writes (for inference: `load_learner` needs fastai alone)
        assert 'loss_scale_history' not in learn.__dict__
    assert learn.loss_scale_history.scales == scales
    getattr(learn, meth)(); quiet_fit(learn, 1)  # a new setup: its own history
    assert len(learn.loss_scale_history.scales) == 3

def test_the_loss_scale_history_is_the_sequence_of_scales():
    """The README calls `learn.loss_scale_history` the loss scale of every step: before the fix `h[-1]`, `list(h)` and
    `plt.plot(h)` raised `TypeError` (the values were only in `.scales`). It is a sequence of the scales, `.skips`
    beside them, and copies and pickles as a sequence."""
    import copy, pickle
    learn = make_learner(n_train=48).to_fp16(loss_scale=2.**24)
    quiet_fit(learn, 1)
    learn.to_fp32()
    h = learn.loss_scale_history
    scales = list(learn.loss_scale_history.scales)
    assert len(scales) == 3 and h[-1] == scales[-1] and h[0] == scales[0] and h[1:] == scales[1:]
    assert list(h) == scales and [s for s in h] == scales and list(reversed(h)) == scales[::-1]
    assert np.asarray(h).tolist() == scales and np.asarray(h).dtype == np.float64
    line, = plt.plot(h)
    assert list(line.get_ydata()) == scales
    plt.close('all')
    assert h.skips == learn.loss_scale_history.skips and len(h.skips) == 3 and h.n_skipped == sum(h.skips)
    for c in (copy.deepcopy(h), pickle.loads(pickle.dumps(h))): assert list(c) == scales and c.skips == h.skips

def _cut_text(fig) -> list:
    """What of `fig`'s text lies outside it once drawn: each axes' title, axis labels and legend, each axis with its
    drawn tick labels, and the figure's suptitle and legends, by name and window extent."""
    r = fig.canvas.get_renderer()
    parts = [(f'suptitle {fig._suptitle.get_text()!r}', fig._suptitle)] if fig._suptitle is not None else []
    parts += [(f'figure legend {i}', l) for i, l in enumerate(fig.legends)]
    for i, ax in enumerate(fig.axes):
        parts += [(f'axes {i} title {t.get_text()!r}', t) for t in (ax.title, ax._left_title, ax._right_title)]
        parts += [(f'axes {i} {a.axis_name}-axis {a.label.get_text()!r}', a) for a in (ax.xaxis, ax.yaxis)]
        if ax.get_legend() is not None: parts.append((f'axes {i} legend', ax.get_legend()))
    box, out = fig.bbox.padded(0.5), []
    for name, a in parts:
        if not a.get_visible() or getattr(a, 'get_text', lambda: 'x')() == '': continue
        e = a.get_tightbbox(r) if hasattr(a, 'axis_name') else a.get_window_extent(r)
        if e is not None and not (box.x0 <= e.x0 and e.x1 <= box.x1 and box.y0 <= e.y0 and e.y1 <= box.y1):
            out.append((name, tuple(round(float(v)) for v in e.extents)))
    return out

def test_figures_save_whole_from_a_script(tmp_path):
    """Before the fix: `plot_gradient_range`'s legend sat outside the figure and `plot_loss_scale`'s x-label was cut: a
    plain `fig.savefig(path)` (no `bbox_inches='tight'`, which notebooks add) cropped them. Each figure, saved so with
    the Agg backend, holds every title, label and legend inside it."""
    from fp16cb import plot_precision_check
    learn = synth_learner().to_fp16(loss_scale=2.**24)
    quiet_fit(learn, 2)
    figs = {'loss scale': plot_loss_scale(learn).figure,
            'gradient range': plot_gradient_range(gradient_report(synth_learner(factor=2.**-30))).figure,
            'precision check': plot_precision_check(make_learner(model=amplified()).precision_check(n_batches=2,
                                                                                                  plot=False))[0].figure}
    for fig in figs.values(): fig.savefig(tmp_path/'figure.png')
    cut = {name: c for name, fig in figs.items() if (c := _cut_text(fig))}
    plt.close('all')
    assert not cut, cut
