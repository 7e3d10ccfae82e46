"""ModelToHalf + MixedPrecision during a fit: dtypes at each event, the recorded (unscaled) loss, what
`learn.mixed_precision` exposes, bf16, the slow-fp16-on-CPU warning, comparison with FP32 training, bad arguments;
with other callbacks (a cancel in an earlier `after_step`, fastai's MixUp), and the Recorder's precision columns."""
import warnings
import pytest
import torch
from torch import nn
from fastai.basics import Learner, DataLoaders, DataLoader, SGD, MSELossFlat, Callback, CancelStepException, CancelBatchException
from fastai.basics import CrossEntropyLossFlat
from fastai.callback.core import CancelTrainException
from fastai.callback.mixup import MixUp
from fastai.metrics import mae
from fastai.optimizer import Optimizer, sgd_step
from fastai.layers import BatchNorm
import fp16cb.dtypes
from fp16cb import ModelToHalf, MixedPrecision
from conftest import make_learner, quiet_fit, Record, StepSpy, flat_pgs, seed_all, DEVICE, to_mode, weights

NO_OVERFLOW = dict(loss_scale=2.**8, max_loss_scale=2.**8)  # a fixed start that does not overflow
HALF = [torch.float16, torch.bfloat16]

def _to(learn, dtype, **kw):
    return learn.to_fp16(**NO_OVERFLOW, **kw) if dtype == torch.float16 else learn.to_bf16(**kw)

def _dtypes(m): return {n: p.dtype for n, p in m.named_parameters()}

def _expect(dtype): return {'0.weight': dtype, '0.bias': dtype, '1.weight': torch.float32, '1.bias': torch.float32,
                            '3.weight': dtype, '3.bias': dtype}

def _event_recorder(train_only=True):
    return Record(train_only=train_only,
        before_fit=lambda l: _dtypes(l.model),
        before_batch=lambda l: ([x.dtype for x in l.xb], [y.dtype for y in l.yb], _dtypes(l.model),
                                l.model[1].running_mean.dtype),
        after_pred=lambda l: l.pred.dtype,
        after_loss=lambda l: (l.loss.dtype, l.loss_grad.dtype, l.loss.item(), l.loss_func(l.pred, *l.yb).item()),
        before_backward=lambda l: (l.loss_grad.item(), l.loss.item(), l.mixed_precision.loss_scale),
        after_backward=lambda l: {n: p.grad.dtype for n, p in l.model.named_parameters() if p.grad is not None},
        before_step=lambda l: ([m.dtype for m in flat_pgs(l.mixed_precision.master_pgs)],
                               [m.grad for m in flat_pgs(l.mixed_precision.master_pgs)]),
        after_fit=lambda l: _dtypes(l.model))

@pytest.mark.parametrize('dtype', HALF)
def test_dtypes_at_each_event(dtype):
    learn = _to(make_learner(), dtype)
    rec, val, spy = _event_recorder(), _event_recorder(train_only=False), StepSpy()
    seen = []
    h = learn.model.register_forward_pre_hook(lambda m, args: seen.append([a.dtype for a in args]))
    computes = []  # what the modules compute with, inside the forward: 16-bit copies, BatchNorm's params FP32
    hs = [learn.model[i].register_forward_pre_hook(lambda m, a: computes.append(m.weight.dtype)) for i in (0, 1, 3)]
    quiet_fit(learn, 1, lr=1e-2, cbs=[rec, spy])
    for x in [h] + hs: x.remove()
    log = rec.log
    fp32 = _expect(torch.float32)
    assert log['before_fit'] == [fp32]  # the model keeps its FP32 params: they are the masters
    assert seen == [[dtype]] * (4 + 2)  # the model gets its floating inputs in 16-bit (train and valid)
    assert computes == [dtype, torch.float32, dtype] * (4 + 2)
    assert len(log['before_batch']) == 4
    for xs, ys, model, bn_stat in log['before_batch']:
        assert xs == [torch.float32] and ys == [torch.float32]  # learn.xb as the data gave it (callbacks such as MixUp mix FP32)
        assert model == fp32 and bn_stat == torch.float32
    assert log['after_pred'] == [torch.float32]*4  # predictions back to FP32 -> loss in FP32
    for loss_dt, lg_dt, loss, recomputed in log['after_loss']:
        assert loss_dt == lg_dt == torch.float32 and loss == recomputed
    for lg, loss, scale in log['before_backward']:
        assert lg == loss * scale  # what is backpropagated is scaled (exactly: a power of 2 in FP32)
        assert scale == (2.**8 if dtype == torch.float16 else 1.)
    for grads in log['after_backward']:
        assert grads == fp32  # the grads arrive FP32 on the FP32 params
    for masters, grads in log['before_step']:  # the masters are the params, with their FP32 grads
        assert set(masters) == {torch.float32} and len(masters) == 6 and {g.dtype for g in grads} == {torch.float32}
    assert [{g.dtype for g in gs} for gs in spy.grads()] == [{torch.float32}] * 4  # FP32 grads, every element once
    assert sum(g.numel() for g in spy.grads()[0]) == sum(p.numel() for p in learn.model.parameters())
    assert log['after_fit'] == [{n: torch.float32 for n in _expect(dtype)}]
    # the validation batches too: inputs cast, predictions FP32
    learn2 = _to(make_learner(), dtype)
    quiet_fit(learn2, 1, lr=1e-2, cbs=[val])
    assert len(val.log['before_batch']) == 4 + 2 and all(xs == [torch.float32] for xs, *_ in val.log['before_batch'])
    assert val.log['after_pred'] == [torch.float32]*6

