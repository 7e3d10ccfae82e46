"""Side-by-side benchmark of mixed-precision modes: `python -m fp16cb.bench [--device cuda] [--json out.json]`.

One process; every mode trains its own copy of the same model on the same synthetic batches with fastai's real
`Learner.fit` (one epoch of `--steps` batches per round), the modes interleaved round-robin over `--rounds` rounds
after `--warmup` untimed steps. A step is timed from the first `before_batch` to the last `after_batch` callback (forward,
loss, backward, optimizer step, zero_grad and every callback: data loading and validation excluded). Reported:
median ms/step and speedup vs fp32; ms/step inside the precision callbacks (their event methods wrapped by timers);
the bookkeeping bound = 12 bytes/param / copy bandwidth (a 16->32 and a 32->16 `_foreach_copy_` of the model's size,
caches flushed first, timed in every round); on a CPU times are this process's CPU time (`--clock cpu`), which other
processes sharing the cores do not inflate;
the memory a step holds (CPU: params + grads + optimizer state + kept originals + tensors saved for backward;
CUDA: this learner's params, grads, optimizer state and originals + `max_memory_allocated` growth during a fit);
the final FP32 loss on the training batches and loss/accuracy on a held-out batch; the skipped (overflow) steps.
"""
from __future__ import annotations
import argparse, copy, json, math, platform, statistics, sys, time, warnings
import torch
from torch import nn
from fastai.basics import Learner, DataLoaders, Callback, CancelStepException, CrossEntropyLossFlat, Adam
import fastai.callback.fp16 as ffp16

from .callbacks import ModelToHalf, MixedPrecision, model_device
from .native import NativeMixedPrecision
from .devices import resolve_device
from .dtypes import cast_floats
from . import learner as _patches  # noqa: F401 (Learner.to_fp16 & co.)

__all__ = ['WORKLOADS', 'MODES', 'AutocastCB', 'FastaiNonNative', 'run_bench', 'format_table', 'main']

# ---------------------------------------------------------------------------------------------------- workloads
class _Batches:
    "A fixed list of batches that fastai iterates like a `DataLoader` (no collation, no shuffling: same data per mode)."
    def __init__(self, batches): self.batches = batches
    def __iter__(self): return iter(self.batches)
    def __len__(self): return len(self.batches)
    def to(self, device): return self

def _mlp(d, h, n_blocks, n_out):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.fc1, self.act, self.fc2 = nn.LayerNorm(d), nn.Linear(d, h), nn.GELU(), nn.Linear(h, d)
        def forward(self, x): return x + self.fc2(self.act(self.fc1(self.ln(x))))
    return nn.Sequential(*[Block() for _ in range(n_blocks)], nn.LayerNorm(d), nn.Linear(d, n_out))

def _many_small(w, n_layers, n_out):
    "`n_layers` Linear(w, w) (+ bias): 2 param tensors each, the compute per param tiny with a tiny batch."
    layers = []
    for _ in range(n_layers): layers += [nn.Linear(w, w), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(w, n_out))

def _convnet(c, n_out):
    def blk(ci, co, s): return nn.Sequential(nn.Conv2d(ci, co, 3, s, 1, bias=False), nn.BatchNorm2d(co), nn.ReLU())
    return nn.Sequential(blk(3, c, 1), blk(c, c, 1), blk(c, 2*c, 2), blk(2*c, 2*c, 1), blk(2*c, 4*c, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4*c, n_out))

def _act_heavy(w, n_layers, n_in, n_out):
    "Narrow and deep: cheap matmuls, many saved activations per param."
    layers = [nn.Linear(n_in, w)]
    for _ in range(n_layers): layers += [nn.GELU(), nn.Linear(w, w)]
    return nn.Sequential(*layers, nn.GELU(), nn.Linear(w, n_out))

