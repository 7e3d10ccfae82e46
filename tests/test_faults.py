"Faults under mixed precision: exceptions in the middle of a fit, non-finite batches, a loss that is never finite."
import math
import pytest, torch
from torch import nn
import torch.nn.functional as F
from fastai.optimizer import SGD
from fastai.callback.core import Callback
from fastai.callback.training import GradientAccumulation
from fp16cb import ModelToHalf, MixedPrecision, LossScaleError, BNStatsGuard
from conftest import DEVICE
try: from test_workflow import make_learner, fit, clone_state, assert_same_state, assert_fp32_between_fits, opt_state, assert_same_opt_state
except ImportError: from tests.test_workflow import make_learner, fit, clone_state, assert_same_state, assert_fp32_between_fits, opt_state, assert_same_opt_state

pytestmark = pytest.mark.filterwarnings("ignore:(fp16|bf16) training on the CPU:RuntimeWarning")

@pytest.fixture(autouse=True, scope='module')
def one_thread():
    n = torch.get_num_threads(); torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

# the scales are low enough that no step overflows by itself: every skip here is the fault's
CLEAN = {'fp16': ('to_fp16', dict(dynamic=False, loss_scale=2.**8)), 'bf16': ('to_bf16', {}),
         'native': ('to_native_fp16', dict(init_scale=2.**8)), 'native_bf16': ('to_native_bf16', {})}

def clean_learner(mode, **kw):
    learn = make_learner(**kw)
    name, kwargs = CLEAN[mode]
    return getattr(learn, name)(**kwargs)

def bn_buffers(learn):
    bn = learn.model.body[1]
    return [bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()]

def same(xs, ys): return len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys))

# ---- exceptions in the middle of a fit --------------------------------------------------------------------------
class Boom(Callback):
    "Raises `exc` at training iteration `at` in `event` (a callback error, or the user's Ctrl-C)."
    order = 20
    def __init__(self, exc=RuntimeError, at=3, event='after_backward'):
        self.exc, self.at, self.event = exc, at, event
        setattr(self, event, self._maybe_raise)
    def _maybe_raise(self):
        if self.training and self.iter == self.at: raise self.exc('boom')

class MasterSpy(Callback):
    "After every step, the FP32 value the optimizer holds for each model param (the masters, or the params themselves)."
    order = MixedPrecision.order + 1
    def __init__(self): self.last, self.n_masters = None, []
    def after_step(self):
        mp = getattr(self.learn, 'mixed_precision', None)
        if mp is not None and mp.store is not None:
            self.last = {id(p): m.clone() for p, m in mp.store.fp32_views().items()}
            self.n_masters.append(len(mp.store.master_params))
        else: self.last = {id(p): p.detach().clone() for p in self.learn.model.parameters()}

@pytest.mark.parametrize('exc,event', [(RuntimeError, 'after_backward'), (KeyboardInterrupt, 'after_pred'),
                                       (RuntimeError, 'after_step')])
@pytest.mark.parametrize('mode', list(CLEAN))
def test_exception_mid_fit_leaves_learner_usable(mode, exc, event):
    learn = clean_learner(mode)
    spy = MasterSpy()
    with pytest.raises(exc):
        with learn.no_bar(), learn.no_logging(): learn.fit(2, 1e-2, cbs=[Boom(exc, 3, event), spy])
    # immediately consistent: FP32 model, optimizer on the model's params, autocast off
    assert_fp32_between_fits(learn)
    for p in learn.model.parameters(): assert torch.equal(p.data, spy.last[id(p)])  # exactly the last FP32 masters
    interrupted = clone_state(learn.model)
    learn.to_fp32()
    assert_same_state(interrupted, clone_state(learn.model))
    getattr(learn, CLEAN[mode][0])(**CLEAN[mode][1])
    spy2 = MasterSpy()
    fit(learn, 'fit', 1, 1e-2, cbs=spy2)
    n_trainable = sum(p.requires_grad for p in learn.model.parameters())
    if 'native' not in mode: assert set(spy2.n_masters) == {n_trainable}  # no master copies stacked up
    assert_fp32_between_fits(learn)
    assert len(learn.opt.state) <= len(list(learn.model.parameters()))
    assert math.isfinite(learn.validate()[0])

