"""8-bit optimizer state (`state_dtype='8bit'`) against FP32 and bf16 state: what it does to the trained model and to
the step's time. `python -m bench.state8_quality [--json bench/results_state8_quality.json]`.

Quality (`--parts quality`): each task trained from the same seeds in every mode (fastai's `Adam`, one-cycle, the same
hyperparameters), the trained weights then evaluated in FP32 on a held-out set (the model a fit gives back is FP32):

- `gpt2`: a small GPT-2 (Hugging Face `transformers`' `GPT2LMHeadModel`, its head tied to the token embedding: 2
  blocks, d=128, byte-level: vocab 256, context 64), next-byte prediction on the text of fastai's own
  `fastai/callback/*.py` (shipped with fastai: no download), the last 10% of the bytes held out. Skipped, with a
  message, where `transformers` is not installed (it is not a dependency of fp16cb).
- `digits`: a CNN on scikit-learn's 8x8 digits (shipped), 2 conv + BatchNorm blocks of 32 and 64 channels and a linear
  head (its conv and head weights of 4096 elements or more: their moving averages 8-bit), 360 images held out.
- `finetune`: timm's `resnet10t` at a quarter width (channels 16 to 128, one input channel: 0.32M params) pretrained
  in FP32 on the digits 0 to 4 of the training images, upscaled to 32x32, then fine-tuned in each mode on all ten
  classes with fastai's `fine_tune` (the body frozen for one epoch, then all of it, the body at a third of the head's
  learning rate) from those weights and a new head, the 360 held-out images never seen by either.

Reported per mode: the held-out loss (and accuracy) averaged over the seeds, against FP32's, and the share of the
optimizer's state elements held in 8 bits between steps (read from the optimizer's state during the fit).

Speed (`--parts speed`): the step's cost on this machine, the modes side by side in one process (one learner each,
same model and batches), interleaved round-robin (the order reversed every other round) after an untimed warm-up (in
which the 8-bit quantizer is compiled), process CPU time (`bench.measure`'s clock), one thread by default. Per mode:
the median batch (first `before_batch` to last `after_batch`) and the median optimizer step (first `before_step` to
last `after_step`: the FP32 grads, the state widened, the update, the state narrowed again, the weights copied back),
both over the steps after each fit's first (the first step of a fit makes the state 8-bit or 16-bit from FP32: its
median is reported apart), with ratios against `to_bf16()`'s FP32 state and against plain FP32.

Targets (reported, never asserted): each 8-bit mode's held-out loss within 5% of FP32's on `gpt2` and `digits`; the
fine-tune's accuracy within 0.3 points of FP32's (mean over seeds; 1 image of 360 is 0.28 points)."""
from __future__ import annotations
import argparse, json, platform, statistics, sys, time, warnings
from functools import partial
from pathlib import Path
import torch
from torch import nn
import torch.nn.functional as F

import fp16cb  # noqa: F401 (patches Learner.to_fp16 & co.)
from fastai.basics import Learner, DataLoaders, Adam, CrossEntropyLossFlat, Callback, accuracy, set_seed, params
from fastai.callback.schedule import fit_one_cycle  # noqa: F401 (patches Learner.fit_one_cycle, fine_tune)
from bench.measure import cpu_flags, set_clock, clock, sync
from bench.workloads import make_data, WORKLOADS, CPU_SCALE

__all__ = ['MODES', 'QUALITY_MODES', 'SPEED_MODES', 'TASKS', 'SPEED_WORKLOADS', 'run_quality', 'run_speed', 'main']

class Fused16(Callback):
    """The compiled Adam steps (`fp16cb.storage.fused16`: bf16 state's, `half_storage`'s) on (`on=True`) or off during
    this learner's fits, whatever their default for the model's device is (on for a CPU, off elsewhere until measured
    there): the two side by side in one run (`bf16-state16-usual`/`-compiled`, `bf16-half-usual`/`-compiled`)."""
    order = -100
    def __init__(self, on:bool): self.on, self.was = on, None
    def before_fit(self):
        from fp16cb.storage import fused16
        self.kind = next(self.learn.model.parameters()).device.type
        self.was, fused16.COMPILE[self.kind] = fused16.COMPILE.get(self.kind), self.on
    def after_fit(self):
        from fp16cb.storage import fused16
        fused16.COMPILE[self.kind] = self.was

