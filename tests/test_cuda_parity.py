"""CUDA parity on any machine: a fused kernel that refuses a dtype (bf16 on CUDA) falls back to the generic pass, and
tensor layout (channels_last, channels_last_3d), `requires_grad`, parameter identity and ties survive a fit."""
import pytest, torch
from torch import nn
import torch.nn.functional as F
from fastai.basics import Learner, DataLoaders, SGD, CrossEntropyLossFlat, Callback
from fastai.callback.channelslast import ChannelsLast

import fp16cb.scaling.check as overflow
from fp16cb.scaling import OverflowCheck, check_and_unscale_
from fp16cb.weights import dense_strides, flat_views
from conftest import make_learner, quiet_fit, seed_all

@pytest.fixture
def refuse_bf16(monkeypatch):
    "The fused kernel as CUDA's is today: it takes float32 and float16 only (torch's CPU kernel also takes bf16)."
    real, calls = torch._amp_foreach_non_finite_check_and_unscale_, []
    def cuda_like(ts, found, inv):
        calls.append(ts[0].dtype)
        if ts[0].dtype not in (torch.float32, torch.float16):
            raise NotImplementedError(f'"_amp_foreach_non_finite_check_and_unscale_cuda" not implemented for {ts[0].dtype}')
        return real(ts, found, inv)
    monkeypatch.setattr(torch, '_amp_foreach_non_finite_check_and_unscale_', cuda_like)
    monkeypatch.setattr(overflow, '_REFUSED', set())
    return calls

def _weights(learn): return [p.detach().clone() for p in learn.model.parameters()]

@pytest.mark.parametrize('flat', [False, True])
@pytest.mark.parametrize('scaler', ['static', 'backoff', 'lognormal'])
def test_bf16_trains_when_the_fused_kernel_refuses_bf16(flat, scaler, monkeypatch):
    "to_bf16 died at its first step on CUDA; with the kernel refusing bf16 here it trains exactly as with it."
    kw = dict(flat_master=flat, scaler=scaler, clip=1.)
    if scaler != 'static': kw['max_loss_scale'] = 2.**8
    ref = quiet_fit(make_learner(opt_func=SGD).to_bf16(**kw), 2)
    monkeypatch.setattr(overflow, '_REFUSED', set())
    real, refused = torch._amp_foreach_non_finite_check_and_unscale_, []
    def cuda_like(ts, found, inv):
        if ts[0].dtype == torch.bfloat16: refused.append(1); raise NotImplementedError("not implemented for 'BFloat16'")
        return real(ts, found, inv)
    monkeypatch.setattr(torch, '_amp_foreach_non_finite_check_and_unscale_', cuda_like)
    learn = quiet_fit(make_learner(opt_func=SGD).to_bf16(**kw), 2)
    for a, b in zip(_weights(ref), _weights(learn)): assert torch.equal(a, b)
    if scaler == 'static' and refused: assert (('cpu', torch.bfloat16) in overflow._REFUSED)

def test_refusal_is_probed_once(refuse_bf16):
    "A refused (device type, dtype) is remembered: later steps go straight to the generic pass."
    check, grads = OverflowCheck(), [torch.ones(3, dtype=torch.bfloat16) for _ in range(12)]  # more than a few: the kernel
    for _ in range(3): assert check(grads, .5).item() == 0
    assert refuse_bf16.count(torch.bfloat16) == 1 and ('cpu', torch.bfloat16) in overflow._REFUSED
    assert all(torch.equal(g, torch.full((3,), .125, dtype=torch.bfloat16)) for g in grads)  # unscaled 3 times all the same

