"The benchmark (`python -m bench`) runs on the test device; the fast paths (flat views, cached foreach lists) train bit for bit like the seed's simple path."
import copy, gc, json, runpy, statistics, sys
from functools import partial
import pytest, torch
from torch import nn
import torch.nn.functional as F
from fastai.basics import Learner, DataLoaders, Callback, SGD, Adam, CrossEntropyLossFlat, MSELossFlat, CancelStepException
from fastai.optimizer import OptimWrapper
from fp16cb import MixedPrecision, convert_network, to_master_grads, to_model_params
from bench import run_bench, defaults, targets, format_table, main, Batches, CPU_MODES, MODES, move_state, PlainAMP
from bench.workloads import GPT
from bench.modes import POLICY_MODES, BareBF16, COMPILED_MODES, COMPILE_MODES, MEMORY_MODES, HEALTH_MODES, pick_compile_backend
from bench.modes import PLAIN, PLAIN_COMPILED, fused_adamw_ok, AutocastCB, FastaiAMP
import bench.modes
from bench.measure import evaluate
from conftest import DEVICE, set_chunk

torch.set_num_threads(1)

def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 3)).to(DEVICE)

def _batches(n=4, bs=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(bs, 6, generator=g).to(DEVICE), torch.randint(0, 3, (bs,), generator=g).to(DEVICE)) for _ in range(n)]

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
    "At each step: the FP32 master grad the optimizer stepped each model param with, in `model.parameters()` order."
    order = 20
    def before_fit(self):
        if self._spy not in self.learn.opt.cbs: self.learn.opt.cbs.insert(0, self._spy)
    def before_step(self): self._seen = {}
    def _spy(self, p, **kwargs): self._seen[p] = p.grad.detach().clone()  # a master and its FP32 grad, as stepped
    _spy.elementwise = True  # it reads each element on its own: flat masters may carry it
    def after_step(self):
        mw = next(cb for cb in self.learn.cbs if isinstance(cb, MixedPrecision)).store
        self.grads = [self._grad_of(mw.fp32_views()[p]) for p in self.learn.model.parameters()]
    def _grad_of(self, view):
        "The grad of the master holding `view` (a param's FP32 value), cut as `view` is (None: not stepped)."
        for m, g in self._seen.items():
            o = view.storage_offset() - m.storage_offset()
            if view.untyped_storage().data_ptr() == m.untyped_storage().data_ptr() and 0 <= o < m.numel():
                return g.reshape(-1)[o:o + view.numel()].reshape(view.shape)
        return None

class _DropGrads(Callback):
    "A user callback that sets the model's grads to None after each step (flat views must survive it)."
    order = 30
    def after_step(self): self.learn.model.zero_grad(set_to_none=True)

def _learner(init, batches, flat, dtype=torch.bfloat16, cbs=()):
    dls = DataLoaders(Batches(batches), Batches(batches[:1]))
    dls.device = DEVICE
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
        ps = list(self.learn.model.parameters())
        self.n_bufs = len({p.untyped_storage().data_ptr() for p in ps})
        self.all_views = all(p.untyped_storage().nbytes() > 4 * p.numel() for p in ps)
        self.grads_views = all(p.grad.untyped_storage().nbytes() > 4 * p.numel() for p in ps)

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
    # `flat_master`: the model's FP32 params are views into one buffer per param group (one group here), their grads
    # views into the buffers they arrive in
    assert spy.n_bufs == 1 and spy.all_views and spy.grads_views
    _ordinary(learn.model)
    learn = _learner(init, batches, True, cbs=[_Boom()])
    with pytest.raises(RuntimeError, match='boom'), learn.no_bar(), learn.no_logging(): learn.fit(1)
    learn.to_fp32()  # an interrupted fit skipped after_fit: to_fp32 gives the model its FP32 values back
    _ordinary(learn.model)

def has_figure(o, key='ms_step') -> bool:
    """A run's time figure is positive, or None when every timed step was skipped (a loss scale still settling after a
    warm-up of one step: fp16 on CUDA; a skipped step runs no optimizer, and is never timed)."""
    return o[key] > 0 if o['timed_skipped'] < o['n_steps'] else o[key] is None