class EmbedLinear(nn.Module):
    "Float features + integer category: the integer input must reach the embedding untouched."
    def __init__(self):
        super().__init__()
        self.emb, self.lin, self.bn, self.head = nn.Embedding(5, 3), nn.Linear(4, 3), BatchNorm(3, ndim=1), nn.Linear(3, 1)
    def forward(self, x, cat):
        assert cat.dtype == torch.long
        return self.head(self.bn(self.lin(x) + self.emb(cat)))

def test_integer_inputs_untouched():
    seed_all(0)
    x, cat, y = torch.randn(32, 4), torch.randint(0, 5, (32,)), torch.randn(32, 1)
    items = [(x[i], cat[i], y[i]) for i in range(32)]
    dls = DataLoaders(DataLoader(items, bs=8), DataLoader(items[:8], bs=8), device=DEVICE)
    learn = Learner(dls, EmbedLinear().to(DEVICE), loss_func=MSELossFlat(), opt_func=SGD, lr=1e-2)
    learn.to_fp16(**NO_OVERFLOW)
    rec = Record(before_batch=lambda l: [t.dtype for t in l.xb], after_pred=lambda l: l.pred.dtype,
                 before_fit=lambda l: (l.model.emb.weight.dtype, l.model.bn.weight.dtype))
    seen = []
    h = learn.model.register_forward_pre_hook(lambda m, args: seen.append([a.dtype for a in args]))
    quiet_fit(learn, 1, cbs=rec)
    h.remove()
    assert rec.log['before_batch'] == [[torch.float32, torch.long]]*4  # learn.xb as the data gave it
    assert seen[:4] == [[torch.float16, torch.long]]*4  # floating inputs cast as they enter the model; ints untouched
    assert rec.log['after_pred'] == [torch.float32]*4
    assert rec.log['before_fit'] == [(torch.float32, torch.float32)]  # the model keeps its FP32 params
    assert learn.model.emb.weight.dtype == torch.float32

def test_recorded_loss_is_unscaled_and_matches_fp32():
    fp32 = quiet_fit(make_learner(), 2, lr=1e-2)
    learn = make_learner().to_fp16(dynamic=False, loss_scale=1024.)
    rec = Record(after_loss=lambda l: l.loss.item(), before_backward=lambda l: l.loss_grad.item())
    quiet_fit(learn, 2, lr=1e-2, cbs=rec)
    losses, grads = rec.log['after_loss'], rec.log['before_backward']
    assert all(g == l * 1024. for l, g in zip(losses, grads))
    # the recorder's smoothed losses (its train_loss) are made of the recorded `learn.loss`, not of the scaled one
    val, smooth = 0., []
    for i, l in enumerate(losses, 1):
        val = 0.98 * val + 0.02 * l; smooth.append(val / (1 - 0.98**i))  # fastai's AvgSmoothLoss
    assert [float(o) for o in learn.recorder.losses] == pytest.approx(smooth, rel=1e-5)
    assert learn.recorder.values[-1][0] == pytest.approx(smooth[-1], rel=1e-5)
    # and close to FP32 training: the losses are ~1-5 and the fp16 forward has relative error ~1e-3 (11-bit
    # mantissa, 4-8 term dot products), the weights differ by ~1e-4 after a few steps (see test_master)
    for a, b in zip(fp32.recorder.values, learn.recorder.values):  # train and valid loss (extra columns ignored)
        assert [float(o) for o in b[:2]] == pytest.approx([float(o) for o in a[:2]], rel=1e-2)
    for a, b in zip(fp32.recorder.losses, learn.recorder.losses):  # smoothed per-batch losses
        assert float(a) == pytest.approx(float(b), rel=1e-2)