# name: (description, model factory(scale), input shape(scale) w/o batch, batch size(scale)); GPU scale=1
WORKLOADS = {
    'mlp':  ('compute-bound: 4 blocks LN+Linear(d,4d)+GELU+Linear(4d,d), d=1024*s, batch 512*s',
             lambda s: _mlp(_r(1024*s), _r(4096*s), 4, 10), lambda s: (_r(1024*s),), lambda s: _r(512*s, 8)),
    'book': ('bookkeeping-bound: 150 Linear(w,w) = 300 param tensors, w=256*sqrt(s) (~20M params at s=1), batch 8',
             lambda s: _many_small(_r(256*math.sqrt(s)*1.43), 150, 10), lambda s: (_r(256*math.sqrt(s)*1.43),),
             lambda s: 8),
    'conv': ('conv net with BatchNorm: 5 conv3x3+BN+ReLU, 32*s channels, 32x32 images, batch 256*s',
             lambda s: _convnet(_r(32*s, 4), 10), lambda s: (3, 32, 32), lambda s: _r(256*s, 8)),
    'act':  ('activation-heavy: 12 x (GELU + Linear(64,64)), batch 32768*s',
             lambda s: _act_heavy(64, 12, 32, 10), lambda s: (32,), lambda s: _r(32768*s, 64)),
}

def _r(x, lo=1): return max(lo, int(round(x)))

def _data(workload, scale, device, n_batches, seed=0):
    "Synthetic classification batches with a learnable signal (labels from a fixed random teacher)."
    _, _, shape_fn, bs_fn = WORKLOADS[workload]
    shape, bs = shape_fn(scale), bs_fn(scale)
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(math.prod(shape), 10, generator=g)
    def batch():
        x = torch.randn(bs, *shape, generator=g)
        y = (x.reshape(bs, -1) @ teacher).argmax(1)
        return x.to(device), y.to(device)
    return [batch() for _ in range(n_batches)], batch()

# -------------------------------------------------------------------------------------------------------- modes
class AutocastCB(Callback):
    "fastai's `MixedPrecision` (autocast + GradScaler) on the model's device instead of hard-coded 'cuda'."
    order = 10
    def __init__(self, dtype): self.dtype = dtype
    def before_fit(self):
        dev = model_device(self.learn.model).type
        self.autocast = torch.autocast(dev, dtype=self.dtype)
        self.learn.scaler = torch.amp.GradScaler(dev, enabled=self.dtype == torch.float16)
    def before_batch(self): self.autocast.__enter__()
    def after_pred(self): self.learn.pred = cast_floats(self.learn.pred, torch.float32)
    def after_loss(self): self.autocast.__exit__(None, None, None)
    def before_backward(self): self.learn.loss_grad = self.learn.scaler.scale(self.learn.loss_grad)
    def before_step(self):
        self.skipped = True
        self.learn.scaler.step(self)
        if self.skipped: raise CancelStepException()
    def after_step(self): self.learn.scaler.update()
    @property
    def param_groups(self): return self.learn.opt.param_groups
    def step(self, *args, **kwargs): self.skipped = False

class FastaiNonNative(ffp16.NonNativeMixedPrecision):
    "fastai's master-weight algorithm with only its CUDA assert lifted (fp16 only: fastai's `ModelToHalf` casts to fp16)."
    def before_fit(self):
        if self.learn.opt is None: self.learn.create_opt()
        self.model_pgs, self.master_pgs = ffp16.get_master(self.opt, self.flat_master)
        self.old_pgs = self.opt.param_lists
        ffp16._copy_state(self.learn.opt, self.model_pgs, self.master_pgs)
        if self.dynamic: self.count = 0

def _half(device): return torch.float16 if torch.device(device).type == 'cuda' else torch.bfloat16

# name: (description, learner setup); the setup gets the learner and the device
MODES = {
    'fp32':      ('plain FP32', lambda l, d: l),
    'autocast':  ('torch autocast as a plain fastai callback (bf16 on CPU, fp16 + GradScaler on CUDA)',
                  lambda l, d: l.add_cb(AutocastCB(_half(d)))),
    'fastai':    ('fastai ModelToHalf + NonNativeMixedPrecision (fp16, FP32 masters, dynamic scale)',
                  lambda l, d: l.add_cbs([ffp16.ModelToHalf(), FastaiNonNative()])),
    'bf16':      ('fp16cb learn.to_bf16()', lambda l, d: l.to_bf16()),
    'bf16-flat': ('fp16cb learn.to_bf16(flat_master=True)', lambda l, d: l.to_bf16(flat_master=True)),
    'fp16':      ('fp16cb learn.to_fp16()', lambda l, d: l.to_fp16()),
    'fp16-flat': ('fp16cb learn.to_fp16(flat_master=True)', lambda l, d: l.to_fp16(flat_master=True)),
    'native':    ('fp16cb learn.to_native_fp16() (dtype=bf16 on CPU)',
                  lambda l, d: l.to_native_fp16(dtype=_half(d))),
}
_PRECISION = (ModelToHalf, MixedPrecision, NativeMixedPrecision, AutocastCB, ffp16.ModelToHalf,
              ffp16.NonNativeMixedPrecision)
