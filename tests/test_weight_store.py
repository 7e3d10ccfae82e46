"""The weight store: one interface for FP32 masters (per param, flat) and 16-bit storage, the shared rules for what is
converted (float64, complex, sparse grads, a param in two groups), the invariant that the model's params are the
store's, the optimizer stepped once per step (Lookahead), and one step read in three modules."""
import sys
from functools import partial
import pytest
import torch
from torch import nn
from fastai.basics import Callback, SGD, Adam
from fastai.optimizer import Lookahead, ranger, OptimWrapper, RMSProp, QHAdam, RAdam, Lamb
from fastai.torch_core import trainable_params
from fastai.optimizer import sgd_step as fastai_sgd_step

from fp16cb.callbacks import MixedPrecision
from fp16cb.weights import Stage, ModelParams, loop
from fp16cb.storage import HalfStorage, stored
from conftest import make_learner, quiet_fit, tiny_model, Record, DEVICE, weights, set_chunk

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
    """A model converted after our setup cannot go on as it was: a clear error, never a fit that changes nothing or
    trains without its FP32 values. A store's 16-bit model made FP32 (`model.float()`); the model's own FP32 params
    (the default, and `flat_master`'s layout of them) made 16-bit (`model.half()`)."""
    learn = make_learner().to_fp16(**kw)
    store = kw.get('half_storage', False)
    convert = (lambda m: m.float()) if store else (lambda m: m.half())
    with pytest.raises(RuntimeError, match=r"parameter .*(0\.weight|0\.bias).*(float32|changed dtype)"):
        quiet_fit(learn, 1, cbs=[MoveModel(convert)])
    if store: assert all(p.dtype == torch.float32 for p in learn.model.parameters())  # torn down: the FP32 learner again

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

def _room(mod:str) -> str:
    "The room a module belongs to: a subpackage of fp16cb is one room (`fp16cb.weights.lift` -> `fp16cb.weights`)."
    return '.'.join(mod.split('.')[:2])

def _rooms_entered(run, during=None) -> set:
    "The fp16cb rooms whose code is called while `run()` runs (with `during`: only while `during[0]` is true)."
    entered = set()
    def prof(frame, event, arg):
        if event == 'call' and (during is None or during[0]):
            mod = frame.f_globals.get('__name__', '')
            if mod.startswith('fp16cb'): entered.add(_room(mod))
    sys.setprofile(prof)
    try: run()
    finally: sys.setprofile(None)
    return entered

@pytest.mark.parametrize('call,kw', [('to_fp16', {}), ('to_bf16', {}), ('to_bf16', dict(half_storage=True)),
                                     ('to_fp16', dict(state_dtype='8bit'))])
def test_one_batch_enters_three_rooms(call, kw):
    """From `before_batch` to `after_batch` of an ordinary batch (not a fit's first, which also checks the model as the
    learner calls it): the events, the weight-store package, loss scaling. Storage precision (`half_storage`,
    `state_dtype`) lives inside the optimizer's step, in a room of its own that only its modes enter."""
    on, n = [False], [0]
    class Trace(Callback):
        order = -100
        def before_batch(self):
            if self.training: n[0] += 1; on[0] = n[0] > 1
        def after_batch(self): on[0] = False
    learn = getattr(make_learner(), call)(**kw)
    quiet_fit(learn, 1)  # the first fit calibrates the scale; the second is the ordinary case
    entered = _rooms_entered(lambda: quiet_fit(learn, 1, cbs=[Trace()]), on)
    step = entered - {'fp16cb.storage'}  # (the optimizer's step, with storage precision)
    assert step <= {'fp16cb.callbacks', 'fp16cb.weights', 'fp16cb.scaling'} and 'fp16cb.weights' in step, entered
    assert ('fp16cb.storage' in entered) == bool(kw), entered

def test_a_fit_enters_at_most_eleven_rooms():
    """From `learn.to_fp16()` through a fit to `learn.to_fp32()`: at most 11 rooms of the package, and none of them
    storage precision's (the default keeps FP32 weights and state)."""
    learn = make_learner()
    entered = _rooms_entered(lambda: (learn.to_fp16(), quiet_fit(learn, 1), learn.to_fp32()))
    assert len(entered) <= 11 and 'fp16cb.storage' not in entered, sorted(entered)