MODES = {'fp32': lambda l: l,
         'bf16': lambda l: l.to_bf16(),
         'bf16-state16': lambda l: l.to_bf16(state_dtype=torch.bfloat16),
         'bf16-state16-usual': lambda l: l.to_bf16(state_dtype=torch.bfloat16).add_cb(Fused16(False)),
         'bf16-state16-compiled': lambda l: l.to_bf16(state_dtype=torch.bfloat16).add_cb(Fused16(True)),
         'bf16-state8': lambda l: l.to_bf16(state_dtype='8bit'),
         'fp16-state8': lambda l: l.to_fp16(state_dtype='8bit'),
         'bf16-half': lambda l: l.to_bf16(half_storage=True),
         'bf16-half-usual': lambda l: l.to_bf16(half_storage=True).add_cb(Fused16(False)),
         'bf16-half-compiled': lambda l: l.to_bf16(half_storage=True).add_cb(Fused16(True)),
         'bf16-half-state8': lambda l: l.to_bf16(half_storage=True, state_dtype='8bit'),
         'bf16-half-sib-state8': lambda l: l.to_bf16(half_storage=True, step_in_backward=True, state_dtype='8bit')}
CALLS = {'fp32': 'FP32 (no mixed precision)', 'bf16': 'to_bf16() (FP32 state)',
         'bf16-state16': 'to_bf16(state_dtype=torch.bfloat16)', 'bf16-state8': "to_bf16(state_dtype='8bit')",
         'bf16-state16-usual': 'to_bf16(state_dtype=torch.bfloat16), the compiled Adam step off',
         'bf16-state16-compiled': 'to_bf16(state_dtype=torch.bfloat16), the compiled Adam step on',
         'fp16-state8': "to_fp16(state_dtype='8bit')",
         'bf16-half': "to_bf16(half_storage=True)",
         'bf16-half-usual': 'to_bf16(half_storage=True), the compiled Adam step off',
         'bf16-half-compiled': 'to_bf16(half_storage=True), the compiled Adam step on',
         'bf16-half-state8': "to_bf16(half_storage=True, state_dtype='8bit')",
         'bf16-half-sib-state8': "to_bf16(half_storage=True, step_in_backward=True, state_dtype='8bit')"}
STATE8 = ('bf16-state8', 'fp16-state8', 'bf16-half-state8', 'bf16-half-sib-state8')

# ---- the peers (`--peers`): other libraries' 8-bit AdamW stepping the same model under fastai, with `to_bf16()` (the
# model's FP32 params, bf16 compute) and fastai Adam's hyperparameters (betas 0.9/0.99, eps 1e-5, decoupled decay 0.01)
def _torchao_adamw8bit():
    """torchao's `AdamW8bit`, under fastai's `OptimWrapper`. Its friction: fastai sets the learning rate as a float
    (`set_hyper`), and torchao keeps it as a tensor and refuses a float ('lr was changed to a non-Tensor object'): each
    step gives it back a tensor first."""
    from torchao.optim import AdamW8bit
    class AdamW8bitUnderFastai(AdamW8bit):
        def step(self, closure=None):
            for g in self.param_groups:
                if not isinstance(g['lr'], torch.Tensor): g['lr'] = torch.tensor(g['lr'], dtype=torch.float32)
            return super().step(closure)
    return AdamW8bitUnderFastai

def _bnb_adamw8bit():
    "bitsandbytes' `AdamW8bit` (it runs on a CPU since 0.45), under fastai's `OptimWrapper` as it is: no friction."
    import bitsandbytes as bnb
    return bnb.optim.AdamW8bit

PEERS = {'torchao-8bit': (_torchao_adamw8bit, "torchao's AdamW8bit in OptimWrapper, with to_bf16()"),
         'bnb-8bit': (_bnb_adamw8bit, "bitsandbytes' AdamW8bit in OptimWrapper, with to_bf16()")}

def _peer(name:str):
    "The learner transform of peer `name`: its optimizer in fastai's `OptimWrapper`, then `to_bf16()`."
    from fastai.optimizer import OptimWrapper
    cls = PEERS[name][0]()
    def mode(learn):
        learn.opt_func, learn.opt = partial(OptimWrapper, opt=cls, betas=(0.9, 0.99), eps=1e-5, weight_decay=0.01), None
        return learn.to_bf16()
    return mode

def available_peers() -> tuple:
    "`(names of the peers installed here, {name: why not} for the others)`."
    ok, missing = [], {}
    for name, (load, _) in PEERS.items():
        try: load(); ok.append(name)
        except ImportError as e: missing[name] = f"not installed ({e})"
    return ok, missing
QUALITY_MODES = ('fp32', 'bf16', 'bf16-state16') + STATE8
SPEED_MODES = ('fp32', 'bf16', 'bf16-state16', 'bf16-state8', 'bf16-half')
LOSS_TOL, ACC_TOL = 0.05, 0.3  # the targets: held-out loss within 5% of FP32's; the fine-tune's accuracy, 0.3 points

