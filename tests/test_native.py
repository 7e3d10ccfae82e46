"""NativeMixedPrecision on the test device (CPU by default): autocast + GradScaler, fp16 and bf16, predictions FP32, skip and backoff on overflow."""
import pytest
import torch
from fastai.basics import Callback
from fp16cb import NativeMixedPrecision
from conftest import make_learner, quiet_fit, Record, Inject, count_host_reads, DEVICE, CancelSteps, updates, assert_close_updates

HALF = [torch.float16, torch.bfloat16]

def _hooked(learn):
    "Record the dtype of what the first Linear computes (autocast makes it 16-bit) in `learn.lin_out`."
    out = []
    learn.model[0].register_forward_hook(lambda m, i, o: out.append(o.dtype))
    return out

@pytest.mark.parametrize('dtype', HALF)
def test_native_on_device(dtype):
    kw = dict(init_scale=2.**8) if dtype == torch.float16 else {}  # bf16 runs no GradScaler: its arguments are refused
    learn = make_learner().to_native_fp16(dtype=dtype, **kw)
    lin = _hooked(learn)
    rec = Record(after_pred=lambda l: l.pred.dtype,
                 after_loss=lambda l: (l.loss.dtype, torch.is_autocast_enabled(DEVICE.type)),
                 before_backward=lambda l: (l.loss_grad.item(), l.loss.item(), l.native_mixed_precision.loss_scale),
                 before_batch=lambda l: [p.dtype for p in l.model.parameters()])
    quiet_fit(learn, 2, lr=1e-2, cbs=rec)
    assert set(lin) == {dtype}  # autocast on the model's device in the asked dtype
    assert rec.log['after_pred'] == [torch.float32]*8  # predictions cast to FP32
    assert all(dt == torch.float32 and not on for dt, on in rec.log['after_loss'])  # autocast left before backward
    assert all(set(p) == {torch.float32} for p in rec.log['before_batch'])  # the model itself stays FP32
    scale = 2.**8 if dtype == torch.float16 else 1.  # GradScaler only for fp16
    for lg, loss, s in rec.log['before_backward']:
        assert s == scale and lg == loss * scale
    v = learn.recorder.values
    assert v[-1][0] < v[0][0]
    assert not torch.is_autocast_enabled(DEVICE.type)  # nothing leaks out of the fit
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())

@pytest.mark.parametrize('dtype', HALF)
def test_native_close_to_fp32(dtype):
    fp32 = quiet_fit(make_learner(), 2, lr=1e-2)
    kw = dict(init_scale=2.**8) if dtype == torch.float16 else {}
    learn = quiet_fit(make_learner().to_native_fp16(dtype=dtype, **kw), 2, lr=1e-2)
    # weights stay FP32 and are stepped in FP32; only the forward/backward matmuls are 16-bit: grads carry
    # ~1e-3 (fp16, 11-bit mantissa) / ~4e-3 (bf16, 8 bits) relative error, 8 steps of lr 1e-2 with |grad| <~ 5
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    for p, q in zip(fp32.model.parameters(), learn.model.parameters()):
        torch.testing.assert_close(q, p, atol=tol, rtol=0)

def test_native_overflow_skips_and_backs_off():
    learn = make_learner().to_native_fp16(init_scale=2.**8, backoff_factor=.25, growth_interval=100)
    rec = Record(after_backward=lambda l: [p.detach().clone() for p in l.model.parameters()],
                 after_step=lambda l: ([p.detach().clone() for p in l.model.parameters()], l.native_mixed_precision.loss_scale))
    quiet_fit(learn, 1, lr=1e-2, cbs=[Inject([1]), rec])
    scales = [s for _, s in rec.log['after_step']]
    assert scales == [2.**8, 2.**6, 2.**6, 2.**6]  # multiplied by backoff_factor on the overflow
    before, (after, _) = rec.log['after_backward'][1], rec.log['after_step'][1]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # the step was skipped
    before, (after, _) = rec.log['after_backward'][2], rec.log['after_step'][2]
    assert any(not torch.equal(a, b) for a, b in zip(before, after))  # the next one was not
    assert all(torch.isfinite(p).all() for p in learn.model.parameters())

def test_native_growth():
    learn = make_learner().to_native_fp16(init_scale=2.**4, growth_factor=4., growth_interval=2)
    rec = Record(after_step=lambda l: l.native_mixed_precision.loss_scale)
    quiet_fit(learn, 1, lr=1e-3, cbs=rec)
    assert rec.log['after_step'] == [2.**4, 2.**6, 2.**6, 2.**8]
    # the scale is learned state: a second fit goes on from it
    quiet_fit(learn, 1, lr=1e-3, cbs=rec)
    assert rec.log['after_step'][4] == 2.**8

def test_native_disabled_is_fp32():
    learn = make_learner().to_native_fp16(enabled=False)
    lin = _hooked(learn)
    rec = Record(before_backward=lambda l: (l.loss_grad.item(), l.loss.item()))
    quiet_fit(learn, 1, lr=1e-2, cbs=rec)
    assert set(lin) == {torch.float32} and all(a == b for a, b in rec.log['before_backward'])
    assert learn.native_mixed_precision.loss_scale == 1.

def test_native_bf16_shortcut_and_to_fp32():
    learn = make_learner().to_native_bf16()
    cbs = learn.precision_callbacks()
    assert len(cbs) == 1 and isinstance(cbs[0], NativeMixedPrecision) and cbs[0].dtype == torch.bfloat16
    assert learn.to_native_fp32() is learn and learn.precision_callbacks() == []

