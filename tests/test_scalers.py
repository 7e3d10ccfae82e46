"""Loss scalers: the state machines (hypothesis), LogNormal on synthetic gradient streams, the loud failure, training;
the first dynamic scale, calibrated from the first step's gradients, or an explicit `loss_scale`."""
import math, random, warnings
import pytest, torch
from torch import nn
from hypothesis import given, settings, strategies as st
from fastai.basics import Learner, DataLoaders, BCEWithLogitsLossFlat, MSELossFlat, set_seed, Callback
from fp16cb import StaticScaler, BackoffScaler, LogNormalScaler, LossScaleError, MixedPrecision
from fp16cb.scaling import make_scaler, FP16_MAX
from fp16cb.scaling import OverflowCheck, underflow_flag
from fp16cb.demos.experiments import make_learner as digits_learner, train
from conftest import DEVICE, quiet_fit, count_host_reads, StepSpy, CancelSteps, updates, assert_close_updates
from conftest import make_learner as synth_learner  # conftest's two-group regression (`make_learner` here: a classifier)

warnings.filterwarnings('ignore', message='(fp16|bf16) training on the CPU')
FAST = settings(max_examples=60, deadline=None)

# ---------- Static ----------
@FAST
@given(st.floats(1e-3, 1e6), st.lists(st.booleans(), max_size=60))
def test_static_never_moves(scale, flags):
    s = StaticScaler(scale, max_skipped=100)
    for f in flags: s.update(f)
    assert s.scale == scale and s.n_skipped == sum(flags) and s.n_steps == len(flags)

# ---------- Backoff: compared step by step with Megatron's DynamicGradScaler, written out independently ----------
def megatron_ref(flags, init, factor, wait, lo, hi, hyst):
    "Megatron-LM's DynamicGradScaler.update (plus bounds at init and the error at min), as a list of scales."
    scale, growth, hyst_left, out = min(max(init, lo), hi), 0, hyst, []
    for f in flags:
        if f:
            growth = 0; hyst_left -= 1
            if hyst_left <= 0:
                if scale <= lo: out.append('error'); return out
                scale = max(scale / factor, lo)
        else:
            growth += 1
            if growth == wait: growth, hyst_left, scale = 0, hyst, min(scale * factor, hi)
        out.append(scale)
    return out

@FAST
@given(flags=st.lists(st.booleans(), max_size=80), factor=st.sampled_from([1.5, 2., 4.]), wait=st.integers(1, 6),
       lo=st.sampled_from([1., 2., 16.]), hi_exp=st.integers(4, 12), init_exp=st.integers(0, 14), hyst=st.integers(1, 3))
def test_backoff_matches_reference(flags, factor, wait, lo, hi_exp, init_exp, hyst):
    hi = max(2.**hi_exp, lo)
    s = BackoffScaler(2.**init_exp, factor, wait, min_scale=lo, max_scale=hi, hysteresis=hyst, max_skipped=1000)
    ref = megatron_ref(flags, 2.**init_exp, factor, wait, lo, hi, hyst)
    got = []
    for f in flags:
        try: s.update(f)
        except LossScaleError as e:
            assert 'min_loss_scale' in str(e) and 'Likely causes' in str(e)
            got.append('error'); break
        assert lo <= s.scale <= hi  # bounds always
        got.append(s.scale)
    assert got == ref

def test_backoff_growth_timing_and_counter_reset():
    s = BackoffScaler(64., 2., wait=3, max_scale=1024.)
    for _ in range(2): s.update(False)
    s.update(True)  # overflow: halve and reset the growth counter (fastai's old code did not)
    assert s.scale == 32.
    for _ in range(2): s.update(False)
    assert s.scale == 32.  # 2 clean steps since the overflow: not yet
    s.update(False)
    assert s.scale == 64.

def test_backoff_hysteresis():
    s = BackoffScaler(64., 2., wait=100, hysteresis=3)
    s.update(True); s.update(True)
    assert s.scale == 64. and s.n_skipped == 2  # tolerated, still skipped
    s.update(True); assert s.scale == 32.
    s.update(True); assert s.scale == 16.  # hysteresis used up: every overflow drops until the scale grows again