_STEP_EVENTS = ('before_batch', 'after_pred', 'after_loss', 'before_backward', 'after_backward', 'before_step',
                'after_step', 'after_cancel_step', 'after_cancel_batch', 'after_batch')

# ------------------------------------------------------------------------------------------------ measurement
def _sync(device):
    if torch.device(device).type == 'cuda': torch.cuda.synchronize()

_now = time.perf_counter  # set by `run_bench`: wall clock, or this process's CPU time (`clock='cpu'`)
def _clock(): return _now()

class _Clock(Callback):
    "Times each training batch: `first` starts it at `before_batch`, the last callback ends it at `after_batch`."
    def __init__(self, rec, device, first):
        self.rec, self.device, self.first = rec, device, first
        self.order = -10**6 if first else 10**6
    def before_batch(self):
        if self.first and self.training: _sync(self.device); self.rec['t0'] = _clock()
    def after_cancel_step(self):
        if not self.first and self.training: self.rec['skipped'] += 1  # fp16cb, autocast: an overflow skips the step
    def after_cancel_batch(self):
        if not self.first and self.training: self.rec['skipped'] += 1  # fastai's algorithm skips the whole batch
    def after_batch(self):
        if not self.first and self.training:
            _sync(self.device); self.rec['steps'].append(_clock() - self.rec['t0'])
            self.rec['cb_steps'].append(self.rec['cb']); self.rec['cb'] = 0.; self.rec['all'] += 1

def _time_events(cb, rec, device):
    "Wrap `cb`'s per-batch event methods so their time (synchronised on CUDA) adds to `rec['cb']` while training."
    for name in _STEP_EVENTS:
        f = getattr(cb, name, None)
        if f is None or getattr(f, '_timed', False): continue
        def timed(f=f, name=name):
            if not cb.learn.training: return f()
            _sync(device); t = _clock()
            try: return f()
            finally:
                _sync(device); dt = _clock() - t
                rec['cb'] += dt; rec['events'][name] = rec['events'].get(name, 0.) + dt
        timed._timed = True
        setattr(cb, name, timed)

def _storage(t): return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()

class _CpuMemory(Callback):
    """Bytes a training step holds (CPU): params + grads (model and masters) + optimizer state + kept FP32 originals
    (each storage counted once) + tensors saved for backward that are not params (saved-tensor hooks); max over batches."""
    order = 10**6 - 1
    def __init__(self): self.peak, self._ctx, self._saved, self._saved_bytes = 0, None, {}, 0
    def before_batch(self):
        if not self.training: return
        self._saved = {}
        def pack(t): k, n = _storage(t); self._saved[k] = n; return t
        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()
    def _exit(self):
        if self._ctx is None: return
        self._ctx.__exit__(None, None, None); self._ctx = None
        params = {_storage(p)[0] for p in self._params()}
        self._saved_bytes = sum(n for k, n in self._saved.items() if k not in params)
    def after_loss(self): self._exit()
    def after_batch(self): self._exit()  # a cancelled batch
    def _params(self):
        return list(self.learn.model.parameters()) + [p for pg in self.learn.opt.param_lists for p in pg]
    def after_backward(self):
        if self.training: self.peak = max(self.peak, _held_bytes(self.learn) + self._saved_bytes)

