"""Shared tiny fixtures: a synthetic-regression `Learner` (Linear/BatchNorm, two param groups) on the test device, and a
callback that records what the learner holds at each training event.

`pytest --device cuda` (default: cpu) runs every test that trains, converts or benchmarks on that device: `DEVICE`
(and the `device` fixture) is it, `make_learner` puts its model and data there, and fastai's own default device
follows it (so that a GPU machine still tests the CPU by default). CUDA-only tests (`cuda_only()`) skip unless it is CUDA.
The multi-process tests run their ranks where `ranks_device()` says: one GPU per rank, or the CPU (gloo)."""
import copy, os, random
from functools import partial
from pathlib import Path
import numpy as np
import pytest
import torch
from torch import nn
from fastai.basics import Learner, DataLoaders, DataLoader, SGD, Adam, MSELossFlat, Callback, CancelStepException
from fastai.layers import BatchNorm
from fastai.torch_core import defaults
import fastai.callback.schedule  # Learner.fit_one_cycle

import fp16cb  # patches Learner.to_fp16 & co.
import fp16cb.dtypes as _dtypes
from fp16cb.dtypes import resolve_device

DEVICE = torch.device('cpu')  # the device of this run (`--device`), set by `pytest_configure`

def pytest_addoption(parser):
    parser.addoption('--device', default='cpu',
                     help="device for the tests that train, convert or benchmark: cpu (default), cuda or cuda:N; "
                          "the CUDA-only tests run with cuda and skip otherwise")

def pytest_configure(config):
    "Check `--device` (a usage error if this machine lacks it) and make it fastai's default device too."
    global DEVICE
    try: DEVICE = resolve_device(config.getoption('--device'), ('cpu', 'cuda'), 'cpu, cuda or cuda:N')
    except ValueError as e: raise pytest.UsageError(f"--device: {e}")
    defaults.use_cuda = DEVICE.type == 'cuda'  # fastai's `default_device()`: CUDA only when asked, even on a GPU machine
    if DEVICE.type == 'cuda' and DEVICE.index is not None: torch.cuda.set_device(DEVICE)

def pytest_report_header(config): return [f"fp16cb test device: {DEVICE}", f"fp16cb multi-process tests: {ranks_where()}"]

def ranks_device(world:int=2) -> torch.device:
    """Where the ranks of a multi-process test (`world` processes on this machine) train: CUDA when this run's device is
    CUDA and the machine has a GPU for every rank (one GPU per rank, nccl, as torch, Accelerate and fastai pick them);
    else the CPU with gloo, as in CI, also under `--device cuda` on a machine with fewer GPUs than ranks (two ranks on
    one GPU is no valid DDP set-up: nccl refuses it)."""
    from fp16cb.demos.ddp import ranks_on_cuda  # the demo's rule, for `world` local processes
    return torch.device('cuda' if DEVICE.type == 'cuda' and ranks_on_cuda(world) else 'cpu')