# ---------- LogNormal ----------
def simulate(s, rng, mu, sigma, n, max_value=FP16_MAX):
    "Feed `n` steps whose max |grad| is 2**N(mu, sigma); a step overflows when the scaled max exceeds `max_value`."
    overflows, logs = 0, []
    for _ in range(n):
        m = 2. ** rng.gauss(mu, sigma)
        found = m * s.scale > max_value
        overflows += found; logs.append(math.log2(s.scale))
        s.update(found, float('inf') if found else m)
    return overflows, logs

@pytest.mark.parametrize('mu,sigma', [(-12., .5), (-3., 1.5), (4., 1.)])
def test_lognormal_converges_and_rarely_overflows(mu, sigma):
    s = LogNormalScaler(pow2=False, max_scale=2.**40)
    simulate(s, random.Random(1), mu, sigma, 300)  # burn-in
    ov, logs = simulate(s, random.Random(2), mu, sigma, 20000)
    assert abs(s.mu - mu) < .2 and abs(s.sigma - sigma) < .2
    assert 4 <= ov <= 45, ov  # target 0.001 * 20000 = 20 (the estimate is noisy: an EMA over ~100 steps)
    z = s.z
    assert abs(sum(logs) / len(logs) - (math.log2(FP16_MAX) - mu - z * sigma)) < .3  # not needlessly small either

def test_lognormal_pow2_rounds_down():
    s = LogNormalScaler()
    ov, logs = simulate(s, random.Random(3), -8., 1., 5000)
    assert all(l == int(l) for l in logs) and ov <= 5  # floor to a power of 2: at most the target rate

@FAST
@given(st.lists(st.tuples(st.booleans(), st.floats(-40, 40)), max_size=80), st.integers(0, 10), st.integers(10, 30),
       st.booleans())
def test_lognormal_bounds_and_failure(steps, lo_exp, hi_exp, pow2):
    lo, hi = 2.**lo_exp, 2.**hi_exp
    s = LogNormalScaler(min_scale=lo, max_scale=hi, pow2=pow2, max_skipped=10)
    for found, x in steps:
        before = s.scale
        try: s.update(found, float('nan') if found else 2.**x)
        except LossScaleError:
            assert found and (before <= lo or s.skipped_in_a_row > 10); return
        assert lo <= s.scale <= hi
        if found: assert s.scale <= max(before / 2, lo)  # an overflow always backs off
        if pow2: assert math.log2(s.scale) == int(math.log2(s.scale))

def test_lognormal_overflow_is_a_censored_observation():
    s = LogNormalScaler(pow2=False)
    simulate(s, random.Random(4), -6., .5, 200)
    mu, n, scale = s.mu, s.n_obs, s.scale
    s.update(True, float('inf'))
    cutoff = math.log2(FP16_MAX / scale)
    assert s.n_obs == n + 1 and s.mu > mu  # the imputed observation E[X | X > cutoff] > cutoff pulls the mean up
    assert s.mu == pytest.approx(mu + (max(cutoff, mu) - mu) / s.window, abs=.05) or s.mu > mu + (cutoff - mu) / s.window
    assert s.scale <= scale / 2

def test_lognormal_adapts_to_a_shift():
    s = LogNormalScaler()
    simulate(s, random.Random(5), -10., .5, 500)
    ov, _ = simulate(s, random.Random(6), -6., .5, 500)  # the gradients grow 16x at once
    assert ov <= 15 and abs(s.mu - (-6.)) < .5

def test_lognormal_warmup_and_zero_grads():
    s = LogNormalScaler(init_scale=2.**10)
    s.update(True, float('inf')); assert s.scale == 2.**9 and s.n_obs == 0  # no statistics yet: back off only
    s.update(False, 0.); assert s.scale == 2.**9 and s.n_obs == 0  # an all-zero gradient says nothing
    s.update(False, 2.**-10)
    assert s.n_obs == 1 and s.sigma == 1.  # one observation: sigma floored at 1 bit during warm-up
    assert s.scale == 2.**math.floor(math.log2(FP16_MAX) + 10 - s.z)
    with pytest.raises(ValueError, match='largest'): s.update(False, None)

def test_state_dict_roundtrip_continues_identically():
    for make in (lambda: LogNormalScaler(), lambda: BackoffScaler(2.**10, wait=3, hysteresis=2)):
        a = make(); simulate(a, random.Random(7), -4., 1., 300)
        b = make(); b.load_state_dict(a.state_dict())
        assert simulate(a, random.Random(8), -4., 1., 300) == simulate(b, random.Random(8), -4., 1., 300)
    with pytest.raises(ValueError, match='cannot be loaded'): StaticScaler(1.).load_state_dict(LogNormalScaler().state_dict())