def test_the_store_owns_the_step_and_its_stage():
    "`Stage` moves READY -> CHECKED -> STEPPED in a step; a store of each kind implements the one interface."
    stages = []
    class Watch(Callback):
        order = 20
        def before_step(self): stages.append(self.learn.mixed_precision.store.stage)
        def after_step(self): stages.append(self.learn.mixed_precision.store.stage)
    for kw in MODES:
        stages.clear()
        learn = make_learner().to_fp16(**kw)
        quiet_fit(learn, 1, cbs=[Watch()])
        assert stages[:2] == [Stage.CHECKED, Stage.READY]  # our after_step (order 10) ran before Watch's
    assert issubclass(HalfStorage, ModelParams)  # the one interface: 16-bit storage is the model's params too

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

# ---- torch's fused AdamW
@pytest.mark.parametrize('kw', [{}, {'flat_master': True}, {'state_dtype': torch.bfloat16}], ids=['own', 'flat', 'state'])
def test_fused_adamw_steps_the_models_params_as_the_unfused_one(kw):
    """The model's own FP32 params (the default, `flat_master`'s layout of them, with 16-bit state too): torch's fused
    AdamW steps them with their unscaled grads, as unfused."""
    res = []
    for fused in (True, False):
        learn = make_learner(opt_func=partial(OptimWrapper, opt=partial(torch.optim.AdamW, fused=fused)))
        kw = {**kw, 'stochastic_rounding': False} if 'state_dtype' in kw else kw
        quiet_fit(learn.to_fp16(dynamic=False, loss_scale=2.**10, clip=.05, **kw), 1, lr=1e-2)
        res.append([p.detach().clone() for p in learn.model.parameters()])
    for a, b in zip(*res): torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

# ---- opt-in: each param stepped in the backward
@pytest.mark.parametrize('half', [False, True], ids=['masters', 'half_storage'])
def test_step_in_backward_trains_as_the_step_after_it(half):
    "Stepping each param in the backward (bf16, scale 1) gives bit for bit the weights of the usual step after it."
    res = []
    for sib in (False, True):
        rounding = dict(stochastic_rounding=False) if half else {}  # FP32 masters round nothing: refused there
        learn = make_learner().to_bf16(half_storage=half, step_in_backward=sib, **rounding)
        grads_seen = Record(before_step=lambda l: [p.grad for p in l.model.parameters()])
        quiet_fit(learn, 2, lr=1e-2, cbs=grads_seen if sib else None)
        res.append([p.detach().clone() for p in learn.model.parameters()])
        if sib: assert all(g is None for gs in grads_seen.log['before_step'] for g in gs)  # each dropped after its step
    for a, b in zip(*res): assert torch.equal(a, b)
    assert learn.model[0].weight.dtype == torch.float32 and not learn.model[0].weight._post_accumulate_grad_hooks

class _NanGradOnce(Callback):
    "Multiplies the first layer's weight grad by NaN at the second batch (a hook before ours: the backward makes it)."
    order = 0
    def before_fit(self):
        self.n = 0
        self.h = self.learn.model[0].weight.register_hook(lambda g: g * float('nan') if self.n == 2 else g)
    def before_batch(self): self.n += 1
    def after_fit(self): self.h.remove()

def test_step_in_backward_on_a_nan_grad():
    """A grad holding NaN, in the backward: zeroed on the device before its param steps (no host sync); that param's
    optimizer steps with a zero grad, the others normally; the step is counted as skipped (the param named in
    `overflows`), BatchNorm's statistics put back; no NaN reaches the weights."""
    learn = make_learner(opt_func=partial(SGD, mom=0.)).to_bf16(step_in_backward=True)
    w0 = {}
    rec = Record(before_batch=lambda l: [p.detach().float().clone() for p in l.model.parameters()])
    quiet_fit(learn, 1, lr=1e-2, cbs=[_NanGradOnce(), rec])
    mp = learn.mixed_precision
    assert mp.skips == [False, True, False, False] and mp.n_skipped == 1
    assert [o['params'] for o in mp.overflows] == [['0.weight']]  # named from the hooks' flags (the grads are gone)
    before, after = rec.log['before_batch'][1], rec.log['before_batch'][2]
    assert torch.equal(before[0], after[0])  # SGD without momentum: a zero grad leaves the weight as it was
    assert not torch.equal(before[2], after[2])  # the other params stepped
    assert all(torch.isfinite(p).all() for p in learn.model.parameters())

@pytest.mark.parametrize('kw,match', [(dict(dtype=torch.float16), 'loss scale'), (dict(clip=1.), 'clipping'),
                                      (dict(flat_master=True), 'flat')])
