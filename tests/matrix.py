"""The harness of the combination matrix (`tests/test_matrix.py`): one tiny deterministic model and data, a fit in any
precision mode x optimizer x training context, and what the fit did to each parameter tensor, so that a mixed-precision
run can be held to plain FP32 fastai's under the same optimizer and callbacks. A helper module: nothing here is
collected by pytest.

The model has what the precision code must treat as FP32 fastai does: a BatchNorm, a `branch` sub-module that only
every other training forward uses (context 'branch': its params get no grad on the other steps), an `unused` Linear that
is in the optimizer but never called (FP32 never touches it) and a frozen param (`requires_grad=False`).

`python tests/matrix.py OUT` is one rank of the DDP subset (launched twice by `fp16cb.demos.ddp.launch`): it trains
every mode of `DDP_MODES` in turn under fastai's `distrib_ctx` and writes what it saw to `OUT/rank{RANK}.json` and
`OUT/rank{RANK}-{mode}.pt`: on the GPU of its LOCAL_RANK with nccl when CUDA is visible to it, else on the CPU with gloo
(the test hides CUDA from the ranks unless each has a GPU of its own)."""
from __future__ import annotations
import json, sys
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import NamedTuple
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from fastai.basics import Callback, SGD, Adam, OptimWrapper
from fastai.optimizer import Lookahead
import copy
from fastai.callback.core import CancelStepException, CancelBatchException
from fastai.callback.training import GradientAccumulation, GradientClip
from fastai.layers import BatchNorm

import fp16cb  # noqa: F401  (patches Learner.to_fp16 & co.)
from fp16cb.weights.optstate import opt_state
from fp16cb.storage import state8
from fp16cb.fsdp import full_tensor
from conftest import make_learner, quiet_fit, seed_all

# ---- what combines: fp16cb.compat, the one declaration

from fp16cb import compat
from fp16cb.compat import MODES, OPTIMIZERS, CONTEXTS, verdict

def refused_at_setup(mode:str, opt:str, ctx:str) -> bool:
    "Whether the cell's refusal comes at set-up (before any step), not when a step does what cannot be kept."
    r = compat.refusal(compat.Facts.of_cell(mode, opt, ctx))
    return r is not None and r.moment != compat.STEP

SUBSETS = ('ddp', 'fsdp2', 'compile')  # contexts with subsets of their own (2-process launches; torch.compile), not in the
# grid
OUTSIDE = tuple(c for c in CONTEXTS if CONTEXTS[c].startswith('other code'))  # other code touching params, grads, opt
OUTSIDE_OPTS = ('adam', 'torch')  # the outside contexts cross every mode with a fastai and a torch optimizer
GRID_CONTEXTS = tuple(c for c in CONTEXTS if c not in SUBSETS + OUTSIDE)

# ---- the model and the data

TARGET_SCALE = 1/8  # the largest |grad| stays under 0.4: fp16 at GradScaler's first scale (2**16) does not overflow

def scale_targets(dls):
    "conftest's synthetic regression with its targets times `TARGET_SCALE`."
    for i, dl in enumerate(dls.loaders): dls.loaders[i] = dl.new([(x, y*TARGET_SCALE) for x, y in dl.dataset])

class Recomputed(nn.Module):
    """`inner` run under activation checkpointing (torch's non-reentrant): its forward runs again in the backward, called
    there alone (not from the model's forward, nor as one of the model's children)."""
    def __init__(self, inner:nn.Module): super().__init__(); self.inner = inner
    def forward(self, x): return checkpoint(self.inner, x, use_reentrant=False)