# ------------------------------------------------------------------------------------------------------ the data
N_VALID = 360  # held-out digits (of 1797): the same images for every task and seed

def _digits(size:int=8) -> tuple:
    "scikit-learn's digits in [0, 1] (upscaled bilinearly to `size`), labels, and the fixed (train, valid) indices."
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.
    if size != 8: x = F.interpolate(x, size=(size, size), mode='bilinear', align_corners=False)
    y = torch.tensor(d.target)
    idx = torch.randperm(len(y), generator=torch.Generator().manual_seed(42))
    return x, y, idx[N_VALID:], idx[:N_VALID]

def _dls(x, y, tr, va, bs:int) -> DataLoaders:
    return DataLoaders.from_dsets(list(zip(x[tr], y[tr])), list(zip(x[va], y[va])), bs=bs, num_workers=0)

def _text() -> tuple:
    "The bytes of fastai's `callback/*.py` (sorted by name, joined), and where they come from."
    import fastai
    root = Path(fastai.__file__).parent
    files = sorted((root/'callback').glob('*.py'))
    data = b''.join(f.read_bytes() for f in files)
    return torch.tensor(list(data), dtype=torch.long), f"fastai {fastai.__version__}'s fastai/callback/*.py"

CTX = 64  # the GPT-2's context: tokens per sequence

def _text_dls(bs:int, n_train:int) -> DataLoaders:
    """Byte windows of `CTX` + 1: `n_train` from the first 90% of the text at random offsets (fixed), the held-out ones
    from the last 10%, side by side, all of it."""
    t, _ = _text()
    cut = int(len(t) * .9)
    train, valid = t[:cut], t[cut:]
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, len(train) - CTX - 1, (n_train,), generator=g)
    tr = [(train[s:s + CTX], train[s + 1:s + CTX + 1]) for s in starts.tolist()]
    va = [(valid[s:s + CTX], valid[s + 1:s + CTX + 1]) for s in range(0, len(valid) - CTX - 1, CTX)]
    return DataLoaders.from_dsets(tr, va, bs=bs, num_workers=0)

# ----------------------------------------------------------------------------------------------------- the models
def has_transformers() -> bool:
    try: import transformers  # noqa: F401
    except ImportError: return False
    return True

class GPT2LM(nn.Module):
    "Hugging Face's `GPT2LMHeadModel` (its head tied to the token embedding) returning the logits alone."
    def __init__(self, d:int=128, n_layer:int=2, n_head:int=4, vocab:int=256, ctx:int=CTX):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(vocab_size=vocab, n_positions=ctx, n_embd=d, n_layer=n_layer, n_head=n_head,
                         resid_pdrop=0., embd_pdrop=0., attn_pdrop=0., tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=None)
        self.gpt = GPT2LMHeadModel(cfg)
        assert self.gpt.lm_head.weight is self.gpt.transformer.wte.weight, "the head is not tied to the embedding"
    def forward(self, x): return self.gpt(input_ids=x).logits

def digits_cnn(c:int=32) -> nn.Module:
    "Two conv + BatchNorm blocks (c and 2c channels) and a linear head, for 8x8 digits."
    return nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
                         nn.Conv2d(c, 2*c, 3, stride=2, padding=1), nn.BatchNorm2d(2*c), nn.ReLU(),
                         nn.Flatten(), nn.Linear(2*c*16, 10))

def resnet(n_out:int) -> nn.Module:
    """timm's `resnet10t` (a BasicBlock per stage, a deep tiered stem, average-pool shortcuts) at a quarter width
    (channels 16 to 128, stem 16), one input channel, no pretrained weights: 0.32M params."""
    import timm
    return timm.create_model('resnet10t', pretrained=False, num_classes=n_out, in_chans=1, channels=(16, 32, 64, 128),
                             stem_width=16)

def _resnet_splitter(m): return [params(nn.Sequential(*[c for n, c in m.named_children() if n != 'fc'])), params(m.fc)]

# -------------------------------------------------------------------------------------------------- measurement
class State8Share(Callback):
    """The share of the optimizer's state elements held as 8-bit codes (uint8) between steps, read at each training
    batch's start after the first: the largest seen."""
    order = -10**6
    share = 0.
    def before_batch(self):
        if not self.training or (self.epoch == 0 and self.iter == 0): return
        n8 = n = 0
        for s in getattr(self.learn.opt, 'state', {}).values():
            for v in (s.values() if isinstance(s, dict) else ()):
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    n += v.numel(); n8 += v.numel() * (v.dtype == torch.uint8)
        if n: self.share = max(self.share, n8 / n)

