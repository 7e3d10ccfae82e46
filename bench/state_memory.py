"""Training state at the step's peak, in bytes per trainable parameter: `python -m bench.state_memory [--json out.json]`.

Counted as the memory issue defines it: the unique storages of every live tensor (found by the garbage collector, with
their `.grad`s) right after the optimizer step and before `zero_grad` (fastai's `after_step`), minus what was alive
before the learner was made (the data) and the batch (inputs, targets, predictions, loss). On a CPU these are exact
bytes, not an allocator's blocks. Each mode with fastai's `Adam` and with `OptimWrapper(torch.optim.AdamW)`; the model
is an MLP of about 9.5M parameters (`--width` scales it). The targets (at most 16 bytes/param with FP32 masters, 12
with `half_storage`; with the optimizer's state in bf16, `state_dtype`, 4 less; in 8 bits, `state_dtype='8bit'`, 6 less,
its block scales, 4 bytes per 256 elements and moment, within the slack) are printed as met or not, never asserted
here (tests/test_bench.py checks the accounting; tests/test_state8.py the 8-bit figures on a smaller MLP).

Then the true peak (`bench.peak_memory`): per mode, the memory between steps beside its peak over the step, the
backward, a mid-fit save and the fit's end, on a model with one large param and on a small GPT-2, and which moments
exceed FP32's own peak (`--no-peaks`: the first table only)."""
from __future__ import annotations
import argparse, gc, json, platform, time, warnings
from functools import partial
import torch
from torch import nn
from fastai.basics import Learner, DataLoaders, Adam, OptimWrapper, MSELossFlat, Callback

import fp16cb  # noqa: F401 (patches Learner.to_fp16 & co.)
from fp16cb.dtypes import cpu_has_native
from bench.measure import cpu_flags
from bench.peak_memory import measure_peaks, format_peaks, MODES  # MODES: every mode, by name

__all__ = ["live_storages", "StateBytes", "state_learner", "MODES", "OPTIMIZERS", "TARGETS", "SLACK", "supported", "measure", "main"]

def cpu_capability() -> str:
    "This CPU's model name, torch's CPU capability and whether bf16 is native here."
    name = next((l.split(':', 1)[1].strip() for l in open('/proc/cpuinfo') if l.startswith('model name')), platform.processor()) \
        if platform.system() == 'Linux' else platform.processor()
    return f"{name}, {torch.backends.cpu.get_cpu_capability()}, native bf16: {cpu_has_native(torch.bfloat16)}"

def live_storages() -> dict:
    """`{storage data_ptr: nbytes}` of every live tensor the garbage collector sees, and of their grads (tensors without
    memory of their own left out: meta tensors, and the fake tensors a `torch.compile` trace may leave behind). Not
    those `gc.freeze()` set aside (`measure`: what the process held before it began)."""
    res = {}
    def add(t):
        if isinstance(t, torch.Tensor) and not t.is_meta and t.device.type != 'meta':
            s = t.untyped_storage()
            try: ptr = s.data_ptr()
            except RuntimeError: return  # a FakeTensor (or functional tensor): no data
            if s.nbytes(): res[ptr] = s.nbytes()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # `isinstance` on torch's deprecated module attributes warns
        objs = [o for o in gc.get_objects() if _is_tensor(o)]
    for o in objs:
        add(o)
        if o.is_leaf and o.grad is not None: add(o.grad)
    return _without_aliases(res)

def _without_aliases(storages:dict) -> dict:
    """`storages` (`{data_ptr: nbytes}`) without those that lie inside another's memory: a storage over part of a
    buffer (`fp16cb.weights.layout.shared`, which a checkpoint and bf16 state's compiled step make) is no memory of its
    own."""
    res, end = {}, -1
    for ptr, n in sorted(storages.items(), key=lambda kv: (kv[0], -kv[1])):
        if ptr + n <= end: continue  # inside the storage before it
        res[ptr], end = n, max(end, ptr + n)
    return res

def _is_tensor(o) -> bool:
    try: return isinstance(o, torch.Tensor)
    except ReferenceError: return False  # a weak proxy whose object is gone (`torch.compile` leaves some behind)

class StateBytes(Callback):
    "Counts the live storages at `after_step` (after the optimizer step, before `zero_grad`), the batch and `baseline` excluded."
    order = -100  # before every other after_step: nothing of ours has run yet
    def __init__(self, baseline:dict): self.baseline, self.counts, self.scratch = baseline, [], []
    def after_step(self):
        if not self.training: return
        batch = {t.untyped_storage().data_ptr() for t in (*self.learn.xb, *self.learn.yb, self.learn.pred, self.learn.loss,
                                                          self.learn.loss_grad) if isinstance(t, torch.Tensor)}
        live, scratch = live_storages(), _scratch(self.learn)
        self.counts.append(sum(n for k, n in live.items() if k not in self.baseline and k not in batch and k not in scratch))
        self.scratch.append(sum(scratch.values()))

def _scratch(learn) -> dict:
    """`{data_ptr: nbytes}` of the weight store's scratch: the FP32 memory one chunk of grads is lifted into during the
    step, kept between steps (one chunk, `WeightStore.chunk_limit`), reported apart from the training state."""
    store = getattr(getattr(learn, 'mixed_precision', None), 'store', None)
    bufs = getattr(getattr(store, 'scratch', None), 'bufs', {})
    return {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in bufs.values()}