def test_bench_smoke(tmp_path, capsys):
    out = tmp_path/'res.json'
    res = main(['--workloads', 'book,act', '--modes', 'fp32,fastai,bf16,bf16-flat,native', '--steps', '1', '--rounds', '1',
                '--warmup', '1', '--warmup-max', '1', '--scale', '0.002', '--json', str(out), '--device', str(DEVICE),
                '--cb-timers'])
    table = capsys.readouterr().out
    for name in ('fp32', 'fastai', 'bf16-flat', 'native', '**book**', '**act**', 'bookkeeping bound'): assert name in table
    data = json.loads(out.read_text())
    book = data['book']
    assert book['_workload']['bound_ms'] > 0 and book['fp32']['speedup'] == 1.
    assert book['fp32']['ms_cb'] == 0 and book['bf16-flat']['ms_cb'] > 0 and has_figure(book['fastai'], 'ms_cb')
    assert set(book['bf16-flat']['events_ms']) >= {'before_step', 'after_step'}
    for m in ('fp32', 'fastai', 'bf16-flat', 'native'):
        o = book[m]
        assert has_figure(o) and o['mem_MB'] > 0 and 0 <= o['acc'] <= 1 and o['loss'] > 0 and o['n_steps'] == 1
        assert o['all_steps'] == 3 and 0 <= o['skipped'] <= 3  # warm-up, timed round, memory fit
        assert 0 <= o['timed_skipped'] <= min(o['n_steps'], o['skipped'])  # timed only when not skipped (unless all were)
        assert o['mode'] == m and o['opt'] == 'adam'
    assert data['act']['fp32']['mem_MB'] > 0 and data['act']['bf16-flat']['mem_ratio'] > 0
    if DEVICE.type == 'cpu':  # (CUDA's allocator rounds each block: exact only on the CPU, where bytes are counted)
        # The model's own FP32 params (the default, and `flat_master`'s layout of them): FP32's training state, plus the
        # 16-bit copies the forward computes with (2 bytes/param, freed as the backward passes them) and a bucket's
        # 16-bit grads: on this tiny workload its halved activations do not pay for them, and the peak is FP32's plus at
        # most those 2 bytes/param
        for m in ('bf16', 'bf16-flat'):
            assert book[m]['mem_MB'] <= book['fp32']['mem_MB'] + 2 * book['_workload']['n_params'] / 2**20, m
    assert format_table(res) == table.strip()

def test_bench_gpu_workloads_smoke():
    "The GPU workloads at a tiny scale: every mode kind with both optimizers, the plain loop, the targets."
    res = run_bench(['resnet50_cl', 'lm'], ['fp32', 'autocast', 'fp16', 'torch-amp'], steps=1, rounds=1, warmup=1,
                    warmup_max=1, device=DEVICE, scale=.002, opts=['adam', 'fused'], verbose=False)
    keys = ['fp32', 'autocast', 'fp16', 'fp32+fused', 'autocast+fused', 'fp16+fused', 'torch-amp']
    for wl in ('resnet50_cl', 'lm'):
        assert list(res[wl])[1:] == keys
        for k in keys:
            o = res[wl][k]
            assert has_figure(o) and has_figure(o, 'speedup') and o['mem_MB'] > 0 and o['all_steps'] == 3 and o['loss'] > 0
        assert res[wl]['torch-amp']['opt'] == 'fused' and res[wl]['fp16+fused']['mode'] == 'fp16'
    lm = GPT(vocab=66, d=16, n_heads=1, seq=8)  # the LM at scale .002: vocab 32768*s, d 1024*s (16 at least), seq 256*s
    assert res['lm']['_workload']['n_params'] == sum(p.numel() for p in lm.parameters()) and lm.head.weight is lm.tok.weight
    cl = res['resnet50_cl']
    for k in ('fp32', 'autocast', 'fp32+fused', 'torch-amp'): assert cl[k]['channels_last'] == 1., k  # ChannelsLast ran
    assert res['lm']['fp32']['channels_last'] is None  # no conv weights
    ts = res['targets']
    assert ts and all(isinstance(t['met'], bool) and t['value'] > 0 for t in ts)
    names = {(t['target'], t['workload'], t['opt']) for t in ts}
    assert ("to_fp16() with fused AdamW within 1.05x of the plain PyTorch AMP loop on the LM", 'lm', 'fused') in names
    assert ("to_fp16() >= 1.3x faster than fastai's to_fp16() on the LM", 'lm', 'adam') in names
    assert not any('ChannelsLast' in t['target'] for t in ts)  # needs the NCHW run too
    table = format_table(res)
    assert '**targets**' in table and 'channels-last' in table and '| torch-amp |' in table

def test_warm_up_goes_on_while_the_loss_scale_skips_steps():
    "fastai's algorithm starts at loss scale 2**24 and overflows: the warm-up goes on (up to `warmup_max`) until a step is clean."
    res = run_bench(['book'], ['fp32', 'fastai'], steps=1, rounds=1, warmup=1, warmup_max=20, device=DEVICE, scale=.002,
                    verbose=False)['book']
    assert res['fp32']['all_steps'] == 1 + 1 + 1  # warm-up, 1 round, memory fit: fp32 never skips
    fp16 = res['fastai']
    assert 1 <= fp16['skipped'] < fp16['all_steps'] - 2 and fp16['timed_skipped'] == 0

def _res(ms:dict, mem:dict=None) -> dict:
    "Results with only what `targets` reads: `{workload: {run: ms}}`."
    mem = mem or {}
    return {'meta': {}, **{wl: {k: {'ms_step': v, 'mem_MB': mem.get(wl, {}).get(k, 1.)} for k, v in runs.items()}
                           for wl, runs in ms.items()}}