class MatrixNet(nn.Module):
    """Linear -> BatchNorm -> tanh -> Linear (+ a frozen shift) -> tanh [-> + branch] -> head. `branch` (`use_branch`)
    joins every other training forward (the 1st, 3rd, ...: a counter, so FP32 and mixed runs agree) and every eval
    forward; `unused` is never called; `shift` is frozen. tanh, not ReLU: a unit whose pre-activation is near 0 flips
    ReLU's mask on 16-bit rounding alone, which sends the trajectory elsewhere (5 to 25 times the differences here).
    `checkpoint` (context 'checkpoint'): `lin2` is a `Recomputed` Linear, run again in the backward."""
    def __init__(self, n_in:int=4, n_hidden:int=8, bn:bool=True, use_branch:bool=False, checkpoint:bool=False):
        super().__init__()
        self.lin1 = nn.Linear(n_in, n_hidden, bias=False)  # BatchNorm follows: a bias would get rounding noise as grad
        self.bn = BatchNorm(n_hidden, ndim=1) if bn else nn.Identity()
        self.lin2 = nn.Linear(n_hidden, n_hidden)
        self.branch = nn.Linear(n_hidden, n_hidden)
        self.head = nn.Linear(n_hidden, 1)
        self.unused = nn.Linear(n_hidden, n_hidden)
        self.shift = nn.Parameter(0.1*torch.randn(n_hidden), requires_grad=False)
        with torch.no_grad(): self.head.weight.mul_(TARGET_SCALE)  # predictions on the targets' scale
        self.use_branch, self.n_train_fwd = use_branch, 0
        if checkpoint: self.lin2 = Recomputed(self.lin2)

    def forward(self, x):
        h = torch.tanh(self.bn(self.lin1(x)))
        h = torch.tanh(self.lin2(h) + self.shift)
        if self.use_branch:
            if not self.training or self.n_train_fwd % 2 == 0: h = h + self.branch(h)
            if self.training: self.n_train_fwd += 1
        return self.head(h)

def all_groups(m:MatrixNet) -> list:
    "Splitter: two param groups holding every param, the unused and the frozen ones too."
    return [[*m.lin1.parameters(), *m.bn.parameters(), m.shift, *m.lin2.parameters()],
            [*m.branch.parameters(), *m.unused.parameters(), *m.head.parameters()]]

# ---- the optimizers

def lookahead_adam(params, **kwargs): return Lookahead(Adam(params, **kwargs))

OPT_FUNCS = {
    'sgd': partial(SGD, mom=0.9),
    'adam': Adam,  # its default wd (0.01, decoupled)
    'lookahead': lookahead_adam,
    'torch': partial(OptimWrapper, opt=torch.optim.AdamW),
    'fused': partial(OptimWrapper, opt=partial(torch.optim.AdamW, fused=True)),
}
LR = {'sgd': 3e-1,  # SGD's larger: its updates must stand well above bf16's rounding of the stored weights
      'adam': 1e-2, 'lookahead': 1e-2, 'torch': 1e-2, 'fused': 1e-2}

# ---- the contexts

def scale_state(learn) -> dict:
    "The precision callback's loss-scale state: its scaler's `state_dict()` and how many steps its record holds."
    pcb = next((cb for cb in learn.precision_callbacks() if hasattr(cb, 'loss_scaler')), None)
    if pcb is None: return {}
    return {**pcb.loss_scaler.state_dict(), 'steps recorded': len(pcb.scales)}

class CancelEveryOther(Callback):
    """Raises `CancelStepException` in `before_step` of every other training step (the 2nd, 4th, ...), after our
    callbacks; `changed`: what of the loss-scale state (`scale_state`) a cancelled step changed."""
    order = 20
    def before_fit(self): self.n, self.changed, self._before, self._cancelled = 0, set(), None, False
    def before_batch(self):
        if self.training: self._before = scale_state(self.learn)
    def before_step(self):
        self.n += 1
        if self.n % 2 == 0: raise CancelStepException()
    def after_cancel_step(self): self._cancelled = True
    def after_batch(self):  # after every callback's `after_step`
        if self._cancelled: self.changed |= {k for k, v in scale_state(self.learn).items() if self._before.get(k) != v}
        self._cancelled = False

class CountSteps(Callback):
    "How many optimizer steps were taken (`after_step` of a step that was not cancelled) and the training losses."
    order = 30
    def before_fit(self): self.n, self.cancelled, self.losses = 0, False, []
    def after_cancel_step(self): self.cancelled = True
    def after_step(self):
        if not self.cancelled: self.n += 1
        self.cancelled = False
    def after_batch(self):
        if self.training: self.losses.append(float(self.learn.loss.detach()))

class GroupClip(Callback):
    "FP32's twin of `to_fp16(clip=...)`: each param group's grad norm clipped to `max_norm` (`GradientClip` per group)."
    order = 11
    def __init__(self, max_norm:float): self.max_norm = max_norm
    def before_step(self):
        for pg in self.learn.splitter(self.learn.model): nn.utils.clip_grad_norm_(pg, self.max_norm)

