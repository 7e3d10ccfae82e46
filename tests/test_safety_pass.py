"""Data safety, a fifth pass: each case against what plain FP32 fastai does with the same code.

- `half_storage` with every step cancelled by a later callback: nothing trained, so every weight keeps its exact FP32
  value (the FP32 originals were forgotten in `before_step`, before the cancel: the weights came back rounded).
- `step_in_backward` with a sparse embedding: refused at the fit's set-up with the declaration's sentence (it crashed
  inside the backward), the learner untouched.
- `keep_fp32` on a compiled model names its modules as `named_modules()` shows them (`_orig_mod.lin1`) or as the
  original's (`lin1`): both keep the module FP32."""
import warnings
import pytest
import torch
from torch import nn
from fastai.basics import Callback, CancelStepException, SGD, Adam

from fp16cb.compat import RULES
from conftest import make_learner, quiet_fit, weights

class _CancelAfterMixedPrecision(Callback):
    "Cancels every step in `before_step`, after `MixedPrecision`'s (a dry run, a warm-up guard)."
    order = 50
    def before_step(self): raise CancelStepException()

@pytest.mark.parametrize('call', ['to_bf16', 'to_fp16'])
def test_half_storage_keeps_exact_fp32_weights_when_every_step_is_cancelled(call):
    """FP32 fastai with every step cancelled: the weights end exactly as they began. `half_storage` too (before: every
    weight ended rounded to 16-bit, 9.7e-4 off in bf16)."""
    ref = make_learner(opt_func=Adam)
    w0 = weights(ref)
    quiet_fit(ref, 1, cbs=_CancelAfterMixedPrecision())
    assert all(torch.equal(a, b) for a, b in zip(w0, weights(ref)))  # FP32: nothing moves
    learn = getattr(make_learner(opt_func=Adam), call)(half_storage=True)
    quiet_fit(learn, 1, cbs=_CancelAfterMixedPrecision())
    learn.to_fp32()
    got = weights(learn)
    assert all(p.dtype == torch.float32 for p in got)
    for a, b in zip(w0, got): assert torch.equal(a, b), (a - b).abs().max()

def test_half_storage_still_forgets_originals_of_stepped_params():
    "A step taken: its params' FP32 originals go (4 bytes/param), their trained values come back widened after the fit."
    learn = make_learner(opt_func=Adam).to_bf16(half_storage=True)
    w0 = weights(learn)
    quiet_fit(learn, 1)
    mth = next(cb for cb in learn.cbs if type(cb).__name__ == 'ModelToHalf')
    learn.to_fp32()
    assert all(not torch.equal(a, b) for a, b in zip(w0, weights(learn)))  # trained
    assert not mth.converted or all(rec.original.is_meta for rec in mth.originals.values() if rec.is_param)

class _SparseNet(nn.Module):
    "A linear model plus a sparse embedding's first row (an `nn.Embedding(sparse=True)` reached by every batch)."
    def __init__(self):
        super().__init__()
        self.lin, self.emb = nn.Linear(4, 1), nn.Embedding(5, 1, sparse=True)
    def forward(self, x): return self.lin(x) + self.emb(torch.zeros(len(x), dtype=torch.long, device=x.device))

def test_step_in_backward_refuses_a_sparse_embedding_at_set_up():
    """FP32 fastai and `to_bf16()` train a sparse embedding with SGD; `step_in_backward` cannot check and step a sparse
    grad inside the backward (it crashed there: `aten::ne.Scalar` on SparseCPU): refused at the fit's set-up, naming the
    module, before anything moved."""
    ref = make_learner(model=_SparseNet(), opt_func=SGD, splitter=lambda m: [list(m.parameters())])
    w0 = weights(ref)
    quiet_fit(ref, 1)
    assert not torch.equal(w0[-1], weights(ref)[-1])  # FP32 trains the embedding
    ok = make_learner(model=_SparseNet(), opt_func=SGD, splitter=lambda m: [list(m.parameters())]).to_bf16()
    quiet_fit(ok, 1)
    learn = make_learner(model=_SparseNet(), opt_func=SGD, splitter=lambda m: [list(m.parameters())])
    learn.to_bf16(step_in_backward=True)
    w0 = weights(learn)
    with pytest.raises(ValueError, match=r"emb get.? sparse gradients"): quiet_fit(learn, 1)
    assert all(torch.equal(a, b) for a, b in zip(w0, weights(learn)))
    assert any(r.name == 'sib-sparse' for r in RULES)