@torch.no_grad()
def evaluate_fp32(model:nn.Module, dl, classes:bool) -> tuple:
    "`(loss, accuracy or None)` of the FP32 `model` on every batch of `dl` (mean over items)."
    assert all(p.dtype == torch.float32 for p in model.parameters()), "the model is not FP32 after the fit"
    model.eval()
    tot = hits = n = 0
    for xb, yb in dl:
        out = model(xb).float()
        tot += float(F.cross_entropy(out.flatten(0, -2), yb.flatten(), reduction='sum'))
        hits += int((out.argmax(-1) == yb).sum()); n += yb.numel()
    return tot / n, (hits / n if classes else None)

def _fit_quietly(learn, fit):
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')  # fp16 on a CPU (emulated, slow): known, and not what is measured
        fit()

# ------------------------------------------------------------------------------------------------------ quality
def _gpt2_run(mode:str, seed:int, epochs:int=2, n_train:int=1920, lr:float=3e-3) -> dict:
    set_seed(seed, reproducible=True)
    dls = _text_dls(16, n_train)
    set_seed(seed, reproducible=True)
    learn = MODES[mode](Learner(dls, GPT2LM(), loss_func=CrossEntropyLossFlat(), opt_func=Adam))
    share = State8Share()
    _fit_quietly(learn, lambda: learn.fit_one_cycle(epochs, lr, cbs=share))
    loss, _ = evaluate_fp32(learn.model, dls.valid, False)
    return {'loss': loss, 'mode_valid_loss': float(learn.recorder.values[-1][1]), 'state8_share': share.share,
            'steps': epochs * len(dls.train)}

def _digits_run(mode:str, seed:int, epochs:int=4, lr:float=1e-2) -> dict:
    x, y, tr, va = _digits()
    set_seed(seed, reproducible=True)
    dls = _dls(x, y, tr, va, 64)
    learn = MODES[mode](Learner(dls, digits_cnn(), loss_func=CrossEntropyLossFlat(), opt_func=Adam, metrics=accuracy))
    share = State8Share()
    _fit_quietly(learn, lambda: learn.fit_one_cycle(epochs, lr, cbs=share))
    loss, acc = evaluate_fp32(learn.model, dls.valid, True)
    return {'loss': loss, 'acc': acc, 'mode_valid_loss': float(learn.recorder.values[-1][1]),
            'state8_share': share.share, 'steps': epochs * len(dls.train)}

_PRETRAINED = {}

def pretrained(epochs:int=8, lr:float=1e-2) -> dict:
    """The FP32 weights of `resnet` trained on the digits 0 to 4 of the training images (32x32), made once a process,
    with the held-out accuracy on the digits 0 to 4 of the held-out images."""
    if 'sd' not in _PRETRAINED:
        x, y, tr, va = _digits(32)
        tr, va = tr[y[tr] < 5], va[y[va] < 5]
        set_seed(1000, reproducible=True)
        dls = _dls(x, y, tr, va, 64)
        learn = Learner(dls, resnet(5), loss_func=CrossEntropyLossFlat(), opt_func=Adam, metrics=accuracy)
        _fit_quietly(learn, lambda: learn.fit_one_cycle(epochs, lr))
        _PRETRAINED['sd'] = {k: v.clone() for k, v in learn.model.state_dict().items()}
        _PRETRAINED['info'] = {'task': 'digits 0-4 of the training images, 32x32, FP32', 'epochs': epochs, 'lr': lr,
                               'n_train': len(tr), 'valid_acc_0_4': evaluate_fp32(learn.model, dls.valid, True)[1]}
    return _PRETRAINED

def _finetune_run(mode:str, seed:int, epochs:int=4, lr:float=1e-2, lr_mult:float=3) -> dict:
    pre = pretrained()
    x, y, tr, va = _digits(32)
    set_seed(seed, reproducible=True)
    model = resnet(10)
    body = {k: v for k, v in pre['sd'].items() if not k.startswith('fc.')}
    missing = model.load_state_dict(body, strict=False).missing_keys
    assert sorted(missing) == ['fc.bias', 'fc.weight'], missing
    dls = _dls(x, y, tr, va, 64)
    learn = MODES[mode](Learner(dls, model, loss_func=CrossEntropyLossFlat(), opt_func=Adam, metrics=accuracy,
                                splitter=_resnet_splitter))
    share = State8Share()
    _fit_quietly(learn, lambda: learn.fine_tune(epochs, lr, freeze_epochs=1, lr_mult=lr_mult, cbs=share))
    loss, acc = evaluate_fp32(learn.model, dls.valid, True)
    return {'loss': loss, 'acc': acc, 'mode_valid_loss': float(learn.recorder.values[-1][1]),
            'state8_share': share.share, 'steps': (epochs + 1) * len(dls.train)}

