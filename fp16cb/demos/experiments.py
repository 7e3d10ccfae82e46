"""Small, download-free experiments on scikit-learn's digits: the precision modes compared in NVIDIA's NVCaffe slides
"Training with Mixed Precision" (Ginsburg, Nikolaev and Micikevicius, 2017: FP32, mixed, FP16, FP16 with loss scale
1000), and the three problems of pure fp16 named in fastai's mixed-precision docs (after Micikevicius et al., 2018,
"Mixed Precision Training", ICLR), each in a run where it breaks and a run where the recipe fixes it; then the per-layer
precision policy (`keep_fp32=`) and FP16 master-weight storage (`half_storage=True`) against their failures.
`MODES`, `TASKS` and `EXPERIMENTS` are the one table of `python -m fp16cb --experiments`."""
from __future__ import annotations
import time, warnings
from dataclasses import dataclass, field
from functools import partial
import torch
from torch import nn
from fastai.callback.core import Callback, CancelStepException
from fastai.data.core import DataLoaders
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from fastai.metrics import accuracy
from fastai.optimizer import SGD, Adam, Optimizer
from fastai.torch_core import set_seed
import fastai.callback.schedule  # noqa: F401 (Learner.fit_one_cycle)

from ..callbacks import ModelToHalf
from ..scaling import OverflowCheck
from ..scaling import check_positive
from .. import learner as _learner  # noqa: F401 (Learner.to_fp16 & co.)

__all__ = ['HalfLossScale', 'classic_momentum', 'ClassicSGD', 'MODES', 'DEFAULT_MODES', 'TASKS', 'Task', 'Run',
           'digits_data', 'digits_cnn', 'digits_linear', 'digits_transformer', 'offset_cnn', 'set_mode', 'make_learner',
           'train', 'run_mode', 'run_many', 'mean_acc', 'TOLERANCE', 'EXPERIMENTS', 'run_experiments']

class HalfLossScale(Callback):
    "Loss scaling for a model trained in 16-bit *without* FP32 masters: the 16-bit grads are unscaled in place."
    order = 10
    def __init__(self,
        scale:float=1000., # a static loss scale (NVIDIA's NVCaffe slides: 'FP16 training, loss scale = 1000')
        check:bool=True, # skip the steps whose grads hold an inf/NaN (False: they reach the weights)
    ):
        self.scale, self.check = float(check_positive('scale', scale)), check
        self.overflow, self.scales, self.skips = OverflowCheck(), [], []

    @property
    def loss_scale(self) -> float: return self.scale

    def before_backward(self): self.learn.loss_grad = self.learn.loss_grad * self.scale

    def before_step(self):
        grads = [p.grad for p in self.learn.model.parameters() if p.grad is not None]
        if not grads: return
        found = bool(self.overflow(grads, 1. / self.scale)[0] > 0)
        self.scales.append(self.scale); self.skips.append(found and self.check)
        if found and self.check: raise CancelStepException()

def classic_momentum(p, lr, mom, mom_buf=None, **kwargs):
    """The 'vanilla' momentum of the slides, in the weights' own dtype: H = m*H - lr*dW, W = W + H. In 16-bit the
    product lr*dW underflows and W + H rounds small updates away: the vanishing updates that FP32 masters, or the
    modified rule, avoid."""
    if mom_buf is None: mom_buf = torch.zeros_like(p.data)
    mom_buf.mul_(mom).sub_(p.grad.data * torch.tensor(lr, dtype=p.dtype))  # lr*dW computed in the param's dtype
    p.data.add_(mom_buf)
    return {'mom_buf': mom_buf}

def ClassicSGD(params, lr, mom=0.9, wd=0.):
    "SGD with the classic momentum rule `classic_momentum` (for the 'plain update' experiment of FP16 storage)."
    return Optimizer(params, [classic_momentum], lr=lr, mom=mom, wd=wd)

def _plain_storage(learn):
    "16-bit storage with the plain update: the classic momentum rule in fp16, grads unscaled in fp16 (no masters)."
    learn.opt_func = partial(ClassicSGD, mom=0.9)
    return learn.to_fp32().add_cbs([ModelToHalf(), HalfLossScale(1000.)])

