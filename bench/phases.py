"""Where a step's time goes, by phase: `python -m bench.phases [--workload book] [--modes fp32,bf16,fp16]`.

Each mode's learner (as `python -m bench` makes it) fits `--rounds` epochs, the modes interleaved; a callback after all
others notes this process's CPU time at `after_pred`, `after_loss`, `after_backward`, `after_step` and `after_batch`,
from the step clock's `before_batch`: the forward, the loss, the backward (with `before_backward`), the optimizer step
(with `before_step` and `after_step`'s callbacks), and fastai's `zero_grad` with `after_batch`. Prints one JSON line,
`{mode: [medians in ms]}`, so that two checkouts can run at once, one on each core, and be compared pair by pair
(`cd A && python -m bench.phases & cd B && python -m bench.phases`): the machine's drift then hits both."""
from __future__ import annotations
import argparse, json, statistics, time
import torch
from fastai.basics import Callback

from .run import _learner, _fit
from .measure import set_clock
from .workloads import WORKLOADS, make_data, CPU_SCALE

__all__ = ['PHASES', 'Phases', 'main']

PHASES = ('forward', 'loss', 'backward', 'step', 'zero_grad')
_EVENTS = ('after_pred', 'after_loss', 'after_backward', 'after_step', 'after_batch')

class Phases(Callback):
    "The CPU time of each phase of the training steps (`PHASES`), from the step clock's start (`rec['t0']`)."
    order = 10**6 + 1  # after the step clock's last callback
    def __init__(self, rec:dict): self.rec, self.t, self.steps = rec, {}, []
    def _mark(self, event):
        if self.training: self.t[event] = time.process_time()
    def after_pred(self): self._mark('after_pred')
    def after_loss(self): self._mark('after_loss')
    def after_backward(self): self._mark('after_backward')
    def after_step(self): self._mark('after_step')
    def after_batch(self):
        if not self.training: return
        self._mark('after_batch')
        ts = [self.rec['t0']] + [self.t.get(e) for e in _EVENTS]
        if None not in ts: self.steps.append([b - a for a, b in zip(ts, ts[1:])])
        self.t = {}

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--workload', default='book', choices=list(WORKLOADS))
    ap.add_argument('--modes', default='fp32,bf16,fp16', help="comma-separated `bench.modes.MODES` keys")
    ap.add_argument('--steps', type=int, default=20, help="training batches of an epoch")
    ap.add_argument('--rounds', type=int, default=3, help="timed epochs of each mode, after one untimed")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    set_clock('cpu')
    s = CPU_SCALE[a.workload]
    torch.manual_seed(0)
    init = WORKLOADS[a.workload].model(s)
    batches, valid = make_data(a.workload, s, 'cpu', a.steps)
    runs = {}
    for m in [m for m in a.modes.split(',') if m]:
        learn, rec = _learner(a.workload, m, 'adam', 'cpu', batches, valid, init, 1e-3, False, False)
        learn.add_cb(ph := Phases(rec))
        runs[m] = (learn, ph)
    for learn, _ in runs.values(): _fit(learn)  # (untimed: the set-up and the first steps)
    for learn, ph in runs.values(): ph.steps = []
    for _ in range(a.rounds):
        for learn, _ in runs.values(): _fit(learn)
    print(json.dumps({m: [round(statistics.median(c) * 1e3, 3) for c in zip(*ph.steps)] for m, (_, ph) in runs.items()}))

if __name__ == '__main__': main()