def test_step_in_backward_refuses_what_it_cannot_keep(kw, match):
    meth = make_learner().to_fp16 if 'dtype' in kw else make_learner().to_bf16
    with pytest.raises(ValueError, match=match): meth(step_in_backward=True, **{k: v for k, v in kw.items() if k != 'dtype'})

@pytest.mark.parametrize('opt', ['adamw', 'lookahead'])
def test_step_in_backward_needs_a_fastai_optimizer(opt):
    opt_func = partial(OptimWrapper, opt=torch.optim.AdamW) if opt == 'adamw' else ranger
    learn = make_learner(opt_func=opt_func).to_bf16(step_in_backward=True)
    w0 = [p.detach().clone() for p in learn.model.parameters()]
    with pytest.raises(ValueError, match="fastai's `Optimizer` loop"): quiet_fit(learn, 1, lr=1e-2)
    for a, b in zip(w0, learn.model.parameters()): assert torch.equal(a, b) and b.dtype == torch.float32

# ---- the lift: FP32 grads a bounded chunk at a time
@pytest.mark.parametrize('opt', ['fastai', 'torch'])
@pytest.mark.parametrize('kind', ['half_storage'])  # (the model's own params lift nothing: every mode but these)
def test_grads_reach_fp32_a_bounded_chunk_at_a_time(monkeypatch, opt, kind):
    """With a small `lift_chunk`, no more FP32 grad elements are alive at once during the step than a chunk (or the
    largest param), and the weights are exactly those of one chunk: the optimizer still steps each param once."""
    opt_func = Adam if opt == 'fastai' else partial(OptimWrapper, opt=torch.optim.AdamW)
    kw = {'masters': {},
          'half_storage': {'half_storage': True, 'stochastic_rounding': False}}[kind]
    res, alive = [], []
    for chunk in (2**22, 40):
        set_chunk(monkeypatch, chunk)
        learn = make_learner(opt_func=opt_func).to_fp16(dynamic=False, loss_scale=2.**8, **kw)
        def count(learn=learn):
            fp32 = [t for t in (learn.mixed_precision.store.master_params if kind != 'half_storage' else []) if t.grad is not None]
            alive.append((chunk, sum(t.numel() for t in fp32)))
        spy = Record(before_step=lambda l: None)
        if opt == 'fastai':
            learn.opt_func = partial(_with_probe, opt_func, count)
        quiet_fit(learn, 1, lr=1e-2, cbs=spy)
        res.append([p.detach().clone() for p in learn.model.parameters()])
    for a, b in zip(*res): assert torch.equal(a, b)
    if kind != 'half_storage' and opt == 'fastai':
        largest = max(p.numel() for p in learn.model.parameters())
        assert max(n for c, n in alive if c == 40) <= max(40, largest) < max(n for c, n in alive if c == 2**22)

def _with_probe(opt_func, probe, params, **kw):
    """A fastai optimizer whose first callback calls `probe()` first (as each param is stepped); its `func` is the one it
    wraps (what tells fp16cb the optimizer is elementwise: flat masters are refused with a callback not known to be)."""
    opt = opt_func(params, **kw)
    cb = opt.cbs[0]
    def probed(p, **kwargs): probe(); return cb(p, **kwargs)
    probed.func = getattr(cb, 'func', cb)
    opt.cbs[0] = probed
    return opt

@pytest.mark.parametrize('flat', [False])  # (the model's own params lift nothing: every mode but 16-bit storage)
def test_between_steps_at_most_one_chunk_of_fp32_grads_is_held(monkeypatch, flat):
    """The lift's scratch is made once and kept for the fit (no allocation in the steps after: the same memory at
    every step) and holds at most `lift_chunk` elements, or the largest param where one is bigger; flat masters are
    cut at the chunk limit, so none needs memory of its own either."""
    set_chunk(monkeypatch, 30)  # the flat weights' group (40 elements) is over it
    held = []
    class Watch(Callback):
        order = 20
        def before_batch(self): self.after_step()
        def after_step(self):
            store = self.learn.mixed_precision.store
            held.append([(b.untyped_storage().data_ptr(), b.numel()) for b in store.lifted.scratch.bufs.values()])
            if flat: assert all(m.numel() <= 32 for m in store.master_params), [m.numel() for m in store.master_params]
    learn = make_learner(opt_func=Adam).to_fp16(half_storage=True)
    largest = max(p.numel() for p in learn.model.parameters())
    assert largest == 32
    quiet_fit(learn, 1, cbs=[Watch()])
    # (16-bit storage: made at the first step) the same memory at every step after
    assert len(held) > 4 and held[0] in ([], held[-1]) and all(h == held[-1] for h in held[1:]), held
    assert len(held[-1]) == 1 and held[-1][0][1] <= max(30, largest), held