# the FP32 params of each mode (the others are 16-bit during the fit: their grads go with the 16-bit model)
LOSS_SCALED = {'fp16': ('to_fp16', dict(loss_scale=2.**12), 'body.1.'),
               'fp16_keep_fp32': ('to_fp16', dict(loss_scale=2.**12, keep_fp32='classifier'), ('body.1.', 'head.')),
               'half_storage': ('to_fp16', dict(loss_scale=2.**12, half_storage=True), 'body.1.'),
               'native': ('to_native_fp16', dict(init_scale=2.**12), '')}

@pytest.mark.parametrize('event', ['after_backward', 'before_step'])
@pytest.mark.parametrize('mode', list(LOSS_SCALED))
def test_an_interrupt_after_the_backward_leaves_no_loss_scaled_grad(mode, event):
    """A Ctrl-C after the backward, before the step: the grads left on the FP32 params are FP32's for that batch, not
    FP32's times the loss scale. Before the fix BatchNorm's (and an FP32 island's) stayed x4096, and the next FP32
    step (`learn.opt.step()`) moved a BatchNorm weight by 6.6 instead of 2.5e-3; native's were all x65536."""
    name, kw, fp32 = LOSS_SCALED[mode]
    res = {}
    for m in ('fp32', mode):
        learn = make_learner(opt_func=SGD)
        if m != 'fp32': getattr(learn, name)(**kw)
        with pytest.raises(KeyboardInterrupt): fit(learn, 'fit', 1, 1e-2, cbs=Boom(KeyboardInterrupt, 0, event))
        learn.to_fp32()
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in learn.model.named_parameters()}
        w0 = clone_state(learn.model)
        learn.opt.step()  # what an FP32 step does with them (lr 1e-2)
        res[m] = grads, {k: v - w0[k] for k, v in clone_state(learn.model).items() if k in grads}
    (g32, step32), (g, step) = res['fp32'], res[mode]
    top, top_step = max(r.abs().max() for r in g32.values()), max(r.abs().max() for r in step32.values())
    for n, ref in g32.items():  # (the grad of the bias before BatchNorm is rounding noise: compared at the model's scale)
        if not n.startswith(fp32): continue  # a 16-bit param's grad went with the 16-bit model
        assert g[n] is not None and torch.allclose(g[n], ref, rtol=1e-2, atol=1e-2 * top), n
        assert torch.allclose(step[n], step32[n], rtol=1e-2, atol=1e-2 * top_step), n
    assert all(v is None or torch.isfinite(v).all() for v in g.values())

class EarlyBoom(Boom): order = 5  # before our callbacks (10): its `after_step` raising, ours does not run