@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.complex64])
@pytest.mark.parametrize('inv_scale', [1., .5, 0.])
@pytest.mark.parametrize('bad', [None, 'inf', 'nan'])
def test_generic_pass_matches_the_kernel(dtype, inv_scale, bad):
    "The fallback flags and unscales like the fused kernel (complex: as real views; never a host sync in between)."
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(5, generator=g).to(dtype) * 8, torch.randn(3, 2, generator=g).to(dtype), torch.zeros(0, dtype=dtype)]
    if bad: ts[1][1, 0] = float(bad)
    ref = [torch.view_as_real(t).clone() if t.is_complex() else t.clone() for t in ts]
    if dtype not in (torch.complex64,):
        f0 = torch.zeros(1); torch._amp_foreach_non_finite_check_and_unscale_(ref, f0, torch.full((1,), inv_scale))
    else:
        f0 = torch.tensor([float(bad is not None)]); ref = [r * inv_scale for r in ref]
    found = torch.zeros(1)
    overflow._generic_check_and_unscale(ts, found, inv_scale)
    assert (found.item() > 0) == (bad is not None) == (f0.item() > 0)
    for t, r in zip(ts, ref):
        assert torch.equal(torch.view_as_real(t) if t.is_complex() else t, r.to(torch.float32 if False else r.dtype)) or \
               torch.allclose(torch.view_as_real(t) if t.is_complex() else t, r, equal_nan=True)

def test_other_kernel_errors_are_not_swallowed(monkeypatch):
    "Only a refusal of the dtype falls back; any other error of the kernel is the caller's to see."
    def broken(ts, found, inv): raise RuntimeError('Expected all tensors to be on the same device')
    monkeypatch.setattr(torch, '_amp_foreach_non_finite_check_and_unscale_', broken)
    with pytest.raises(RuntimeError, match='same device'):
        check_and_unscale_([torch.ones(3)], torch.zeros(1), torch.ones(1), 1.)

# ------------------------------------------------------------------------------------------------------------- layout
def test_dense_strides_and_views():
    x = torch.randn(2, 3, 4, 5)
    for t in (x, x.to(memory_format=torch.channels_last), torch.randn(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d),
              x.permute(1, 0, 3, 2), torch.randn(7), torch.randn(3, 1, 4)):
        assert dense_strides(t) == t.stride()
    assert dense_strides(x[:, :, ::2]) == (30, 10, 5, 1)  # gappy: a dense copy gets contiguous strides
    flat = torch.zeros(x.numel() * 2)
    cl = x.to(memory_format=torch.channels_last)
    v1, v2 = flat_views(flat, [x, cl])
    v1.copy_(x); v2.copy_(cl)
    assert v2.is_contiguous(memory_format=torch.channels_last) and torch.equal(v2, x)
    assert torch.equal(flat[x.numel():], cl.permute(0, 2, 3, 1).reshape(-1))  # physical order, as channels_last lays it out

def _conv_net(c=4, n_out=3, three_d=False):
    Conv, BN = (nn.Conv3d, nn.BatchNorm3d) if three_d else (nn.Conv2d, nn.BatchNorm2d)
    return nn.Sequential(Conv(3, c, 3, padding=1, bias=False), BN(c), nn.ReLU(), Conv(c, c, 3, padding=1),
                         nn.AdaptiveAvgPool3d(1) if three_d else nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, n_out))

class _Batches:
    def __init__(self, b): self.b = b
    def __iter__(self): return iter(self.b)
    def __len__(self): return len(self.b)
    def to(self, device): return self

def _image_learner(three_d=False, cbs=()):
    seed_all(0)
    shape = (3, 4, 6, 6) if three_d else (3, 8, 8)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, *shape, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
    dls = DataLoaders(_Batches(batches), _Batches(batches[:1]))
    dls.device = torch.device('cpu')
    return Learner(dls, _conv_net(three_d=three_d), loss_func=CrossEntropyLossFlat(), opt_func=SGD, lr=0.05, cbs=list(cbs))

def _formats(model, fmt):
    "Per conv weight: whether it is in memory format `fmt`."
    return [m.weight.is_contiguous(memory_format=fmt) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Conv3d))]