def test_targets_are_checked_against_the_issues_thresholds():
    res = _res({'lm': {'autocast': 13., 'fp16': 10., 'bf16': 10.5, 'fp16+fused': 8.4, 'torch-amp': 8.},
                'resnet50': {'fp16': 26.}, 'resnet50_cl': {'fp16': 20.}},
               mem={'lm': {'fp16': 2., 'autocast': 3.}})
    got = {(t['target'].split(' (')[0].split(' on the')[0], t['workload'], t['opt']): (round(t['value'], 3), t['met'])
           for t in targets(res)}
    assert got == {
        ("to_fp16() no slower than fastai's to_fp16()", 'lm', 'adam'): (1.3, True),
        ("to_fp16() >= 1.3x faster than fastai's to_fp16()", 'lm', 'adam'): (1.3, True),
        ('ResNet-50 with ChannelsLast >= 1.3x faster than NCHW', 'resnet50', 'adam'): (1.3, True),
        ('to_bf16() at least as fast as to_fp16()', 'lm', 'adam'): (0.952, False),
        ("to_fp16() peak memory no more than fastai's to_fp16()", 'lm', 'adam'): (0.667, True),
        ('to_fp16() with fused AdamW within 1.05x of the plain PyTorch AMP loop', 'lm', 'fused'): (1.05, True),
    }  # and nothing for what did not run (resnet50 has no bf16 or autocast run here, only one run has fused AdamW)
    res['lm']['fp16+fused']['ms_step'] = 8.5
    assert [t['met'] for t in targets(res) if 'plain PyTorch' in t['target']] == [False]

def test_bench_bad_input(capsys):
    with pytest.raises(ValueError, match='unknown workload'): run_bench(['nope'], ['fp32'], verbose=False)
    with pytest.raises(ValueError, match='unknown mode'): run_bench(['book'], ['fp33'], verbose=False)
    with pytest.raises(ValueError, match='unknown optimizer'): run_bench(['book'], ['fp32'], opts=['sgd'], verbose=False)
    with pytest.raises(ValueError, match='steps'): run_bench(['book'], ['fp32'], steps=0, verbose=False)
    with pytest.raises(ValueError, match='not a torch device'): run_bench(['book'], ['fp32'], device='gpu0', verbose=False)
    with pytest.raises(ValueError, match='cpu or cuda'): run_bench(['book'], ['fp32'], device='meta', verbose=False)
    # on the command line: a usage error (exit 2) that says what is wrong, not a traceback
    bad = [(['--workloads', 'nope'], 'unknown workload'), (['--gpu', '--workloads', 'lm'], 'give one of them'),
           (['--opts', 'adam,sgd'], 'unknown optimizer')]
    if not torch.cuda.is_available(): bad.append((['--device', 'cuda'], 'CUDA is not available'))
    for argv, msg in bad:
        with pytest.raises(SystemExit) as e: main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err

def test_defaults_by_device_and_module_entry(capsys, monkeypatch):
    "CUDA: the GPU workloads, every mode and the plain loop, both optimizers; `python -m bench` runs `bench.main`."
    assert defaults(True) == (('resnet50', 'resnet50_cl', 'lm', 'book'), CPU_MODES + ('torch-amp',), ('adam', 'fused'))
    assert defaults(False) == (('mlp', 'book', 'conv', 'act'), CPU_MODES, ('adam',))
    # the policy's opt-ins and the compiled modes: named with --modes (or --compile)
    assert set(CPU_MODES) == (set(MODES) - {'torch-amp'} - set(POLICY_MODES) - set(COMPILED_MODES)
                              - (set(MEMORY_MODES) - set(CPU_MODES)) - (set(HEALTH_MODES) - set(CPU_MODES)))
    monkeypatch.setattr(sys, 'argv', ['bench', '--help'])
    with pytest.raises(SystemExit) as e: runpy.run_module('bench', run_name='__main__')
    assert e.value.code == 0 and capsys.readouterr().out.startswith('usage: python -m bench')

def _tensors(learn):
    "Every tensor of the model (params, grads, buffers) and of the optimizer state (fastai's, torch's)."
    ts = [t for p in learn.model.parameters() for t in (p, p.grad) if t is not None] + list(learn.model.buffers())
    opt = learn.opt
    for st in (getattr(opt, 'state', {}), getattr(getattr(opt, 'opt', None), 'state', {})):
        ts += [v for s in st.values() if isinstance(s, dict) for v in s.values() if isinstance(v, torch.Tensor)]
    return ts