@pytest.mark.parametrize('cls', [StaticScaler, BackoffScaler, LogNormalScaler])
def test_max_skipped_in_a_row(cls):
    s = cls(2.**24, max_skipped=5) if cls is StaticScaler else cls(2.**24, max_skipped=5, min_scale=1e-30)
    for _ in range(4): s.update(True, float('nan'))
    s.update(False, 1.)  # a clean step resets the run
    for _ in range(5): s.update(True, float('nan'))
    with pytest.raises(LossScaleError, match='6 steps in a row'): s.update(True, float('nan'))

def test_make_scaler_and_bad_input():
    kw = dict(loss_scale=512, dynamic=True, max_loss_scale=2.**20, div_factor=2., scale_wait=100)
    s = make_scaler(None, **kw)
    assert isinstance(s, BackoffScaler) and s.scale == 1. and not s.calibrated and s.max_scale == 2.**20  # calibrates
    s = make_scaler(None, **{**kw, 'loss_scale': 2.**10})
    assert s.scale == 2.**10 and s.calibrated and not s.needs_max_grad  # an explicit loss_scale is the start
    assert isinstance(make_scaler(None, **{**kw, 'dynamic': False}), StaticScaler)
    ln = make_scaler('LogNormal', **kw)
    assert isinstance(ln, LogNormalScaler) and ln.scale == 1. and ln.calibrating and ln.max_scale == 2.**20 and ln.needs_max_grad
    ln2 = make_scaler('lognormal', **{**kw, 'loss_scale': 2.**12})  # an explicit loss_scale is the start, as for backoff
    assert ln2.scale == 2.**12 and not ln2.calibrating
    assert ln.max_value == 65504.  # fp16's largest finite value, by default
    assert make_scaler('lognormal', **kw, dtype=torch.float16).max_value == 65504.
    assert make_scaler('lognormal', **kw, dtype=torch.bfloat16).max_value == torch.finfo(torch.bfloat16).max
    assert make_scaler('lognormal', **kw, dtype='bf16').max_value == torch.finfo(torch.bfloat16).max
    bf = make_learner().to_bf16(scaler='lognormal', dynamic=True).mixed_precision.scaler
    assert isinstance(bf, LogNormalScaler) and bf.max_value == torch.finfo(torch.bfloat16).max  # bf16's own range
    inst = StaticScaler(3.); assert make_scaler(inst, **kw) is inst
    with pytest.raises(ValueError, match='lognormal'): make_scaler('logmax', **kw)
    for bad in [dict(overflow_prob=0.), dict(overflow_prob=.7), dict(window=0), dict(min_sigma=-1.), dict(backoff=1.),
                dict(min_scale=4., max_scale=2.), dict(init_scale=float('nan'))]:
        with pytest.raises(ValueError): LogNormalScaler(**bad)
    with pytest.raises(ValueError, match='hysteresis'): BackoffScaler(hysteresis=0)

# ---------- with a learner ----------
def make_learner(n=96, bs=16, seed=0, loss_func=None):
    set_seed(seed)
    x = torch.randn(n + 32, 8); y = (x[:, :2].sum(1, keepdim=True) > 0).float()
    dls = DataLoaders.from_dsets(list(zip(x[:n], y[:n])), list(zip(x[n:], y[n:])), bs=bs, shuffle=False, device=DEVICE)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(DEVICE)
    return Learner(dls, model, loss_func=loss_func or BCEWithLogitsLossFlat())

class MaxGrad(StepSpy):
    "Records the largest |master grad| the optimizer steps with (unscaled), per step."
    @property
    def maxes(self): return [max(g.abs().max().item() for g in gs) for gs in self.grads()]

