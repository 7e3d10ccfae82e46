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
from conftest import DEVICE, make_learner, weights
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