def test_move_state_parks_everything():
    "Parking a learner moves all it holds between fits (model, grads, optimizer state), for each kind of learner."
    batches = _batches(2)
    dls = DataLoaders(Batches(batches), Batches(batches[:1])); dls.device = DEVICE
    adamw = partial(OptimWrapper, opt=torch.optim.AdamW)
    def learner(opt_func): return Learner(dls, _model(), loss_func=CrossEntropyLossFlat(), opt_func=opt_func, lr=LR)
    learns = [learner(Adam), learner(Adam).to_bf16(), learner(adamw).to_fp16(flat_master=True, max_loss_scale=2.**8)]
    for learn in learns: _fit(learn)
    plain = PlainAMP(_model(), batches, DEVICE, fused=False)
    plain.fit()
    for learn in learns + [plain]:
        ts = _tensors(learn)
        assert len(ts) >= 3 * len(list(learn.model.parameters()))  # params and Adam's two averages, at least
        move_state(learn, 'meta')
        assert len(_tensors(learn)) == len(ts) and all(t.device.type == 'meta' for t in _tensors(learn))

def test_policy_opt_ins_are_benchmark_modes():
    "The precision policy's opt-ins run as benchmark modes (their cost is measured side by side with plain to_bf16)."
    res = run_bench(['mlp'], ['bf16', 'bf16-norm', 'bf16-cls'], steps=1, rounds=1, warmup=1, warmup_max=1, device=DEVICE,
                    scale=.002, verbose=False)['mlp']
    for m in ('bf16', 'bf16-norm', 'bf16-cls'): assert res[m]['ms_step'] > 0 and res[m]['skipped'] == 0

def test_bare_bf16_mode_trains_bf16_params_directly():
    "The bare bf16 mode (the limit of a bf16 fastai loop): bf16 params but BatchNorm, stepped directly, no fp16cb callback."
    batches = _batches(4)
    dls = DataLoaders(Batches(batches), Batches(batches[:1])); dls.device = DEVICE
    learn = Learner(dls, _model(), loss_func=CrossEntropyLossFlat(), opt_func=Adam, lr=1e-2)
    MODES['bare-bf16'][1](learn, DEVICE)
    before = statistics.mean(evaluate(learn.model, b)[0] for b in batches)  # FP32 inputs: the model casts them
    _fit(learn, 8)
    after = statistics.mean(evaluate(learn.model, b)[0] for b in batches)
    assert after < before - .05, (before, after)
    for m in learn.model.modules():
        for p in m.parameters(recurse=False):
            assert p.dtype == (torch.float32 if isinstance(m, nn.BatchNorm1d) else torch.bfloat16), m
    opt_params = [p for pg in learn.opt.param_lists for p in pg]
    assert len(opt_params) == len(list(learn.model.parameters()))  # the optimizer steps the model's params: no masters
    assert all(a is b for a, b in zip(opt_params, learn.model.parameters()))
    assert all(v.dtype == p.dtype for p in opt_params for v in learn.opt.state[p].values() if isinstance(v, torch.Tensor)
               and v.is_floating_point() and v.dim())
    assert not any(type(cb).__module__.startswith('fp16cb') for cb in learn.cbs)
    assert sum(isinstance(cb, BareBF16) for cb in learn.cbs) == 1

def test_report_prints_the_design_issues_cpu_targets():
    "The bookkeeping targets (copy bound, fastai's algorithm) on `book` and to_bf16 vs bare-bf16 on `mlp`: reported lines."
    # warm-up steps while fastai's loss scale (2^24 at first) skips them: its timed step must step (fp16 on CUDA)
    res = run_bench(['mlp', 'book'], ['fastai', 'bf16', 'bare-bf16', 'native'], steps=1, rounds=1, warmup=1, warmup_max=40,
                    device=DEVICE, scale=.002, verbose=False, cb_timers=True)
    assert res['mlp']['bare-bf16']['ms_step'] > 0 and res['mlp']['bare-bf16']['skipped'] == 0
    got = {(t['workload'], t['what'], t['op'], t['threshold']) for t in res['targets']}
    assert {('book', 'bf16 cb ms / copy bound ms', '<=', 1.3), ('book', 'fastai cb ms / bf16 cb ms', '>=', 3.),
            ('mlp', 'bare-bf16 ms / bf16 ms', '>=', .97), ('mlp', 'native ms / bf16 ms', '>=', 1.05)} <= got
    table = format_table(res)
    for line in ("| to_bf16() bookkeeping (ms in its callbacks) within 1.3x the copy bound on the many-tensor model (CPU) "
                 "| book | adam | bf16 cb ms / copy bound ms |",
                 "| to_bf16() bookkeeping >= 3x less than fastai's master-weight algorithm on the many-tensor model "
                 "(CPU) | book | adam | fastai cb ms / bf16 cb ms |",
                 "| to_bf16() at >= 0.97x the speed of the bare bf16 model (the limit) on the compute-bound MLP | mlp | "
                 "adam | bare-bf16 ms / bf16 ms |"):
        assert line in table
    assert '<= 1.3 |' in table and '>= 3 |' in table and '>= 0.97 |' in table and '>= 1.05 |' in table