@pytest.mark.parametrize('name', ['_orig_mod.0', '0'])
def test_keep_fp32_on_a_compiled_model_takes_either_name(name):
    """`torch.compile(model)` shows its modules as `_orig_mod.0`; fp16cb names them as the original model does (`0`).
    Either name keeps the module FP32 (before: `_orig_mod.0` warned "matches no module" and kept nothing)."""
    learn = make_learner(model=torch.compile(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), backend='eager'),
                         splitter=lambda m: [list(m.parameters())])
    seen = []
    class Dtypes(Callback):
        def before_batch(self):
            if self.training: seen.append((self.learn.model._orig_mod[0].weight.dtype, self.learn.model._orig_mod[2].weight.dtype))
    learn.to_bf16(keep_fp32=name)
    with warnings.catch_warnings():
        warnings.simplefilter('error', UserWarning)
        warnings.filterwarnings('ignore', message='.*(jit|deprecated|TorchScript).*')
        quiet_fit(learn, 1, cbs=Dtypes())
    assert seen and all(s == (torch.float32, torch.float32) for s in seen)  # the model keeps its FP32 params
    report = learn.mixed_precision.policy_report().set_index('module')
    assert report.loc[['0', '2'], 'compute'].tolist() == ['float32', 'bfloat16']

class _UnusedHead(nn.Module):
    "A linear model and a head never called (switched on later in training, say)."
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.head = nn.Linear(4, 1), nn.Linear(4, 1)
    def forward(self, x): return self.lin(x)

@pytest.mark.parametrize('opt', ['adam', 'adamw'])
def test_flat_masters_leave_no_state_to_params_that_never_had_a_grad(opt):
    """FP32 fastai leaves a param that never got a grad no optimizer state (fastai's flags aside). Flat masters step
    its group as one tensor, its slices put back each step; after the fit it has FP32's state (before: zero moments and
    the group's step count, so that trained later it moved 0.64x as far as under FP32)."""
    from functools import partial
    from fastai.optimizer import OptimWrapper
    from fp16cb.weights.optstate import opt_state
    opt_func = Adam if opt == 'adam' else partial(OptimWrapper, opt=torch.optim.AdamW)
    def run(mode):
        learn = make_learner(model=_UnusedHead(), opt_func=opt_func, splitter=lambda m: [list(m.parameters())])
        if mode: learn.to_fp16(flat_master=True)
        quiet_fit(learn, 1)
        if mode: learn.to_fp32()
        st = opt_state(learn.opt)
        return {n: {k: (tuple(v.shape) if torch.is_tensor(v) and v.dim() else float(v) if torch.is_tensor(v) else v)
                    for k, v in st.get(p, {}).items()} for n, p in learn.model.named_parameters()}
    ref, got = run(None), run('fp16')
    assert ref['head.weight'] == got['head.weight'] and ref['head.bias'] == got['head.bias'], (ref, got)
    assert got['lin.weight'] == ref['lin.weight']  # the params it stepped keep their state

def test_a_static_scale_that_flushes_every_gradient_warns():
    """A loss weighted by 1e-9 with `to_fp16(loss_scale=1, dynamic=False)`: every fp16 gradient flushes to zero and
    nothing trains, which FP32 would not do. The fit's first step says so (read in its one sync); the dynamic default
    calibrates the scale and trains, without the warning."""
    import torch.nn.functional as F
    loss = lambda p, y: 1e-9 * F.mse_loss(p, y)
    def tiny_loss_learner():
        l = make_learner()
        l.loss_func = loss
        return l
    learn = tiny_loss_learner().to_fp16(loss_scale=1., dynamic=False)
    w0 = weights(learn)
    with pytest.warns(RuntimeWarning, match=r"underflowed \(flushed to zero\), so nothing trains"): quiet_fit(learn, 1)
    learn.to_fp32()
    assert all(torch.equal(a, b) for a, b in zip(w0[:2], weights(learn)[:2]))  # the first Linear never moved
    ok = tiny_loss_learner().to_fp16()
    with warnings.catch_warnings():
        warnings.filterwarnings('error', message='.*underflowed.*')
        quiet_fit(ok, 1)