TASKS = {'gpt2': (_gpt2_run, 2, "GPT-2 (transformers' GPT2LMHeadModel, tied head, 2 blocks, d=128, byte vocab 256, "
                                "context 64), next byte of fastai's own callback/*.py, 2 epochs of 120 batches of 16, "
                                "one-cycle lr 3e-3"),
         'digits': (_digits_run, 5, "digits CNN (conv 32, conv 64 + BatchNorm, linear head), 8x8 digits, 4 epochs "
                                    "of 23 batches of 64, one-cycle lr 1e-2"),
         'finetune': (_finetune_run, 8, "timm's resnet10t at a quarter width (0.32M params), pretrained in FP32 on "
                                        "the digits 0-4 (8 epochs, one-cycle lr 1e-2), fine-tuned on the 10 digits "
                                        "(32x32) with fastai's fine_tune(4, 1e-2, freeze_epochs=1, lr_mult=3): the "
                                        "body frozen for one epoch, then 4 epochs of all of it")}

def run_quality(tasks=None, modes=QUALITY_MODES, seeds:int=None, verbose:bool=True) -> dict:
    "`{task: {'desc', 'seeds', 'runs': {mode: [per seed]}, 'summary': {mode: ...}}}`; a task that cannot run: 'skipped'"
    res = {}
    for task in tasks or TASKS:
        fn, n_seeds, desc = TASKS[task]
        if task == 'gpt2' and not has_transformers():
            msg = "transformers is not installed (`pip install transformers`): the GPT-2 task is skipped"
            print(msg, file=sys.stderr)
            res[task] = {'skipped': msg}
            continue
        n = seeds or n_seeds
        out = res[task] = {'desc': desc, 'seeds': list(range(n)), 'runs': {}, 'secs': {}}
        if task == 'gpt2': out['text'] = _text()[1] + f", {len(_text()[0])} bytes, the last 10% held out"
        if task == 'finetune': out['pretrained'] = pretrained()['info']
        for mode in modes:
            t0 = time.perf_counter()
            out['runs'][mode] = [fn(mode, s) for s in range(n)]
            out['secs'][mode] = time.perf_counter() - t0
            if verbose:
                r = out['runs'][mode]
                print(f"  [{task}] {mode:22s} loss {statistics.mean(x['loss'] for x in r):.4f}"
                      + (f" acc {100 * statistics.mean(x['acc'] for x in r):.2f}" if 'acc' in r[0] else '')
                      + f"  8-bit share {r[0]['state8_share']:.3f}  ({out['secs'][mode]:.0f} s)", file=sys.stderr)
        out['summary'] = _summary(out['runs'])
    return res

def _summary(runs:dict) -> dict:
    "Per mode: mean loss (and accuracy, in points), their difference from FP32's, per seed and averaged."
    ref = runs['fp32']
    res = {}
    for mode, rs in runs.items():
        rel = [r['loss'] / f['loss'] - 1 for r, f in zip(rs, ref)]
        s = {'loss': statistics.mean(r['loss'] for r in rs), 'state8_share': min(r['state8_share'] for r in rs),
             'loss_vs_fp32': statistics.mean(r['loss'] for r in rs) / statistics.mean(f['loss'] for f in ref) - 1,
             'loss_vs_fp32_per_seed': rel}
        if 'acc' in rs[0]:
            d = [100 * (r['acc'] - f['acc']) for r, f in zip(rs, ref)]
            s.update(acc=100 * statistics.mean(r['acc'] for r in rs), acc_vs_fp32=statistics.mean(d),
                     acc_vs_fp32_per_seed=d, acc_vs_fp32_sem=statistics.stdev(d) / len(d)**.5 if len(d) > 1 else None)
        res[mode] = s
    return res

# -------------------------------------------------------------------------------------------------------- speed
class _Clock(Callback):
    "The step's clock: `first` starts the batch and the optimizer step, the last callback ends them (on a GPU, synced)."
    def __init__(self, rec:dict, first:bool, device='cpu'):
        self.rec, self.first, self.device = rec, first, device
        self.order = -10**6 if first else 10**6
    def _now(self) -> float:
        sync(self.device)
        return clock()
    def before_batch(self):
        if self.first and self.training: self.rec['t0'] = self._now()
    def before_step(self):
        if self.first and self.training: self.rec['ts'] = self._now()
    def after_step(self):
        if not self.first and self.training: self.rec['step_now'] = self._now() - self.rec['ts']
    def after_batch(self):
        if self.first or not self.training: return
        self.rec['batch'].append(self._now() - self.rec['t0'])
        self.rec['step'].append(self.rec.pop('step_now', None))
        self.rec['first'].append(self.iter == 0)