@pytest.mark.parametrize('dtype', HALF)
def test_trains_close_to_fp32(dtype):
    fp32 = quiet_fit(make_learner(), 2, lr=3e-2)
    learn = quiet_fit(_to(make_learner(), dtype), 2, lr=3e-2)
    v32, v16 = fp32.recorder.values, learn.recorder.values
    assert v16[-1][0] < v16[0][0]  # it trains
    # 8 SGD steps: the weights move by ~1e-1 in total; fp16 perturbs each step's grads by ~1e-3 relative and
    # bf16 (8-bit mantissa) by ~4e-3, so weights agree to ~1e-3 (fp16) / ~1e-2 (bf16)
    tol = 2e-3 if dtype == torch.float16 else 2e-2
    for p, q in zip(fp32.model.parameters(), learn.model.parameters()):
        torch.testing.assert_close(q, p, atol=tol, rtol=0)
    assert v16[-1][1] == pytest.approx(v32[-1][1], rel=5*tol)

def test_mixed_precision_exposed_while_fitting():
    learn = make_learner().to_fp16(**NO_OVERFLOW)
    def seen(l):
        mp = l.mixed_precision
        return (mp.loss_scale, [[p.dtype for p in pg] for pg in mp.model_pgs], [[m.dtype for m in pg] for pg in mp.master_pgs],
                [[id(p) for p in pg] for pg in mp.model_pgs] == [[id(p) for p in pg if p.requires_grad] for pg in
                                                                 [list(l.model[0].parameters()) + list(l.model[1].parameters()),
                                                                  list(l.model[3].parameters())]])
    rec = Record(before_step=seen)
    quiet_fit(learn, 1, lr=1e-2, cbs=rec)
    scale, model_dt, master_dt, same = rec.log['before_step'][0]
    assert isinstance(scale, float) and scale == 2.**8
    assert model_dt == [[torch.float32]*4, [torch.float32]*2] and same  # the model's params, FP32: the masters
    assert master_dt == [[torch.float32]*4, [torch.float32]*2]
    assert isinstance(learn.mixed_precision, MixedPrecision)
    assert learn.mixed_precision.model_pgs is None and learn.mixed_precision.master_pgs is None  # fit is over

def test_bf16_no_loss_scaling_fp32_masters():
    learn = make_learner().to_bf16()
    mp = learn.mixed_precision
    assert mp.loss_scale == 1. and mp.dtype == torch.bfloat16 and learn.model_to_half.dtype == torch.bfloat16
    rec = Record(before_step=lambda l: ([m.dtype for m in flat_pgs(l.mixed_precision.master_pgs)], l.mixed_precision.loss_scale))
    quiet_fit(learn, 2, lr=3e-2, cbs=rec)
    assert all(set(d) == {torch.float32} and s == 1. for d, s in rec.log['before_step'])
    assert mp.scales == [1.]*8 and not any(mp.skips)
    v = learn.recorder.values
    assert v[-1][0] < v[0][0]
    # bf16 with scaling on, when asked
    s = make_learner().to_bf16(dynamic=True).mixed_precision.scaler
    assert s.is_dynamic and not s.calibrated and s.max_value == torch.finfo(torch.bfloat16).max  # the first step picks the scale

def _native(monkeypatch, fp16:bool, bf16:bool):
    "Pretend this CPU has (or lacks) native fp16 / bf16 math."
    monkeypatch.setattr(fp16cb.dtypes, 'cpu_has_native', {torch.float16: fp16, torch.bfloat16: bf16}.get)

def _slow_warnings(w): return [str(o.message) for o in w if o.category is RuntimeWarning and 'training on the CPU' in str(o.message)]