# ---- a master bigger than a chunk, under an elementwise optimizer: stepped a slice at a time
SLICE_OPTS = {'adam': Adam, 'sgd-mom': partial(SGD, mom=.9, wd=1e-2), 'rmsprop': partial(RMSProp, mom=.9),
              'qhadam': QHAdam, 'radam': RAdam, 'lamb': Lamb,
              'torch-adamw': partial(OptimWrapper, opt=torch.optim.AdamW),
              'torch-sgd': partial(OptimWrapper, opt=partial(torch.optim.SGD, momentum=.9, weight_decay=1e-2)),
              'torch-fused': partial(OptimWrapper, opt=partial(torch.optim.AdamW, fused=True))}

@pytest.mark.parametrize('opt', list(SLICE_OPTS))
@pytest.mark.parametrize('kw', [dict(flat_master=True, state_dtype=torch.bfloat16, stochastic_rounding=False),
                                dict(state_dtype=torch.bfloat16, stochastic_rounding=False),
                                dict(clip=.5, flat_master=True, state_dtype=torch.bfloat16, stochastic_rounding=False),
                                dict(half_storage=True, stochastic_rounding=False)],
                         ids=['flat', 'bf16-state', 'clip', 'half'])  # (the default and `flat_master` alone lift nothing)
def test_a_master_over_a_chunk_steps_a_slice_at_a_time(monkeypatch, opt, kw):
    """With a chunk limit under the largest param (the 32-element Linear weight), an elementwise fastai optimizer (SGD,
    Adam, RMSProp, QHAdam, RAdam) steps it a chunk-sized slice at a time, its state made whole at the first step: the
    weights and the state are those of the whole-param step, and the scratch stays one chunk. LAMB takes whole-param
    norms: it is stepped whole (and refused with flat masters)."""
    import fp16cb.weights.optstate as optstate, fp16cb.storage.lifted as half_mod
    calls = []  # the slice size of each param stepped in more than one slice
    def spy(f, i):  # the param is argument i, the slice size i + 1 (sliced_update: core, p, hyper, n; torch: opt, p, n)
        def g(*a, **k):
            if a[1].numel() > a[i]: calls.append(a[i])
            return f(*a, **k)
        return g
    for mod in (half_mod, loop): monkeypatch.setattr(mod, 'sliced_update', spy(optstate.sliced_update, 3))
    monkeypatch.setattr(stored, 'sliced_torch_step', spy(stored.sliced_torch_step, 2))
    res = []
    for chunk in (2**22, 12):
        set_chunk(monkeypatch, chunk)
        torch.manual_seed(0)
        learn = make_learner(model=nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), opt_func=SLICE_OPTS[opt],
                             splitter=trainable_params).to_fp16(dynamic=False, loss_scale=2.**6, **kw)
        scratch = []
        lifted = lambda store: sum(b.numel() for b in store.lifted.scratch.bufs.values()) if hasattr(store, 'lifted') else 0
        quiet_fit(learn, 2, lr=1e-2, cbs=Record(after_step=lambda l: scratch.append(lifted(l.mixed_precision.store))))
        state = [{k: v.clone() for k, v in learn.opt.state[p].items() if isinstance(v, torch.Tensor)}
                 for p in learn.model.parameters()]
        res.append((weights(learn), state, max(scratch)))
    sliceable = opt != 'lamb' and not (kw.get('half_storage') and opt.startswith('torch'))  # half + torch: whole params
    assert (len(calls) > 0) == sliceable and set(calls) <= {6 if kw.get('half_storage') else 12}  # half: weights and grads in a chunk
    (w0, s0, _), (w1, s1, most) = res
    for a, b in zip(w0, w1): torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(s0, s1):
        assert a.keys() == b.keys()
        for k in a: torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)
    assert not sliceable or most <= 12

def test_channels_last_masters_step_in_slices_like_whole(monkeypatch):
    "A channels_last conv weight over the chunk limit: its slices (memory order) step as the whole param does."
    from fastai.data.core import DataLoaders
    from fastai.learner import Learner
    from fastai.losses import MSELossFlat
    res = []
    for chunk in (2**22, 20):
        set_chunk(monkeypatch, chunk)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 1)).to(memory_format=torch.channels_last)
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(3, 6, 6, generator=g), torch.randn(1, generator=g)) for _ in range(32)]
        from torch.utils.data import DataLoader
        dls = DataLoaders(DataLoader(data, batch_size=8), DataLoader(data[:8], batch_size=8))
        learn = Learner(dls, model, loss_func=MSELossFlat(), opt_func=Adam, lr=1e-2).to_bf16()
        quiet_fit(learn, 2)
        assert learn.model[0].weight.is_contiguous(memory_format=torch.channels_last)
        res.append(weights(learn))
    for a, b in zip(*res): torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)