# ---- training state at the step peak (bench/state_memory.py)
def test_live_storages_counts_each_storage_once_with_grads():
    "The accounting itself: a view adds nothing, a grad is found through its param, a freed tensor is gone."
    from bench.state_memory import live_storages
    gc.collect(); before = live_storages()
    a = torch.zeros(1000); v = a[10:20]  # 4000 bytes, the view shares them
    p = nn.Parameter(torch.zeros(250)); p.grad = torch.zeros(250)  # 1000 + 1000
    new = {k: n for k, n in live_storages().items() if k not in before}
    assert sorted(new.values()) == [1000, 1000, 4000] and v.untyped_storage().data_ptr() in new
    del a, v; gc.collect()
    assert sorted(n for k, n in live_storages().items() if k not in before) == [1000, 1000]

@pytest.mark.skipif(DEVICE.type != 'cpu', reason="exact bytes: counted on the CPU")
def test_training_state_bytes_per_param():
    """FP32 + Adam: 4 weights + 4 grads + 8 state = 16 bytes/param; the model's own FP32 params (the default, flat, bf16
    state): FP32's, never more; 16-bit storage: 2 + 2 + 8 (the FP32 originals let go of
    once the weights have been stepped). A few KB of fixed buffers on top (the loss scale, the overflow flag). The
    optimizer's state in bf16 (`state_dtype`): Adam's two moments 4 bytes, not 8."""
    from bench.state_memory import measure
    res = measure(width=128, modes=['fp32', 'to_bf16', 'to_bf16 flat', 'to_fp16', 'to_bf16 half_storage',
                                    'to_bf16 step_in_backward', 'to_bf16 half_storage step_in_backward',
                                    'to_bf16 state_dtype', 'to_bf16 flat state_dtype', 'to_bf16 half_storage state_dtype',
                                    'to_bf16 step_in_backward state_dtype', 'to_bf16 half_storage step_in_backward state_dtype'])
    assert 'to_bf16 step_in_backward' not in res['torch AdamW']  # fastai's optimizer loop only
    for opt, r in res.items():
        assert r['fp32'] == pytest.approx(16, abs=0.3), (opt, r)
        for m in ('to_bf16', 'to_bf16 flat', 'to_fp16'): assert 15.7 < r[m] <= r['fp32'], (opt, m, r)
        assert 11.7 < r['to_bf16 half_storage'] < 12.3, (opt, r)
        # bf16 state: 2 + 2 + 4 + 4 with masters, 2 + 2 + 4 with 16-bit storage
        for m in ('to_bf16 state_dtype', 'to_bf16 flat state_dtype'): assert 11.7 < r[m] < 12.3, (opt, m, r)
        assert 7.7 < r['to_bf16 half_storage state_dtype'] < 8.3, (opt, r)
    # stepping in the backward: no param's grad outlives its step (the model's FP32 params 4 + 8, 16-bit storage 2 + 8;
    # bf16 state 4)
    r = res['fastai Adam']
    assert 11.7 < r['to_bf16 step_in_backward'] < 12.3 and 9.7 < r['to_bf16 half_storage step_in_backward'] < 10.3, r
    assert 7.7 < r['to_bf16 step_in_backward state_dtype'] < 8.3, r
    assert 5.7 < r['to_bf16 half_storage step_in_backward state_dtype'] < 6.3, r
@pytest.mark.skipif(DEVICE.type != 'cpu', reason="exact bytes: counted on the CPU")
def test_true_peak_accounting(monkeypatch):
    """The true peak (bench/peak_memory.py), from the profiler's every allocation and free: FP32 Adam holds 16 bytes/param
    between steps and more in its step; `to_bf16(state_dtype=bf16)` 12 between steps (the model's FP32 params and grads,
    bf16 moments: no lift scratch), nothing more at a mid-fit save but one tensor made as it is written, and at the
    fit's end the state's widening (4) and one param's FP32 at most; in the backward the copies and a bucket's grads."""
    from bench.peak_memory import run_one, format_peaks, PHASES
    set_chunk(monkeypatch, 256 * 256)
    def data(g, n):
        return list(zip(torch.randn(8 * n, 256, generator=g), torch.randn(8 * n, 256, generator=g))), MSELossFlat()
    four = (lambda: nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(4)]), data)  # one param: 1 byte/param
    res = {'four': {m: run_one(four, m) for m in ('fp32', 'to_bf16 state_dtype')}}
    fp32, bf16 = res['four']['fp32'], res['four']['to_bf16 state_dtype']
    assert fp32['n'] == 4 * 256 * 256 and 15.9 < fp32['between'] < 16.3 and fp32['step'] > fp32['between'] + 1, fp32
    assert 11.9 < bf16['between'] < 12.4 and bf16['save'] <= bf16['between'] + 1.1, bf16
    # the backward: the 16-bit copies (2 bytes/param) and one bucket's FP32 grads as autograd adds them into the kept
    # ones (here the bucket is the whole model: 4), nothing more
    assert bf16['end'] <= bf16['between'] + 4 + 1.1 and bf16['backward'] <= bf16['between'] + 2 + 4 + 0.3, bf16
    table = format_peaks(res)
    assert "| to_bf16 state_dtype | " in table and "above FP32's peak" in table and len(PHASES) == 5