def test_native_fp16_shows_its_dynamic_scale_as_columns():
    """`to_native_fp16()` runs a dynamic GradScaler: the fit's table has `loss_scale` and `n_skipped` as with
    `to_fp16()` (before: none), a `validate()` inside the fit returns what FP32's does, and after the fit the Recorder
    has the user's columns only. `to_native_bf16()` runs no GradScaler: no columns."""
    from fastai.metrics import mae
    from test_callbacks import _ValidateEachEpoch
    def run(call):
        learn = make_learner(metrics=mae)
        if call: getattr(learn, call)()
        v = _ValidateEachEpoch()
        quiet_fit(learn, 2, lr=1e-2, cbs=v)
        return learn, v
    (l32, v32), (l16, v16), (lbf, vbf) = run(None), run('to_native_fp16'), run('to_native_bf16')
    names32 = v32.rows[0][0]
    assert [n for n, _ in v16.rows] == [names32[:-1] + ['loss_scale', 'n_skipped', names32[-1]]] * 2
    assert [len(r) for r in v16.results] == [len(r) for r in v32.results] == [2, 2]
    assert [n for n, _ in vbf.rows] == [names32] * 2
    assert list(l16.recorder.metric_names) == names32
    names16, row = v16.rows[-1]
    native = next(c for c in l16.cbs if type(c).__name__ == 'NativeMixedPrecision')
    assert row[names16.index('n_skipped')] == native.n_skipped == sum(native.skips)  # the printed row: its values
    assert row[names16.index('loss_scale')] > 0

class _HugeValidInputs(Callback):
    "Validation inputs of ~1e7 (a feature constant in the training split, normalized by std + 1e-7), training ones as they are."
    def before_batch(self):
        if not self.training: self.learn.xb = (self.xb[0] * 1e7,)

def test_validation_inputs_beyond_fp16s_range_warn_once():
    """FP32 reports a large finite validation loss on inputs of ~1e7; fp16 casts them to inf and reports nan. That is
    said, once (read once per validation, no per-batch sync); bf16 (FP32's range) and ordinary inputs say nothing."""
    ref = make_learner()
    quiet_fit(ref, 1, cbs=_HugeValidInputs())
    assert torch.isfinite(torch.tensor(ref.recorder.values[-1][1]))  # FP32: a finite (huge) valid loss
    learn = make_learner().to_fp16()
    with pytest.warns(RuntimeWarning, match="beyond fp16's range") as ws: quiet_fit(learn, 2, cbs=_HugeValidInputs())
    assert sum("beyond fp16's range" in str(w.message) for w in ws) == 1
    for l in (make_learner().to_bf16(), make_learner().to_fp16()):
        cbs = [_HugeValidInputs()] if l.precision_callbacks()[0].dtype == torch.bfloat16 else []
        with warnings.catch_warnings():
            warnings.filterwarnings('error', message=".*beyond fp16's range.*")
            quiet_fit(l, 1, cbs=cbs)

class _CancelEveryOther(Callback):
    "Cancels every other step after `MixedPrecision`'s `before_step` (the 1st, 3rd, ...)."
    order = 50
    def before_fit(self): self.n = 0
    def before_step(self):
        self.n += 1
        if self.n % 2: raise CancelStepException()

def test_lognormal_calibrates_its_first_scale_and_skips_nothing_on_small_gradients():
    """`scaler='lognormal'` started at 2^16 whatever the gradients; on a model whose gradients overflow fp16 at that
    scale its first steps were skipped (the updates ended 50% off FP32's). It calibrates now as the backoff scaler does:
    the first step at scale 1, its largest |grad| the first observation; no step skipped where nothing overflows."""
    from fp16cb.scaling import LogNormalScaler
    learn = make_learner(opt_func=Adam).to_fp16(scaler='lognormal')
    assert isinstance(learn.mixed_precision.scaler, LogNormalScaler) and learn.mixed_precision.loss_scale == 1.
    quiet_fit(learn, 2, cbs=_CancelEveryOther())
    mp = learn.mixed_precision
    assert mp.n_skipped == 0 and not any(mp.skips) and mp.scales[0] == 1. and mp.loss_scale > 1.
    ref = make_learner(opt_func=Adam)
    w0 = weights(ref)
    quiet_fit(ref, 2, cbs=_CancelEveryOther())
    learn.to_fp32()
    names = [n for n, _ in learn.model.named_parameters()]
    for n, a, b, c in zip(names, w0, weights(ref), weights(learn)):
        if n == '0.bias': continue  # BatchNorm follows: its grad is 0 but for rounding noise, which Adam normalizes
        assert (c - b).norm() <= 0.1 * (b - a).norm(), n

