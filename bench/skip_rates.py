"""How often a healthy `to_fp16()` fit skips a step once its loss scale is calibrated: the data behind the threshold
of `fp16cb.scaling.record.SkipRate` (a fit that skips more than any healthy one is told so within a few steps).

Healthy fits: the digits CNN and the digits transformer of `fp16cb.demos.experiments` (fastai's Adam, one-cycle), at
their own learning rate and at 3x it, with the default `scale_wait=500` and with `scale_wait=20` (the scale tries to
grow every 20 clean steps: many more growth overflows than a default fit meets), from several seeds, for many epochs.
Reported per run: the steps after calibration, the skips among them, and the most skips in any window of 4, 8, 16
and 32 consecutive steps. Beside them, unhealthy fits: a digits MLP with a module that squares a scaled activation,
`(300 x)^2 / 300^2`, which overflows fp16 for |x| > 0.85 (FP32 computes x^2).

    python -m bench.skip_rates --seeds 3 --json bench/results_skip_rates.json
"""
from __future__ import annotations
import argparse, json, time, warnings
import torch
from torch import nn

from fp16cb.dtypes import cpu_flags
from fp16cb.demos.experiments import TASKS, make_learner, train
from fp16cb.scaling.record import settled

WINDOWS = (4, 8, 16, 32)

def most_in_window(skips:list, w:int) -> int:
    "The most skipped steps in any `w` consecutive steps."
    if not skips: return 0
    w = min(w, len(skips))
    best = cur = sum(skips[:w])
    for i in range(w, len(skips)):
        cur += skips[i] - skips[i - w]
        best = max(best, cur)
    return best

def summary(skips:list, scales:list) -> dict:
    "The steps once the scale has settled (`fp16cb.scaling.record.settled`), their skips, the most in each window."
    post = settled(skips, scales, dynamic=True)
    return dict(steps=len(post), skips=sum(post), **{f'max_in_{w}': most_in_window(post, w) for w in WINDOWS})

def run(task:str, seed:int, lr_mult:float, wait:int, epochs:int) -> dict:
    learn = make_learner(task, lambda l: l.to_fp16(scale_wait=wait), seed)
    r = train(learn, epochs=epochs, lr=TASKS[task].lr * lr_mult)
    return dict(task=task, seed=seed, lr_mult=lr_mult, scale_wait=wait, accuracy=r.accuracy, error=r.error,
                **summary(r.skips, r.scales))

class Squares(nn.Module):
    "x^2 computed as (300 x)^2 / 300^2: the same in FP32, inf in fp16 once |x| > 0.85."
    def forward(self, x): return (x * 300.) ** 2 / 9e4

def unhealthy(seed:int, epochs:int=2) -> dict:
    "The digits MLP with `Squares` after its first layer, under `to_fp16()`."
    learn = make_learner('digits', 'fp32', seed)
    learn.model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), Squares(), nn.Linear(64, 10))
    learn = learn.to_fp16()
    r = train(learn, epochs=epochs, lr=1e-3)
    return dict(task='squares (fp16 overflow)', seed=seed, error=r.error and r.error[:120], **summary(r.skips, r.scales))

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--seeds', type=int, default=3)
    ap.add_argument('--epochs', type=int, default=30)
    ap.add_argument('--json', default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter('ignore')
    t0, rows = time.time(), []
    for task in ('digits', 'transformer'):
        for wait in (500, 20):
            for lr_mult in (1., 3.):
                for seed in range(a.seeds):
                    rows.append(run(task, seed, lr_mult, wait, a.epochs if task == 'digits' else a.epochs // 3))
                    print(rows[-1], flush=True)
    bad = [unhealthy(seed) for seed in range(a.seeds)]
    for b in bad: print(b, flush=True)
    res = dict(meta=dict(date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), cpu_flags=cpu_flags(),
                         torch=torch.__version__, secs=round(time.time() - t0)), healthy=rows, unhealthy=bad)
    for w in WINDOWS:
        print(f"most skips in {w} steps: healthy {max(r[f'max_in_{w}'] for r in rows)}, "
              f"unhealthy {min(r[f'max_in_{w}'] for r in bad)}")
    if a.json:
        with open(a.json, 'w') as f: json.dump(res, f, indent=1)

if __name__ == '__main__': main()
