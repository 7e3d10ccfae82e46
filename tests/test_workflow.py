"Mixed precision in the whole fastai workflow: schedules, freezing, lr_find, accumulation, clipping, inference."
import math, random, warnings
import pytest, torch
from torch import nn
import torch.nn.functional as F
from fastai.learner import Learner
from fastai.data.core import Datasets
from fastai.optimizer import Adam, SGD
from fastai.callback.core import Callback
from fastai.metrics import mae
from fastai.torch_core import params
import fastai.callback.schedule  # fit_one_cycle, fine_tune, lr_find
from fastai.callback.training import GradientAccumulation, GradientClip
from fastai.callback.tracker import EarlyStoppingCallback
from fp16cb import ModelToHalf, MixedPrecision, NativeMixedPrecision
from conftest import DEVICE, StepSpy

pytestmark = pytest.mark.filterwarnings("ignore:(fp16|bf16) training on the CPU:RuntimeWarning")

@pytest.fixture(autouse=True, scope='module')
def one_thread():
    "Tiny tensors: torch's thread pool only costs time (a lot of it on a busy 2-core machine)."
    n = torch.get_num_threads(); torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

# fp16's dynamic scale starts at 2**24 and its first ~12 steps overflow (skipped): these short fits start lower
MODES = {'fp16': ('to_fp16', {'max_loss_scale': 2.**12}), 'bf16': ('to_bf16', {}), 'native': ('to_native_fp16', {}),
         'native_bf16': ('to_native_bf16', {})}