def _held_bytes(learn) -> int:
    "Bytes of the storages of the params and grads (model and masters), optimizer state and kept FP32 originals."
    held = {}
    def add(t):
        if isinstance(t, torch.Tensor) and t.numel(): k, n = _storage(t); held[k] = n
    for p in list(learn.model.parameters()) + [p for pg in learn.opt.param_lists for p in pg]: add(p.data); add(p.grad)
    for s in learn.opt.state.values():
        for v in (s.values() if isinstance(s, dict) else []): add(v)
    for cb in learn.cbs:
        for rec in (getattr(cb, 'originals', None) or {}).values(): add(rec.original)  # fp16cb keeps exact FP32 originals
        for pg in (getattr(cb, 'master_pgs', None) or []):
            for m in pg: add(m.data); add(m.grad)
        master = getattr(cb, 'master', None)  # fp16cb: the master grads are dropped between steps, not their buffers
        for t in (master.buffers() if hasattr(master, 'buffers') else []): add(t)
    return sum(held.values())

def _copy_bound(n_params, dtype, device, reps=3, cold=True) -> float:
    """Seconds for the bookkeeping bound of `n_params`: a 16->32 plus a 32->16 `_foreach_copy_` of that many elements
    (12 bytes/param), the best of `reps`; `cold`: the caches are flushed before each copy, as in a training step."""
    a, b = torch.empty(n_params, dtype=dtype, device=device).normal_(), torch.empty(n_params, device=device)
    flush = torch.empty((64 if torch.device(device).type == 'cpu' else 256) * 2**20 // 4, device=device) if cold else None
    ts = []
    for _ in range(reps):
        t = 0.
        for dst, src in ((b, a), (a, b)):
            if cold: flush.zero_()
            _sync(device); t0 = _clock()
            torch._foreach_copy_([dst], [src])
            _sync(device); t += _clock() - t0
        ts.append(t)
    return min(ts)

@torch.no_grad()
def _evaluate(model, xy):
    x, y = xy
    model.eval()
    pred = model(x).float()
    return float(CrossEntropyLossFlat()(pred, y)), float((pred.argmax(1) == y).float().mean())

# ----------------------------------------------------------------------------------------------------- driver
def _learner(workload, scale, mode, device, batches, valid, init, lr):
    model = copy.deepcopy(init).to(device)
    dls = DataLoaders(_Batches(batches), _Batches([valid]))
    dls.device = torch.device(device)
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), opt_func=Adam, lr=lr)
    learn.remove_cbs([cb for cb in learn.cbs if type(cb).__name__ == 'ProgressCallback'])
    MODES[mode][1](learn, device)
    rec = {'steps': [], 'cb_steps': [], 'cb': 0., 'events': {}, 't0': 0., 'skipped': 0, 'all': 0}
    for cb in learn.cbs:
        if isinstance(cb, _PRECISION): _time_events(cb, rec, device)
    learn.add_cbs([_Clock(rec, device, True), _Clock(rec, device, False)])
    return learn, rec

def _fit(learn):
    fit = type(learn).fit
    # fastai's own pair (its ModelToHalf + NonNativeMixedPrecision) runs under fastai's plain `fit`: fp16cb's stacking
    # check around `Learner.fit` counts the pair as two setups. The timed steps are the same either way.
    if any(isinstance(cb, FastaiNonNative) for cb in learn.cbs): fit = getattr(fit, '__wrapped__', fit)
    with warnings.catch_warnings(), learn.no_logging():
        warnings.simplefilter('ignore')
        fit(learn, 1)