@pytest.mark.parametrize('scaler', ['backoff', 'lognormal', 'static'])
def test_training_with_each_strategy(scaler):
    learn = make_learner().to_fp16(scaler=scaler, scale_wait=3)
    mg = MaxGrad()
    with learn.no_logging(): learn.fit(2, 1e-2, cbs=mg)
    mp = learn.mixed_precision
    assert len(mp.scales) == len(mp.skips) == 12 and mp.n_skipped == sum(mp.skips)
    # printed during the fit (dynamic scales only), then out of the recorded metrics (tests/test_callbacks.py)
    assert list(learn.recorder.metric_names) == ['epoch', 'train_loss', 'valid_loss', 'time']
    assert len(learn.recorder.values[-1]) == 2
    assert learn.recorder.values[-1][0] < learn.recorder.values[0][0] + .05 and learn.model[0].weight.dtype == torch.float32
    assert len(learn.metrics) == 0  # the columns leave with the fit: validate() is unchanged
    if scaler == 'lognormal':  # the max |grad| reached the scaler from the overflow check's single sync
        s = mp.scaler
        assert s.n_obs == 12 - mp.n_skipped
        assert s.mu == pytest.approx(sum(math.log2(m) for m in mg.maxes) / len(mg.maxes), rel=1e-5)
    if scaler == 'backoff':  # step 0 at scale 1 calibrates; then growth after 3 clean steps, bounded by 2**24
        assert mp.scales[0] == 1. and mp.scales[1] > 1. and max(mp.scales) <= 2.**24
        assert mp.scales[4] == min(2 * mp.scales[1], 2.**24) or mp.n_skipped

class Skipped(Callback): "A user's callback whose name is one of `NativeMixedPrecision`'s attributes (`skipped`)."

@pytest.mark.parametrize('mode,cb', [('to_fp16', MaxGrad), ('to_native_fp16', Skipped)])
def test_no_shadowing_warning_of_ours(mode, cb):
    """Before the fix: a user's callback named `MaxGrad` is `learn.max_grad`, and `MixedPrecision` setting its own
    `self.max_grad` at each step made fastai's `Callback.__setattr__` warn "You are shadowing an attribute (max_grad)
    that exists in the learner" (native: `self.skipped`, with a callback `Skipped`)."""
    learn = getattr(make_learner(), mode)()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        with learn.no_logging(), learn.no_bar(): learn.fit(1, 1e-2, cbs=cb())
    assert not [str(w.message) for w in ws if 'shadowing' in str(w.message)]

def test_overflow_check_with_max():
    g = [torch.tensor([4., -8.], device=DEVICE), torch.tensor([[2.], [1.]], device=DEVICE)]
    assert OverflowCheck()(g, .5, with_max=True).tolist() == [0., 4.]
    assert OverflowCheck()([torch.tensor([1., float('inf')], device=DEVICE)], 1., with_max=True)[0].item() > 0

def test_scaler_lives_across_fits():
    learn = make_learner().to_fp16(scaler='lognormal')
    with learn.no_logging(): learn.fit(1, 1e-2)
    s, n = learn.mixed_precision.scaler, learn.mixed_precision.scaler.n_steps
    with learn.no_logging(): learn.fit(1, 1e-2)
    assert learn.mixed_precision.scaler is s and s.n_steps == 2 * n == 12 and s.n_obs == 12 - s.n_skipped
    learn = make_learner().to_native_fp16(init_scale=2.**10)
    with learn.no_logging(): learn.fit(1, 1e-2)
    gs = learn.native_mixed_precision.scaler
    with learn.no_logging(): learn.fit(1, 1e-2)
    assert learn.native_mixed_precision.scaler is gs

class NaNLoss(nn.Module):
    def forward(self, pred, targ): return (pred - targ).pow(2).mean() * float('nan')

@pytest.mark.parametrize('mode', ['to_fp16', 'to_native_fp16'])
def test_a_loss_scale_error_says_its_sentence_first(mode):
    """Before the fix: raised in `before_step`, it read "Exception occured in `MixedPrecision` when calling event
    `before_step`:" (fastai's `modify_exception`) before fp16cb's sentence; now the sentence, then where it was raised."""
    learn = getattr(make_learner(n=16 * 8, loss_func=NaNLoss()), mode)(max_skipped=3)
    with pytest.raises(LossScaleError) as e, warnings.catch_warnings():
        warnings.simplefilter('ignore')
        with learn.no_logging(), learn.no_bar(): learn.fit(1, 1e-2)
    said, cb = str(e.value), type(learn.precision_callbacks()[-1]).__name__
    assert said.startswith('Mixed-precision training stopped') and said.endswith(f"(raised in `{cb}.before_step`)"), said

