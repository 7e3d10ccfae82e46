"""What the in-fit precision-health check costs (`MixedPrecision(health_every=100)`, on by default): each workload
trained with the check on and off, side by side in one process (the two learners' fits interleaved, medians).

A check runs 1/16 of the 16-bit modules again in FP32 on its step's batch, every 100 steps, and every 20 in a first
round of 16 checks. Reported per workload and mode:
- `check ms`: what a check step takes more than the other steps (medians of the same learner's steps: the copies of
  the modules and their inputs and outputs, the FP32 forwards, the comparison, the read of the last check);
- `steady`: that time over 100 steps of the step time with the check off: the cost once the first round is done;
- `first round`: that time over 20 steps of the step time: the cost of a fit's first 320 steps;
- `fit ratio`: a whole fit of `--steps` steps, on over off (medians of `--rounds`; noisy, the direct reading).

    python -m bench.health_cost --json bench/results_health_cost.json
    python -m bench.health_cost --device cuda --workloads resnet50_cl,lm
"""
from __future__ import annotations
import argparse, copy, json, statistics, time, warnings
import torch
from fastai.basics import Learner, DataLoaders, CrossEntropyLossFlat, Callback

import fp16cb  # noqa: F401
from fp16cb.callbacks import health
from fp16cb.dtypes import cpu_flags, resolve_device
from .workloads import WORKLOADS, WORKLOAD_SETS, CPU_SCALE, make_data
from .run import Batches
from .measure import sync

MODES = {'bf16': lambda l, **kw: l.to_bf16(**kw), 'fp16': lambda l, **kw: l.to_fp16(**kw)}

def _learner(init, batches, valid, device, mode, every):
    dls = DataLoaders(Batches(batches), Batches([valid]))
    dls.device = torch.device(device)
    learn = Learner(dls, copy.deepcopy(init).to(device), loss_func=CrossEntropyLossFlat(), lr=1e-3)
    learn.remove_cbs([cb for cb in learn.cbs if type(cb).__name__ == 'ProgressCallback'])
    return MODES[mode](learn, health_every=every)

class StepTimes(Callback):
    "Each training step's time (`before_batch` to `after_batch`, the device synchronised), and whether it was checked."
    order = -100
    def __init__(self, device): self.device, self.steps = device, []
    def before_batch(self):
        if self.training: sync(self.device); self.t = time.perf_counter()
    def after_batch(self):
        if not self.training: return
        sync(self.device)
        watch = self.learn.mixed_precision.health
        self.steps.append((time.perf_counter() - self.t, watch is not None and watch.due(self.learn.train_iter)))  # before fastai counts it

def _fit(learn, device) -> float:
    with warnings.catch_warnings(), learn.no_logging():
        warnings.simplefilter('ignore')
        sync(device); t = time.perf_counter(); learn.fit(1); sync(device)
    return time.perf_counter() - t

def measure(wl:str, device:str, mode:str, steps:int, rounds:int) -> dict:
    s = 1. if device.startswith('cuda') else CPU_SCALE[wl]
    torch.manual_seed(0)
    init = WORKLOADS[wl].model(s)
    batches, valid = make_data(wl, s, device, steps)
    on, off = _learner(init, batches, valid, device, mode, 100), _learner(init, batches, valid, device, mode, 0)
    _fit(on, device); _fit(off, device)  # warm-up: kernels, the scale's calibration
    clock = StepTimes(device); on.add_cb(clock)
    t_on, t_off = [], []
    for r in range(rounds):
        for learn, ts in ((on, t_on), (off, t_off))[:: 1 if r % 2 == 0 else -1]: ts.append(_fit(learn, device))
    checked, plain = [t for t, c in clock.steps if c], [t for t, c in clock.steps if not c]
    check = statistics.median(checked) - statistics.median(plain) if checked and plain else float('nan')
    step = statistics.median(t_off) / steps
    return dict(workload=wl, mode=mode, steps=steps, n_checks=len(checked) // max(rounds, 1), check_ms=1e3 * check,
                step_ms=1e3 * step, steady=check / (100 * step), first_round=check / (health.FIRST * step),
                fit_ratio=statistics.median(t_on) / statistics.median(t_off))

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--device', default='cpu')
    ap.add_argument('--workloads', default=None)
    ap.add_argument('--modes', default='bf16,fp16')
    ap.add_argument('--steps', type=int, default=200)
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--json', default=None)
    a = ap.parse_args()
    device = str(resolve_device(a.device, ('cpu', 'cuda'), 'cpu or cuda'))
    if device == 'cpu': torch.set_num_threads(1)
    wls = a.workloads.split(',') if a.workloads else WORKLOAD_SETS['gpu' if device.startswith('cuda') else 'cpu']
    rows = []
    for wl in wls:
        for mode in a.modes.split(','):
            rows.append(measure(wl, device, mode, a.steps, a.rounds))
            r = rows[-1]
            print(f"{wl:12s} {mode:5s} step {r['step_ms']:8.2f} ms  check {r['check_ms']:7.2f} ms  steady "
                  f"{r['steady']:6.2%}  first round {r['first_round']:6.2%}  fit on/off {r['fit_ratio']:.3f}", flush=True)
    meta = dict(date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), device=device, torch=torch.__version__,
                cpu_flags=cpu_flags(), machine=torch.cuda.get_device_name() if device.startswith('cuda') else 'cpu')
    if a.json:
        with open(a.json, 'w') as f: json.dump(dict(meta=meta, rows=rows), f, indent=1)

if __name__ == '__main__': main()