# contexts of other code that reads or writes the params, their grads, `requires_grad` or the optimizer (as users bring)
class EMAWeights(Callback):
    "An EMA of the weights (fastxtend's `EMACallback` in short): `deepcopy(learn.model)` in `before_fit`, lerp per batch."
    order = 30
    def before_fit(self): self.avg = copy.deepcopy(self.learn.model)
    def after_batch(self):
        if not self.training: return
        with torch.no_grad():
            for e, w in zip(self.avg.parameters(), self.learn.model.parameters()): e.lerp_(w.to(e.dtype), .01)

class Constrain(Callback):
    "A weight constraint in place after each step: `lin2`'s weights clamped to +-0.2 (binding from the first steps)."
    order = 30
    def after_step(self):
        with torch.no_grad(): self.learn.model.lin2.weight.clamp_(-.2, .2)

class UnfreezeHead(Callback):
    "The head frozen at the fit's start (before the precision set-up), made trainable at the third training batch."
    order = -60
    def before_fit(self): self.n = 0; self.learn.model.head.requires_grad_(False)
    def before_batch(self):
        if not self.training: return
        self.n += 1
        if self.n == 3: self.learn.model.head.requires_grad_(True)

class UserClip(Callback):
    "A user's own clipping: `clip_grad_norm_(learn.model.parameters(), 0.05)` in `before_step`, after ours."
    order = 30
    def before_step(self): nn.utils.clip_grad_norm_(self.learn.model.parameters(), .05)

class SkipBatch(Callback):
    "Drops the 3rd and 11th training batches after their backward: `learn.opt.zero_grad()`, `CancelBatchException`."
    order = 30
    def before_fit(self): self.n = 0
    def after_backward(self):
        self.n += 1
        if self.n in (3, 11): self.learn.opt.zero_grad(); raise CancelBatchException()

class AccumulateByCancel(Callback):
    "Accumulation by cancelling every other step and holding the optimizer's `zero_grad` back for it."
    order = 30
    def before_fit(self): self.n = 0
    def before_step(self):
        self.n += 1
        if self.n % 2:
            self.learn.opt.__dict__['zero_grad'] = lambda: None
            raise CancelStepException()
    def after_batch(self): self.learn.opt.__dict__.pop('zero_grad', None)

class NewHead(Callback):
    """After the 5th training batch: a new `head` module, a copy of the head as it is (new Parameters, which the
    optimizer does not hold: it stays as it is, and the rest trains on with it). A new optimizer would restart Adam's
    moments, whose first step is the sign of each grad: chaotic for rounding-sized grads, in FP32 too."""
    order = 30
    def before_fit(self): self.n = 0
    def after_batch(self):
        if not self.training: return
        self.n += 1
        if self.n == 5: self.learn.model.head = copy.deepcopy(self.learn.model.head)

class GradPenalty(Callback):
    "The squared norm of the loss's grads w.r.t. the trainable params, times 0.1, added to the loss (second order)."
    order = 30
    def after_loss(self):
        if not self.training: return
        ps = [p for p in self.learn.model.parameters() if p.requires_grad]
        gs = torch.autograd.grad(self.learn.loss, ps, create_graph=True, allow_unused=True)
        self.learn.loss_grad = self.learn.loss_grad + .1 * sum((g.float() ** 2).sum() for g in gs if g is not None)

OUTSIDE_CBS = {'ema': EMAWeights, 'constraint': Constrain, 'unfreeze': UnfreezeHead, 'userclip': UserClip,
               'skipbatch': SkipBatch, 'cancelaccum': AccumulateByCancel, 'surgery': NewHead, 'gradpenalty': GradPenalty}

BS = 16
GRADCLIP = 1.  # as compat declares the cell; it binds on loss-scaled grads only (the global norm here: 0.06 to 0.4)
CONTEXT_CBS = {'plain': lambda: [], 'accumulate': lambda: [GradientAccumulation(n_acc=2*BS)], 'branch': lambda: [],
               'cancel': lambda: [CancelEveryOther()], 'gradclip': lambda: [GradientClip(max_norm=GRADCLIP)],
               'compile': lambda: [], 'ddp': lambda: [], 'fsdp2': lambda: [],
               **{k: (lambda c=c: [c()]) for k, c in OUTSIDE_CBS.items()},
               'checkpoint': lambda: []}  # (the model's own doing: `MatrixNet(checkpoint=True)`)

