"""CUDA-only checks (`pytest --device cuda`; skipped otherwise): one host sync per step, seen by CUDA's own sync
debugger; GradScaler on CUDA through `to_native_fp16`; `to_bf16` on CUDA with each scaler, flat or not, clipped per
group or globally, against FP32; a model left on the CPU with CUDA DataLoaders (fastai moves it in `before_fit`)."""
import warnings
import pytest
import torch
from torch import nn
from fastai.basics import Callback
from fp16cb import MixedPrecision, NativeMixedPrecision
from conftest import make_learner, quiet_fit, Inject, DEVICE, cuda_only

pytestmark = cuda_only()

# what CUDA's sync debugger says of each synchronising call; its first use in a process also warns that it is "a
# prototype feature and does not yet detect all synchronizing operations", which is no sync (the first test of each
# pytest-xdist worker counted it, on an H200, 2026-11-26)
SYNC_WARNING = 'called a synchronizing CUDA operation'

def count_syncs(monkeypatch, cls, events=('before_step', 'after_step')) -> list:
    """Patch `cls`'s `events` to run under `torch.cuda.set_sync_debug_mode('warn')`, the device idle first; returns
    the list that gets `(event, number of synchronising CUDA calls, the file:line of each)` per call."""
    log = []
    for ev in events:
        orig = getattr(cls, ev)
        def wrapped(self, _orig=orig, _ev=ev):
            torch.cuda.synchronize()  # earlier work is done: only this event's own syncs count
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter('always')
                torch.cuda.set_sync_debug_mode('warn')
                try: return _orig(self)
                finally:
                    torch.cuda.set_sync_debug_mode('default')
                    where = [f"{o.filename}:{o.lineno}" for o in w if SYNC_WARNING in str(o.message)]
                    log.append((_ev, len(where), where))  # where: the Python line of each sync, for the failure message
        monkeypatch.setattr(cls, ev, wrapped)
    return log

def per_step(log) -> list:
    "Syncs per optimizer step: each `before_step` and the `after_step` that follows it (none when the step was skipped)."
    steps = []
    for ev, n, _ in log:
        if ev == 'before_step': steps.append(n)
        else: steps[-1] += n
    return steps

def on_device_fp32(learn) -> bool:
    "Every param of the model on the test device, FP32 and finite."
    return all(p.device.type == DEVICE.type and p.dtype == torch.float32 and bool(torch.isfinite(p).all())
               for p in learn.model.parameters())

@pytest.mark.parametrize('kwargs', [dict(), dict(clip=1.), dict(flat_master=True, clip=.1), dict(scaler='lognormal'),
                                    dict(flat_master=True, clip=.1, clip_global=True),
                                    dict(dtype=torch.bfloat16, loss_scale=1., dynamic=False),
                                    dict(dtype=torch.bfloat16, loss_scale=1., dynamic=False, flat_master=True)])
def test_one_sync_per_step(monkeypatch, kwargs):
    """MixedPrecision's step work synchronises with the GPU once per step (its one `.tolist()`), skipped steps included,
    but for a bf16 fit's first skipped step, never normal, which reads the overflow log to say so at once."""
    log = count_syncs(monkeypatch, MixedPrecision)
    learn = make_learner().to_fp16(max_loss_scale=2.**8, **kwargs)
    quiet_fit(learn, 1, lr=1e-2, cbs=Inject([1]))
    monkeypatch.undo()
    said = kwargs.get('dtype') == torch.bfloat16
    assert per_step(log) == [1, 1 + said, 1, 1], log
    assert learn.mixed_precision.skips == [False, True, False, False]
    assert on_device_fp32(learn)

@pytest.mark.parametrize('dtype,n', [(torch.float16, 2), (torch.bfloat16, 1)])
def test_native_syncs_per_step(monkeypatch, dtype, n):
    "Native fp16: GradScaler's own inf check, then the scale read once after it; bf16: our one fused check."
    log = count_syncs(monkeypatch, NativeMixedPrecision)
    learn = make_learner().to_native_fp16(dtype=dtype, **(dict(init_scale=2.**8) if dtype == torch.float16 else {}))
    quiet_fit(learn, 1, lr=1e-2, cbs=Inject([1]))
    monkeypatch.undo()
    assert per_step(log) == [n] * 4, log