# ---- tiny data and models -------------------------------------------------------------------------------------
N, NIN, NTOK = 96, 6, 20
def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x, tok = torch.randn(N, NIN, generator=g), torch.randint(0, NTOK // 2, (N,), generator=g)  # half the vocabulary unused
    y = (x @ torch.randn(NIN, generator=g) + 0.1 * torch.randn(N, generator=g))[:, None]
    return x, tok, y

def make_dls(tokens=False, bs=8, shuffle=True, seed=0):
    x, tok, y = _data(seed)
    tfms = [[lambda i: x[i]]] + ([[lambda i: tok[i]]] if tokens else []) + [[lambda i: y[i]]]
    dss = Datasets(range(N), tfms=tfms, splits=[list(range(64)), list(range(64, N))], n_inp=2 if tokens else 1)
    return dss.dataloaders(bs=bs, shuffle=shuffle, device=DEVICE, num_workers=0)

class Net(nn.Module):
    "Linear -> BatchNorm -> ReLU -> Linear; `out` picks a tensor, a tuple or a dict of tensors as output."
    def __init__(self, out='tensor', tokens=False):
        super().__init__()
        self.out, self.emb = out, nn.Embedding(NTOK, 4) if tokens else None
        self.body = nn.Sequential(nn.Linear(NIN + (4 if tokens else 0), 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Linear(16, 1)
    def forward(self, x, tok=None):
        self.in_dtypes = (x.dtype, None if tok is None else tok.dtype)
        if tok is not None: x = torch.cat([x, self.emb(tok)], 1)
        h = self.body(x); o = self.head(h)
        if self.out == 'tuple': return o, h
        if self.out == 'dict': return {'o': o, 'h': h}
        return o

def _loss(pred, y):
    if isinstance(pred, tuple): return F.mse_loss(pred[0], y) + 1e-3 * pred[1].pow(2).mean()
    if isinstance(pred, dict): return F.mse_loss(pred['o'], y) + 1e-3 * pred['h'].pow(2).mean()
    return F.mse_loss(pred, y)

def splitter(m): return [params(m.body) + (params(m.emb) if m.emb is not None else []), params(m.head)]

def make_learner(mode=None, seed=0, out='tensor', tokens=False, opt_func=Adam, dls=None, loss_func=_loss, **kw):
    torch.manual_seed(seed); random.seed(seed)  # fastai's DataLoader shuffles with `random`
    learn = Learner(dls or make_dls(tokens), Net(out, tokens).to(DEVICE), loss_func=loss_func, opt_func=opt_func, splitter=splitter,
                    metrics=[mae] if out == 'tensor' else None)
    learn.recorder.train_metrics = False
    if mode is not None:
        name, kwargs = MODES[mode]
        getattr(learn, name)(**{**kwargs, **kw})
    return learn

def quiet(learn): return learn.no_bar(), learn.no_logging()

def fit(learn, meth='fit', *args, **kwargs):
    with learn.no_bar(), learn.no_logging(): getattr(learn, meth)(*args, **kwargs)
    return learn

def clone_state(model): return {k: v.detach().clone() for k, v in model.state_dict().items()}

def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a: assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k

def assert_fp32_between_fits(learn):
    "Between fits: every floating param and buffer FP32, and the optimizer steps the model's own params."
    assert all(t.dtype == torch.float32 for t in learn.model.state_dict().values() if t.is_floating_point())
    opt_params = list(learn.opt.all_params().itemgot(0))
    assert {id(p) for p in opt_params} == {id(p) for p in learn.model.parameters()}
    assert all(p.dtype == torch.float32 for p in opt_params)
    assert all(k in {id(p) for p in opt_params} for k in map(id, learn.opt.state))
    assert not torch.is_autocast_enabled(DEVICE.type)

def opt_state(learn):
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in learn.opt.state[p].items()}
            for p in learn.opt.all_params().itemgot(0)]

def assert_same_opt_state(a, b):
    assert len(a) == len(b)
    for sa, sb in zip(a, b):
        assert sa.keys() == sb.keys()
        for k in sa:
            if isinstance(sa[k], torch.Tensor): assert torch.equal(sa[k], sb[k]), k
            else: assert sa[k] == sb[k], k

def valid_loss(learn):
    with learn.no_bar(): return learn.validate()[0]

# ---- schedules, freezing, param groups ------------------------------------------------------------------------
@pytest.mark.parametrize('mode', list(MODES))
def test_fit_one_cycle_learns(mode):
    learn = make_learner()
    getattr(learn, MODES[mode][0])()  # the defaults
    before = valid_loss(learn)
    fit(learn, 'fit_one_cycle', 4, 3e-2)  # fp16: the dynamic scale starts at 2**24, the first ~12 steps are skipped
    after = valid_loss(learn)
    assert math.isfinite(after) and after < 0.6 * before
    assert_fp32_between_fits(learn)
    assert len(learn.precision_callbacks()) == (1 if 'native' in mode else 2)

@pytest.mark.parametrize('mode', ['fp16', 'bf16', 'native'])
def test_freeze_fit_unfreeze(mode):
    "fine_tune's steps: frozen groups stay bit-identical (BatchNorm excepted: train_bn), then everything trains."
    learn = make_learner(mode)
    learn.freeze()
    start = clone_state(learn.model)
    fit(learn, 'fit_one_cycle', 1, 1e-2)
    end = clone_state(learn.model)
    assert_fp32_between_fits(learn)
    for k in start:
        frozen_non_bn = k.startswith('body.0.')
        if frozen_non_bn: assert torch.equal(start[k], end[k]), k  # frozen: exactly the FP32 original
        elif k.startswith(('body.1.weight', 'body.1.bias', 'head.')): assert not torch.equal(start[k], end[k]), k
    assert all(not p.requires_grad for p in learn.model.body[0].parameters())
    assert all(p.requires_grad for p in learn.model.body[1].parameters())  # train_bn
    learn.unfreeze()
    fit(learn, 'fit_one_cycle', 1, slice(1e-4, 1e-2))
    assert not torch.equal(learn.model.body[0].weight, end['body.0.weight'])
    assert_fp32_between_fits(learn)
    fit(learn, 'fine_tune', 1, 1e-2)  # fastai's own freeze -> fit -> unfreeze -> fit
    assert_fp32_between_fits(learn)
    assert math.isfinite(valid_loss(learn))

def test_discriminative_lrs_reach_the_masters():
    "slice(1e-7, 1e-1): the body's tiny steps are kept by the FP32 masters and match the FP32 run's."
    runs = {}
    for mode in [None, 'fp16']:
        learn = make_learner(mode, opt_func=SGD, dls=make_dls(shuffle=False), **({} if mode is None else
                             dict(dynamic=False, loss_scale=256)))
        w0 = learn.model.body[0].weight.detach().clone(); h0 = learn.model.head.weight.detach().clone()
        fit(learn, 'fit', 1, slice(1e-7, 1e-1))
        assert [h['lr'] for h in learn.opt.hypers] == pytest.approx([1e-7, 1e-1])
        runs[mode] = (learn.model.body[0].weight - w0, learn.model.head.weight - h0)
    (b32, h32), (b16, h16) = runs[None], runs['fp16']
    assert 0 < b16.abs().max() < 1e-5  # an fp16 weight could not move by this much less than its ulp: masters did
    assert (b16 - b32).norm() < 0.05 * b32.norm() and (h16 - h32).norm() < 0.05 * h32.norm()

@pytest.mark.parametrize('flat_master', [False, True])
@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
def test_frozen_params_come_back_bit_identical(mode, flat_master):
    learn = make_learner(mode, flat_master=flat_master)
    learn.model.head.bias.requires_grad_(False); learn.model.body[0].weight.requires_grad_(False)
    start = clone_state(learn.model)
    fit(learn, 'fit', 1, 1e-2)
    end = clone_state(learn.model)
    assert_fp32_between_fits(learn)
    assert torch.equal(start['head.bias'], end['head.bias']) and torch.equal(start['body.0.weight'], end['body.0.weight'])
    assert not torch.equal(start['head.weight'], end['head.weight'])

@pytest.mark.parametrize('mode', ['fp16', 'native'])
def test_param_groups_change_between_fits(mode):
    learn = make_learner(mode)
    fit(learn, 'fit', 1, 1e-2)
    learn.splitter = lambda m: [params(m)]  # one group now
    learn.create_opt()
    fit(learn, 'fit', 1, 1e-2)
    assert len(learn.opt.param_lists) == 1
    assert_fp32_between_fits(learn)
    learn.model.head = nn.Linear(16, 1).to(DEVICE)  # new parameters, new optimizer
    new = learn.model.head.weight.detach().clone()
    learn.splitter = splitter
    learn.create_opt()
    fit(learn, 'fit', 1, 1e-2)
    assert_fp32_between_fits(learn)
    assert not torch.equal(new, learn.model.head.weight)
    assert math.isfinite(valid_loss(learn))

@pytest.mark.parametrize('mode', ['fp16', 'native'])
def test_early_stopping_cancels_cleanly(mode):
    "EarlyStopping ends the fit with CancelFitException: after_fit still runs, the model is FP32 again."
    learn = make_learner(mode)
    fit(learn, 'fit', 10, 1e-2, cbs=EarlyStoppingCallback(monitor='valid_loss', min_delta=1e3, patience=1))
    assert learn.epoch == 1  # stopped after patience + 1 epochs
    assert_fp32_between_fits(learn)
    fit(learn, 'fit', 1, 1e-2)
    assert math.isfinite(valid_loss(learn))

# ---- lr_find ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('mode,kw', [('fp16', {}), ('fp16', {'flat_master': True}), ('bf16', {}), ('native', {})])
def test_lr_find_restores_model_and_optimizer(mode, kw):
    learn = make_learner(mode, **kw)
    learn.freeze()  # some params frozen: the optimizer state must still load back
    fit(learn, 'fit', 1, 1e-2)
    model0, opt0 = clone_state(learn.model), opt_state(learn)
    mp = getattr(learn, 'mixed_precision', None)
    scale0 = mp.scaler.state_dict() if mp is not None else learn.native_mixed_precision.scaler.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter('error', UserWarning)  # fastai warns "Could not load the optimizer state."
        with learn.no_bar(): res = learn.lr_find(num_it=20, show_plot=False)
    assert 1e-7 < res.valley < 10
    assert_same_state(model0, clone_state(learn.model))
    assert_same_opt_state(opt0, opt_state(learn))
    assert (mp.scaler.state_dict() if mp is not None else learn.native_mixed_precision.scaler.state_dict()) == scale0
    assert_fp32_between_fits(learn)
    fit(learn, 'fit', 1, res.valley)
    assert math.isfinite(valid_loss(learn))

def test_lr_find_diverging_fp16_stops_instead_of_raising():
    "Without stop_div the huge lrs make every step overflow: the search ends (like stop_div), it does not raise."
    learn = make_learner('fp16')
    model0 = clone_state(learn.model)
    with learn.no_bar(): res = learn.lr_find(num_it=100, end_lr=1e6, stop_div=False, show_plot=False)
    assert len(learn.recorder.lrs) < 100 and math.isfinite(res.valley)
    assert_same_state(model0, clone_state(learn.model))
    mp = learn.mixed_precision
    assert any(mp.skips) and mp.loss_scale == 1. and not mp.scaler.calibrated  # restored: uncalibrated, as before
    assert_fp32_between_fits(learn)

# ---- gradient accumulation and clipping -------------------------------------------------------------------------
class GradSpy(StepSpy):
    """Records, at each real optimizer step, the gradients the optimizer steps with (unscaled), all params in one vector
    in the model's order (the masters are stepped in their buffer's order: each is named by the model param it holds)."""
    def before_step(self):
        super().before_step()
        mp = getattr(self.learn, 'mixed_precision', None)
        pairs = mp.store.fp32_views().items() if mp is not None and mp.store is not None else ((p, p) for p in self.learn.model.parameters())
        rank = {id(p): i for i, p in enumerate(self.learn.model.parameters())}
        self._rank = {t.data_ptr(): rank[id(p)] for p, t in pairs}
    def _spy(self, p, **kwargs):
        if self._cur is not None: self._cur.append((self._rank[p.data_ptr()], self.fn(p)))
    _spy.elementwise = True
    @property
    def grads(self): return [torch.cat([g.float().reshape(-1) for _, g in sorted(step, key=lambda o: o[0])]) for step in self.steps]

@pytest.mark.parametrize('mode', ['fp16', 'native'])
def test_gradient_accumulation_matches_fp32(mode, per_param_steps):  # the spy compares grads param by param
    res = {}
    for m in [None, mode]:
        kw = dict(dynamic=False, loss_scale=64.) if m == 'fp16' else dict(init_scale=64.) if m == 'native' else {}
        learn = make_learner(m, opt_func=SGD, dls=make_dls(shuffle=False), **kw)
        spy = GradSpy()
        fit(learn, 'fit', 2, 1e-2, cbs=[GradientAccumulation(n_acc=32), spy])
        res[m] = (spy.grads, clone_state(learn.model))
        if m == 'fp16': assert len(learn.mixed_precision.scales) == 2 * 64 // 32  # checked once per real step
    (g32, s32), (g16, s16) = res[None], res[mode]
    assert len(g16) == len(g32) == 4
    for a, b in zip(g16, g32): torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)  # unscaled, whole window
    for k in s32:
        if s32[k].is_floating_point(): torch.testing.assert_close(s16[k], s32[k], rtol=2e-2, atol=2e-3)