@pytest.mark.parametrize('call', ['to_native_bf16', 'to_native_fp16'])
def test_native_autocast_survives_a_pause_inside_a_batch(call):
    """A callback's `before_batch`, after the native callback's, that saves or unfreezes (a pause: the FP32 learner for
    a moment) used to leave that batch's forward and backward in FP32. Every training forward runs in autocast."""
    class PauseEachBatch(Callback):
        order = 50
        def before_batch(self):
            if self.training: self.learn.freeze_to(0)  # a pause of the precision setup, as `learn.save` is
    learn = getattr(make_learner(), call)()
    seen = []
    h = learn.model[0].register_forward_hook(lambda m, a, out: seen.append((m.training, out.dtype)))
    quiet_fit(learn, 1, cbs=PauseEachBatch())
    h.remove()
    half = torch.bfloat16 if call.endswith('bf16') else torch.float16
    assert [dt for tr, dt in seen if tr] == [half] * 4

class _Float64Head(nn.Module):
    "A body and a float64 `nn.Linear` head that casts its own input (`self.head(x.double())`: a physics or calibration head)."
    def __init__(self, casts:bool=True):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.casts = nn.Linear(4, 8), nn.Linear(8, 1).double(), casts
    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.head(h.double() if self.casts else h).float()

def test_a_float64_layer_that_casts_its_own_input_trains_and_stays_float64():
    """A model that keeps one torch layer in float64 and feeds it float64 itself trains with `to_bf16()` as in FP32, the
    layer staying float64 (refused by the layer's type before: a regression); a layer that a 16-bit input reaches is
    refused at that first forward, before any step, naming it; a model float64 throughout is refused at set-up."""
    def run(mode, casts=True, **kw):
        learn = make_learner(model=_Float64Head(casts), splitter=lambda m: [list(m.parameters())])
        w0 = weights(learn)
        if mode: learn.to_bf16(**kw)
        quiet_fit(learn, 1)
        if mode: learn.to_fp32()
        return learn, w0
    (ref, w0), (got, _) = run(None), run('bf16')
    assert got.model.head.weight.dtype == torch.float64 and got.model.body.weight.dtype == torch.float32
    for a, b, c in zip(w0, weights(ref), weights(got)): assert (c - b).norm() <= 0.05 * (b - a).norm() + 1e-6
    kept, _ = run('bf16', keep_fp32='head')  # an FP32 island: its own float64 input is not cast down to FP32
    assert kept.model.head.weight.dtype == torch.float64
    for a, b, c in zip(w0, weights(ref), weights(kept)): assert (c - b).norm() <= 0.05 * (b - a).norm() + 1e-6
    learn = make_learner(model=_Float64Head(casts=False), splitter=lambda m: [list(m.parameters())]).to_bf16()
    w1 = weights(learn)
    with pytest.raises(ValueError, match=r"layer head is float64 and a bfloat16 input reached it"): quiet_fit(learn, 1)
    assert all(torch.equal(a, b) for a, b in zip(w1, weights(learn)))

@pytest.mark.parametrize('call', ['to_bf16', 'to_fp16'])
def test_inference_between_fits_makes_no_weight_store(monkeypatch, call):
    """`get_preds`/`validate`/`predict` between fits run the 16-bit model: no FP32 masters, flat buffers or optimizer
    moves (a bf16 `get_preds` on an 8.4M-param MLP took 6.7x FP32's time, 2.2x now: `bench/RESULTS.md`). The predictions are the 16-bit model's
    as before, and a fit afterwards makes its store and trains."""
    from fp16cb.weights import ModelParams
    from fp16cb.storage import HalfStorage
    made = []
    for cls in (HalfStorage, ModelParams):
        init = cls.__init__
        monkeypatch.setattr(cls, '__init__', lambda self, *a, _init=init, **k: (made.append(type(self).__name__), _init(self, *a, **k))[1])
    learn = getattr(make_learner(), call)()
    with learn.no_bar(), learn.no_logging():
        preds, _ = learn.get_preds()
        learn.validate()
    assert made == [] and torch.isfinite(preds).all()
    w0 = weights(learn)
    quiet_fit(learn, 1)
    assert made and any(not torch.equal(a, b) for a, b in zip(w0, weights(learn)))