def test_native_fp16_gradscaler_on_cuda():
    "to_native_fp16 on CUDA: a CUDA GradScaler, fp16 autocast in the forward, overflow skipped and backed off."
    learn = make_learner().to_native_fp16(init_scale=2.**8, backoff_factor=.25)
    out = []
    learn.model[0].register_forward_hook(lambda m, i, o: out.append((o.dtype, o.device.type)))
    quiet_fit(learn, 2, lr=1e-2, cbs=Inject([1]))
    mp = learn.native_mixed_precision
    assert mp.device_type == 'cuda' and mp.scaler.is_enabled() and mp.scaler._device == 'cuda'
    assert set(out) == {(torch.float16, 'cuda')}
    assert mp.skips[:3] == [False, True, False] and mp.scales[:3] == [2.**8, 2.**8, 2.**6]
    assert on_device_fp32(learn) and not torch.is_autocast_enabled('cuda')
    fp32 = quiet_fit(make_learner(), 2, lr=1e-2)
    v, v32 = learn.recorder.values[-1], fp32.recorder.values[-1]
    assert v[1] == pytest.approx(v32[1], rel=.1)  # one step fewer (the skipped one), fp16 matmuls: close, not equal

class Clip(Callback):
    "The FP32 reference of fp16cb's clipping: clip each param group's grad norm to `clip`, or the norm of all of them."
    order = 20
    def __init__(self, clip, glob): self.clip, self.glob = clip, glob
    def before_step(self):
        pgs = [[p for p in pg if p.grad is not None] for pg in self.learn.opt.param_lists]
        for pg in ([[p for pg in pgs for p in pg]] if self.glob else pgs): nn.utils.clip_grad_norm_(pg, self.clip)

SCALERS = {'static': {}, 'backoff': dict(dynamic=True, scaler='backoff'), 'lognormal': dict(dynamic=True, scaler='lognormal')}

@pytest.mark.parametrize('clip', [None, 'group', 'global'])
@pytest.mark.parametrize('scaler', list(SCALERS))
@pytest.mark.parametrize('flat', [False, True])
def test_bf16_on_cuda_trains_like_fp32(flat, scaler, clip):
    "bf16 on CUDA (the fused inf check has no bf16 kernel there: fp16cb must not need it) ends close to FP32."
    kw = {} if clip is None else dict(clip=.5, clip_global=clip == 'global')
    fp32 = quiet_fit(make_learner(), 2, lr=3e-2, cbs=[] if clip is None else [Clip(.5, clip == 'global')])
    learn = quiet_fit(make_learner().to_bf16(flat_master=flat, **SCALERS[scaler], **kw), 2, lr=3e-2)
    mp = learn.mixed_precision
    assert not any(mp.skips) and len(mp.skips) == 8  # bf16 has FP32's range: even 2**24 does not overflow
    assert on_device_fp32(learn)
    assert learn.recorder.values[-1][0] < learn.recorder.values[0][0]  # it trains
    # as tests/test_callbacks.py: 8 SGD steps with bf16's 8-bit mantissa, the weights agree to ~1e-2
    for p, q in zip(fp32.model.parameters(), learn.model.parameters()): torch.testing.assert_close(q, p, atol=2e-2, rtol=0)

@pytest.mark.parametrize('mode,kw', [('to_fp16', dict(max_loss_scale=2.**8)), ('to_fp16', dict(max_loss_scale=2.**8, flat_master=True)),
                                     ('to_bf16', {}), ('to_native_fp16', {})])
def test_model_left_on_the_cpu(mode, kw):
    "The usual fastai set-up: the model made on the CPU, the DataLoaders on CUDA; fastai moves the model in before_fit."
    learn = make_learner(device='cpu')
    learn.dls.to(DEVICE)
    getattr(learn, mode)(**kw)
    quiet_fit(learn, 2, lr=1e-2)
    assert on_device_fp32(learn) and all(p.is_cuda for p in learn.model.parameters())
    ids = {id(p) for p in learn.model.parameters()}
    assert all(id(p) in ids and p.is_cuda for pg in learn.opt.param_lists for p in pg)
    assert learn.recorder.values[-1][0] < learn.recorder.values[0][0]

def test_the_health_check_adds_no_sync(monkeypatch):
    """The precision-health check (`health_every`): its hooks, the FP32 copies' forwards, the comparison and the read of
    the last check's figures (a non-blocking copy to pinned memory, read once it has landed) make no synchronising CUDA
    call. Every 2nd step is checked here; `before_batch` (the read, the hooks) and `after_loss` (the comparison) are
    watched."""
    log = count_syncs(monkeypatch, MixedPrecision, events=('before_batch', 'after_loss'))
    learn = make_learner().to_fp16(max_loss_scale=2.**8, health_every=2)
    quiet_fit(learn, 3, lr=1e-2)
    monkeypatch.undo()
    assert len(learn.mixed_precision.health_checks) >= 3  # checks were made and read
    assert [w for _, n, w in log if n] == [], log