@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
def test_fastai_gradient_clip_is_rejected_with_a_16bit_model(mode):
    "A 16-bit model (`half_storage`): `GradientClip` would clip its loss-scaled 16-bit grads, refused."
    learn = make_learner(mode, half_storage=True)
    w0 = clone_state(learn.model)
    # the remedy in the learner's own dtype (before: `to_fp16(clip=...)` for a bf16 learner too)
    with pytest.raises(ValueError, match=rf"learn.to_{mode}\(clip=0.5, clip_global=True\)"):
        fit(learn, 'fit', 1, 1e-2, cbs=GradientClip(0.5))
    assert_same_state(w0, clone_state(learn.model))
    assert_fp32_between_fits(learn)
    fit(learn, 'fit', 1, 1e-2)  # the learner is fine afterwards

class NormSpy(Callback):
    "The global norm of the grads the optimizer steps, after every other before_step (clipping included)."
    order = 50
    def __init__(self): self.norms = []
    def before_step(self):
        self.norms.append(torch.stack([p.grad.float().norm() for p, *_ in self.learn.opt.all_params(with_grad=True)]).norm().item())

@pytest.mark.parametrize('flat', [False, True])
@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
def test_fastai_gradient_clip_clips_the_fp32_grads_by_default(mode, flat):
    """The model keeps its FP32 params (laid out flat or not): fastai's `GradientClip` clips their unscaled FP32 grads,
    as in FP32."""
    learn = make_learner(mode, flat_master=flat, **({'dynamic': False, 'loss_scale': 2.**10} if mode == 'fp16' else {}))
    spy = NormSpy()
    fit(learn, 'fit', 1, 1e-2, cbs=[GradientClip(0.05), spy])
    assert spy.norms and max(spy.norms) <= 0.05 * 1.001  # clipped at the true scale, not at 2**10 times it