@pytest.mark.parametrize('bf16_native', [True, False])
def test_fp16_on_cpu_warns_once(reset_warned, monkeypatch, bf16_native):
    _native(monkeypatch, fp16=False, bf16=bf16_native)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        learn = make_learner(device='cpu').to_fp16(**NO_OVERFLOW)  # the CPU's warning, whatever the test device
        quiet_fit(learn, 1); quiet_fit(learn, 1)
        quiet_fit(make_learner(device='cpu').to_fp16(**NO_OVERFLOW), 1)
        ours = _slow_warnings(w)
        assert len(ours) == 1 and ours[0].startswith('fp16') and 'to_bf16' in ours[0]
        assert ('Use `learn.to_bf16()`' in ours[0]) == bf16_native  # suggested only where it is native
        quiet_fit(make_learner(device='cpu'), 1)
        assert len(_slow_warnings(w)) == 1

@pytest.mark.parametrize('native', [True, False])
def test_bf16_on_cpu_warns_once_only_without_native_bf16(reset_warned, monkeypatch, native):
    "bf16 on a CPU without AVX512/AVX512-BF16/AMX runs in slow reference kernels: say so once (this machine: AVX2)."
    _native(monkeypatch, fp16=False, bf16=native)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        quiet_fit(make_learner(device='cpu').to_bf16(), 1); quiet_fit(make_learner(device='cpu').to_native_bf16(), 1)
    ours = _slow_warnings(w)
    assert ours == [] if native else (len(ours) == 1 and ours[0].startswith('bf16') and 'slower than FP32' in ours[0])

