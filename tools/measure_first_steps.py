"""Skipped steps at the start of a fit and final accuracy, fp32 vs `to_fp16()` (its first scale calibrated from the
first step's gradients): the digits CNN, or timm's resnet10t (random init, no download) on the digits upscaled to
32x32. Usage:
`python tools/measure_first_steps.py digits|resnet10t BS EPOCHS LR SEEDS [KWARGS for to_fp16]`."""
import sys, time, warnings, torch, torch.nn.functional as F
warnings.filterwarnings('ignore')
import fp16cb
from fp16cb.demos.experiments import digits_data, digits_cnn
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from fastai.metrics import accuracy
from fastai.optimizer import Adam
from fastai.torch_core import set_seed
torch.set_num_threads(2)
class Up(torch.nn.Module):
    def __init__(s, m): super().__init__(); s.m = m
    def forward(s, x): return s.m(F.interpolate(x.expand(-1, 3, -1, -1), size=32, mode='bilinear'))
def model(name):
    if name == 'digits': return digits_cnn()
    import timm; return Up(timm.create_model('resnet10t', pretrained=False, num_classes=10))
def run(name, mode, seed, bs, epochs, lr):
    set_seed(seed, reproducible=True)
    learn = Learner(digits_data(bs), model(name), loss_func=CrossEntropyLossFlat(), opt_func=Adam, metrics=accuracy)
    if mode == 'to_fp16': learn.to_fp16(**KW)
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(epochs, lr)
    mp = getattr(learn, 'mixed_precision', None)
    skips = mp.skips if mp else []
    lead = next((i for i, s in enumerate(skips) if not s), len(skips))
    vl, acc = learn.recorder.values[-1][1], learn.recorder.values[-1][2]
    return lead, sum(skips), len(learn.recorder.lrs), (mp.scales[:3] + [mp.loss_scale]) if mp else None, vl, acc
name, bs, epochs, lr = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
seeds = [int(s) for s in sys.argv[5].split(',')]
KW = eval(sys.argv[6]) if len(sys.argv) > 6 else {}
for mode in ('fp32', 'to_fp16'):
    rs = [run(name, mode, s, bs, epochs, lr) for s in seeds]
    for s, r in zip(seeds, rs): print(f"{name} {mode} seed={s} skipped_at_start={r[0]} skipped={r[1]}/{r[2]} scales(first3,final)={r[3]} valid_loss={r[4]:.4f} acc={r[5]:.4f}")
    print(f"{name} {mode} MEAN acc={sum(r[5] for r in rs)/len(rs):.4f} valid_loss={sum(r[4] for r in rs)/len(rs):.4f} skipped={sum(r[1] for r in rs)/len(rs):.2f}")