def test_compile_backend_choice(monkeypatch):
    "auto: inductor where it compiles, else aot_eager with the reason; inductor asked where it does not compile: an error."
    assert pick_compile_backend('aot_eager', 'cpu') == ('aot_eager', 'asked for')
    with pytest.raises(ValueError, match='unknown compile backend'): pick_compile_backend('tvm', 'cpu')
    monkeypatch.setattr(bench.modes, '_inductor_error', lambda dev: None)
    assert pick_compile_backend('auto', 'cpu') == ('inductor', 'a C++ compiler works')
    assert pick_compile_backend('inductor', 'cpu')[0] == 'inductor'
    monkeypatch.setattr(bench.modes, '_inductor_error', lambda dev: 'CalledProcessError: no g++')
    backend, why = pick_compile_backend('auto', 'cpu')
    assert backend == 'aot_eager' and 'no g++' in why
    with pytest.raises(ValueError, match='does not compile here.*no g\\+\\+'): pick_compile_backend('inductor', 'cpu')

def test_compile_targets_and_ratios():
    "Issue 20's targets: compiled to_bf16 >= 1.2x eager, within 1.05x of the compiled plain loop; the backend named."
    res = _res({'mlp': {'bf16': 12., 'bf16-compile': 10., 'torch-amp-compile': 9.6, 'bf16+fused': 11., 'bf16-compile+fused': 9.}})
    res['meta']['compile_backend'] = 'inductor'
    got = {(t['target'].split(' (')[0], t['opt'], t['what']): (round(t['value'], 3), t['met']) for t in targets(res)
           if 'compiled' in t['target']}
    assert got == {
        ('compiled to_bf16() >= 1.2x faster than eager to_bf16()', 'adam', 'bf16 ms / bf16-compile ms (inductor)'): (1.2, True),
        ('compiled to_bf16() within 1.05x of the compiled plain PyTorch loop', 'adam',
         'bf16-compile ms / torch-amp-compile ms (inductor)'): (1.042, True),
        ('compiled to_bf16() >= 1.2x faster than eager to_bf16()', 'fused',
         'bf16+fused ms / bf16-compile+fused ms (inductor)'): (1.222, True),
        ('compiled to_bf16() within 1.05x of the compiled plain PyTorch loop', 'fused',
         'bf16-compile+fused ms / torch-amp-compile ms (inductor)'): (0.938, True),
    }
    res['mlp']['bf16-compile']['ms_step'] = 10.2  # 1.176x eager, 1.0625x the plain loop: neither met
    assert [t['met'] for t in targets(res) if 'compiled' in t['target'] and t['opt'] == 'adam'] == [False, False]