# name -> (what it is, how to set up a learner); `python -m fp16cb --help` lists these descriptions
MODES = {
    'fp32':        ("plain FP32 training (`learn.to_fp32()`)", lambda learn: learn.to_fp32()),
    'to_fp16':     ("`learn.to_fp16()`: fp16 compute (BatchNorm in FP32), FP32 master weights, dynamic loss scale",
                    lambda learn: learn.to_fp16()),
    'to_bf16':     ("`learn.to_bf16()`: bf16 compute, FP32 master weights, no loss scale (bf16 has FP32's range)",
                    lambda learn: learn.to_bf16()),
    'native':      ("`learn.to_native_fp16()`: PyTorch's autocast in fp16 with its GradScaler",
                    lambda learn: learn.to_native_fp16()),
    'native_bf16': ("`learn.to_native_bf16()`: PyTorch's autocast in bf16, no scaler",
                    lambda learn: learn.to_native_bf16()),
    'fp16':        ("pure fp16: model and optimizer step in fp16, no FP32 masters, no loss scale",
                    lambda learn: learn.to_fp32().add_cb(ModelToHalf())),
    'fp16_scaled': ("pure fp16 with a static loss scale of 1000 "
                    "(the NVCaffe slides' 'FP16 training, loss scale = 1000')",
                    lambda learn: learn.to_fp32().add_cbs([ModelToHalf(), HalfLossScale(1000.)])),
    'to_fp16_unscaled': ("`learn.to_fp16(loss_scale=1, dynamic=False)`: FP32 masters but no loss scaling",
                         lambda learn: learn.to_fp16(loss_scale=1., dynamic=False)),
    'to_fp16_wait20': ("`learn.to_fp16(loss_scale=2**24, scale_wait=20)`: the dynamic scale starts at 2^24 and grows "
                       "again after 20 clean steps (default 500), so a short run shows overflows skipped",
                       lambda learn: learn.to_fp16(loss_scale=2.**24, scale_wait=20)),
    'fp16_unchecked': ("pure fp16, static loss scale 2^24, no overflow check: the infs reach the weights",
                       lambda learn: learn.to_fp32().add_cbs([ModelToHalf(), HalfLossScale(2.**24, check=False)])),
    # the per-layer precision policy
    'bf16_norm': ("to_bf16, LayerNorm/GroupNorm kept FP32", lambda learn: learn.to_bf16(keep_fp32='norm')),
    'bf16_classifier': ("to_bf16, final classifier kept FP32", lambda learn: learn.to_bf16(keep_fp32='classifier')),
    'bf16_norm_classifier': ("to_bf16, norms and classifier FP32",
                             lambda learn: learn.to_bf16(keep_fp32=['norm', 'classifier'])),
    'fp16_norm': ("to_fp16, norms kept FP32", lambda learn: learn.to_fp16(keep_fp32='norm')),
    'fp16_classifier': ("to_fp16, final classifier kept FP32", lambda learn: learn.to_fp16(keep_fp32='classifier')),
    # FP16 master-weight storage
    'fp16_storage_plain': ("fp16 storage, classic momentum in fp16, no masters", _plain_storage),
    'fp16_storage_rn': ("fp16 storage, modified rule, round to nearest",
                        lambda learn: learn.to_fp16(half_storage=True, stochastic_rounding=False)),
    'fp16_storage': ("fp16 storage, modified rule, stochastic rounding",
                     lambda learn: learn.to_fp16(half_storage=True)),
}
DEFAULT_MODES = ('fp32', 'to_fp16', 'to_bf16', 'native')

def set_mode(learn:Learner, mode) -> Learner:
    "Put `learn` in the precision `mode` (a name of `MODES`, or a function of the learner)."
    if callable(mode): return mode(learn) or learn
    if mode not in MODES: raise ValueError(f"unknown mode {mode!r}: expected one of {', '.join(MODES)}")
    return MODES[mode][1](learn) or learn

def digits_data(bs:int=64, device='cpu', flat:bool=False, n_valid:int=600, center:bool=False) -> DataLoaders:
    "scikit-learn's 8x8 digits scaled to [0,1] (1797 images, no download); the split is fixed, the shuffling seeded."
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.
    if flat: x = x.flatten(1)
    if center: x = x - x.mean(dim=tuple(range(1, x.dim())), keepdim=True)
    y = torch.tensor(d.target)
    idx = torch.randperm(len(y), generator=torch.Generator().manual_seed(42))
    tr, va = idx[n_valid:], idx[:n_valid]
    return DataLoaders.from_dsets(list(zip(x[tr], y[tr])), list(zip(x[va], y[va])), bs=bs, device=torch.device(device),
                                  num_workers=0)

