"The benchmark runs; the fast paths (flat views, cached foreach lists) train bit for bit like the seed's simple path."
import copy, json
import pytest, torch
from torch import nn
import torch.nn.functional as F
from fastai.basics import Learner, DataLoaders, Callback, SGD, CrossEntropyLossFlat
from fp16cb import MixedPrecision, convert_network, to_master_grads, to_model_params
from fp16cb.bench import run_bench, format_table, main, _Batches

torch.set_num_threads(1)

def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 3))

def _batches(n=4, bs=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(bs, 6, generator=g), torch.randint(0, 3, (bs,), generator=g)) for _ in range(n)]

LR = 0.05

def _reference(init, batches, dtype, fits):
    "The seed's simple path in a plain loop: 16-bit model, per-param FP32 masters, `to_master_grads/to_model_params`."
    model = convert_network(copy.deepcopy(init), dtype).train()
    masters = [[nn.Parameter(p.detach().clone(), requires_grad=True) for p in init.parameters()]]
    model_pgs = [list(model.parameters())]
    for _ in range(fits):
        for x, y in batches:
            F.cross_entropy(model(x.to(dtype)).float(), y).backward()
            to_master_grads(model_pgs, masters)
            with torch.no_grad():
                for m in masters[0]: m.add_(m.grad, alpha=-LR)
            to_model_params(model_pgs, masters)
            model.zero_grad(set_to_none=True)
    return [m.detach() for m in masters[0]], [m.grad for m in masters[0]]

class _GrabGrads(Callback):
    "After each step: the FP32 master grad of every model param, in `model.parameters()` order."
    order = 20
    def after_step(self):
        mw = next(cb for cb in self.learn.cbs if isinstance(cb, MixedPrecision)).master
        grads = mw.grad_views if mw.flat else [m.grad for m in mw.master_params]  # None: no grad
        by_param = dict(zip(mw.models, grads))
        self.grads = [None if by_param[p] is None else by_param[p].clone() for p in self.learn.model.parameters()]

class _DropGrads(Callback):
    "A user callback that sets the model's grads to None after each step (flat views must survive it)."
    order = 30
    def after_step(self): self.learn.model.zero_grad(set_to_none=True)

def _learner(init, batches, flat, dtype=torch.bfloat16, cbs=()):
    dls = DataLoaders(_Batches(batches), _Batches(batches[:1]))
    dls.device = torch.device('cpu')
    learn = Learner(dls, copy.deepcopy(init), loss_func=CrossEntropyLossFlat(), opt_func=SGD, lr=LR, cbs=list(cbs))
    if dtype == torch.bfloat16: learn.to_bf16(flat_master=flat)
    else: learn.to_fp16(flat_master=flat, loss_scale=2.**20, max_loss_scale=2.**20)  # start high: overflows
    return learn

def _fit(learn, n=1):
    with learn.no_bar(), learn.no_logging():
        for _ in range(n): learn.fit(1)

@pytest.mark.parametrize('drop', [False, True])
def test_flat_and_foreach_paths_match_seed_path(drop):
    init, batches = _model(), _batches()
    ref, ref_grads = _reference(init, batches, torch.bfloat16, fits=2)
    for flat in (False, True):
        grab = _GrabGrads()
        learn = _learner(init, batches, flat, cbs=[grab] + ([_DropGrads()] if drop else []))
        _fit(learn, 2)  # two fits: the views are built, released and built again
        for a, b in zip(learn.model.parameters(), ref): assert torch.equal(a.data, b), f"flat={flat}"
        for a, b in zip(grab.grads, ref_grads): assert torch.equal(a, b), f"flat={flat}"

def test_flat_fp16_dynamic_scaling_matches_non_flat():
    init, batches = _model(), _batches(6)
    res = {}
    for flat in (False, True):
        learn = _learner(init, batches, flat, dtype=torch.float16)
        _fit(learn, 2)
        mp = next(cb for cb in learn.cbs if isinstance(cb, MixedPrecision))
        res[flat] = [p.data.clone() for p in learn.model.parameters()], mp.scales, mp.skips
    assert any(res[True][2]), "the scale 2**20 should overflow at first: skipped steps are part of the test"
    assert res[True][1:] == res[False][1:]
    for a, b in zip(res[True][0], res[False][0]): assert torch.equal(a, b)

class _Spy(Callback):
    order = 20
    def after_step(self):
        mw = next(cb for cb in self.learn.cbs if isinstance(cb, MixedPrecision)).master
        self.n_runs = len(mw.runs)
        bufs = {r.buf.untyped_storage().data_ptr() for r in mw.runs}
        self.all_views = all(p.untyped_storage().data_ptr() in bufs for p in self.learn.model.parameters())
        self.grads_views = all(p.grad.untyped_storage().data_ptr() in {r.grad.untyped_storage().data_ptr() for r in mw.runs}
                               for p in self.learn.model.parameters())

class _Boom(Callback):
    order = 40
    def after_batch(self):
        if self.training and self.iter == 1: raise RuntimeError('boom')

def _ordinary(model):
    for p in model.parameters():
        assert p.dtype == torch.float32 and p._base is None
        assert p.untyped_storage().nbytes() == 4 * p.numel(), "a param still views a flat buffer"
        assert p.grad is None or (p.grad.dtype == torch.float32 and p.grad.untyped_storage().nbytes() == 4 * p.numel())