def first_linear(model:nn.Module) -> str:
    "The qualified name of `model`'s first Linear, as the learner's model names it ('_orig_mod.lin1' once compiled)."
    return next(n for n, m in model.named_modules() if isinstance(m, nn.Linear))

def mode_kwargs(mode:str, model:nn.Module) -> dict:
    "The keyword arguments of `mode`'s call, `keep_fp32` naming `model`'s first Linear (the module `bf16-keep` keeps)."
    kw = dict(MODES[mode].kwargs)
    if 'keep_fp32' in kw: kw['keep_fp32'] = first_linear(model)
    return kw

def fp32_twin(mode:str|None) -> tuple:
    "The callbacks plain FP32 fastai needs to train as `mode` is meant to: its `clip` (per param group, or global)."
    kw = MODES[mode].kwargs if mode is not None else {}
    if kw.get('clip') is None: return ()
    return (GradientClip(kw['clip']) if kw.get('clip_global') else GroupClip(kw['clip']),)

def apply_mode(learn, mode:str|None):
    "Put `learn` in `mode` (None: plain FP32, no precision callback)."
    if mode is None: return learn
    return getattr(learn, MODES[mode].call)(**mode_kwargs(mode, learn.model))

# ---- a run

class Run(NamedTuple):
    params:dict  # name -> (initial FP32 value, value after the fit and `to_fp32()`)
    dtypes:dict  # name -> dtype after `to_fp32()`
    error:Exception|None  # what the set-up or the fit raised (None: the fit ran)
    n_steps:int  # optimizer steps taken
    losses:list  # the training losses, batch by batch
    left:list  # the precision callbacks left on the learner after `to_fp32()`
    scaled_steps:int|None  # the steps the precision callback's loss-scale record holds (`scales`); None in FP32
    cancel_changed:list  # what of the loss-scale state the cancelled steps changed (context 'cancel')
    state_dtypes:list  # the dtypes of the optimizer's state tensors (those with a dim) after `to_fp32()`

N_TRAIN, EPOCHS = 128, 2  # 8 batches of 16 an epoch: 16 optimizer steps (8 with 'accumulate' and 'cancel')

def build(mode:str|None, opt:str, ctx:str, n_train:int=N_TRAIN, bn:bool=True, seed:int=42, twin_of:str|None=None):
    """A learner in `mode` (the error its set-up raised, if any) for `opt` and `ctx`, the model initialised from `seed`;
    `twin_of` (with `mode=None`): the FP32 learner with what it needs to train as that mode means to (`fp32_twin`)."""
    seed_all(seed)
    model = MatrixNet(bn=bn, use_branch=ctx == 'branch', checkpoint=ctx == 'checkpoint')
    learn = make_learner(model=model, opt_func=OPT_FUNCS[opt], lr=LR[opt], n_train=n_train, bs=BS, seed=seed,
                         splitter=all_groups, cbs=[*CONTEXT_CBS[ctx](), *fp32_twin(twin_of), CountSteps()])
    scale_targets(learn.dls)
    if ctx == 'compile':  # dynamo's `aot_eager` backend needs no C++ compiler (as tests/test_compile.py)
        torch._dynamo.reset()
        learn.model = torch.compile(learn.model, backend='aot_eager')
    try: apply_mode(learn, mode)
    except (ValueError, TypeError) as e: return learn, e
    return learn, None

def snapshot(learn) -> dict: return {n: p.detach().clone() for n, p in learn.model.named_parameters()}

def finish(learn, init:dict, error) -> Run:
    "What the fit left: back to FP32 (`to_fp32()`), every param against its initial value."
    scales = [len(cb.scales) for cb in learn.precision_callbacks() if hasattr(cb, 'scales')]
    cancel = next((cb for cb in learn.cbs if isinstance(cb, CancelEveryOther)), None)
    learn.to_fp32()
    final = snapshot(learn)
    state = opt_state(learn.opt) if learn.opt is not None else {}
    sdt = sorted({str(v.dtype) for st in state.values() for v in st.values() if torch.is_tensor(v) and v.dim()})
    cs = vars(learn.count_steps)  # its own attributes (a fastai callback's others are the learner's)
    return Run({n: (init[n], final[n]) for n in init}, {n: p.dtype for n, p in learn.model.named_parameters()}, error,
               cs.get('n', 0), cs.get('losses', []), learn.precision_callbacks(), scales[0] if scales else None,
               sorted(vars(cancel).get('changed', ())) if cancel is not None else [], sdt)