def digits_cnn(c:int=8) -> nn.Module:
    "A tiny CNN for 8x8 images: two conv + BatchNorm blocks and a linear head."
    return nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
                         nn.Conv2d(c, 2*c, 3, stride=2, padding=1), nn.BatchNorm2d(2*c), nn.ReLU(),
                         nn.Flatten(), nn.Linear(2*c*16, 10))

def digits_linear(offset:float=0.) -> nn.Module:
    "Logistic regression on the 64 pixels; every weight shifted by `offset` (the softmax ignores a common shift)."
    lin = nn.Linear(64, 10)
    with torch.no_grad(): lin.weight.normal_(0, 0.01).add_(offset); lin.bias.zero_()
    return lin

class DigitsTransformer(nn.Module):
    """An 8x8 image as 8 tokens of 8 pixels: linear embedding + position, one pre-norm encoder layer, mean, LayerNorm,
    head."""
    def __init__(self, d:int=32, heads:int=4):
        super().__init__()
        self.embed, self.pos = nn.Linear(8, d), nn.Parameter(torch.zeros(8, d))
        self.encoder = nn.TransformerEncoderLayer(d, heads, 2*d, dropout=0., batch_first=True, norm_first=True)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 10)
    def forward(self, x): return self.head(self.norm(self.encoder(self.embed(x.flatten(1, 2)) + self.pos).mean(1)))

def digits_transformer() -> nn.Module: return DigitsTransformer()

def offset_cnn(offset:float=4096.) -> nn.Module:
    """The digits CNN whose classifier adds `offset` to every logit (its bias): the softmax ignores a common shift,
    but 16-bit logits near 4096 are spaced by 4 (fp16) or 32 (bf16), so a 16-bit classifier rounds class differences
    away."""
    m = digits_cnn()
    with torch.no_grad(): m[-1].bias.add_(offset)
    return m

class ScaledLoss:
    "Cross-entropy times `factor`: a loss (term) whose gradients live far below 1."
    def __init__(self, factor:float): self.factor, self.ce = factor, CrossEntropyLossFlat()
    def __call__(self, pred, targ): return self.ce(pred, targ) * self.factor
    def activation(self, x): return self.ce.activation(x)
    def decodes(self, x): return self.ce.decodes(x)

@dataclass
class Task:
    "How to build and train a learner for one experiment."
    name:str
    model:callable
    epochs:int=8
    lr:float=1e-2
    bs:int=64
    opt_func:callable=Adam
    loss_func:callable=None
    one_cycle:bool=True
    flat:bool=False
    center:bool=False
    note:str=''

TASKS = {
    'digits': Task('digits', digits_cnn, note="tiny CNN, Adam, one-cycle"),
    # (1) every weight sits near 24, where fp16's spacing is 2^-6: Adam's steps (about lr) are < half of it
    # inputs are centred per image, so the shared offset of 24 adds exactly nothing to the logits
    'vanishing': Task('vanishing', partial(digits_linear, 24.), epochs=6, lr=5e-3, bs=16, flat=True, center=True,
                      one_cycle=False, note="logistic regression whose weights sit near 24 (fp16 spacing 2^-6), "
                                            "Adam lr 5e-3 (< half the spacing)"),
    # (2) a loss weighted by 2^-20: its gradients are below fp16's smallest subnormal (2^-24); SGD's lr makes up for it
    'underflow': Task('underflow', digits_cnn, lr=0.1 * 2**20, opt_func=partial(SGD, mom=0.9),
                      loss_func=ScaledLoss(2.**-20), note="tiny CNN, loss x 2^-20, SGD lr 0.1 x 2^20"),
    # the precision policy on a small transformer, and a classifier that 16-bit rounds
    'transformer': Task('transformer', digits_transformer, epochs=6, lr=1e-2,
                        note="8 tokens of 8 pixels, 1 pre-norm encoder layer (d=32), Adam, one-cycle"),
    'logit_offset': Task('logit_offset', offset_cnn, epochs=6,
                         note="tiny CNN whose logits all carry +4096 (16-bit spacing 4 in fp16, 32 in bf16), Adam, "
                              "one-cycle"),
    # FP16 storage: the loss x 2^-22 puts raw gradients below fp16's subnormals once unscaled; SGD's lr x 2^22 (< 65504)
    # makes up for it
    'storage': Task('storage', digits_cnn, epochs=4, lr=0.015 * 2**22, opt_func=partial(SGD, mom=0.9), one_cycle=False,
                    loss_func=ScaledLoss(2.**-22), note="tiny CNN, loss x 2^-22, SGD momentum 0.9, lr 0.015 x 2^22"),
}