class _Batches:
    "A fixed list of batches, iterated by fastai like a `DataLoader` (the same data in every mode, no collation)."
    def __init__(self, batches): self.batches = batches
    def __iter__(self): return iter(self.batches)
    def __len__(self): return len(self.batches)
    def to(self, device): return self

def _gpt2_speed(s, n:int) -> tuple:
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, 256, (n + 1, 16, CTX + 1), generator=g)
    b = [(x[:, :-1], x[:, 1:]) for x in t]
    return GPT2LM(), b[:-1], b[-1]

def _bench_speed(name:str):
    def make(s, n:int) -> tuple:
        torch.manual_seed(0)
        batches, valid = make_data(name, s, 'cpu', n)
        return WORKLOADS[name].model(s), batches, valid
    return make

SPEED_WORKLOADS = {
    'mlp': (_bench_speed('mlp'), CPU_SCALE['mlp'], "the benchmark's compute-bound `mlp` at its CPU scale: 4 blocks "
                                                   "LN + Linear(128, 512) + GELU + Linear(512, 128), batch 64"),
    'book': (_bench_speed('book'), CPU_SCALE['book'], "the benchmark's bookkeeping-bound `book` at its CPU scale: "
                                                      "150 Linear(116, 116), batch 8"),
    'mlp10m': (_bench_speed('mlp'), 0.5625, "the benchmark's `mlp` at 10.6M params: 4 blocks LN + Linear(576, 2304) + "
                                            "GELU + Linear(2304, 576), batch 288 (each weight a multiple of 256 "
                                            "elements: torchao quantizes it)"),
    'gpt2': (_gpt2_speed, 1., "the GPT-2 of the quality runs (transformers), batch 16 x 64 tokens")}

def run_speed(workloads=None, modes=SPEED_MODES, steps:int=5, rounds:int=5, warmup_fits:int=2,
              verbose:bool=True, device='cpu') -> dict:
    """`{workload: {mode: figures}}`: the modes interleaved over `rounds` fits of `steps` batches after `warmup_fits`,
    on `device` (a CPU: this process's CPU time; a GPU: wall time, the device synced at each reading)."""
    import copy
    device = torch.device(device)
    set_clock('cpu' if device.type == 'cpu' else 'wall')
    res = {}
    for wl in workloads or SPEED_WORKLOADS:
        make, s, desc = SPEED_WORKLOADS[wl]
        if wl == 'gpt2' and not has_transformers():
            res[wl] = {'skipped': "transformers is not installed: the GPT-2 workload is skipped"}
            continue
        init, batches, valid = make(s, steps)
        batches, valid = [tuple(t.to(device) for t in b) for b in batches], tuple(t.to(device) for t in valid)
        n = sum(p.numel() for p in init.parameters())
        learners = {}
        for mode in modes:
            dls = DataLoaders(_Batches(batches), _Batches([valid]))
            dls.device = device
            learn = (MODES[mode] if mode in MODES else _peer(mode))(Learner(dls, copy.deepcopy(init), loss_func=CrossEntropyLossFlat(), opt_func=Adam,
                                        lr=1e-3))
            learn.remove_cbs([cb for cb in learn.cbs if type(cb).__name__ == 'ProgressCallback'])
            rec = {'batch': [], 'step': [], 'first': []}
            learn.add_cbs([_Clock(rec, True, device), _Clock(rec, False, device)])
            for _ in range(warmup_fits): _fit_quietly(learn, lambda: learn.fit(1))
            for k in ('batch', 'step', 'first'): rec[k].clear()
            learners[mode] = learn, rec
        for r in range(rounds):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                learn, rec = learners[mode]
                _fit_quietly(learn, lambda: learn.fit(1))
        out = res[wl] = {'_workload': {'desc': desc, 'n_params': n, 'tensors': len(list(init.parameters())),
                                       'steps': steps, 'rounds': rounds, 'warmup_fits': warmup_fits}}
        for mode, (learn, rec) in learners.items():
            later = [i for i, f in enumerate(rec['first']) if not f]
            med = lambda key, idx: 1e3 * statistics.median(rec[key][i] for i in idx)
            first = [i for i, f in enumerate(rec['first']) if f]
            out[mode] = {'ms_batch': med('batch', later), 'ms_step': med('step', later) if mode_steps(mode) else None,
                         'ms_batch_first': med('batch', first), 'n_timed': len(later)}
            if verbose: print(f"  [{wl}] {mode:22s} batch {out[mode]['ms_batch']:8.2f} ms  step "
                              f"{out[mode]['ms_step'] or float('nan'):8.2f} ms  first batch of a fit "
                              f"{out[mode]['ms_batch_first']:8.2f} ms", file=sys.stderr)
        for mode in modes:
            f = out[mode]
            for ref in ('bf16', 'fp32'):
                if ref in out:
                    f[f'batch_vs_{ref}'] = f['ms_batch'] / out[ref]['ms_batch']
                    if f['ms_step'] and out[ref]['ms_step']: f[f'step_vs_{ref}'] = f['ms_step'] / out[ref]['ms_step']
        del learners
    return res