@pytest.mark.parametrize('scaler', ['backoff', 'lognormal', 'static'])
def test_nan_loss_fails_loudly(scaler):
    learn = make_learner(n=16 * 80, loss_func=NaNLoss()).to_fp16(scaler=scaler, max_skipped=20)
    with pytest.raises(LossScaleError) as e:
        with learn.no_logging(): learn.fit(1, 1e-2)
    msg = str(e.value)
    assert 'MixedPrecision' in msg and 'Likely causes' in msg and 'learn.precision_check()' in msg
    # the loss itself is NaN: the remedy is the data or the loss, not a dtype (bf16, advised before whatever the cause
    # and the machine, would not help)
    assert 'check the targets' in msg and 'to_bf16' not in msg
    mp = learn.mixed_precision
    assert all(mp.skips) and len(mp.skips) <= 21 and mp.n_skipped == len(mp.skips)
    assert '21 steps in a row' in msg  # the dynamic scales calibrate from 1 and stay there: max_skipped ends it
    assert len(learn.metrics) == 0  # fastai skipped after_fit, but the exception leaving `fit` restored at once
    learn.to_fp32()
    assert len(learn.metrics) == 0 and learn.model[0].weight.dtype == torch.float32

# ---------- the first dynamic scale comes from the first step's gradients ----------
def test_calibrated_scale_is_the_largest_power_of_2_under_the_headroom():
    s = BackoffScaler(1., calibrate=True, headroom=16.)
    assert s.scale == 1. and not s.calibrated and s.needs_max_grad
    s.update(False, 0.3)  # the first finite step: counted as a step, not a skip
    assert s.scale == 2.**math.floor(math.log2(FP16_MAX / (16 * 0.3))) == 2.**13
    assert s.calibrated and not s.needs_max_grad and s.n_skipped == 0 and s.n_steps == 1
    assert BackoffScaler(1., calibrate=True, max_scale=2.**10).calibrated_scale(1e-9) == 2.**10  # the ceiling holds
    assert BackoffScaler(1., calibrate=True).calibrated_scale(1e4) == 1.  # the floor holds
    assert BackoffScaler(1., calibrate=True).calibrated_scale(0.) == 2.**24  # no gradient seen: the old fixed start

def test_calibration_survives_overflow_and_checkpoints():
    s = BackoffScaler(1., calibrate=True)
    s.update(True, float('nan'))  # a NaN first batch is skipped (no error at the floor), the next one calibrates
    assert not s.calibrated and s.scale == 1. and s.n_skipped == 1
    s.update(False, 1.)
    t = BackoffScaler(1., calibrate=True); t.load_state_dict(s.state_dict())
    assert t.calibrated and t.scale == s.scale == 2.**11

def test_default_to_fp16_skips_at_most_two_steps_at_the_start():
    "Before: the scale started at 2^24 and the first ~7 steps of this 1-epoch digits fit were skipped."
    run = train(digits_learner('digits', 'to_fp16', seed=0), epochs=1)
    assert sum(run.skips) <= 2 and run.scales[0] == 1. and run.scales[1] > 2.**8 and run.accuracy > .5

def test_calibration_keeps_one_host_read_per_step_and_the_first_step(monkeypatch):
    calls = count_host_reads(monkeypatch, MixedPrecision)
    learn = synth_learner().to_fp16()
    w0 = learn.model[3].weight.detach().clone()
    quiet_fit(learn, 1, lr=1e-2, cbs=_StopAfter(1))
    monkeypatch.undo()
    mp = learn.mixed_precision
    assert mp.skips == [False] and mp.scaler.calibrated and len(calls) == 1
    assert not torch.equal(w0, learn.model[3].weight)  # the calibrating step was applied

class TinyLoss:
    "MSE times 1e-6: gradients of 1e-7 to 1e-5, under fp16's smallest normal (2^-14) at scale 1, flushed under 2^-25."
    def __init__(self): self.mse = MSELossFlat()
    def __call__(self, pred, targ): return self.mse(pred, targ) * 1e-6

def _tiny(learn):
    learn.loss_func = TinyLoss()
    return learn