def test_fp16_native_cpu_does_not_warn(reset_warned, monkeypatch):
    "A CPU with AVX512-FP16 / AMX-FP16 computes fp16 natively: no warning."
    _native(monkeypatch, fp16=True, bf16=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        quiet_fit(make_learner(device='cpu').to_fp16(**NO_OVERFLOW), 1)
    assert _slow_warnings(w) == []

AVX2_ONLY = 'fpu sse2 avx fma avx2'  # an AMD EPYC without AVX512: bf16 emulated, a step several times FP32's
AVX512_NO_BF16 = AVX2_ONLY + ' avx512f avx512dq avx512bw avx512vl'  # oneDNN's probe says bf16: it converts around each op
AVX512_BF16 = AVX512_NO_BF16 + ' avx512_vnni avx512_bf16'

@pytest.mark.parametrize('flags, bf16', [(AVX2_ONLY, False), (AVX512_NO_BF16, False), (AVX512_BF16, None), ('', None)],
                         ids=['avx2-only', 'avx512-no-bf16', 'avx512-bf16', 'flags-unknown'])
def test_cpu_native_is_what_runs_faster_than_fp32(monkeypatch, flags, bf16):
    """`cpu_has_native` says bf16 only where the CPU has native bf16 math (AVX512-BF16, AMX-BF16, Arm's BF16) and torch's
    oneDNN uses it (its probe, which `ONEDNN_MAX_CPU_ISA` can turn off): oneDNN's probe alone said bf16 on AVX512
    without BF16, where bf16 is emulated; fp16 with AVX512-FP16 or AMX-FP16. Where /proc/cpuinfo is not to be read, the
    probe alone; FP32 always. Each CPU kind mocked, whatever this machine is."""
    probe = fp16cb.dtypes.cpu_has_native.__wrapped__  # uncached
    monkeypatch.setattr(fp16cb.dtypes, '_cpuinfo', lambda: {'flags': flags} if flags else {})
    onednn = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert probe(torch.bfloat16) == (onednn if bf16 is None else bf16)
    assert probe(torch.float16) == (False if flags else torch.ops.mkldnn._is_mkldnn_fp16_supported())
    assert probe(torch.float32) and fp16cb.dtypes.has_fast_half_math(torch.float32, 'cpu')
    monkeypatch.setattr(fp16cb.dtypes, '_ONEDNN_PROBES', {torch.bfloat16: '_no_such_probe', torch.float16: '_no_such_probe'})
    assert probe(torch.bfloat16) == (flags == AVX512_BF16) and not probe(torch.float16)  # a torch without the probe
    assert fp16cb.dtypes.has_fast_half_math(torch.float16, 'cuda')  # GPUs compute both natively

def test_model_to_half_alone_restores_exactly():
    "Without MixedPrecision the model still runs 16-bit and comes back FP32 (params it did not train: exactly)."
    learn = make_learner(cbs=[ModelToHalf(torch.bfloat16)])
    before = [p.detach().clone() for p in learn.model.parameters()]
    with learn.no_bar(), learn.no_logging(): learn.validate()
    for p, q in zip(before, learn.model.parameters()):
        assert q.dtype == torch.float32 and torch.equal(p, q)

def test_interrupted_fit_then_refit():
    "An exception (not Cancel*) skips after_fit: the next fit must start from an FP32 model and fresh masters."
    class Boom(Exception): pass
    def boom(l):
        if l.iter == 2: raise Boom('boom')
    learn = make_learner().to_fp16(**NO_OVERFLOW)
    with pytest.raises(Boom): quiet_fit(learn, 1, lr=1e-2, cbs=Record(before_step=boom))
    rec = Record(before_fit=lambda l: _dtypes(l.model), after_fit=lambda l: _dtypes(l.model))
    quiet_fit(learn, 1, lr=1e-2, cbs=rec)
    assert rec.log['before_fit'] == [_expect(torch.float32)]  # the model keeps its FP32 params
    assert rec.log['after_fit'] == [_expect(torch.float32)]
    assert all(torch.isfinite(p).all() for p in learn.model.parameters())
    ids = {id(p) for p in learn.model.parameters()}
    assert all(id(p) in ids for pg in learn.opt.param_lists for p in pg)

def test_validate_returns_only_loss_and_metrics():
    "The loss-scale Recorder columns belong to a fit: `loss, metric = learn.validate()` must keep working."
    from fastai.metrics import mae
    learn = make_learner(metrics=mae).to_fp16(**NO_OVERFLOW)
    quiet_fit(learn, 1, lr=1e-2)
    with learn.no_bar(), learn.no_logging(): res = learn.validate()
    assert len(res) == 2 and 'loss_scale' not in learn.recorder.metric_names

class _ValidateEachEpoch(Callback):
    "Calls `learn.validate()` at the end of each epoch (after the Recorder logged it), as a user's callback may."
    order = 60
    def __init__(self): self.results, self.rows, self.names, self.busy = [], [], [], False
    def after_epoch(self):
        if self.busy: return  # the `after_epoch` of validate() itself
        self.rows.append((list(self.recorder.metric_names), list(self.recorder.log)))  # the row the fit's table printed
        self.busy = True
        try: loss, metric = self.learn.validate()  # two values: the validation loss and the one metric
        finally: self.busy = False
        self.results.append((loss, metric))
        self.names.append(list(self.recorder.metric_names))  # the fit's names again, for its next epoch

def test_validate_inside_a_fit_returns_only_loss_and_metrics():
    """Before the fix: `learn.validate()` from a callback of a `to_fp16` fit returned `loss_scale` and `n_skipped` too,
    so `loss, acc = learn.validate()` failed. It returns what it does in FP32; the fit's table keeps the two columns."""
    runs = {}
    for mode in ('fp32', 'fp16'):
        learn = make_learner(metrics=mae)
        if mode == 'fp16': learn.to_fp16(**NO_OVERFLOW)
        v = _ValidateEachEpoch()
        quiet_fit(learn, 2, lr=1e-2, cbs=v)
        runs[mode] = (learn, v)
    (l32, v32), (l16, v16) = runs['fp32'], runs['fp16']
    assert [len(r) for r in v16.results] == [len(r) for r in v32.results] == [2, 2]
    assert [len(r) for r in l16.recorder.values] == [len(r) for r in l32.recorder.values]
    assert len(l16.final_record) == len(l32.final_record)
    names32 = v32.rows[0][0]
    names16 = names32[:-1] + ['loss_scale', 'n_skipped', names32[-1]]  # the fit's table: the two columns before 'time'
    assert [n for n, _ in v16.rows] == v16.names == [names16] * 2
    assert all(len(row) == len(names16) for _, row in v16.rows)  # and each printed row their values
    assert list(l16.recorder.metric_names) == names32  # after the fit: the user's columns only

# ---- bad arguments -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize('kwargs,name', [
    (dict(loss_scale=0), 'loss_scale'), (dict(loss_scale=-1.), 'loss_scale'), (dict(loss_scale=float('inf')), 'loss_scale'),
    (dict(loss_scale=0, dynamic=False), 'loss_scale'), (dict(loss_scale='512'), 'loss_scale'),
    (dict(div_factor=1.), 'div_factor'), (dict(div_factor=0.5), 'div_factor'), (dict(div_factor=-2), 'div_factor'),
    (dict(scale_wait=0), 'scale_wait'), (dict(scale_wait=-5), 'scale_wait'), (dict(scale_wait=1.5), 'scale_wait'),
    (dict(clip=0), 'clip'), (dict(clip=-1.), 'clip'), (dict(clip=float('nan')), 'clip'),
    (dict(max_loss_scale=0), 'max_loss_scale'), (dict(max_loss_scale=-2.), 'max_loss_scale'),
    (dict(dtype='fp8'), 'dtype'), (dict(dtype=torch.float32), 'dtype'), (dict(dtype=torch.int8), 'dtype'),
])
def test_mixed_precision_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name): MixedPrecision(**kwargs)