@contextmanager
def every_state_8bit(mode:str|None):
    """Within: a mode with 8-bit state (`state_dtype='8bit'`) quantizes every moving average, however small (the tiny
    model's are far under `state8.MIN_NUMEL`, which would leave them FP32 and the cell nothing of 8 bits to show)."""
    old = state8.MIN_NUMEL
    if mode is not None and MODES[mode].kwargs.get('state_dtype') == '8bit': state8.MIN_NUMEL = 1
    try: yield
    finally: state8.MIN_NUMEL = old

def run(mode:str|None, opt:str, ctx:str, epochs:int=EPOCHS, **kwargs) -> Run:
    "Fit `epochs` in `mode` (None: plain FP32) with optimizer `opt` in context `ctx`; what it did to the params."
    with every_state_8bit(mode):
        learn, error = build(mode, opt, ctx, **kwargs)
        init = snapshot(learn)
        if error is None:
            try: quiet_fit(learn, epochs)
            except (ValueError, TypeError) as e: error = e
        return finish(learn, init, error)

# ---- comparing runs

_REFS = {}  # the FP32 runs, made once per (optimizer, context, clipping)

def fp32_reference(mode:str|None, opt:str, ctx:str) -> Run:
    "Plain FP32 fastai's run with `opt` in `ctx`, clipped as `mode` clips (cached)."
    twin = tuple((type(cb).__name__, cb.max_norm) for cb in fp32_twin(mode))
    key = (opt, ctx, twin)
    if key not in _REFS: _REFS[key] = run(None, opt, ctx, twin_of=mode if twin else None)
    return _REFS[key]

def rel_errors(got:Run, ref:Run) -> dict:
    "Per param tensor, ||update - FP32's update|| / ||FP32's update|| (params FP32 leaves untouched left out)."
    res = {}
    for n, (i0, f0) in ref.params.items():
        d_ref = (f0 - i0).double()
        if not d_ref.any(): continue
        i1, f1 = got.params[n]
        res[n] = float(((f1 - i1).double() - d_ref).norm() / d_ref.norm())
    return res

def untouched(ref:Run) -> list:
    "The params whose FP32 update is exactly 0 (the unused Linear, the frozen shift)."
    return [n for n, (i, f) in ref.params.items() if torch.equal(i, f)]

def changed(got:Run, names:list) -> list:
    "Those of `names` that `got`'s fit changed, in any bit."
    return [n for n in names if not torch.equal(*got.params[n])]

# ---- the DDP subset: one rank (`python tests/matrix.py OUT`)

DDP_MODES = ('fp16', 'bf16', 'bf16-half', 'bf16-sib', 'bf16-state', 'bf16-half-state8')
DDP_OPT, DDP_EPOCHS, DDP_N = 'adam', 3, 128  # 2 ranks x 16 rows a step: 4 steps an epoch

def ddp_order(items:list, bs:int=BS, world:int=2) -> list:
    """`items` reordered for fastai's `DistributedDL` (rank r takes the r-th contiguous part of the indices): rank r's
    batch i is then global batch i's r-th part of `bs`, as one process on batches of `bs*world` sees them."""
    from fp16cb.demos.ddp import shard
    return [x for r in range(world) for x in shard(items, bs, r, world)]

def ddp_build(mode:str|None, single:bool, device='cpu', opt:str=DDP_OPT):
    """The DDP subset's learner: no BatchNorm (its batch statistics are each rank's own); the data ordered for
    `DistributedDL`, or (`single`) one process on the 2 ranks' batches concatenated (batches of 32, in order); the
    model and the data on `device` (where the ranks train); the optimizer `opt`."""
    learn, error = build(mode, opt, 'ddp', n_train=DDP_N, bn=False)
    train = learn.dls.train
    learn.dls.loaders[0] = train.new(bs=2*BS) if single else train.new(ddp_order(list(train.dataset)))
    learn.dls.to(device); learn.model.to(device)
    return learn, error