def test_flat_params_are_views_during_fit_and_ordinary_after():
    init, batches = _model(), _batches()
    spy = _Spy()
    learn = _learner(init, batches, True, cbs=[spy])
    _fit(learn)
    # fastai flags biases and BatchNorm with do_wd=False: 2 flat masters, 3 runs (bf16 weights; bf16 biases, FP32 BN)
    assert spy.n_runs == 3 and spy.all_views and spy.grads_views
    _ordinary(learn.model)
    learn = _learner(init, batches, True, cbs=[_Boom()])
    with pytest.raises(RuntimeError, match='boom'), learn.no_bar(), learn.no_logging(): learn.fit(1)
    learn.to_fp32()  # an interrupted fit skipped after_fit: to_fp32 gives the model its FP32 values back
    _ordinary(learn.model)

def test_bench_smoke(tmp_path, capsys):
    out = tmp_path/'res.json'
    res = main(['--workloads', 'book,act', '--modes', 'fp32,fastai,bf16,bf16-flat,native', '--steps', '1', '--rounds', '1',
                '--warmup', '1', '--scale', '0.002', '--json', str(out)])
    table = capsys.readouterr().out
    for name in ('fp32', 'fastai', 'bf16-flat', 'native', '**book**', '**act**', 'bookkeeping bound'): assert name in table
    data = json.loads(out.read_text())
    book = data['book']
    assert book['_workload']['bound_ms'] > 0 and book['fp32']['speedup'] == 1.
    assert book['fp32']['ms_cb'] == 0 and book['fastai']['ms_cb'] > 0 and book['bf16-flat']['ms_cb'] > 0
    assert set(book['bf16-flat']['events_ms']) >= {'before_step', 'after_step'}
    for m in ('fp32', 'fastai', 'bf16-flat', 'native'):
        o = book[m]
        assert o['ms_step'] > 0 and o['mem_MB'] > 0 and 0 <= o['acc'] <= 1 and o['loss'] > 0 and o['n_steps'] == 1
        assert o['all_steps'] == 3 and 0 <= o['skipped'] <= 3  # warm-up, timed round, memory fit
    assert data['act']['fp32']['mem_MB'] > 0 and data['act']['bf16-flat']['mem_ratio'] > 0
    # flat or not, the same buffers (16-bit params and grads, FP32 masters, grads, Adam state), counted even while
    # the master grads are dropped between steps; and on a fit's first step too (non-flat attaches the grad views
    # before the first backward, so autograd allocates no 16-bit grads of its own)
    assert book['bf16']['mem_MB'] == book['bf16-flat']['mem_MB'] > book['fp32']['mem_MB']
    assert format_table(res) == table.strip()

def test_bench_bad_input(capsys):
    with pytest.raises(ValueError, match='unknown'): run_bench(['nope'], ['fp32'], verbose=False)
    with pytest.raises(ValueError, match='steps'): run_bench(['book'], ['fp32'], steps=0, verbose=False)
    with pytest.raises(ValueError, match='not a torch device'): run_bench(['book'], ['fp32'], device='gpu0', verbose=False)
    with pytest.raises(ValueError, match='cpu or cuda'): run_bench(['book'], ['fp32'], device='meta', verbose=False)
    # on the command line: a usage error (exit 2) that says what is wrong, not a traceback
    bad = [(['--workloads', 'nope'], 'unknown workload')] + ([] if torch.cuda.is_available() else
                                                             [(['--device', 'cuda'], 'CUDA is not available')])
    for argv, msg in bad:
        with pytest.raises(SystemExit) as e: main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err

class _Unused(nn.Module):
    "A model with a param that never gets a gradient."
    def __init__(self):
        super().__init__()
        self.body, self.unused = _model(), nn.Linear(3, 3)
    def forward(self, x): return self.body(x)

def test_a_param_without_grad_stays_without_grad_when_not_flat():
    batches = _batches()
    for flat in (False, True):
        torch.manual_seed(0)
        init = _Unused()
        dls = DataLoaders(_Batches(batches), _Batches(batches[:1])); dls.device = torch.device('cpu')
        learn = Learner(dls, copy.deepcopy(init), loss_func=CrossEntropyLossFlat(), opt_func=SGD, lr=LR, wd=0.5)
        learn.to_bf16(flat_master=flat)
        grab, first = _GrabGrads(), _FirstBackward(); learn.add_cbs([grab, first])
        _fit(learn, 2)  # the second fit starts from params without grads again
        w = list(learn.model.parameters())[-2]
        assert (grab.grads[-2] is None) == (not flat)  # non-flat: no grad, no step; flat: a zero grad (seed semantics)
        assert torch.equal(w.data, init.unused.weight.data) == (not flat)  # a zero grad still gets weight decay
        # even the first backward of a fit accumulates into the flat buffer: autograd allocates no 16-bit grad of its own
        assert first.log == [True, True], first.log

class _FirstBackward(Callback):
    "At the first `after_backward` of each fit: whether every 16-bit grad (of the used params) is a view of a run's buffer."
    order = 20
    def __init__(self): self.log = []
    def before_fit(self): self.seen = False
    def after_backward(self):
        if self.seen: return
        self.seen = True
        mw = next(cb for cb in self.learn.cbs if isinstance(cb, MixedPrecision)).master
        bufs = {r.grad.untyped_storage().data_ptr() for r in mw.runs}
        used = list(self.learn.model.body.parameters())
        self.log.append(all(p.grad.untyped_storage().data_ptr() in bufs for p in used))