@pytest.mark.parametrize('dtype', ['fp32', torch.float32, torch.float64, 'int8'])
def test_model_to_half_bad_dtype(dtype):
    with pytest.raises(ValueError, match='dtype'): ModelToHalf(dtype)

def test_good_arguments_accepted():
    mp = MixedPrecision(loss_scale=1, div_factor=1.5, scale_wait=1, clip=1e-3, max_loss_scale=4., dtype='bf16')
    assert mp.dtype == torch.bfloat16 and mp.clip == 1e-3 and mp.loss_scale == 1.  # an explicit start, within [1, 4]
    assert MixedPrecision(dynamic=False, loss_scale=3).loss_scale == 3.

@pytest.mark.parametrize('flat', [False, True])
def test_validate_and_get_preds_leave_model_fp32_untouched(flat):
    "validate/get_preds run before_fit/after_fit too: the model goes 16-bit and comes back bit-identical."
    learn = make_learner().to_fp16(flat_master=flat, **NO_OVERFLOW)
    quiet_fit(learn, 1, lr=1e-2)
    w = [p.detach().clone() for p in learn.model.parameters()]
    lin = []
    learn.model[0].register_forward_hook(lambda m, i, o: lin.append(o.dtype))
    with learn.no_bar(), learn.no_logging():
        loss = learn.validate()[0]
        preds, targs = learn.get_preds()
    assert set(lin) == {torch.float16}  # they did run in fp16
    assert preds.dtype == torch.float32 and preds.shape == (32, 1)
    assert loss == pytest.approx(float(MSELossFlat()(preds, targs)), rel=1e-6)
    for a, b in zip(w, learn.model.parameters()): assert b.dtype == torch.float32 and torch.equal(a, b)
    ids = {id(p) for p in learn.model.parameters()}
    assert all(id(p) in ids for pg in learn.opt.param_lists for p in pg)

class _CancelAndOverflow(Callback):
    "Before `MixedPrecision` (order 5): cancel the optimizer step of batch 2, put an inf in a 16-bit grad of batch 3."
    order = 5
    def __init__(self): self.n = 0
    def after_backward(self):
        self.n += 1
        if self.n == 3: self.learn.model[3].weight.grad[0, 0] = float('inf')
    def before_step(self):
        if self.n == 2: raise CancelStepException()

class _LateCancelBatch(Callback):
    "After `MixedPrecision` (order 15): cancel the whole of batch 1 in `before_step` (fastai then skips `after_step`)."
    order, n = 15, 0
    def before_step(self):
        self.n += 1
        if self.n == 1: raise CancelBatchException()

def _zero(l): return all(p.grad is None or not p.grad.any() for p in l.model.parameters())

def _spying_sgd(seen:list):
    "A fastai SGD that records, at each optimizer step, whether the model's 16-bit grads are zero already."
    learn_ref = []
    def spy(p, **kwargs):  # called per param: note the step once, at its first param
        if p is learn_ref[0].opt.param_lists[0][0]: seen.append(_zero(learn_ref[0]))
    spy.elementwise = True  # it updates nothing: flat masters may carry it
    return learn_ref, lambda params, lr: Optimizer(params, [spy, sgd_step], lr=lr)