def on_cpu(r:Run) -> Run:
    "`r` with its params (initial, final) on the CPU: the ranks' and the reference's compared wherever they trained."
    return r._replace(params={n: (i.cpu(), f.cpu()) for n, (i, f) in r.params.items()})

def _ddp_rank(out:Path):
    import warnings; warnings.filterwarnings('ignore')
    import torch.distributed as dist
    from accelerate import DistributedDataParallelKwargs
    import fastai.distributed  # noqa: F401  (Learner.distrib_ctx)
    from fp16cb.demos.ddp import init
    torch.set_num_threads(1)
    rank, res = init(timeout=60), {}
    device = torch.device('cuda', torch.cuda.current_device()) if dist.get_backend() == 'nccl' else torch.device('cpu')
    res['_where'] = dict(backend=dist.get_backend(), device=str(device))
    for mode in DDP_MODES:
        learn, error = ddp_build(mode, single=False, device=device)
        torch.manual_seed(1000 + rank)  # each rank's own global seed (torchrun, no seed set): the rounding must agree
        init_w = snapshot(learn)
        if error is None:
            try:
                with learn.distrib_ctx(sync_bn=False, cpu=device.type == 'cpu',
                                       kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)]):
                    quiet_fit(learn, DDP_EPOCHS)
            except (ValueError, TypeError) as e: error = e
        r = on_cpu(finish(learn, init_w, error))
        torch.save(r.params, out/f'rank{rank}-{mode}.pt')
        res[mode] = dict(error=None if error is None else f'{type(error).__name__}: {error}', n_steps=r.n_steps,
                         losses=r.losses, dtypes=sorted({str(d) for d in r.dtypes.values()}),
                         left=[type(c).__name__ for c in r.left])
        dist.barrier()
    (out/f'rank{rank}.json').write_text(json.dumps(res))
    from fp16cb.demos.ddp import shutdown
    shutdown()

# ---- the FSDP2 subset: one rank (`python tests/matrix.py OUT fsdp2`)

FSDP_MODES = ('fp16', 'bf16', 'bf16-keep', 'bf16-state', 'bf16-state8', 'fp16-clip', 'fp16-lognormal', 'bf16-half',
              'bf16-sib', 'bf16-flat', 'native-bf16')
FSDP_CELLS = tuple((m, DDP_OPT) for m in FSDP_MODES) + tuple((m, 'torch') for m in ('fp16', 'bf16-state', 'bf16-state8'))

def fsdp_shard(learn):
    """`learn.model` sharded with FSDP2 as a user would before the fit (`fp16cb.shard_model`): each Linear a unit, the
    module its mode keeps FP32 (`bf16-keep`) too, then the root."""
    from fp16cb import shard_model, ModelToHalf
    keep = next((cb.policy for cb in learn.cbs if isinstance(cb, ModelToHalf)), None)
    shard_model(learn.model, layers=(nn.Linear,), keep_fp32=keep)

class Seen(Callback):
    """What a sharded fit computed with and stored: the dtype of `lin1`'s and `lin2`'s weights as their forward runs
    (FSDP2's all-gathered params), and the types and dtypes of the optimizer's state after each step."""
    order = 30
    def before_fit(self):
        self.weights, self.state = set(), set()
        m = self.learn.model
        self.hooks = [getattr(m, n).register_forward_pre_hook(lambda mod, a, n=n: self.weights.add(
            f"{n}:{str(mod.weight.dtype)[6:]}")) for n in ('lin1', 'lin2')]
    def after_step(self):
        self.state |= {f"{type(v).__name__}:{str(v.dtype)[6:]}" for st in opt_state(self.learn.opt).values()
                       for v in st.values() if torch.is_tensor(v) and v.dim()}
    def after_fit(self):
        for h in self.hooks: h.remove()

def gathered(r:Run) -> Run:
    "`r` with its final params whole (FSDP2's shards gathered from every rank: a collective) and on the CPU."
    return r._replace(params={n: (i.cpu(), full_tensor(f).cpu()) for n, (i, f) in r.params.items()})