def test_fastai_gradient_clip_sees_unscaled_grads_with_native():
    learn = make_learner('native', init_scale=2.**10)
    spy = NormSpy()
    fit(learn, 'fit', 1, 1e-2, cbs=[GradientClip(0.05), spy])
    assert spy.norms and max(spy.norms) <= 0.05 * 1.001  # clipped at the true scale, not at 2**10 times it

def _norms(spy) -> list: return [torch.stack([g.float().norm() for g in gs]).norm().item() for gs in spy.grads()]

def test_our_clip_clips_unscaled_master_grads():
    learn = make_learner('fp16', clip=0.05, dynamic=False, loss_scale=2.**10)
    spy = StepSpy()
    fit(learn, 'fit', 1, 1e-2, cbs=spy)
    assert _norms(spy) and max(_norms(spy)) <= 0.05 * 2 ** .5 * 1.001  # per param group (two groups)
    assert max(_norms(spy)) > 0.05 * 1.01  # ... which lets the global norm exceed `clip`
    learn = make_learner('fp16', clip=0.05, clip_global=True, dynamic=False, loss_scale=2.**10)
    spy = StepSpy()
    fit(learn, 'fit', 1, 1e-2, cbs=spy)
    assert _norms(spy) and max(_norms(spy)) <= 0.05 * 1.001  # the global norm, as fastai's GradientClip