def mode_steps(mode:str) -> bool: return 'sib' not in mode  # stepped in the backward: no optimizer step to time

# ------------------------------------------------------------------------------------------------------ reporting
def targets(quality:dict) -> list:
    "The accuracy targets the run can check, with their value and whether they are met."
    out = []
    for task, r in quality.items():
        if 'summary' not in r: continue
        for mode in STATE8:
            s = r['summary'].get(mode)
            if s is None: continue
            if task in ('gpt2', 'digits'):
                out.append({'task': task, 'mode': mode, 'what': 'held-out loss vs FP32 (mean over seeds)',
                            'value': s['loss_vs_fp32'], 'threshold': LOSS_TOL,
                            'met': abs(s['loss_vs_fp32']) <= LOSS_TOL})
            if task == 'finetune':
                out.append({'task': task, 'mode': mode, 'what': 'held-out accuracy vs FP32, points (mean over seeds)',
                            'value': s['acc_vs_fp32'], 'threshold': ACC_TOL, 'met': abs(s['acc_vs_fp32']) <= ACC_TOL})
    return out

def format_quality(quality:dict) -> str:
    lines = []
    for task, r in quality.items():
        if 'summary' not in r:
            lines.append(f"{task}: {r['skipped']}\n"); continue
        acc = 'acc' in next(iter(r['summary'].values()))
        lines.append(f"{task}: {r['desc']}; seeds {r['seeds'][0]}-{r['seeds'][-1]}, held-out figures of the FP32 "
                     "weights after the fit, means over the seeds\n")
        head = "| mode | state in 8 bits | held-out loss | vs FP32 | worst seed vs FP32 |"
        if acc: head += " accuracy % | vs FP32, points (± s.e.) | per seed, points |"
        lines += [head, '|' + '---|' * (head.count('|') - 1)]
        for mode, s in r['summary'].items():
            worst = max(s['loss_vs_fp32_per_seed'], key=abs)
            row = (f"| `{CALLS[mode]}` | {100 * s['state8_share']:.1f}% | {s['loss']:.4f} | "
                   f"{100 * s['loss_vs_fp32']:+.1f}%"
                   f" | {100 * worst:+.1f}% |")
            if acc:
                sem = f" ± {s['acc_vs_fp32_sem']:.2f}" if s['acc_vs_fp32_sem'] is not None else ''
                row += (f" {s['acc']:.2f} | {s['acc_vs_fp32']:+.2f}{sem} | "
                        + ' '.join(f"{d:+.2f}" for d in s['acc_vs_fp32_per_seed']) + " |")
            lines.append(row)
        lines.append('')
    return '\n'.join(lines)

def format_speed(speed:dict) -> str:
    lines = []
    for wl, r in speed.items():
        if '_workload' not in r:
            lines.append(f"{wl}: {r['skipped']}\n"); continue
        w = r['_workload']
        lines.append(f"{wl}: {w['desc']}; {w['n_params'] / 1e6:.2f}M params in {w['tensors']} tensors; medians of "
                     f"{w['rounds']} rounds x {w['steps'] - 1} steps (each fit's first step apart)\n")
        lines += ["| mode | batch ms | step ms | batch vs `to_bf16()` | step vs `to_bf16()` | batch vs FP32 | "
                  "first batch of a fit, ms |", "|---|---:|---:|---:|---:|---:|---:|"]
        for mode, f in r.items():
            if mode == '_workload': continue
            fmt = lambda v, spec='.2f', suf='': '-' if v is None else f"{v:{spec}}{suf}"
            call = CALLS[mode] if mode in CALLS else PEERS[mode][1]
            lines.append(f"| `{call}` | {f['ms_batch']:.2f} | {fmt(f['ms_step'])} | "
                         f"{fmt(f.get('batch_vs_bf16'), '.2f', 'x')} | {fmt(f.get('step_vs_bf16'), '.2f', 'x')} | "
                         f"{fmt(f.get('batch_vs_fp32'), '.2f', 'x')} | {f['ms_batch_first']:.2f} |")
        lines.append('')
    return '\n'.join(lines)