def _fsdp_rank(out:Path):
    import warnings; warnings.filterwarnings('ignore')
    from fp16cb import DistributedData
    from fp16cb.demos.ddp import init, shutdown
    torch.set_num_threads(1)
    rank, res = init(timeout=60), {}
    device = torch.device('cuda', torch.cuda.current_device()) if dist.get_backend() == 'nccl' else torch.device('cpu')
    res['_where'] = dict(backend=dist.get_backend(), device=str(device))
    from fp16cb.weights import loop
    loop.STATE_CHUNK = {'cpu': 16, 'cuda': 16}  # the state widened a few params at a time (a large param: sliced)
    for mode, opt in FSDP_CELLS:
        with every_state_8bit(mode):
            learn, error = ddp_build(mode, single=False, device=device, opt=opt)
            torch.manual_seed(1000 + rank)
            init_w = snapshot(learn)
            if error is None:
                seen = Seen()
                try:
                    fsdp_shard(learn)
                    quiet_fit(learn, DDP_EPOCHS, cbs=[DistributedData(), seen])
                except (ValueError, TypeError) as e: error = e
            r = gathered(finish(learn, init_w, error))
        torch.save(r.params, out/f'rank{rank}-{mode}-{opt}.pt')
        res[f'{mode}-{opt}'] = dict(error=None if error is None else f'{type(error).__name__}: {error}',
                                    n_steps=r.n_steps, losses=r.losses, dtypes=sorted({str(d) for d in r.dtypes.values()}),
                                    left=[type(c).__name__ for c in r.left], state=r.state_dtypes,
                                    seen={k: sorted(getattr(seen, k, ())) for k in ('weights', 'state')})
        dist.barrier()
    for mode in FSDP_CKPT_MODES: res[f'ckpt-{mode}'] = _resume(mode, out, rank, device)
    res['skips'] = _one_rank_overflows(rank, device)
    res['refused'] = _setups_refused(rank, device)
    torch.save(_clipped(rank, device), out/f'rank{rank}-clipped.pt')
    torch.save(_accumulated(rank, device), out/f'rank{rank}-accumulated.pt')
    res['one-process'] = _loads_one_process_file(out, rank, device)
    (out/f'rank{rank}.json').write_text(json.dumps(res))
    shutdown()

FSDP_CKPT_MODES = ('fp16', 'bf16-state8')

class InfOnRank1(Callback):
    "After the 3rd backward, an inf in rank 1's shard of `lin2.weight`'s grad alone (rank 0's shards stay finite)."
    def before_fit(self): self.n = 0
    def after_backward(self):
        self.n += 1
        if self.n == 3 and dist.get_rank() == 1:
            with torch.no_grad(): self.learn.model.lin2.weight.grad.to_local()[0, 0] = float('inf')

def _one_rank_overflows(rank:int, device) -> dict:
    "A sharded fp16 fit in which one rank's shard overflows at step 3: each rank's skips and loss scales."
    from fp16cb import DistributedData
    learn, _ = ddp_build('fp16', single=False, device=device)
    fsdp_shard(learn)
    quiet_fit(learn, 1, cbs=[DistributedData(), InfOnRank1()])
    pcb = next(cb for cb in learn.precision_callbacks() if hasattr(cb, 'skips'))
    return dict(skips=list(pcb.skips), scales=list(pcb.scales), overflowed=[o['params'] for o in pcb.overflows])

CLIP = .01  # binds on every step (the grads' global norm here: 0.06 to 0.4)

def _clipped(rank:int, device) -> dict:
    "A sharded `to_fp16(clip=CLIP, clip_global=True)` fit of `DDP_EPOCHS`: its gathered params, initial and final."
    from fp16cb import DistributedData
    learn, _ = ddp_build(None, single=False, device=device)
    learn.to_fp16(clip=CLIP, clip_global=True)
    init_w = snapshot(learn)
    fsdp_shard(learn)
    quiet_fit(learn, DDP_EPOCHS, cbs=DistributedData())
    return {n: (init_w[n].cpu(), full_tensor(p).cpu()) for n, p in learn.model.named_parameters()}

def _accumulated(rank:int, device) -> dict:
    """A sharded `to_fp16()` fit with fastai's `GradientAccumulation` (2 micro-batches a step): the loss scale is divided
    out of each micro-batch's grads as FSDP2 reduces them, so the step adds unscaled grads. Its gathered params."""
    from fp16cb import DistributedData
    learn, _ = ddp_build('fp16', single=False, device=device)
    init_w = snapshot(learn)
    fsdp_shard(learn)
    quiet_fit(learn, DDP_EPOCHS, cbs=[DistributedData(), GradientAccumulation(n_acc=2 * BS)])
    return {n: (init_w[n].cpu(), full_tensor(p).cpu()) for n, p in learn.model.named_parameters()}