# ---- inference, outputs, inputs ---------------------------------------------------------------------------------
class InferDuringFit(Callback):
    "Calls get_preds and validate on the valid set in the middle of the fit, when the model is 16-bit."
    order = 90
    def __init__(self): self.res, self.busy = [], False
    def after_epoch(self):
        if self.busy: return  # get_preds itself fires after_epoch
        self.busy = True
        try:  # what the model's head computes with (the model keeps its FP32 params)
            seen = []
            h = self.learn.model.head.register_forward_pre_hook(lambda m, a: seen.append({p.dtype for p in m.parameters()}))
            preds, targs = self.learn.get_preds(dl=self.dls.valid, reorder=False)  # fastai cannot reorder dicts
            h.remove()
            self.res.append((preds, seen[0]))
        finally: self.busy = False

@pytest.mark.parametrize('mode', list(MODES))
def test_inference_during_and_after_training(mode):
    learn = make_learner(mode)
    spy = InferDuringFit()
    fit(learn, 'fit', 2, 1e-2, cbs=spy)
    for preds, half in spy.res:
        assert preds.dtype == torch.float32 and preds.shape == (32, 1) and torch.isfinite(preds).all()
        assert half == ({torch.float32} if 'native' in mode else {torch.bfloat16 if 'bf16' in mode else torch.float16})
    preds, targs = learn.get_preds()
    assert preds.dtype == torch.float32 and torch.isfinite(preds).all()
    torch.testing.assert_close(preds, spy.res[-1][0], rtol=0.05, atol=0.05)  # same weights, 16-bit vs FP32 compute
    vl, vmae = learn.validate()[:2]  # (to_fp16 may add loss_scale, n_skipped columns)
    assert math.isfinite(vl) and math.isfinite(vmae)
    with learn.no_bar(): _, pred, _ = learn.predict(70)
    assert pred.dtype == torch.float32 and pred.shape == (1,)
    eps = torch.finfo(torch.bfloat16 if 'bf16' in mode else torch.float16).eps  # both run the 16-bit model, as fastai's
    torch.testing.assert_close(pred, preds[70 - 64], rtol=eps, atol=eps)  # AMP does: batch of 1 vs 32, other GEMM kernels on CUDA
    assert_fp32_between_fits(learn)

@pytest.mark.parametrize('out', ['tuple', 'dict'])
@pytest.mark.parametrize('mode', ['fp16', 'native_bf16'])
def test_tuple_and_dict_outputs(mode, out):
    learn = make_learner(mode, out=out)
    spy = InferDuringFit()
    fit(learn, 'fit', 1, 1e-2, cbs=spy)
    during = spy.res[0][0]
    parts = during if out == 'tuple' else tuple(during.values())
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in parts)
    preds, _ = learn.get_preds(reorder=False)
    parts = preds if out == 'tuple' else (preds['o'], preds['h'])
    assert [t.shape for t in parts] == [(32, 1), (32, 16)] and all(t.dtype == torch.float32 for t in parts)
    assert math.isfinite(learn.validate()[0])
    assert_fp32_between_fits(learn)