def test_compiled_comparison_smoke(tmp_path, capsys):
    """`--compile` (aot_eager: no C++ compiler needed): eager and compiled to_bf16 and plain loop, interleaved; the first
    (compiling) epoch untimed, its graphs counted, none compiled in the timed rounds; compiled trains as eager; the
    table, the targets and the JSON."""
    dynamo = pytest.importorskip('torch._dynamo')
    dynamo.reset()
    out = tmp_path/'res.json'
    res = main(['--compile', '--compile-backend', 'aot_eager', '--steps', '2', '--rounds', '2', '--warmup', '1',
                '--warmup-max', '2', '--scale', '0.002', '--device', str(DEVICE), '--json', str(out)])
    table = capsys.readouterr().out
    wl = 'lm' if DEVICE.type == 'cuda' else 'mlp'
    # CUDA's default optimizers are fastai's Adam and torch's fused AdamW (`defaults`): to_bf16, eager and compiled, with
    # each (the plain loops always use the fused AdamW); a CPU's, fastai's Adam only
    fused = DEVICE.type == 'cuda' and fused_adamw_ok(DEVICE) is None
    runs = ['bf16', 'bf16-compile'] + (['bf16+fused', 'bf16-compile+fused'] if fused else []) + [PLAIN, PLAIN_COMPILED]
    assert list(res)[1:-1] == [wl] and list(res[wl])[1:] == runs
    r = res[wl]
    assert {r[k]['mode'] for k in runs} == set(COMPILE_MODES)
    assert res['meta']['compile_backend'] == 'aot_eager' and res['meta']['runs'] == runs
    warmed = set()  # the modes whose model a run before compiled
    for k in runs:
        assert r[k]['ms_step'] > 0 and len(r[k]['ms_rounds']) == 2 and r[k]['first_fit_s'] > 0 and r[k]['n_steps'] == 4
        assert r[k]['timed_graphs'] == 0, k  # nothing recompiled while timed
        # fastai's fit compiles a training and a validation graph, the plain loop only trains; the second run of a
        # compiled mode (CUDA's bf16-compile+fused, after bf16-compile) compiles none: dynamo has the model's graphs
        graphs = 0 if r[k]['mode'] in warmed else {'bf16-compile': 2, 'torch-amp-compile': 1}.get(r[k]['mode'], 0)
        warmed.add(r[k]['mode'])
        assert r[k]['first_fit_graphs'] == graphs if wl == 'mlp' else (r[k]['first_fit_graphs'] > 0) == (graphs > 0), k
    pairs = [('bf16', 'bf16-compile'), (PLAIN, PLAIN_COMPILED)] + ([('bf16+fused', 'bf16-compile+fused')] if fused else [])
    for eager, comp in pairs:
        assert abs(r[eager]['train_loss'] - r[comp]['train_loss']) < 1e-3 * max(1., r[eager]['train_loss']), (eager, comp)
    speedup, vs_plain = r['bf16']['ms_step']/r['bf16-compile']['ms_step'], r['bf16-compile']['ms_step']/r['torch-amp-compile']['ms_step']
    assert f"| bf16-compile | yes | aot_eager | {r['bf16-compile']['ms_step']:.1f} |" in table
    assert f"| {speedup:.2f}x | {vs_plain:.2f} |" in table and f"**{wl}, compiled vs eager** - backend **aot_eager**" in table
    ts = {t['target'].split(' (')[0]: t for t in res['targets']
          if t['workload'] == wl and t['opt'] == 'adam' and 'compiled' in t['target']}  # fastai's Adam (CUDA: +fused too)
    assert ts['compiled to_bf16() >= 1.2x faster than eager to_bf16()']['value'] == pytest.approx(speedup)
    assert ts['compiled to_bf16() within 1.05x of the compiled plain PyTorch loop']['value'] == pytest.approx(vs_plain)
    data = json.loads(out.read_text())
    assert data[wl]['bf16-compile']['ms_step'] == r['bf16-compile']['ms_step'] and data['meta']['compile_backend'] == 'aot_eager'
    with pytest.raises(SystemExit) as e: main(['--compile', '--modes', 'bf16'])
    assert e.value.code == 2 and 'give one of them' in capsys.readouterr().err

def test_a_run_that_fails_is_reported_and_the_others_are_measured(monkeypatch):
    """One run that cannot train a workload (on an H100, fastai's own master-weight algorithm on the channels-last
    ResNet-50 with torch's fused AdamW: fastai gives channels-last masters contiguous grads, which the fused CUDA kernel
    refuses) used to end the whole benchmark, every other run's figures lost. It is now left out and named."""
    def fails(learn, device): raise RuntimeError("params, grads, exp_avgs, and exp_avg_sqs must have same dtype, device, and layout")
    monkeypatch.setitem(bench.modes.MODES, 'fastai', (MODES['fastai'][0], fails))
    res = run_bench(['book'], ['fp32', 'fastai', 'bf16'], steps=1, rounds=1, warmup=1, warmup_max=1, device=DEVICE,
                    scale=.002, verbose=False, opts=['adam'])  # one optimizer (CUDA's default adds fused AdamW)
    book = res['book']
    assert 'fastai' not in book and book['fp32']['ms_step'] > 0 and book['bf16']['ms_step'] > 0
    assert book['_workload']['failed'] == {'fastai': 'RuntimeError: params, grads, exp_avgs, and exp_avg_sqs must have '
                                                     'same dtype, device, and layout'}
    assert 'fastai failed on this workload and was left out: RuntimeError' in format_table(res)
    assert targets(res) is not None

class _SkipsEveryStep(Callback):
    "Cancels every optimizer step, as a loss scale that overflows on every step does."
    order = 10
    def before_step(self): raise CancelStepException()

def test_a_run_whose_timed_steps_were_all_skipped_has_no_step_time(monkeypatch):
    """A skipped step runs no optimizer. fastai's AMP skipped every timed step of ResNet-50 on an H200, and its time, that
    of steps without the optimizer, was reported as its step time (1.43x FP32's speed). Such a run has no step time now."""
    monkeypatch.setitem(bench.modes.MODES, 'skips', ('skips every step', lambda l, d: l.add_cb(_SkipsEveryStep())))
    res = run_bench(['book'], ['fp32', 'skips'], steps=2, rounds=1, warmup=1, warmup_max=1, device=DEVICE,
                    scale=.002, verbose=False, opts=['adam'])
    book = res['book']
    assert book['skips']['ms_step'] is None and book['skips']['speedup'] is None and book['fp32']['ms_step'] > 0
    assert book['skips']['timed_skipped'] == book['skips']['n_steps'] == 2
    assert '| skips | every timed step skipped | -x |' in format_table(res)