@pytest.mark.parametrize('late', [None, 'observe', 'cancel'])
@pytest.mark.parametrize('flat', [False, True])
@pytest.mark.parametrize('dtype', HALF)
def test_each_backward_starts_from_zero_model_grads(dtype, flat, late):
    """Every backward starts from zero 16-bit grads: after an ordinary step, a step an earlier callback cancelled and
    an overflow-skipped step. They are the optimizer's source (lifted to FP32 as it steps), so they are cleared after
    the step (`after_step`), never before: a later callback's `before_step` (`late`) that raises
    `CancelBatchException` to accumulate them into the next batch (fastai then skips `after_step`) does carry them."""
    seen = []
    learn_ref, opt_func = _spying_sgd(seen)
    learn = make_learner(opt_func=opt_func); learn_ref.append(learn)
    _to(learn, dtype, flat_master=flat)
    rec = Record(before_backward=_zero, after_backward=_zero)
    cbs = [rec, _CancelAndOverflow()] + {None: [], 'observe': [Record(before_step=lambda l: None)],
                                         'cancel': [_LateCancelBatch()]}[late]
    quiet_fit(learn, 1, lr=1e-2, cbs=cbs)
    # batch 1 is stepped, or cancelled late (its grads carry into batch 2); 2 is cancelled early; 3 overflows
    assert rec.log['before_backward'] == ([True, False, True, True] if late == 'cancel' else [True] * 4)
    assert rec.log['after_backward'] == [False] * 4  # each backward did produce grads
    # at each optimizer step (1 and 4; 1 is cancelled when `late == 'cancel'`): were the 16-bit grads cleared already?
    assert seen == [False] * (1 if late == 'cancel' else 2)
    # the optimizer steps: 1 (unless cancelled late: with 2's grads, it is then cancelled early, no step), 3, 4
    assert learn.mixed_precision.skips == ([True, False] if late == 'cancel' else [False, True, False])

@pytest.mark.parametrize('setup', [lambda l: l, lambda l: l.to_native_fp16(dtype=torch.bfloat16),
                                   lambda l: l.to_bf16(), lambda l: l.to_bf16(flat_master=True)],
                         ids=['fp32', 'native', 'bf16', 'bf16-flat'])
def test_channels_last_is_kept_during_the_fit(setup):
    "With fastai's `ChannelsLast` callback the conv weights train in channels-last format, in any precision."
    from fastai.callback.channelslast import ChannelsLast
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, 4, 4, generator=g), torch.randn(32, 1, generator=g)
    items = list(zip(x, y))
    dls = DataLoaders(DataLoader(items, bs=16), DataLoader(items[:16], bs=16), device=DEVICE)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(4, 1)).to(DEVICE)
    learn = setup(Learner(dls, model, loss_func=MSELossFlat(), opt_func=SGD, lr=1e-2, cbs=ChannelsLast()))
    rec = Record(after_pred=lambda l: l.model[0].weight.is_contiguous(memory_format=torch.channels_last))
    quiet_fit(learn, 1, cbs=rec)
    assert rec.log['after_pred'] == [True, True]

# ---- a lower-order callback cancels the training in after_step ------------------------------------------------

class CancelTrainAfterStep(Callback):
    "Order 5, before MixedPrecision (10): `CancelTrainException` in the `after_step` of the second batch."
    order = 5
    def after_step(self):
        if self.training and self.iter == 1: raise CancelTrainException()

class WeightsAtValidate(Callback):
    order = 90
    def before_validate(self): self.w = weights(self.learn)

@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
def test_cancel_train_in_an_earlier_after_step_updates_the_model(mode):
    """Before the fix: our `after_step` was skipped, so the 16-bit model missed the last update and the validation
    after the cancel ran the stale weights (only `after_fit` gave the FP32 model the masters)."""
    finals = []
    for m in ('fp32', mode):
        learn = to_mode(make_learner(), m)
        at_valid = WeightsAtValidate()
        quiet_fit(learn, 1, lr=1e-1, cbs=[CancelTrainAfterStep(), at_valid])
        finals.append(weights(learn))
    # the final weights are the trained masters (those of BatchNorm, FP32 in the model, too: they missed the update)
    for a, b in zip(*finals): assert torch.allclose(a, b, rtol=0., atol=5e-3)
    # the model that validated after the cancel is the masters (= the final FP32 weights) rounded to 16-bit
    for v, f in zip(at_valid.w, finals[1]): assert torch.equal(v, f.to(v.dtype))

# ---- fastai's MixUp -------------------------------------------------------------------------------------------

def classifier(n=64, bs=16):
    "A tiny 2-class classifier on fixed data."
    seed_all()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g); y = (x[:, 0] > 0).long()
    ds = list(zip(x, y))
    dls = DataLoaders(DataLoader(ds[:48], bs=bs), DataLoader(ds[48:], bs=bs), device=torch.device('cpu'))
    return Learner(dls, nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), loss_func=CrossEntropyLossFlat())