def test_an_interrupt_after_the_step_finishes_it_at_the_teardown():
    """An earlier callback's `after_step` raises: the optimizer stepped, our `after_step` did not run. The teardown
    finishes the step: counted, its grads cleared. Before the fix it went uncounted and BatchNorm's grads stayed x4096."""
    learn = make_learner().to_fp16(loss_scale=2.**12)
    with pytest.raises(KeyboardInterrupt): fit(learn, 'fit', 1, 1e-2, cbs=EarlyBoom(KeyboardInterrupt, 1, 'after_step'))
    assert learn.mixed_precision.skips == [False, False]
    # the grads are what FP32 fastai leaves there (its `zero_grad` never came): unscaled, not x4096
    ref = make_learner()
    with pytest.raises(KeyboardInterrupt): fit(ref, 'fit', 1, 1e-2, cbs=EarlyBoom(KeyboardInterrupt, 1, 'after_step'))
    for p, q in zip(learn.model.parameters(), ref.model.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None: assert (p.grad - q.grad).abs().max() <= 1e-2 * q.grad.abs().max() + 1e-3

class FailBeforeFit(Callback):
    order = 0  # after ModelToHalf converted the model, before MixedPrecision made the masters
    def before_fit(self): raise RuntimeError('setup failed')

def test_exception_in_another_callbacks_before_fit():
    learn = clean_learner('fp16')
    start = clone_state(learn.model)
    with pytest.raises(RuntimeError, match='setup failed'): learn.fit(1, 1e-2, cbs=FailBeforeFit())
    assert_same_state(start, clone_state(learn.model))  # the exact FP32 originals
    assert_fp32_between_fits(learn)
    fit(learn, 'fit', 1, 1e-2)
    assert_fp32_between_fits(learn)

def test_exception_with_precision_callbacks_given_to_fit():
    "The precision callbacks leave with the fit (fastai removes `fit(cbs=...)`): they restore on their way out."
    learn = make_learner()
    spy = MasterSpy()
    with pytest.raises(RuntimeError):
        with learn.no_bar(), learn.no_logging():
            learn.fit(1, 1e-2, cbs=[ModelToHalf(), MixedPrecision(dynamic=False), Boom(), spy])
    assert learn.precision_callbacks() == []
    assert_fp32_between_fits(learn)
    for p in learn.model.parameters(): assert torch.equal(p.data, spy.last[id(p)])
    fit(learn, 'fit', 1, 1e-2)

def test_stale_state_is_restored_at_the_next_before_fit():
    "Without our `fit` (events fired by hand, as an interrupted fit of another tool would leave them): still clean."
    learn = clean_learner('fp16'); learn.create_opt()
    start = clone_state(learn.model)
    for cb in learn.precision_callbacks(): cb.before_fit()
    for cb in learn.precision_callbacks(): cb.before_fit()  # no after_fit in between: the stale state is restored first
    # set up: the model keeps its FP32 params and computes with copies; no store yet: outside a fit it comes with the
    # first training batch (a validate needs none)
    assert learn.model.head.weight.dtype == torch.float32 and learn.model_to_half.copies is not None
    assert learn.mixed_precision.store is None
    for cb in learn.precision_callbacks(): cb.after_fit()
    assert_same_state(start, clone_state(learn.model))
    assert_fp32_between_fits(learn)

def test_loss_scale_error_leaves_learner_usable():
    learn = make_learner(loss_func=lambda p, y: F.mse_loss(p, y) * float('nan')).to_fp16(max_skipped=3, dynamic=False)
    with pytest.raises(LossScaleError): fit(learn, 'fit', 1, 1e-2)
    assert_fp32_between_fits(learn)

# ---- non-finite batches -----------------------------------------------------------------------------------------
class Poison(Callback):
    "Puts `value` into the inputs or targets of training iterations `at` (before any other callback sees the batch)."
    order = -100
    def __init__(self, at=(3,), where='input', value=float('nan')): self.at, self.where, self.value = at, where, value
    def before_batch(self):
        if not self.training or self.iter not in self.at: return
        if self.where == 'input': xb = self.learn.xb[0].clone(); xb[0, 0] = self.value; self.learn.xb = (xb,)
        else: yb = self.learn.yb[0].clone(); yb[0] = self.value; self.learn.yb = (yb,)

class StepSpy(Callback):
    "What the optimizer holds (FP32 masters or params), its state and BatchNorm's statistics before/after each batch."
    order = 95
    def __init__(self): self.before, self.after = {}, {}
    def _weights(self):
        mp = getattr(self.learn, 'mixed_precision', None)
        ws = [m for m in mp.store.masters] if mp is not None and mp.store is not None else list(self.learn.model.parameters())
        return [w.detach().clone() for w in ws]
    def _snap(self): return self._weights(), bn_buffers(self.learn), opt_state(self.learn)
    def before_batch(self):
        if self.training: self.before[self.iter] = self._snap()
    def after_batch(self):
        if self.training: self.after[self.iter] = self._snap()

def skipped_steps(learn):
    mp = getattr(learn, 'mixed_precision', None)
    return mp.skips if mp is not None else None

@pytest.mark.parametrize('where,value', [('input', float('nan')), ('target', float('inf')), ('input', float('-inf'))])
@pytest.mark.parametrize('mode', list(CLEAN))
def test_nonfinite_batch_is_skipped(mode, where, value):
    learn = clean_learner(mode)
    spy = StepSpy()
    fit(learn, 'fit', 2, 1e-2, cbs=[Poison((3,), where, value), spy])
    w0, bn0, o0 = spy.before[3]; w1, bn1, o1 = spy.after[3]
    assert same(w0, w1)  # FP32 masters (or params) bit-identical
    assert same(bn0, bn1)  # BatchNorm's running statistics did not take the batch
    assert_same_opt_state(o0, o1)  # nor did the optimizer state (Adam's moments and step count)
    for i in (2, 4, 5):  # training went on around it
        assert not same(spy.before[i][0], spy.after[i][0]) and not same(spy.before[i][1], spy.after[i][1])
    if skipped_steps(learn) is not None: assert skipped_steps(learn)[:8] == [False] * 3 + [True] + [False] * 4
    assert all(torch.isfinite(t).all() for t in learn.model.state_dict().values() if t.is_floating_point())
    vl, vmae = learn.validate()[:2]  # (to_fp16 may add loss_scale, n_skipped columns)
    assert math.isfinite(vl) and math.isfinite(vmae)
    assert_fp32_between_fits(learn)

@pytest.mark.parametrize('mode', ['fp16', 'native'])
def test_nonfinite_micro_batch_skips_the_accumulated_step(mode):
    "With GradientAccumulation the statistics go back to before the window's first micro-batch."
    learn = clean_learner(mode, opt_func=SGD)
    spy = StepSpy()
    fit(learn, 'fit', 1, 1e-2, cbs=[GradientAccumulation(n_acc=16), Poison((3,)), spy])  # window: iterations 2, 3
    assert same(spy.before[2][0], spy.after[3][0]) and same(spy.before[2][1], spy.after[3][1])
    assert not same(spy.before[4][1], spy.after[5][1]) and not same(spy.before[4][0], spy.after[5][0])
    assert math.isfinite(learn.validate()[0])

def test_bn_stats_guard():
    bn = nn.BatchNorm1d(3).to(DEVICE)
    g = BNStatsGuard(nn.Sequential(nn.Linear(2, 3), bn).to(DEVICE))
    x = lambda: torch.randn(4, 3, device=DEVICE)
    assert len(g.bufs) == 3
    bn(x()); start = [b.clone() for b in g.bufs]
    g.snapshot(); bn(x()); g.snapshot(); bn(x())  # 2nd snapshot: same window, ignored
    g.restore()
    assert same(start, g.bufs)
    bn(x()); g.arm(); moved = [b.clone() for b in g.bufs]
    g.restore()  # nothing to restore after an optimizer step
    assert same(moved, g.bufs)
    assert BNStatsGuard(nn.Linear(2, 2)).bufs == []

# ---- a loss that is never finite --------------------------------------------------------------------------------
class CountSteps(Callback):
    order = 0
    def __init__(self): self.n = 0
    def after_loss(self):
        if self.training: self.n += 1

def nan_loss(pred, y): return F.mse_loss(pred, y) * float('nan')

@pytest.mark.parametrize('mode,kwargs,bound', [('to_fp16', {}, 51), ('to_fp16', dict(dynamic=False), 51),
                                               ('to_bf16', dict(max_skipped=5), 6), ('to_native_fp16', dict(max_skipped=5), 6),
                                               ('to_native_bf16', {}, 51)])
def test_nonfinite_loss_every_step_fails_loudly(mode, kwargs, bound):
    learn = make_learner(loss_func=nan_loss)
    getattr(learn, mode)(**kwargs)
    counter = CountSteps()
    start = clone_state(learn.model)
    with pytest.raises(LossScaleError, match='in a row|min_loss_scale'):
        fit(learn, 'fit', 10, 1e-2, cbs=counter)  # 80 steps available
    assert counter.n <= bound
    assert_same_state(start, clone_state(learn.model))  # nothing was ever stepped
    assert_fp32_between_fits(learn)