@pytest.mark.parametrize('kwargs,name', [
    (dict(init_scale=0), 'init_scale'), (dict(init_scale=-1.), 'init_scale'),
    (dict(growth_factor=1.), 'growth_factor'), (dict(growth_factor=.5), 'growth_factor'),
    (dict(backoff_factor=1.), 'backoff_factor'), (dict(backoff_factor=0), 'backoff_factor'),
    (dict(backoff_factor=2.), 'backoff_factor'), (dict(backoff_factor=-.5), 'backoff_factor'),
    (dict(backoff_factor='half'), 'backoff_factor'),
    (dict(growth_interval=0), 'growth_interval'), (dict(growth_interval=2.5), 'growth_interval'),
    (dict(dtype='fp8'), 'dtype'), (dict(dtype=torch.float32), 'dtype'),
])
def test_native_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name): NativeMixedPrecision(**kwargs)

@pytest.mark.parametrize('dtype', HALF)
def test_native_host_reads_per_step(monkeypatch, dtype):
    """fp16: GradScaler's own inf check, then the scale read once, after it (nothing is queued on the device by then:
    no second stall); bf16 (no GradScaler): our one fused check, and at the fit's first skipped step, never normal in
    bf16, one read more of the overflow log to say so at once. The recorded scales are the ones each step used."""
    calls = count_host_reads(monkeypatch, NativeMixedPrecision)
    kw = dict(init_scale=2.**8) if dtype == torch.float16 else {}
    learn = make_learner().to_native_fp16(dtype=dtype, **kw)
    quiet_fit(learn, 1, lr=1e-2, cbs=Inject([1]))
    monkeypatch.undo()
    mp = learn.native_mixed_precision
    assert mp.skips == [False, True, False, False]
    assert len(calls) == (2 * 4 if dtype == torch.float16 else 4 + 1), calls
    assert mp.scales == ([2.**8, 2.**8, 2.**7, 2.**7] if dtype == torch.float16 else [1.] * 4)

class RaiseAt(Callback):
    "Raise `exc` in the event `event` of the optimizer step number `step` (after NativeMixedPrecision's own: order 20)."
    order = 20
    def __init__(self, event, step, exc=RuntimeError('boom')):
        self.step, self.exc, self.n = step, exc, 0
        setattr(self, event, self._maybe_raise)
    def _maybe_raise(self):
        self.n += 1
        if self.n == self.step + 1: raise self.exc

@pytest.mark.parametrize('exc', [RuntimeError('boom'), KeyboardInterrupt()])
def test_native_fit_after_an_exception_between_step_and_update(exc):
    """An exception after GradScaler.step (our before_step) and before its update (our after_step) must not leave
    the scaler half-stepped: the next fit works, and goes on from the learned scale."""
    learn = make_learner().to_native_fp16(init_scale=2.**4, growth_factor=4., growth_interval=2)
    rec = Record(after_step=lambda l: l.native_mixed_precision.loss_scale)
    with pytest.raises(type(exc)): quiet_fit(learn, 1, lr=1e-3, cbs=[rec, RaiseAt('before_step', 3, exc)])
    assert rec.log['after_step'] == [2.**4, 2.**6, 2.**6]  # the 4th step raised before its update
    assert learn.native_mixed_precision.loss_scale == 2.**6 and not torch.is_autocast_enabled(DEVICE.type)
    rec = Record(before_step=lambda l: l.native_mixed_precision.loss_scale)
    quiet_fit(learn, 1, lr=1e-3, cbs=rec)  # "step() has already been called since the last update()" before the fix
    assert rec.log['before_step'][0] == 2.**6  # the learned scale, not init_scale
    assert all(torch.isfinite(p).all() for p in learn.model.parameters())

def test_native_save_between_step_and_update_keeps_the_step(tmp_path):
    "A pause mid-step (`learn.save` from a later callback's before_step) is not an interruption: the update still comes."
    learn = make_learner(path=tmp_path).to_native_fp16(init_scale=2.**4, growth_factor=4., growth_interval=2)
    save = Record(before_step=lambda l: l.save('mid'))
    rec = Record(after_step=lambda l: l.native_mixed_precision.loss_scale)
    quiet_fit(learn, 1, lr=1e-3, cbs=[save, rec])
    assert rec.log['after_step'] == [2.**4, 2.**6, 2.**6, 2.**8]  # as without the saves (test_native_growth)

def test_native_a_step_another_callback_cancels_is_no_step():
    """A `CancelStepException` from a later callback's `before_step` (after GradScaler.step): as in FP32 nothing moves,
    and GradScaler.update is not called for it. Before the fix each cancelled step counted as a clean step (recorded,
    and the scale grew after `growth_interval` of them)."""
    cancelled = {1, 2, 3, 5}  # of 8 batches: 0, 4, 6 and 7 are stepped
    ref = updates(make_learner(n_train=16 * 8), CancelSteps(cancelled))
    learn = make_learner(n_train=16 * 8).to_native_fp16(init_scale=2.**8, growth_interval=2)
    assert_close_updates(updates(learn, CancelSteps(cancelled)), ref)
    mp = learn.native_mixed_precision
    assert mp.scales == [2.**8, 2.**8, 2.**9, 2.**9] and mp.skips == [False] * 4 and mp.loss_scale == 2.**10