@pytest.mark.parametrize('mode', ['fp16', 'bf16', 'native'])
def test_integer_inputs_next_to_float_inputs(mode):
    learn = make_learner(mode, tokens=True, opt_func=SGD)
    emb0 = learn.model.emb.weight.detach().clone()
    with learn.no_bar(), learn.no_logging(): learn.fit(2, 1e-1)
    x_dtype, tok_dtype = learn.model.in_dtypes  # from the last (validation) batch, after the fit restored FP32
    assert tok_dtype == torch.int64
    emb = learn.model.emb.weight.detach()
    assert emb.dtype == torch.float32
    assert not torch.equal(emb[:NTOK // 2], emb0[:NTOK // 2])
    assert torch.equal(emb[NTOK // 2:], emb0[NTOK // 2:])  # never looked up: bit-identical
    assert_fp32_between_fits(learn)
    assert math.isfinite(learn.validate()[0])

class DtypeSpy(Callback):
    order = 60
    def after_pred(self):
        if self.training: self.seen = self.learn.model.in_dtypes

def test_integer_inputs_stay_integer_in_training():
    learn = make_learner('fp16', tokens=True)
    spy = DtypeSpy()
    fit(learn, 'fit', 1, 1e-2, cbs=spy)
    assert spy.seen == (torch.float16, torch.int64)

# ---- one precision setup at a time ------------------------------------------------------------------------------
def test_last_precision_call_wins():
    learn = make_learner('fp16')
    learn.to_fp16()
    assert [type(cb) for cb in learn.precision_callbacks()] == [ModelToHalf, MixedPrecision]
    fit(learn, 'fit', 1, 1e-2)
    trained = clone_state(learn.model)
    learn.to_native_fp16()
    assert [type(cb) for cb in learn.precision_callbacks()] == [NativeMixedPrecision]
    assert_same_state(trained, clone_state(learn.model))
    learn.to_bf16()
    assert [type(cb) for cb in learn.precision_callbacks()] == [ModelToHalf, MixedPrecision]
    assert learn.mixed_precision.dtype == learn.model_to_half.dtype == torch.bfloat16
    fit(learn, 'fit', 1, 1e-2)
    assert_fp32_between_fits(learn)
    learn.to_fp32()
    assert learn.precision_callbacks() == []

@pytest.mark.parametrize('extra', [lambda: NativeMixedPrecision(), lambda: [ModelToHalf(), MixedPrecision()],
                                   lambda: MixedPrecision])
def test_stacked_precision_callbacks_are_refused(extra):
    learn = make_learner('fp16')
    w0 = clone_state(learn.model)
    with pytest.raises(ValueError, match='stacked'): learn.fit(1, 1e-2, cbs=extra())
    assert_same_state(w0, clone_state(learn.model))
    assert [type(cb) for cb in learn.precision_callbacks()] == [ModelToHalf, MixedPrecision]

def test_precision_callbacks_given_to_fit():
    "fit(cbs=[ModelToHalf(), MixedPrecision()]) on a plain learner: mixed precision for that fit only."
    learn = make_learner()
    fit(learn, 'fit', 1, 1e-2, cbs=[ModelToHalf(), MixedPrecision(dynamic=False)])
    assert learn.precision_callbacks() == []
    assert_fp32_between_fits(learn)

@pytest.mark.parametrize('kw', [dict(dynamic=False, loss_scale=2.**10), dict(dtype=torch.bfloat16)], ids=['fp16', 'bf16'])
def test_mixed_precision_without_model_to_half_trains_as_fp32(kw):
    """`MixedPrecision` alone (no `ModelToHalf`): the forward runs in FP32, the loss scaled, and the model's FP32 params
    are what the optimizer steps, their grads divided by the scale on their way in: with a power-of-two scale the weights
    are FP32 fastai's, bit for bit. (Before: FP32 masters beside the FP32 model, a second copy of the weights.)"""
    ref = make_learner()
    fit(ref, 'fit', 2, 1e-2)
    learn = make_learner()
    learn.add_cb(MixedPrecision(**kw))
    fit(learn, 'fit', 2, 1e-2)
    mp = learn.cbs.filter(lambda c: isinstance(c, MixedPrecision))[0]
    assert not any(mp.skips) and len(mp.skips) > 4
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())
    for a, b in zip(ref.model.parameters(), learn.model.parameters()): assert torch.equal(a, b)

def test_fastai_own_master_weight_pair_is_one_setup():
    "fastai's ModelToHalf + NonNativeMixedPrecision are one setup (not 'stacked'); next to ours they are refused."
    import fastai.callback.fp16 as ffp16
    from fp16cb.session import check_precision_cbs
    check_precision_cbs([ffp16.ModelToHalf(), ffp16.NonNativeMixedPrecision()])  # no error
    check_precision_cbs([ModelToHalf(), MixedPrecision()])
    for mixed in ([ffp16.ModelToHalf(), MixedPrecision()], [ffp16.MixedPrecision(), NativeMixedPrecision()],
                  [ffp16.MixedPrecision(), ffp16.NonNativeMixedPrecision()]):
        with pytest.raises(ValueError, match='stacked'): check_precision_cbs(mixed)
