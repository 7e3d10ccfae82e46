"""The weight store: one interface for FP32 masters (per param, flat) and 16-bit storage, the shared rules for what is
converted (float64, complex, sparse grads, a param in two groups), the invariant that the model's params are the
store's, the optimizer stepped once per step (Lookahead), and one step read in three modules."""
import sys
from functools import partial
import pytest
import torch
from torch import nn
from fastai.basics import Callback, SGD, Adam
from fastai.optimizer import Lookahead, ranger, OptimWrapper

from fp16cb.callbacks import MixedPrecision
from fp16cb.weights import Stage, WeightStore, HalfStorage, FP32Masters
from conftest import make_learner, quiet_fit, tiny_model, DEVICE

MODES = [dict(), dict(flat_master=True), dict(half_storage=True)]
IDS = ['masters', 'flat', 'half_storage']

class MoveModel(Callback):
    "After our setup (order 11, like fastai's DistributedTrainer), move the model as Accelerate's `prepare()` does."
    order = 11
    def __init__(self, how): self.how = how
    def before_fit(self): self.how(self.learn.model)

def _weights(learn): return [p.detach().float().clone() for p in learn.model.parameters()]

@pytest.mark.parametrize('meth', ['to_fp16', 'to_bf16'])
@pytest.mark.parametrize('kw', MODES, ids=IDS)
def test_a_model_moved_after_setup_still_trains(meth, kw):
    "`model.to(device('cpu', 0))` after our setup (same device and dtype) is re-linked: the fit changes the weights."
    ref, learn = make_learner(), make_learner()
    getattr(ref, meth)(**kw); getattr(learn, meth)(**kw)
    quiet_fit(ref, 1)
    quiet_fit(learn, 1, cbs=[MoveModel(lambda m: m.to(torch.device(DEVICE.type, 0)))])
    for a, b in zip(_weights(ref), _weights(learn)): assert torch.equal(a, b)  # as if nothing had moved it

@pytest.mark.parametrize('kw', MODES, ids=IDS)
def test_a_model_converted_after_setup_is_an_error_naming_the_param(kw):
    "`model.float()` after our setup cannot be re-linked: a clear error, never a fit that changes nothing."
    learn = make_learner().to_fp16(**kw)
    with pytest.raises(RuntimeError, match=r"parameter .*(0\.weight|0\.bias).*(float32|changed dtype)"):
        quiet_fit(learn, 1, cbs=[MoveModel(lambda m: m.float())])
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())  # torn down: the FP32 learner again

class CountSteps(Callback):
    order = 20
    def before_fit(self): self.n = 0
    def after_step(self): self.n += 1

@pytest.mark.parametrize('kw', MODES, ids=IDS)
def test_lookahead_counts_one_step_per_step(kw):
    "A Lookahead (ranger) counts each optimizer step once, whatever the store (16-bit storage lifted params in chunks)."
    learn = make_learner(opt_func=partial(ranger, k=3)).to_fp16(**kw)
    steps = CountSteps()
    quiet_fit(learn, 2, cbs=[steps])
    assert learn.opt.count == steps.n == 8

def test_half_storage_steps_a_large_model_once_per_step():
    "Over 2^22 elements (resnet18's size): the optimizer still steps once per step, each slow weight with its own param."
    big = nn.Sequential(nn.Linear(4, 2048), nn.Linear(2048, 2048), nn.Linear(2048, 1))  # 4.2M elements
    learn = make_learner(model=big, splitter=lambda m: [list(m.parameters())], opt_func=partial(ranger, k=100))
    learn.to_bf16(half_storage=True)
    quiet_fit(learn, 1, cbs=[steps := CountSteps()])
    assert learn.opt.count == steps.n == 4
    for pg, sg in zip(learn.opt.param_lists, learn.opt.slow_weights):
        assert [p.shape for p in pg] == [s.shape for s in sg]

@pytest.mark.parametrize('flat', [False, True])
def test_ranger_with_masters_keeps_per_param_slow_weights(flat, tmp_path):
    "Lookahead's slow weights follow the masters and come back per param: a second fit and an FP32 fit work, and save."
    learn = make_learner(opt_func=partial(ranger, k=2)).to_fp16(flat_master=flat)
    quiet_fit(learn, 1)
    for pg, sg in zip(learn.opt.param_lists, learn.opt.slow_weights):
        assert [(p.shape, p.dtype) for p in pg] == [(s.shape, s.dtype) for s in sg]
    learn.path = tmp_path
    learn.save('m')
    quiet_fit(learn, 1)  # the slow weights merge into the flat masters again
    learn.to_fp32(); quiet_fit(learn, 1)  # and Lookahead's sync works on the FP32 params
    assert all(torch.isfinite(p).all() for p in learn.model.parameters())

class F64(nn.Module):
    "A tiny model with a float64 scale and a complex weight, besides the usual 16-bit layers."
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.s = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
        self.c = nn.Parameter(torch.tensor([0.5 + 0.5j], dtype=torch.complex64))
    def forward(self, x): return self.lin(x) * self.s.to(x.dtype) + (self.c.abs() ** 2).to(x.dtype)