@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
def test_mixup_trains(mode):
    """Before the fix: `expected dtype c10::BFloat16 for 'weight' but got dtype float` in MixUp's `before_batch`
    (fp16: c10::Half)."""
    learn = to_mode(classifier(), mode)
    w0 = weights(learn)
    quiet_fit(learn, 1, lr=1e-1, cbs=MixUp())
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in learn.model.parameters())
    assert not torch.equal(learn.model[0].weight, w0[0])

# ---- Recorder columns: with a dynamic scale only, printed but kept out of the recorded metrics ----------------

class _Printed(Callback):
    "What fastai prints for each epoch: the Recorder's names and the logged row (`learn.logger`)."
    order = 70
    def before_fit(self): self.names, self.rows, self.learn.logger = [], [], lambda row: self.rows.append(list(row))
    def after_epoch(self): self.names.append(list(self.recorder.metric_names))

@pytest.mark.parametrize('setup,shown', [(lambda l: l.to_fp16(), True), (lambda l: l.to_bf16(), False),
                                          (lambda l: l.to_fp16(dynamic=False, loss_scale=64.), False)])
def test_precision_columns_only_with_a_dynamic_scale(setup, shown):
    learn = setup(make_learner(metrics=mae))
    p = _Printed()
    with learn.no_bar(): learn.fit(2, 1e-2, cbs=p)
    assert (p.names[-1][-3:-1] == ['loss_scale', 'n_skipped']) == shown  # the table printed during the fit
    assert all(len(r) == len(p.names[-1]) for r in p.rows)
    # what plots the metrics (e.g. the widespread `Recorder.plot_metrics` recipe) sees the user's columns only
    rec = learn.recorder
    assert list(rec.metric_names) == ['epoch', 'train_loss', 'valid_loss', 'mae', 'time']
    assert all(len(v) == 3 for v in rec.values) and learn.final_record is rec.values[-1]

# ---- the slow-fp16 warning: how much slower, what to use, at the user's line ----------------------------------

@pytest.mark.parametrize('how', ['fit_one_cycle', 'fit'])
def test_slow_fp16_warning_says_how_much_and_points_at_the_users_line(reset_warned, monkeypatch, how):
    monkeypatch.setattr(fp16cb.dtypes, 'cpu_has_native', {torch.float16: False, torch.bfloat16: True}.get)
    learn = make_learner(device='cpu').to_fp16()  # the CPU's warning (a GPU's fp16 is native), whatever the test device
    with warnings.catch_warnings(record=True) as w, learn.no_bar(), learn.no_logging():
        warnings.simplefilter('always')
        getattr(learn, how)(1, 1e-2)  # the user's line: fastai's fit -> its callbacks -> fp16cb
    ours = [o for o in w if 'fp16 training on the CPU' in str(o.message)]
    assert len(ours) == 1 and ours[0].filename == __file__, [(o.filename, o.lineno) for o in ours]
    msg = str(ours[0].message)
    assert '1.9x (a small tabular MLP), 8x (a compute-bound MLP), 23x (an LSTM) and over 40x (a resnet18) slower than FP32' in msg
    assert 'Use `learn.to_bf16()` instead: bf16 is native' in msg

@pytest.mark.parametrize('bf16_native', [True, False])
def test_range_advice_follows_what_the_machine_runs_fast(monkeypatch, bf16_native):
    """Every piece of advice for an fp16 overflow (all steps skipped, the scale at its floor, inputs beyond fp16's
    range, the collapse) names `learn.to_bf16()` only where bf16 is native, else FP32: before the fix each named bf16 on
    any CPU, where an AVX2-only one runs it several times slower than FP32. A GPU runs bf16 natively."""
    from fp16cb.scaling import warn_all_skipped
    _native(monkeypatch, fp16=False, bf16=bf16_native)
    with pytest.warns(RuntimeWarning) as w: warn_all_skipped([True] * 3, 'MixedPrecision', 'cpu')
    msg = str(w[0].message)
    assert ('`learn.to_bf16()`' in msg) == bf16_native and ('`learn.to_fp32()`' in msg) == (not bf16_native)
    assert '`learn.to_bf16()`' in fp16cb.dtypes.range_remedy('cuda')