def make_learner(task='digits', mode='fp32', seed:int=0, device='cpu') -> Learner:
    "A fresh learner for `task` in precision `mode`: data order and initial weights depend only on `seed`."
    task = TASKS[task] if isinstance(task, str) else task
    set_seed(seed, reproducible=True)
    dls = digits_data(task.bs, device, flat=task.flat, center=task.center)
    model = task.model().to(device)
    learn = Learner(dls, model, loss_func=task.loss_func or CrossEntropyLossFlat(), opt_func=task.opt_func,
                    metrics=accuracy, lr=task.lr)
    learn.task = task
    return set_mode(learn, mode)

@dataclass
class Run:
    "What one training run gave."
    mode:str
    seed:int
    accuracy:float # final validation accuracy
    secs_per_epoch:float
    loss_scale:float|None # final loss scale (None: no scaling)
    skipped:int # optimizer steps skipped for inf/NaN grads
    scales:list=field(default_factory=list) # loss scale at each step
    skips:list=field(default_factory=list) # whether each step was skipped
    valid_acc:list=field(default_factory=list) # validation accuracy after each epoch
    weights_moved:float=float('nan') # fraction of the weights that changed during training
    error:str|None=None # why training stopped early, if it did
    finite:bool=True # whether every weight is finite after training

def _scaling_cb(learn):
    return next((cb for cb in learn.cbs if hasattr(cb, 'scales') and hasattr(cb, 'loss_scale')), None)

def train(learn:Learner, epochs:int=None, lr:float=None) -> Run:
    "Fit `learn` quietly and collect a `Run` (an exception such as `LossScaleError` is recorded, not raised)."
    task = getattr(learn, 'task', TASKS['digits'])
    epochs, lr = epochs or task.epochs, lr or task.lr
    before = [p.detach().float().clone() for p in learn.model.parameters()]
    cb, err = _scaling_cb(learn), None
    t0 = time.perf_counter()
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore', RuntimeWarning)  # fp16 on a CPU: slow but correct, said once by main()
        try:
            if task.one_cycle: learn.fit_one_cycle(epochs, lr)
            else: learn.fit(epochs, lr)
        except Exception as e: err = f"{type(e).__name__}: {e}"
    secs = (time.perf_counter() - t0) / epochs
    if err is not None:
        for c in learn.precision_callbacks():
            if hasattr(c, 'restore'): c.restore()
    vals = [v[2] for v in learn.recorder.values] if err is None else []
    after = [p.detach().float() for p in learn.model.parameters()]
    dt = next((c.dtype for c in learn.cbs if isinstance(c, ModelToHalf)), None)  # compare at the trained resolution
    changed = [(a.to(dt) != b.to(dt)) if dt else (a != b) for a, b in zip(after, before)]
    moved = sum(int(c.sum()) for c in changed) / max(1, sum(b.numel() for b in before))
    acc = vals[-1] if vals else float('nan')
    return Run('', 0, float(acc), secs, float(cb.loss_scale) if cb is not None else None,
               int(sum(cb.skips)) if cb else 0, list(cb.scales) if cb else [], list(cb.skips) if cb else [],
               [float(v) for v in vals], moved, err,
               all(bool(torch.isfinite(a).all()) for a in after))

def run_mode(mode, seed:int=0, task='digits', device='cpu', epochs:int=None, label:str=None) -> Run:
    "Train `task` in `mode` with `seed`: a `Run`."
    learn = make_learner(task, mode, seed, device)
    run = train(learn, epochs)
    run.mode, run.seed = label or (mode if isinstance(mode, str) else getattr(mode, '__name__', 'custom')), seed
    return run

def run_many(mode, seeds=(0,), task='digits', device='cpu', epochs:int=None, label:str=None) -> list:
    "`run_mode` for each of `seeds`."
    return [run_mode(mode, s, task, device, epochs, label) for s in seeds]