def test_a_calibrating_step_whose_gradients_underflow_is_skipped():
    """Before the fix the calibrating step (scale 1) was applied with its gradients flushed or rounded coarsely in
    fp16: its update was 40-100% off FP32's. Now it is skipped (and counted), the next step runs at the scale it set,
    and the updates are FP32's from there (an FP32 fit without that first step). bf16 (FP32's range) never underflows."""
    ref = updates(_tiny(synth_learner(n_train=64)), CancelSteps({0}), lr=1e4)
    learn = _tiny(synth_learner(n_train=64)).to_fp16()
    assert_close_updates(updates(learn, lr=1e4), ref)
    mp = learn.mixed_precision
    assert mp.skips == [True, False, False, False] and mp.n_skipped == 1 and mp.scales == [1.] + [2.**24] * 3
    assert mp.skip_causes == {0: 'underflow'}  # said apart from an overflow (`plot_precision_health` marks it so)
    learn = _tiny(synth_learner(n_train=64)).to_bf16(dynamic=True)
    quiet_fit(learn, 1, lr=1e4)
    assert learn.mixed_precision.skips == [False] * 4 and learn.mixed_precision.scaler.calibrated

def test_underflow_flag_counts_the_small_nonzero_gradients():
    h = lambda *v: torch.tensor(v, dtype=torch.float16, device=DEVICE)
    one = torch.ones((), device=DEVICE)
    def flag(grads, mx, loss=one): return underflow_flag(torch.tensor([0., mx], device=DEVICE), grads, loss).tolist()
    assert flag([h(1e-6, -3e-5, 0., 0.), h(.5)], .5) == [0., .5, 1.]  # 2 of the 3 nonzero ones under 2^-14
    assert flag([h(1e-6, 0., .01), h(-.5)], .5) == [0., .5, 0.]  # 1 of 3: an ordinary distribution's tail
    assert flag([h(0., 0.)], 0.)[2] == 1. and flag([h(0., 0.)], 0., one * 0)[2] == 0.  # all flushed; a masked batch

class _StopAfter(Callback):
    order = 30
    def __init__(self, n): self.n = n
    def after_step(self):
        self.n -= 1
        if self.n == 0: raise __import__('fastai').callback.core.CancelFitException()

# ---------- an explicit loss_scale is the dynamic scale's start ----------
def test_explicit_loss_scale_starts_the_dynamic_scale():
    learn = synth_learner().to_fp16(loss_scale=1024)
    quiet_fit(learn, 1, lr=1e-2)
    mp = learn.mixed_precision
    assert mp.scales[0] == 1024. and mp.scaler.calibrated

# ---------- a step that another callback cancels is no step ----------
@pytest.mark.parametrize('scaler', ['backoff', 'lognormal', 'static'])
def test_a_step_another_callback_cancels_changes_nothing(scaler):
    """A `CancelStepException` from a later callback's `before_step`: FP32 changes nothing, so neither do we: no weight
    moves and the scaler sees nothing of the step (torch's GradScaler.update is never called for it either). Before
    the fix each cancelled step counted as a clean step and a LogNormal observation: the tiny gradients of the
    cancelled batches pulled the scale up until the real steps overflowed and were skipped (FP32 applies them)."""
    cancelled = set(range(1, 17)) | set(range(18, 24, 2))  # 24 batches; 0, 17, 19, 21, 23 are stepped
    kw = {'backoff': {}, 'lognormal': dict(scaler=LogNormalScaler(2.**8)), 'static': dict(scaler='static')}[scaler]
    ref = updates(synth_learner(n_train=16 * 24), CancelSteps(cancelled, 1e-6))
    learn = synth_learner(n_train=16 * 24).to_fp16(**kw)
    assert_close_updates(updates(learn, CancelSteps(cancelled, 1e-6)), ref)
    mp, n = learn.mixed_precision, 24 - len(cancelled)
    assert len(mp.scales) == len(mp.skips) == mp.scaler.n_steps == n and mp.n_skipped == 0
    if scaler == 'lognormal': assert mp.scaler.n_obs == n
    if scaler == 'backoff': assert mp.scaler.clean_in_a_row == n - 1  # the calibrating step, then n - 1 clean ones

def test_calibrate_is_an_explicit_loss_scale():
    "`loss_scale='calibrate'` is what fastai's default 512 means with a dynamic scale; a static scale needs a number."
    from conftest import make_learner, quiet_fit
    runs = [make_learner().to_fp16(**kw) for kw in ({}, {'loss_scale': 'calibrate'})]
    for l in runs: quiet_fit(l, 1)
    assert runs[0].mixed_precision.scales == runs[1].mixed_precision.scales and runs[1].mixed_precision.scales[0] == 1.
    with pytest.raises(ValueError, match="loss_scale='calibrate'"): make_learner().to_fp16(loss_scale='calibrate', dynamic=False)