class _Layouts(Callback):
    order = 50
    def __init__(self, fmt): self.fmt, self.seen = fmt, []
    def before_step(self): self.seen.append(('train', _formats(self.learn.model, self.fmt)))
    def after_batch(self):
        if not self.training: self.seen.append(('valid', _formats(self.learn.model, self.fmt)))

@pytest.mark.parametrize('flat', [False, True])
@pytest.mark.parametrize('mode', ['to_fp16', 'to_bf16'])
@pytest.mark.parametrize('first', ['channels_last', 'precision'])
def test_channels_last_callback_composes(flat, mode, first):
    "fastai's ChannelsLast with to_fp16/to_bf16, added in either order: conv weights channels_last in and after the fit."
    learn = _image_learner()
    rec = _Layouts(torch.channels_last)
    kw = dict(flat_master=flat, **({'max_loss_scale': 2.**10} if mode == 'to_fp16' else {}))
    if first == 'channels_last': learn.add_cb(ChannelsLast()); getattr(learn, mode)(**kw)
    else: getattr(learn, mode)(**kw); learn.add_cb(ChannelsLast())
    fp32 = _image_learner(cbs=[ChannelsLast()])
    quiet_fit(learn, 2, cbs=rec); quiet_fit(fp32, 2)
    assert rec.seen and all(all(fmts) for _, fmts in rec.seen), rec.seen
    assert all(_formats(learn.model, torch.channels_last))
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())
    for a, b in zip(learn.model.parameters(), fp32.model.parameters()):
        assert torch.allclose(a, b, atol=5e-2), (a - b).abs().max()
    learn.to_fp32()
    assert all(_formats(learn.model, torch.channels_last))

@pytest.mark.parametrize('flat', [False, True])
def test_channels_last_3d_model_keeps_its_layout(flat):
    "A model the user put in channels_last_3d trains in it (16-bit views keep the strides) and comes back in it."
    learn = _image_learner(three_d=True)
    learn.model.to(memory_format=torch.channels_last_3d)
    rec = _Layouts(torch.channels_last_3d)
    quiet_fit(learn.to_bf16(flat_master=flat), 1, cbs=rec)
    assert rec.seen and all(all(f) for _, f in rec.seen)
    assert all(_formats(learn.model, torch.channels_last_3d))

@pytest.mark.parametrize('flat', [False, True])
@pytest.mark.parametrize('mode', ['to_fp16', 'to_bf16'])
def test_identity_requires_grad_and_ties_survive(flat, mode):
    "The same Parameter objects, the same requires_grad flags, and a tied weight stays one tensor, in and after the fit."
    class Tied(nn.Module):
        "A head tied to the embedding (as an LM's), a second Linear sharing a weight Parameter, a frozen bias."
        def __init__(self):
            super().__init__()
            self.emb, self.mid, self.out, self.dec = nn.Linear(4, 8, bias=False), nn.Linear(8, 8), nn.Linear(4, 1), nn.Linear(4, 1)
            self.dec.weight = self.out.weight
            self.mid.bias.requires_grad_(False)
        def forward(self, x):
            z = F.linear(torch.relu(self.mid(self.emb(x))), self.emb.weight.t())
            return self.out(z) + self.dec(z)
    model = Tied()
    ids = [id(p) for p in model.parameters()]
    flags = [p.requires_grad for p in model.parameters()]
    learn = make_learner(model=model, splitter=lambda m: [list(m.parameters())])  # moves `model` to the test device
    bias0 = model.mid.bias.detach().clone()  # there, as the fit leaves it
    class _Check(Callback):
        order = 50
        def before_step(self):
            m = self.learn.model
            assert m.dec.weight is m.out.weight and [id(p) for p in m.parameters()] == ids
            assert [p.requires_grad for p in m.parameters()] == flags
    getattr(learn, mode)(flat_master=flat)
    quiet_fit(learn, 2, cbs=_Check())
    assert [id(p) for p in model.parameters()] == ids and [p.requires_grad for p in model.parameters()] == flags
    assert model.dec.weight is model.out.weight and torch.equal(model.mid.bias, bias0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