def mean_acc(runs) -> float:
    "Mean final accuracy of `runs`, in percent."
    return 100 * sum(r.accuracy for r in runs) / len(runs)

# The experiments of `python -m fp16cb --experiments`: (title, task, [(label, mode, role)]); role is 'fp32' (baseline),
# 'breaks' (the failure shows) or 'recipe' (must stay within `TOLERANCE` accuracy points of the baseline)
TOLERANCE = 0.5
EXPERIMENTS = [
    ("NVCaffe slides' table (FP32 / mixed / FP16 / FP16 + loss scale) at small scale", 'digits',
     [('FP32', 'fp32', 'fp32'), ('mixed (to_fp16)', 'to_fp16', 'recipe'), ('pure FP16', 'fp16', 'other'),
      ('FP16 + loss scale 1000', 'fp16_scaled', 'other'), ('bf16 (to_bf16)', 'to_bf16', 'recipe'),
      ('native AMP fp16', 'native', 'recipe')]),
    ("Failure 1: vanishing updates without FP32 masters", 'vanishing',
     [('FP32', 'fp32', 'fp32'), ('pure FP16 (no masters)', 'fp16', 'breaks'),
      ('mixed (FP32 masters)', 'to_fp16', 'recipe')]),
    ("Failure 2: gradient underflow without loss scaling", 'underflow',
     [('FP32', 'fp32', 'fp32'), ('mixed, loss scale 1', 'to_fp16_unscaled', 'breaks'),
      ('mixed, dynamic loss scale', 'to_fp16', 'recipe')]),
    ("Failure 3: overflow, handled by dynamic scaling", 'digits',
     [('FP32', 'fp32', 'fp32'), ('FP16, scale 2^24, unchecked', 'fp16_unchecked', 'breaks'),
      ('mixed, dynamic, scale_wait=20', 'to_fp16_wait20', 'recipe')]),
    ("Precision policy: opt-ins on a small transformer (speed and accuracy)", 'transformer',
     [('FP32', 'fp32', 'fp32'), ('to_bf16 (BatchNorm only)', 'to_bf16', 'recipe'),
      ('+ norms FP32', 'bf16_norm', 'recipe'), ('+ classifier FP32', 'bf16_classifier', 'recipe'),
      ('+ norms + classifier', 'bf16_norm_classifier', 'recipe')]),
    ("Precision policy: keeping the classifier FP32 is what makes fp16 match FP32", 'logit_offset',
     [('FP32', 'fp32', 'fp32'), ('to_fp16', 'to_fp16', 'breaks'),
      ('to_fp16, classifier FP32', 'fp16_classifier', 'recipe'), ('to_bf16', 'to_bf16', 'breaks'),
      ('to_bf16, classifier FP32', 'bf16_classifier', 'recipe')]),
    ("FP16 master-weight storage (NVIDIA's NVCaffe slides): plain vs modified update", 'storage',
     [('FP32 masters (to_fp16)', 'to_fp16', 'fp32'), ('fp16 storage, plain update', 'fp16_storage_plain', 'breaks'),
      ('fp16 storage, modified, nearest', 'fp16_storage_rn', 'recipe'),
      ('fp16 storage, modified, stochastic', 'fp16_storage', 'recipe')]),
    ("FP16 storage: updates under half an fp16 spacing need stochastic rounding", 'vanishing',
     [('FP32 masters (to_fp16)', 'to_fp16', 'fp32'), ('fp16 storage, nearest', 'fp16_storage_rn', 'breaks'),
      ('fp16 storage, stochastic', 'fp16_storage', 'recipe')]),
]

def run_experiments(seeds=(0, 1, 2), device='cpu', epochs:int=None, log=print) -> list:
    "Run `EXPERIMENTS`: `[(title, task, [(label, role, runs)])]`; a failing ('breaks') run uses only the first seed."
    res, cache = [], {}
    for title, task, rows in EXPERIMENTS:
        out = []
        for label, mode, role in rows:
            key = (task, mode)
            if key not in cache:
                cache[key] = run_many(mode, seeds[:1] if role == 'breaks' else seeds, task, device, epochs, label)
            runs = cache[key]
            for r in runs: r.mode = label
            out.append((label, role, runs))
        res.append((title, task, out))
        if log: log(f"  ... {title}: done")
    return res