def _setups_refused(rank:int, device) -> dict:
    """What `to_bf16()` says of sharded models it cannot compute with: the root not sharded, a BatchNorm in a 16-bit
    unit, fastai's `distrib_ctx()` (a DDP wrap) around a sharded model; and the FSDP2 policy after a fit."""
    from torch.distributed.fsdp import fully_shard
    import fastai.distributed  # noqa: F401  (Learner.distrib_ctx)
    from fp16cb import DistributedData
    res = {}
    for case in ('no-root', 'bn-shared', 'distrib_ctx'):
        learn, _ = build('bf16', DDP_OPT, 'ddp', n_train=DDP_N, bn=case == 'bn-shared')
        learn.model.to(device)
        for m in (learn.model.lin1, learn.model.lin2): fully_shard(m)
        if case != 'no-root': fully_shard(learn.model)
        try:
            if case == 'distrib_ctx':
                with learn.distrib_ctx(sync_bn=False, cpu=device.type == 'cpu'): quiet_fit(learn, 1)
            else: quiet_fit(learn, 1, cbs=DistributedData())
            res[case] = None
        except (ValueError, TypeError) as e: res[case] = f'{type(e).__name__}: {e}'
    learn, _ = ddp_build('bf16', single=False, device=device)
    fsdp_shard(learn)
    quiet_fit(learn, 1, cbs=DistributedData())
    res['policies_after'] = sorted({repr(m._get_fsdp_state()._mp_policy) for m in learn.model.modules()
                                    if hasattr(m, '_get_fsdp_state')})
    return res

def _loads_one_process_file(out:Path, rank:int, device) -> dict:
    """A one-process FP32 learner's file (a fit on the concatenated batches, written by rank 0) loaded into a sharded
    `to_bf16()` learner: its gathered params, and the file's."""
    learn, _ = ddp_build(None, single=True, device=device)
    learn.path = out
    quiet_fit(learn, 1)
    if rank == 0: learn.save('one-process')
    dist.barrier()
    one = {n: p.detach().cpu().clone() for n, p in learn.model.named_parameters()}
    learn, _ = ddp_build('bf16', single=False, device=device)
    learn.path = out
    fsdp_shard(learn)
    learn.load('one-process')
    got = {n: full_tensor(p).cpu() for n, p in learn.model.named_parameters()}
    return dict(equal=all(torch.equal(one[n], got[n]) for n in one), opt_sharded=all(
        type(v).__name__ == 'DTensor' for st in opt_state(learn.opt).values() for v in st.values()
        if torch.is_tensor(v) and v.dim()))

def _resume(mode:str, out:Path, rank:int, device) -> dict:
    """A sharded fit of 1 epoch saved (`learn.save`, every rank), then 2 more epochs; and a new sharded learner that
    loads the file and fits the same 2: each one's gathered params (`OUT/rank{RANK}-ckpt-{mode}.pt`) and loss scales."""
    from fp16cb import DistributedData
    got, scales = {}, {}
    with every_state_8bit(mode):
        for name in ('through', 'resumed'):
            learn, _ = ddp_build(mode, single=False, device=device)
            learn.path = out
            fsdp_shard(learn)
            if name == 'through':
                quiet_fit(learn, 1, cbs=DistributedData())
                learn.save(f'mid-{mode}')
                got['saved'] = {n: full_tensor(p).cpu() for n, p in learn.model.named_parameters()}
            else: learn.load(f'mid-{mode}')
            scales[name] = [float(cb.loss_scale) for cb in learn.precision_callbacks() if hasattr(cb, 'loss_scale')]
            quiet_fit(learn, 2, cbs=DistributedData())
            got[name] = {n: full_tensor(p).cpu() for n, p in learn.model.named_parameters()}
            learn.to_fp32()
    torch.save(got, out/f'rank{rank}-ckpt-{mode}.pt')
    return dict(scales=scales)

if __name__ == '__main__': (_fsdp_rank if sys.argv[2:] == ['fsdp2'] else _ddp_rank)(Path(sys.argv[1]))