def _cl_convnet():
    "4 features as a 2x2x1 image, a 2x1 conv whose weight is channels-last (another memory order), a Linear head."
    return nn.Sequential(nn.Unflatten(1, (2, 2, 1)), nn.Conv2d(2, 3, (2, 1)), nn.Flatten(), nn.ReLU(),
                         nn.Linear(3, 1)).to(memory_format=torch.channels_last)

@pytest.mark.parametrize('sr', [False, True])
@pytest.mark.parametrize('chunk,net', [(12, 'mlp'), (64, 'mlp'), (None, 'mlp'), (None, 'conv-cl'), (12, 'conv-cl')])
def test_half_storage_in_slices_steps_like_the_lifted_param(monkeypatch, sr, chunk, net):
    """`half_storage` with an elementwise optimizer steps each 16-bit param in the scratch, a param of a slice or more a
    slice at a time, smaller ones together (chunk 12: a slice of 6; 64: the 32-element weight alone, the rest together;
    the default: all together): rounded to nearest, exactly the weights and state of lifting each param whole to FP32
    (the path LAMB and torch optimizers take), a channels-last weight too; rounded stochastically (the draws fall
    differently), a few 16-bit spacings from it."""
    import fp16cb.storage.lifted as half_mod
    res = []
    for whole in (True, False):
        if whole: monkeypatch.setattr(half_mod, 'elementwise', lambda core: False)
        else: monkeypatch.undo()
        set_chunk(monkeypatch, chunk)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)) if net == 'mlp' else _cl_convnet()
        learn = make_learner(model=model, opt_func=Adam,
                             splitter=trainable_params).to_bf16(half_storage=True, stochastic_rounding=sr)
        quiet_fit(learn, 2, lr=1e-2)
        res.append((weights(learn), [{k: v.clone() for k, v in learn.opt.state[p].items() if isinstance(v, torch.Tensor)}
                                     for p in learn.model.parameters()]))
    (w0, s0), (w1, s1) = res
    for a, b in zip(w0, w1):
        if sr: torch.testing.assert_close(a, b, rtol=0, atol=.03)  # other random draws: a few 16-bit spacings apart after 8 steps
        else: assert torch.equal(a, b)
    if not sr:
        for a, b in zip(s0, s1): assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

def test_a_grad_replaced_after_the_check_is_the_one_stepped():
    """A callback after MixedPrecision's `before_step` that replaces a model grad (a new tensor, not in place): the step
    uses the grad as it is then, as FP32 fastai's optimizer would (the lift's plan is made again for that step)."""
    class Halve(Callback):
        order = 15  # after MixedPrecision (10)
        def before_step(self):
            for p in self.learn.model.parameters():
                if p.grad is not None: p.grad = p.grad * 0.  # replaced: zero grads, the step moves nothing but decay
    learn = make_learner(opt_func=partial(SGD, mom=0.)).to_bf16()
    w0 = weights(learn)
    quiet_fit(learn, 1, lr=1e-1, cbs=Halve())
    for a, b in zip(w0, weights(learn)): torch.testing.assert_close(a, b, rtol=0, atol=2**-8 * a.abs().max().item())

def test_an_optimizer_with_its_own_step_trains_like_fp32():
    "A fastai `Optimizer` whose `step` is its own (not fastai's loop): stepped once on all the masters, as in FP32."
    from fastai.optimizer import Optimizer
    class Counting(Optimizer):
        n = 0
        def step(self, closure=None): Counting.n += 1; super().step(closure)
    opt_func = lambda ps, lr=1e-2, **kw: Counting(ps, [fastai_sgd_step], lr=lr)
    res = []
    for mode in (None, 'to_bf16'):
        torch.manual_seed(0)
        learn = make_learner(model=nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), opt_func=opt_func,
                             splitter=trainable_params)
        if mode: getattr(learn, mode)()
        quiet_fit(learn, 1, lr=1e-2)
        res.append(weights(learn))
    assert Counting.n == 8  # 4 steps each
    for a, b in zip(*res): torch.testing.assert_close(a, b, rtol=.02, atol=1e-3)