def run_bench(
    workloads=('mlp', 'book', 'conv', 'act'), # which of `WORKLOADS`
    modes=tuple(MODES), # which of `MODES`
    steps:int=3, # training steps per mode per round
    rounds:int=3, # timed rounds (after the warm-up)
    warmup:int=8, # untimed warm-up steps per mode (the dynamic loss scales fall from 2**24 meanwhile)
    device=None, # 'cpu' or 'cuda' (default: cuda when available)
    scale:float=None, # workload size factor (default 1 on CUDA, `cpu_scale` of each workload on CPU)
    lr:float=1e-3, # Adam learning rate
    verbose:bool=True,
    clock:str=None, # 'wall' or 'cpu' (process CPU time: robust to other processes sharing a CPU; default on CPU)
) -> dict:
    "Run the benchmark; returns `{workload: {mode: figures}}` plus `'meta'`."
    device = device or ('cuda' if torch.cuda.is_available() else 'cpu')
    for name in list(workloads) + list(modes):
        if name not in WORKLOADS and name not in MODES: raise ValueError(f"unknown workload or mode {name!r}")
    if steps < 1 or rounds < 1: raise ValueError("`steps` and `rounds` must be >= 1")
    resolve_device(device, ('cpu', 'cuda'), 'cpu or cuda')
    is_cuda = torch.device(device).type == 'cuda'
    clock = clock or ('wall' if is_cuda else 'cpu')
    if clock not in ('wall', 'cpu') or (clock == 'cpu' and is_cuda): raise ValueError(f"bad clock {clock!r} for {device}")
    global _now
    _now = time.process_time if clock == 'cpu' else time.perf_counter
    res = {'meta': {'device': device, 'torch': torch.__version__, 'steps': steps, 'rounds': rounds,
                    'threads': torch.get_num_threads(), 'clock': clock, 'machine': _machine(device),
                    'date': time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}}
    for wl in workloads:
        s = scale if scale is not None else (1. if is_cuda else CPU_SCALE[wl])
        torch.manual_seed(0)
        init = WORKLOADS[wl][1](s)
        batches, valid = _data(wl, s, device, steps)
        n_params = sum(p.numel() for p in init.parameters())
        if verbose: print(f"[{wl}] {WORKLOADS[wl][0]} | scale {s:g}, {n_params/1e6:.3g}M params, "
                          f"{sum(1 for _ in init.parameters())} tensors, batch {len(batches[0][0])}", file=sys.stderr)
        learners = {m: _learner(wl, s, m, device, batches, valid, init, lr) for m in modes}
        mems, bounds = {}, []
        for m, (learn, rec) in learners.items():  # warm-up (not timed; the dynamic loss scales settle meanwhile)
            for _ in range(max(1, math.ceil(warmup/steps))): _fit(learn)
            rec.update(steps=[], cb_steps=[], events={})
        for r in range(rounds):
            bounds.append(_copy_bound(n_params, _half(device), device))
            for m in (modes if r % 2 == 0 else modes[::-1]):  # alternate the order: no mode always runs first
                _fit(learners[m][0])
                if verbose: print(f"  round {r+1}/{rounds} {m:9s} {1e3*statistics.median(learners[m][1]['steps'][-steps:]):9.2f} ms/step",
                                  file=sys.stderr)
        for m, (learn, rec) in learners.items():  # memory: one more untimed fit per mode (optimizer state exists now)
            mem = None if is_cuda else _CpuMemory()
            if mem is not None: learn.add_cb(mem)
            if is_cuda: torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats(); before = torch.cuda.memory_allocated()
            n, ev = len(rec['steps']), dict(rec['events'])
            _fit(learn); del rec['steps'][n:], rec['cb_steps'][n:]; rec['events'] = ev
            # CUDA: the other modes' learners are resident too: this one's own bytes + what the fit allocated on top
            mems[m] = _held_bytes(learn) + torch.cuda.max_memory_allocated() - before if is_cuda else mem.peak
            if mem is not None: learn.remove_cb(mem)
        bound, hot = statistics.median(bounds), _copy_bound(n_params, _half(device), device, cold=False)
        out = {'_workload': {'scale': s, 'n_params': n_params, 'bound_ms': 1e3*bound, 'bound_hot_ms': 1e3*hot,
                             'copy_GBps': 12*n_params/bound/1e9, 'batch': len(batches[0][0])}}
        for m, (learn, rec) in learners.items():
            loss, acc = _evaluate(learn.model, valid)
            train_loss = statistics.mean(_evaluate(learn.model, b)[0] for b in batches)
            n = len(rec['steps'])
            out[m] = {'ms_step': 1e3*statistics.median(rec['steps']), 'ms_cb': 1e3*statistics.median(rec['cb_steps']),
                      'events_ms': {k: 1e3*v/n for k, v in rec['events'].items()}, 'mem_MB': mems[m]/2**20,
                      'loss': loss, 'acc': acc, 'train_loss': train_loss, 'n_steps': n, 'skipped': rec['skipped'],
                      'all_steps': rec['all']}
        for m in modes:
            f, o = out.get('fp32'), out[m]
            o['speedup'] = f['ms_step']/o['ms_step'] if f else None
            o['mem_ratio'] = o['mem_MB']/f['mem_MB'] if f and f['mem_MB'] else None
            o['cb_over_bound'] = o['ms_cb']/out['_workload']['bound_ms']
        res[wl] = out
    return res