class _RMSNorm(nn.Module):
    "A hand-written RMSNorm: `x * rsqrt(mean(x**2) + eps) * weight` (in fp16, `x**2` of activations ~360 is inf: 0 out)."
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
    def forward(self, x): return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

class _NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.norm, self.head = nn.Linear(4, 32), _RMSNorm(32), nn.Linear(32, 1)
        with torch.no_grad(): self.lin.weight.mul_(400.)  # activations in the hundreds
    def forward(self, x): return self.head(self.norm(self.lin(x)))

def test_precision_check_names_an_output_far_from_fp32s_with_no_inf_anywhere():
    """A hand-written RMSNorm after activations of ~360: in fp16 `x**2` overflows to inf and `rsqrt(inf)` is 0, so the
    norm outputs 0 with no inf/NaN anywhere; the fit fails silently. `precision_check` said "safe" with the norm's
    `rel_diff` at 0.9. It names the module and the remedy it checked (keeping it FP32); a sound model is still safe."""
    learn = make_learner(model=_NormNet(), splitter=lambda m: [list(m.parameters())]).to_fp16()
    df = learn.precision_check(n_batches=2, plot=False)
    assert df.loc['norm', 'rel_diff'] > .5 and df.attrs['keep_fp32'] == ['re:norm']  # 'norm' alone: the category
    assert df.attrs['advice'].startswith("keep_fp32=['re:norm']: `learn.to_fp16(keep_fp32=['re:norm'])`")
    kept = make_learner(model=_NormNet(), splitter=lambda m: [list(m.parameters())]).to_fp16(keep_fp32=['re:norm'])
    assert kept.precision_check(n_batches=2, plot=False).attrs['advice'].split(':')[0] in ('safe', 'underflow')
    ok = make_learner().to_fp16().precision_check(n_batches=2, plot=False)
    assert ok.attrs['advice'].startswith('safe')

class _LateHead(nn.Module):
    "A body, and a head that joins the forward from the 3rd training forward on (switched on after warm-up)."
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.n = nn.Linear(4, 1), nn.Linear(4, 1), 0
    def forward(self, x):
        if self.training: self.n += 1
        return self.body(x) + (self.head(x) if self.n >= 3 or not self.training else 0.)

class _SkippedLater(nn.Module):
    "Two layers; the second is skipped from the 4th training forward on (LayerDrop-like)."
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.n = nn.Linear(4, 1), nn.Linear(4, 1), 0
    def forward(self, x):
        if self.training: self.n += 1
        return self.a(x) + (self.b(x) if self.n < 4 or not self.training else 0.)

@pytest.mark.parametrize('model,opt', [(_LateHead, 'adam'), (_SkippedLater, 'adamw')])
def test_flat_masters_follow_a_param_whose_grad_comes_or_goes(model, opt):
    """FP32 trains a head that joins at step 3 (fastai's Adam) and a layer skipped from step 4 (torch's AdamW), each
    with its own step count. Flat masters beside the model kept one count per group: they were refused at step 3 or 4,
    after the weights had moved, and later went on with one master per param (a warning said so). `flat_master` now
    lays the model's FP32 params out and the optimizer steps each of them: it trains as FP32 does, with nothing to say."""
    from functools import partial
    from fastai.optimizer import OptimWrapper
    opt_func = Adam if opt == 'adam' else partial(OptimWrapper, opt=torch.optim.AdamW)
    def run(mode):
        learn = make_learner(model=model(), opt_func=opt_func, splitter=lambda m: [list(m.parameters())])
        w0 = weights(learn)
        if mode: learn.to_fp16(flat_master=True)
        with warnings.catch_warnings():
            warnings.filterwarnings('error', message=".*one FP32 master per param")
            quiet_fit(learn, 2)
        if mode: learn.to_fp32()
        return w0, weights(learn), learn
    (w0, ref, _), (_, got, learn) = run(None), run('fp16')
    for a, b, c in zip(w0, ref, got): assert (c - b).norm() <= 0.02 * (b - a).norm() + 1e-5, ((c - b).norm(), (b - a).norm())