def _versions() -> dict:
    import fastai, importlib.metadata as md
    res = {'torch': torch.__version__, 'fastai': fastai.__version__, 'python': platform.python_version()}
    for p in ('torchao', 'timm', 'transformers', 'scikit-learn'):
        try: res[p] = md.version(p)
        except md.PackageNotFoundError: res[p] = None
    return res

def _cpu() -> str:
    name = next((l.split(':', 1)[1].strip() for l in open('/proc/cpuinfo') if l.startswith('model name')),
                platform.processor()) if platform.system() == 'Linux' else platform.processor()
    return f"{name}, {torch.backends.cpu.get_cpu_capability()}"

def _device_name(device) -> str:
    d = torch.device(device)
    return torch.cuda.get_device_name(d) if d.type == 'cuda' else 'cpu'

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--json', default=str(Path(__file__).parent/'results_state8_quality.json'),
                   help="write the results here ('' : nowhere)")
    p.add_argument('--parts', default='quality,speed', help="quality, speed or both (comma-separated)")
    p.add_argument('--tasks', default=','.join(TASKS), help="quality tasks: " + ', '.join(TASKS))
    p.add_argument('--modes', default=','.join(QUALITY_MODES), help="quality modes: " + ', '.join(MODES))
    p.add_argument('--seeds', type=int, default=None, help="seeds per task (default: gpt2 2, digits 5, finetune 6)")
    p.add_argument('--workloads', default=','.join(SPEED_WORKLOADS),
                   help="speed workloads: " + ', '.join(SPEED_WORKLOADS))
    p.add_argument('--speed-modes', default=','.join(SPEED_MODES), help="speed modes: " + ', '.join(MODES))
    p.add_argument('--rounds', type=int, default=5, help="timed rounds (speed)")
    p.add_argument('--peers', action='store_true', help="speed: also torchao's and bitsandbytes' AdamW8bit, where "
                                                       "installed, in the same loop")
    p.add_argument('--threads', type=int, default=1, help="torch's threads")
    p.add_argument('--device', default='cpu', help="speed: where the models train (cpu, cuda)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    parts = args.parts.split(',')
    t0 = time.perf_counter()
    res = {'date': time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), 'cpu': _cpu(), 'cpu_flags': cpu_flags(),
           'threads': args.threads, **_versions(),
           'command': 'python -m bench.state8_quality ' + ' '.join(argv or sys.argv[1:])}
    print(f"CPU: {res['cpu']} ({res['cpu_flags']}); torch {res['torch']}, fastai {res['fastai']}, torchao "
          f"{res['torchao']}, timm {res['timm']}, transformers {res['transformers']}; {args.threads} thread(s)")
    if 'quality' in parts:
        q = res['quality'] = run_quality(args.tasks.split(','), tuple(args.modes.split(',')), args.seeds)
        res['targets'] = targets(q)
        print("\n" + format_quality(q))
        for t in res['targets']:
            v, tol = ((f"{100 * t['value']:+.1f}%", f"{100 * t['threshold']:g}%") if 'loss' in t['what'] else
                      (f"{t['value']:+.2f}", f"{t['threshold']:g} points"))
            print(f"target {t['task']} {t['mode']}: {t['what']} {v} (within {tol}): {'met' if t['met'] else 'NOT met'}")
    if 'speed' in parts:
        modes = tuple(args.speed_modes.split(','))
        if args.peers:
            peers, res['peers_missing'] = available_peers()
            modes += tuple(peers)
            for name, why in res['peers_missing'].items(): print(f"peer {name}: {why}")
        sp = res['speed'] = run_speed(args.workloads.split(','), modes, rounds=args.rounds, device=args.device)
        res['device'] = _device_name(args.device)
        clock_kind = 'process CPU time' if args.device == 'cpu' else f"wall time on {res['device']}, synced"
        print(f"\nThe step's cost, {clock_kind}, one process, modes interleaved:\n" + format_speed(sp))
    res['wall_s'] = time.perf_counter() - t0
    print(f"{res['wall_s']:.0f} s in all")
    if args.json:
        with open(args.json, 'w') as f: json.dump(res, f, indent=1)

if __name__ == '__main__': main()