def test_fastai_amp_carries_its_loss_scale_across_the_benchmarks_fits():
    """fastai's `MixedPrecision` makes a new GradScaler at 2^16 each fit; the benchmark's fits are a few steps long, so its
    AMP mode carries the scale over (`KeepsScale`), as one long fit would: each fit starts where the last one ended."""
    cls = (lambda: FastaiAMP()) if DEVICE.type == "cuda" else (lambda: AutocastCB(torch.float16))
    learn = Learner(DataLoaders(Batches(_batches()), Batches(_batches(1))), _model(), loss_func=CrossEntropyLossFlat(),
                    opt_func=SGD, lr=LR, cbs=cls())
    starts, ends = [], []
    class Scales(Callback):
        order = 9
        def before_batch(self):
            if self.training and self.iter == 0: starts.append(self.learn.scaler.get_scale())
        def after_fit(self): ends.append(self.learn.scaler.get_scale())  # before fastai's own `after_fit` drops it
    learn.add_cb(Scales())
    learn.model.register_forward_hook(lambda m, i, o: o * 2.**12)  # logits large enough that 2^16 overflows fp16's grads
    for _ in range(3):
        with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert starts[0] == 2.**16 and ends[0] < 2.**16  # the first fit backs off from fastai's start
    assert starts[1:] == ends[:-1]

def test_the_state_step_benchmark_runs_on_the_test_device():
    """`python -m bench.state8_quality --parts speed --device ...`: the stored-state modes timed side by side on the
    test device (a GPU's run is the table the GPU check brings back), each mode's step and batch measured."""
    from bench.state8_quality import run_speed
    res = run_speed(['mlp'], ('fp32', 'bf16', 'bf16-state8'), steps=2, rounds=1, warmup_fits=1, verbose=False,
                    device=DEVICE)
    out = res['mlp']
    assert out['_workload']['n_params'] > 0
    for mode in ('fp32', 'bf16', 'bf16-state8'):
        assert 0 < out[mode]['ms_step'] <= out[mode]['ms_batch'], out[mode]  # (the batch holds its step)
    assert out['bf16']['step_vs_bf16'] == 1.

def test_a_storage_over_part_of_a_buffer_is_not_counted_again():
    """A storage over part of a buffer's memory (`layout.shared`: a checkpoint's tensors, the tensors bf16 state's
    compiled step keeps for a run) is no memory of its own: counted once, with the buffer."""
    from bench.state_memory import live_storages
    from fp16cb.weights.layout import shared
    buf = torch.zeros(1000)
    part = shared(buf[100:300])
    assert part.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    live = live_storages()  # (by address: a total against one taken before would move with earlier tests' garbage)
    assert live.get(buf.untyped_storage().data_ptr()) == 4000 and part.untyped_storage().data_ptr() not in live

def test_the_state_step_benchmark_turns_the_compiled_adam_step_off_or_on_for_its_mode():
    """`bf16-state16-usual` and `bf16-state16-compiled` (the GPU check's A/B of bf16 state's compiled Adam step, off on a
    GPU until measured there): each fit of the mode runs with the compiled step off or on, and the setting is what it
    was after it."""
    from conftest import make_learner, quiet_fit
    from bench.state8_quality import MODES
    from fp16cb.storage import fused16
    seen, before = [], dict(fused16.COMPILE)
    class Look(Callback):
        def before_batch(self):
            if self.training: seen.append(fused16.COMPILE.get(DEVICE.type))
    for mode in ('bf16-state16-usual', 'bf16-state16-compiled'):
        learn = MODES[mode](make_learner(opt_func=Adam, cbs=[Look()]))
        quiet_fit(learn, 1)
    assert seen == [False] * 4 + [True] * 4 and fused16.COMPILE == before, (seen, fused16.COMPILE)

def test_instruction_counts_read_callgrinds_totals_and_say_when_valgrind_is_missing(monkeypatch):
    import shutil
    from bench.instructions import totals, main
    assert totals("events: Ir\nsummary: 0\ntotals: 2415852594\n") == 2415852594
    with pytest.raises(ValueError, match='totals'): totals("events: Ir\n")
    monkeypatch.setattr(shutil, 'which', lambda name: None)
    with pytest.raises(SystemExit, match='valgrind'): main(['--workloads', 'book'])

def test_phases_time_each_part_of_the_step_for_each_mode(capsys):
    from bench.phases import main as phases_main, PHASES
    phases_main(['--workload', 'book', '--modes', 'fp32,bf16', '--steps', '3', '--rounds', '1'])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(res) == {'fp32', 'bf16'}
    assert all(len(v) == len(PHASES) and all(t > 0 for t in v) for v in res.values()), res