@pytest.mark.parametrize('sr', [True, False])
def test_half_storage_steps_float64_and_complex_in_their_own_dtype(sr):
    "float64 stays float64 with updates finer than FP32's spacing; a complex param keeps and trains its imaginary part."
    learn = make_learner(model=F64(), splitter=lambda m: [list(m.parameters())], lr=1e-9).to_fp16(half_storage=True, stochastic_rounding=sr)
    s0, c0 = learn.model.s.detach().clone(), learn.model.c.detach().clone()
    quiet_fit(learn, 1, lr=1e-9)
    s, c = learn.model.s.detach(), learn.model.c.detach()
    assert s.dtype == torch.float64 and c.dtype == torch.complex64
    assert s != s0 and float(s.float()) == float(s0.float())  # moved by less than an FP32 spacing: kept in float64
    learn2 = make_learner(model=F64(), splitter=lambda m: [list(m.parameters())]).to_fp16(half_storage=True, stochastic_rounding=sr)
    quiet_fit(learn2, 1, lr=1e-2)
    assert learn2.model.c.imag != c0.imag  # the imaginary part trains (not zeroed, no nextafter error)

def test_half_storage_refuses_a_param_in_two_groups():
    "Shared rule: a param in two param groups is refused for 16-bit storage as for FP32 masters, naming it."
    m = tiny_model()
    learn = make_learner(model=m, splitter=lambda m: [list(m.parameters()), [m[3].weight]]).to_fp16(half_storage=True)
    with pytest.raises(ValueError, match=r"3\.weight.*param groups 0 and 1"): quiet_fit(learn, 1)

class Emb(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lin = nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1)
    def forward(self, x): return self.lin(self.emb((x.abs() * 3).long().clamp(0, 9)).mean(1))

@pytest.mark.parametrize('kw', MODES, ids=IDS)
def test_sparse_embedding_trains(kw):
    "`nn.Embedding(sparse=True)`: its sparse grads are made dense as they come in (no aminmax on SparseCPU)."
    learn = make_learner(model=Emb(), splitter=lambda m: [list(m.parameters())]).to_fp16(**kw)
    w0 = learn.model.emb.weight.detach().float().clone()
    quiet_fit(learn, 1)
    assert not torch.equal(w0, learn.model.emb.weight.detach().float())

def test_stochastic_rounding_uses_its_own_generator():
    "Turning `half_storage` on does not shift torch's global RNG stream (dropout, augmentation draw as without it)."
    draws = []
    for kw in (dict(), dict(half_storage=True)):
        learn = make_learner().to_fp16(**kw)
        torch.manual_seed(0)
        quiet_fit(learn, 1)
        draws.append(torch.rand(3))
    assert torch.equal(*draws)

def test_resumed_half_storage_run_matches_the_uninterrupted_one(tmp_path):
    "The rounding generator is in the checkpoint: a run resumed from a mid-run save ends with the same weights."
    full = make_learner().to_fp16(half_storage=True)
    quiet_fit(full, 1); quiet_fit(full, 1)
    a = make_learner().to_fp16(half_storage=True); a.path = tmp_path
    quiet_fit(a, 1); a.save('half')
    b = make_learner().to_fp16(half_storage=True); b.path = tmp_path
    b.load('half'); quiet_fit(b, 1)
    for x, y in zip(_weights(full), _weights(b)): assert torch.equal(x, y)

def test_one_batch_enters_three_package_modules():
    "From `before_batch` to `after_step` of an ordinary `to_fp16()` batch: the events, the weight store, loss scaling."
    entered, on = set(), [False]
    class Trace(Callback):
        order = -100
        def before_batch(self):
            if self.training: on[0] = True
        def after_batch(self): on[0] = False
    def prof(frame, event, arg):
        if on[0] and event == 'call':
            mod = frame.f_globals.get('__name__', '')
            if mod.startswith('fp16cb'): entered.add(mod)
    learn = make_learner().to_fp16()
    quiet_fit(learn, 1)  # the first fit calibrates the scale; the second is the ordinary case
    sys.setprofile(prof)
    try: quiet_fit(learn, 1, cbs=[Trace()])
    finally: sys.setprofile(None)
    assert entered == {'fp16cb.callbacks', 'fp16cb.weights', 'fp16cb.scaling'}, entered

def test_the_store_owns_the_step_and_its_stage():
    "`Stage` moves READY -> UNSCALED -> STEPPED in a step; a store of each kind implements the one interface."
    stages = []
    class Watch(Callback):
        order = 20
        def before_step(self): stages.append(self.learn.mixed_precision.store.stage)
        def after_step(self): stages.append(self.learn.mixed_precision.store.stage)
    for kw in MODES:
        stages.clear()
        learn = make_learner().to_fp16(**kw)
        quiet_fit(learn, 1, cbs=[Watch()])
        assert stages[:2] == [Stage.UNSCALED, Stage.READY]  # our after_step (order 10) ran before Watch's
    assert issubclass(HalfStorage, WeightStore) and issubclass(FP32Masters, WeightStore)

@pytest.mark.parametrize('opt', ['fastai Adam', 'OptimWrapper(AdamW)'])
def test_half_storage_keeps_the_model_s_own_tensors_and_fp32_state(opt):
    "16-bit storage steps FP32 copies: the params' tensors are never swapped; the state is FP32, keyed by the params."
    opt_func = Adam if opt == 'fastai Adam' else partial(OptimWrapper, opt=torch.optim.AdamW)
    learn = make_learner(opt_func=opt_func).to_bf16(half_storage=True)
    ptrs = {}
    class Watch(Callback):
        order = 20
        def after_step(self):
            for p in self.learn.model.parameters(): assert ptrs.setdefault(id(p), p.data_ptr()) == p.data_ptr()
    w0 = _weights(learn)
    quiet_fit(learn, 1, cbs=[Watch()])
    assert all(not torch.equal(a, b) for a, b in zip(w0, _weights(learn)))
    state = learn.opt.opt.state if opt != 'fastai Adam' else learn.opt.state
    ps = [p for p in learn.model.parameters()]
    assert all(p in state for p in ps)
    assert all(v.dtype == torch.float32 for p in ps for v in state[p].values() if torch.is_tensor(v) and v.dim())