def ranks_env(world:int=2) -> dict:
    """What the ranks' environment adds: this checkout's fp16cb first on `PYTHONPATH` (not an installed one), and for
    `ranks_device(world)` the CPU no visible GPU (`CUDA_VISIBLE_DEVICES` empty), so that `torch.cuda.is_available()` is
    False in every rank and each of them (torch, Accelerate, fastai, the recipe's `cpu=not torch.cuda.is_available()`)
    chooses the CPU and gloo by itself."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get('PYTHONPATH')]))
    return {'PYTHONPATH': path, **({} if ranks_device(world).type == 'cuda' else {'CUDA_VISIBLE_DEVICES': ''})}

def ranks_where(world:int=2) -> str:
    "`ranks_device(world)` in words, with the backend its ranks use and why (the run's report header says it)."
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if ranks_device(world).type == 'cuda': return f"{world} ranks on CUDA, one GPU each (nccl)"
    why = (f"{n} CUDA device{'s' if n != 1 else ''} for {world} ranks" if DEVICE.type == 'cuda' else f"--device {DEVICE}")
    return f"{world} ranks on the CPU (gloo; {why})"

def ranks_backend(world:int=2) -> str: return 'nccl' if ranks_device(world).type == 'cuda' else 'gloo'

def cuda_only():
    "`pytest.mark.skipif` for tests that need `--device cuda`."
    return pytest.mark.skipif(DEVICE.type != 'cuda', reason="CUDA-only: run with `pytest --device cuda`")

@pytest.fixture
def device() -> torch.device:
    "The device of this run (`pytest --device ...`)."
    return DEVICE

# The tests use batches of 16x8: with several threads each tiny op pays OpenMP fork/join (measured: a 6-batch fit
# takes 0.5 s with 2 threads on a busy 2-core machine, 0.03 s with 1).
torch.set_num_threads(1)

def seed_all(seed=42):
    random.seed(seed); np.random.seed(seed); torch.manual_seed(seed)

def synth_data(n=64, n_in=4, seed=0):
    "`y = x @ w + b + noise` with a fixed generator: the same data for every run."
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n_in, generator=g)
    w = torch.randn(n_in, 1, generator=g)
    y = x @ w + 0.5 + 0.1*torch.randn(n, 1, generator=g)
    return [(x[i], y[i]) for i in range(n)]

def tiny_model(n_in=4, n_hidden=8):
    "Linear -> fastai BatchNorm (ndim=1) -> ReLU -> Linear: the body (0, 1) and the head (3) are two param groups."
    return nn.Sequential(nn.Linear(n_in, n_hidden), BatchNorm(n_hidden, ndim=1), nn.ReLU(), nn.Linear(n_hidden, 1))

def two_groups(m):
    "Splitter: the body (Linear + BatchNorm) and the head."
    return [list(m[0].parameters()) + list(m[1].parameters()), list(m[3].parameters())]

def make_learner(model=None, opt_func=None, lr=1e-2, n_train=64, n_valid=32, bs=16, seed=42, splitter=two_groups,
                 cbs=None, device=None, **kwargs):
    """A `Learner` on fixed synthetic data, model and data on `device` (default: the test device): unshuffled train
    batches and the model initialised from `seed`, so that two learners made with the same arguments train identically
    (in the same precision)."""
    seed_all(seed)
    device = DEVICE if device is None else torch.device(device)
    model = (tiny_model() if model is None else model).to(device)
    train, valid = synth_data(n_train, seed=1), synth_data(n_valid, seed=2)
    dls = DataLoaders(DataLoader(train, bs=bs, shuffle=False, drop_last=False, num_workers=0),
                      DataLoader(valid, bs=bs, num_workers=0),
                      device=device)
    opt_func = partial(SGD, mom=0.) if opt_func is None else opt_func
    learn = Learner(dls, model, loss_func=MSELossFlat(), opt_func=opt_func, lr=lr, splitter=splitter, cbs=cbs, **kwargs)
    return learn

def quiet_fit(learn, n_epoch=1, lr=None, cbs=None, one_cycle=False, **kwargs):
    "Fit without progress bar or logging (fastai's `fit`, or `fit_one_cycle` when asked)."
    with learn.no_bar(), learn.no_logging():
        if one_cycle: learn.fit_one_cycle(n_epoch, lr, cbs=cbs, **kwargs)
        else: learn.fit(n_epoch, lr, cbs=cbs, **kwargs)
    return learn

def clones(ts): return [t.detach().clone() for t in ts]

def weights(learn): return [p.detach().clone() for p in learn.model.parameters()]

def assert_apart_less_than_moved(a, b, start, share=0.05):
    """Each param of models `a` and `b` (FP32) apart by far less (`share`) than `b` moved from `start`: two fits whose
    steps differ by roundings land together."""
    for (n, x), y, s in zip(a.named_parameters(), b.parameters(), start.parameters()):
        assert x.dtype == y.dtype == torch.float32, n
        moved, apart = (y - s).norm(), (x - y).norm()
        assert apart < share * moved, (n, apart.item(), moved.item())

# short fits: fp16's dynamic scale starts lower than 2**24, so that its first steps do not overflow
HALF_MODES = {'fp16': ('to_fp16', {'max_loss_scale': 2.**8}), 'bf16': ('to_bf16', {})}

def to_mode(learn, mode, **kwargs):
    "Put `learn` in `mode` of `HALF_MODES` ('fp32' leaves it alone: the reference run without precision callbacks)."
    if mode == 'fp32': return learn
    name, kw = HALF_MODES[mode]
    return getattr(learn, name)(**{**kw, **kwargs})

def flat_pgs(pgs): return [t for pg in pgs for t in pg]

_INNER = ('before_batch', 'after_pred', 'after_loss', 'before_backward', 'after_backward', 'before_step', 'after_step',
          'after_cancel_step', 'after_batch')

class Record(Callback):
    "Call `fn(learn)` at the events named in `events` (after our precision callbacks: order 20); keep what it returns."
    order = 20
    def __init__(self, train_only=True, **events):
        self.train_only, self.events, self.log = train_only, events, {k: [] for k in events}
        for name in events: setattr(self, name, partial(self._run, name))
    def _run(self, name):
        if self.train_only and not self.training and name in _INNER: return
        self.log[name].append(self.events[name](self.learn))

class Inject(Callback):
    "At the optimizer steps numbered in `steps`, put `value` into the first model grad (or into the loss, `where='loss'`)."
    order = 5  # after ModelToHalf, before MixedPrecision (10) and the recorders (20)
    def __init__(self, steps, value=float('inf'), where='grad'): self.steps, self.value, self.where, self.n = set(steps), value, where, 0
    def after_loss(self):
        if self.training and self.where == 'loss' and self.n in self.steps:
            self.learn.loss_grad = self.learn.loss_grad * self.value
    def after_backward(self):
        if self.where == 'grad' and self.n in self.steps:
            self.learn.model[3].weight.grad[0, 0] = self.value
        self.n += 1

class CancelSteps(Callback):
    "Cancel the optimizer steps of the training batches `iters` in `before_step` (after ours), their loss times `factor`."
    order = 20
    def __init__(self, iters, factor=1.): self.iters, self.factor = set(iters), factor
    def after_loss(self):
        if self.training and self.train_iter in self.iters: self.learn.loss_grad = self.learn.loss_grad * self.factor
    def before_step(self):
        if self.train_iter in self.iters: raise CancelStepException()

def updates(learn, cbs=None, n_epoch=1, lr=1e-2) -> list:
    "How much each param of `learn` moves in a quiet fit."
    w0 = weights(learn)
    quiet_fit(learn, n_epoch, lr=lr, cbs=cbs)
    return [p.detach() - w for p, w in zip(learn.model.parameters(), w0)]

def assert_close_updates(upd, ref, rtol=1e-2):
    "Each param's update is `ref`'s within `rtol` (of the largest param update, for one that is near zero: a sum that cancels)."
    top = max(r.norm() for r in ref)
    for u, r in zip(upd, ref): assert (u - r).norm() <= rtol * max(r.norm(), .1 * top), (u, r)

class StepSpy(Callback):
    """What the optimizer consumes at each step: a fastai optimizer callback put in front of the learner's (`learn.opt.cbs`,
    inside a `Lookahead` too) sees every param the step reaches, with the grad it is stepped with (the FP32 master grads
    exist only then). `steps`: per optimizer step, `[(param, fn(param))]`; default `fn`: a clone of the grad. Ordered
    before `MixedPrecision` (its `before_step` only starts a step's list): a callback handling `before_step` after ours
    sees the grads unscaled, which changes them (in 16 bits)."""
    order = 5
    def __init__(self, fn=None): self.fn, self.steps, self._cur = fn or (lambda p: p.grad.detach().clone()), [], None
    def before_fit(self):
        opt = self.learn.opt
        while not hasattr(opt, 'cbs') and hasattr(opt, 'opt'): opt = opt.opt
        while hasattr(opt, 'opt') and hasattr(opt.opt, 'cbs'): opt = opt.opt  # fastai's Lookahead: the wrapped one
        if self._spy not in opt.cbs: opt.cbs.insert(0, self._spy)
    def before_step(self): self._cur = []
    def _spy(self, p, **kwargs):
        if self._cur is not None: self._cur.append((p, self.fn(p)))
    def after_step(self):
        if self._cur: self.steps.append(self._cur)
        self._cur = None
    def grads(self) -> list: return [[g for _, g in step] for step in self.steps]
    _spy.elementwise = True  # it reads each element on its own (`compat.known_elementwise`)

@pytest.fixture
def learner(): return make_learner

_HOST_READS = ('item', 'tolist', '__bool__', '__float__', '__int__', '__index__', 'numpy')

_HOST_DATA = ((torch, 'tensor'), (torch, 'as_tensor'), (torch.Tensor, 'new_tensor'))  # a tensor made of host data

def count_host_reads(monkeypatch, cls, events=('before_step', 'after_step', 'before_backward')) -> list:
    """Patch `Tensor`'s device-to-host reads to be logged (in the returned list) while `cls` runs one of its `events`;
    tensors made there from host data too (`'h2d:tensor'`...): on CUDA each is a blocking copy, a host sync as well
    (`torch.cuda.set_sync_debug_mode` counts it; on a CPU nothing else would show it)."""
    calls, active = [], [False]
    for obj, name in [(torch.Tensor, n) for n in _HOST_READS] + [(o, n) for o, n in _HOST_DATA]:
        orig, label = getattr(obj, name), name if obj is torch.Tensor and name != 'new_tensor' else f'h2d:{name}'
        def counted(*a, _orig=orig, _label=label, **k):
            if active[0]: calls.append(_label)
            return _orig(*a, **k)
        monkeypatch.setattr(obj, name, counted)
    for event in events:
        orig = getattr(cls, event)
        def wrapped(self, _orig=orig):
            active[0] = True
            try: return _orig(self)
            finally: active[0] = False
        monkeypatch.setattr(cls, event, wrapped)
    return calls

@pytest.fixture
def reset_warned():
    "Forget which slow-fp16 warnings were already given in this process (`fp16cb.dtypes._warned`)."
    saved = set(_dtypes._warned); _dtypes._warned.clear()
    yield _dtypes._warned
    _dtypes._warned.clear(); _dtypes._warned.update(saved)

@pytest.fixture(autouse=True)
def _no_slow_fp16_warning_noise():
    "Tests that do not check the warning do not care about it either."
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='(fp16|bf16) training on the CPU', category=RuntimeWarning)
        yield

@pytest.fixture
def per_param_steps(monkeypatch):
    """fastai's loop steps each master on its own (no `FusedRun`): for tests whose `StepSpy` reads the grads param by
    param (fused, a run of masters is stepped as one flat tensor, which the spy sees as one)."""
    from fp16cb.weights.drivers import FusedRun
    monkeypatch.setattr(FusedRun, 'step', lambda self, core, hyper: [])

def set_chunk(monkeypatch, n):
    """The step's chunks of `n` elements (None: the device's own): the 16-bit params lifted to FP32 (`half_storage`)
    and the optimizer's state widened, a chunk at a time (`fp16cb.weights.loop.STATE_CHUNK`)."""
    from fp16cb.weights import loop
    if n: monkeypatch.setattr(loop, 'STATE_CHUNK', {'cpu': n, 'cuda': n})

class GradOfLoss(Callback):
    "In `after_loss`: `torch.autograd.grad(learn.loss, params)` beside the grads an FP32 copy of the model gives."
    order = 60
    def __init__(self): self.pairs = []
    def after_loss(self):
        if not self.training: return
        ps = [p for p in self.learn.model.parameters() if p.requires_grad]
        got = torch.autograd.grad(self.learn.loss, ps, retain_graph=True)
        m32 = copy.deepcopy(self.learn.model).float()  # the FP32 weights, computed in FP32
        ref = torch.autograd.grad(self.learn.loss_func(m32(*self.learn.xb), *self.learn.yb),
                                  [p for p in m32.parameters() if p.requires_grad])
        self.pairs.append(([g.float() for g in got], list(ref)))
    def errors(self) -> list:
        "Per batch: the distance of all the grads (one vector) from FP32's, relative to FP32's norm."
        norm = lambda ts: sum(float((t ** 2).sum()) for t in ts) ** .5
        return [norm([g - r for g, r in zip(got, ref)]) / norm(ref) for got, ref in self.pairs]