CPU_SCALE = {'mlp': .125, 'book': .1, 'conv': .125, 'act': .125}  # sizes on a CPU (bf16 matmul can be 100x slower)

def _machine(device):
    if torch.device(device).type == 'cuda': return torch.cuda.get_device_name()
    name = platform.processor() or platform.machine()
    try:
        for line in open('/proc/cpuinfo'):
            if line.startswith('model name'): name = line.split(':', 1)[1].strip(); break
    except OSError: pass
    import os
    return f"{name}, {os.cpu_count()} cores"

def format_table(res:dict) -> str:
    "The results as markdown tables, one per workload."
    meta, lines = res['meta'], []
    lines.append(f"device: {meta['device']} ({meta['machine']}), torch {meta['torch']}, {meta['threads']} threads, "
                 f"{meta['clock']} clock, {meta['rounds']} rounds x {meta['steps']} steps per mode, {meta['date']}")
    for wl, out in res.items():
        if wl == 'meta': continue
        w = out['_workload']
        lines += ['', f"**{wl}** - {WORKLOADS[wl][0]} (scale {w['scale']:g}: {w['n_params']/1e6:.3g}M params, batch "
                  f"{w['batch']}); bookkeeping bound {w['bound_ms']:.2f} ms (copy {w['copy_GBps']:.2f} GB/s)", '',
                  '| mode | ms/step | speedup vs fp32 | ms in precision cbs | cbs / bound | memory MB | mem vs fp32 | train loss | '
                  'valid loss | valid acc | skipped steps |', '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|']
        for m, o in out.items():
            if m == '_workload': continue
            sp = f"{o['speedup']:.2f}x" if o['speedup'] else '-'
            mr = f"{o['mem_ratio']:.2f}" if o['mem_ratio'] else '-'
            lines.append(f"| {m} | {o['ms_step']:.1f} | {sp} | {o['ms_cb']:.2f} | {o['cb_over_bound']:.2f} | "
                         f"{o['mem_MB']:.1f} | {mr} | {o['train_loss']:.4f} | {o['loss']:.4f} | {o['acc']:.3f} | "
                         f"{o['skipped']}/{o['all_steps']} |")
    return '\n'.join(lines)

def _csv(s): return tuple(o.strip() for o in s.split(',') if o.strip())

def main(argv=None):
    p = argparse.ArgumentParser(prog='python -m fp16cb.bench', description=__doc__.split('\n')[0])
    p.add_argument('--workloads', type=_csv, default=tuple(WORKLOADS), help=f"comma-separated: {','.join(WORKLOADS)}")
    p.add_argument('--modes', type=_csv, default=tuple(MODES), help=f"comma-separated: {','.join(MODES)}")
    p.add_argument('--steps', type=int, default=3, help='training steps per mode per round')
    p.add_argument('--rounds', type=int, default=3, help='timed rounds (after the warm-up)')
    p.add_argument('--warmup', type=int, default=8, help='untimed warm-up steps per mode')
    p.add_argument('--device', default=None, help='cpu or cuda (default: cuda when available)')
    p.add_argument('--scale', type=float, default=None, help='workload size factor (default: 1 on CUDA, smaller on CPU)')
    p.add_argument('--threads', type=int, default=None, help='torch.set_num_threads')
    p.add_argument('--clock', default=None, choices=('wall', 'cpu'),
                   help='wall time, or process CPU time (default on CPU: robust to a shared machine)')
    p.add_argument('--json', default=None, help='also write the results as JSON to this file')
    a = p.parse_args(argv)
    if a.threads: torch.set_num_threads(a.threads)
    try: res = run_bench(a.workloads, a.modes, a.steps, a.rounds, warmup=a.warmup, device=a.device, scale=a.scale,
                         clock=a.clock)
    except ValueError as e: p.error(str(e))  # bad input: a usage error (exit 2), not a traceback
    print(format_table(res))
    if a.json:
        with open(a.json, 'w') as f: json.dump(res, f, indent=1)
    return res

if __name__ == '__main__': main()