def _mlp(width:int) -> nn.Module:
    return nn.Sequential(nn.Linear(width // 4, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))

OPTIMIZERS = {'fastai Adam': Adam, 'torch AdamW': partial(OptimWrapper, opt=torch.optim.AdamW)}
TARGETS = {'to_bf16': 16, 'to_bf16 flat': 16, 'to_fp16': 16, 'to_bf16 half_storage': 12, 'to_bf16 step_in_backward': 12,
           'to_bf16 half_storage step_in_backward': 10, 'to_bf16 state_dtype': 12, 'to_bf16 flat state_dtype': 12,
           'to_bf16 half_storage state_dtype': 8,
           'to_bf16 step_in_backward state_dtype': 8, 'to_bf16 half_storage step_in_backward state_dtype': 6,
           'to_bf16 state8': 10, 'to_bf16 half_storage state8': 6, 'to_bf16 step_in_backward state8': 6,
           'to_bf16 half_storage step_in_backward state8': 4}
SLACK = .05  # bytes/param of fixed buffers (the loss scale, the overflow flags, the scaler's state) on a small model

def supported(mode:str, opt:str) -> bool:
    "Stepping in the backward runs fastai's optimizer loop param by param: not a torch optimizer."
    return not ('step_in_backward' in mode and opt != 'fastai Adam')

def _fastai_to_fp16(learn):
    "fastai's own `to_fp16` (AMP), whatever fp16cb patched in."
    from fastai.callback.fp16 import MixedPrecision as FastaiMP
    return learn.add_cb(FastaiMP())
Learner.to_fp16_fastai = _fastai_to_fp16

def state_learner(mode:str, opt:str, width:int=2048, bs:int=8, n_batches:int=2, seed:int=0) -> tuple:
    "`(learner, StateBytes, n_params)`: the MLP in `mode` with `opt`; the data made (and counted as baseline) first."
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(bs * n_batches, width // 4, generator=g), torch.randn(bs * n_batches, 10, generator=g)
    dls = DataLoaders.from_dsets(list(zip(x, y)), list(zip(x[:bs], y[:bs])), bs=bs, shuffle=False, device='cpu')
    if 'state8' in mode:  # the 8-bit maps and their search tables: made once per process, not per param (counted out)
        from fp16cb.storage import state8
        for signed in (True, False): state8._lut(signed, 'cpu')
    from fp16cb.storage.state_storage import _noise_table
    _noise_table('cpu')  # the stochastic rounding's noise table (512 KiB on a CPU): once per process, counted out too
    gc.collect()
    baseline = live_storages()
    torch.manual_seed(seed)
    model = _mlp(width)
    learn = MODES[mode](Learner(dls, model, loss_func=MSELossFlat(), opt_func=OPTIMIZERS[opt], lr=1e-4))
    sb = StateBytes(baseline)
    return learn, sb, sum(p.numel() for p in model.parameters())

def measure(width:int=2048, modes=None, opts=None, with_scratch:bool=False) -> dict:
    """`{opt: {mode: bytes/param at the step peak}}` (the largest over a fit's steps); `with_scratch`: also `{opt: {mode:
    bytes of the lift's scratch}}`, kept apart."""
    res, scratch = {}, {}
    # what the process held before (every baseline's, never counted): out of the collector's scans, which then read
    # only what was made since (a test process holds half a million objects: each scan took a second)
    gc.collect(); gc.freeze()
    try:
        for opt in opts or OPTIMIZERS:
            for mode in modes or MODES:
                if not supported(mode, opt): continue
                learn, sb, n = state_learner(mode, opt, width)
                with learn.no_bar(), learn.no_logging(): learn.fit(1, cbs=sb)
                res.setdefault(opt, {})[mode] = max(sb.counts) / n
                scratch.setdefault(opt, {})[mode] = max(sb.scratch)
                del learn, sb; gc.collect()
    finally: gc.unfreeze()
    return (res, scratch) if with_scratch else res

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--width', type=int, default=2048, help="the MLP's width (2048: about 9.5M parameters)")
    p.add_argument('--json', help="also write the results here")
    p.add_argument('--no-peaks', action='store_true', help="skip the true peaks (step, backward, save, fit's end)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings('ignore')  # fastai's AMP on a CPU, fp16 on a CPU: known, and not what is measured
    res, scratch = measure(args.width, with_scratch=True)
    n = sum(q.numel() for q in _mlp(args.width).parameters())
    print(f"CPU: {cpu_capability()} ({cpu_flags()}); torch {torch.__version__}; 1 thread")
    print(f"Training state at the step peak, bytes/param; MLP of {n/1e6:.1f}M params")
    opts = list(res)
    print(f"{'mode':<50}" + ''.join(f"{o:>14}" for o in opts) + "   target")
    for mode in MODES:
        t, vals = TARGETS.get(mode), [res[o].get(mode) for o in opts]
        met = '' if t is None else f"   <= {t}: " + ('met' if all(v <= t + SLACK for v in vals if v is not None) else 'NOT met')
        print(f"{mode:<50}" + ''.join(f"{v:>14.2f}" if v is not None else f"{'-':>14}" for v in vals) + met)
    most = max(v for r in scratch.values() for v in r.values())
    print(f"plus the lift's scratch, one chunk of FP32 grads kept between steps: at most {most/2**20:.1f} MiB")
    peaks = None if args.no_peaks else measure_peaks()
    if peaks is not None:
        print("\nThe true peak over a fit (1 epoch of 3 batches, a `learn.save` at its end):\n" + format_peaks(peaks))
    if args.json:
        date = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
        out = {'date': date, 'width': args.width, 'n_params': n, 'bytes_per_param': res, 'scratch_bytes': scratch,
               'cpu': cpu_capability(), 'cpu_flags': cpu_flags(), 'torch': torch.__version__, 'peaks': peaks}
        with open(args.json, 'w') as f: json.dump(out, f, indent=1)

if __name__ == '__main__': main()
