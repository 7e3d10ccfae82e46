"""Side-by-side benchmark of mixed-precision modes: `python -m bench [--device cuda] [--json out.json]`.

One process; every mode trains its own copy of the same model on the same synthetic batches with fastai's real
`Learner.fit` (one epoch of `--steps` batches per round), the modes interleaved round-robin over `--rounds` rounds
after `--warmup` untimed steps (more, up to `--warmup-max`, while a dynamic loss scale still skips steps); each mode
with fastai's Adam and/or torch's fused AdamW (`--opts`); `torch-amp` is the same training in a plain PyTorch loop. A step is timed from the first `before_batch` to the last `after_batch`
callback (forward, loss, backward, optimizer step, zero_grad and every callback: data loading and validation
excluded), synchronised on CUDA. Reported: median ms/step over the timed steps not skipped for an overflow (a
skipped step skips the optimizer) and speedup vs fp32 (same optimizer); ms/step inside the
precision callbacks (`--cb-timers`: their event methods wrapped by timers; default on a CPU only, as the timers
synchronise the GPU); the bookkeeping bound = 12 bytes/param / copy bandwidth (a 16->32 and a 32->16
`_foreach_copy_` of the model's size, caches flushed first, timed in every round); on a CPU times are this process's
CPU time (`--clock cpu`), which other processes sharing the cores do not inflate; the peak memory of a step (CPU:
params + grads + optimizer state + kept originals + tensors saved for backward; CUDA: `max_memory_allocated` during
a fit, reset per mode, with every other learner parked on the CPU); the final FP32 loss on the training batches and
loss/accuracy on a held-out batch; the skipped (overflow) steps; the share of conv weights in channels-last format
during the fit; and whether the speed targets are met (reported, never asserted): the CPU ones (the
bookkeeping of `to_bf16`/`to_fp16`, flat or not, on the many-tensor model `book` within 1.3x the copy bound and
>= 3x less than fastai's master-weight algorithm; `to_bf16` at >= 0.97x the speed of `bare-bf16`, a bare bf16 model in the
same fastai loop, on the compute-bound `mlp`) and the GPU ones.

The compiled comparison (`--compile`, or `--modes compile` on the workloads given): eager `to_bf16`, `to_bf16` with
`learn.model = torch.compile(learn.model)` and the plain loop with its model compiled, interleaved like every run, on
`--compile-backend` (auto: inductor where it compiles, a C++ compiler on a CPU; else aot_eager); the first epoch,
which compiles, is in the untimed warm-up and its wall time is reported on its own (`first_fit_s`, every run); the
compiled targets (compiled `to_bf16` >= 1.2x eager, within 1.05x of the compiled plain loop) are reported.
"""
from __future__ import annotations
import argparse, contextlib, copy, json, math, os, platform, statistics, sys, time, warnings
import torch
from fastai.basics import Learner, DataLoaders, CrossEntropyLossFlat
from fastai.callback.channelslast import ChannelsLast
import fastai.callback.fp16 as ffp16

import fp16cb  # noqa: F401 (patches Learner.to_fp16 & co.)
from fp16cb.callbacks import ModelToHalf, MixedPrecision
from fp16cb.callbacks import NativeMixedPrecision
from fp16cb.dtypes import resolve_device

from .workloads import WORKLOADS, WORKLOAD_SETS, CPU_SCALE, make_data, n_params
from .modes import (AutocastCB, FastaiNonNative, BareBF16, MODES, OPTS, PLAIN, run_key, fused_adamw_ok, half_dtype,
                    PLAIN_COMPILED, PLAIN_MODES, COMPILED_MODES, MODE_SETS, set_compile_backend, compile_backend,
                    pick_compile_backend)
from .measure import (set_clock, new_record, StepClock, time_events, CpuMemory, copy_bound, evaluate, move_state, sync,
                      cpu_flags, clear_steps, stepped)
from .plain import PlainAMP

__all__ = ['run_bench', 'defaults', 'targets', 'format_table', 'main', 'Batches', 'CPU_MODES', 'GPU_MODES',
           'COMPILE_WORKLOADS']

CPU_MODES = ('fp32', 'autocast', 'fastai', 'bf16', 'bf16-flat', 'bare-bf16', 'fp16', 'fp16-flat', 'native')
GPU_MODES = CPU_MODES + (PLAIN,)
COMPILE_WORKLOADS = {'cpu': ('mlp',), 'cuda': ('lm',)}  # `--compile` without `--workloads`: the issue's CPU MLP, GPU LM
_PRECISION = (ModelToHalf, MixedPrecision, NativeMixedPrecision, AutocastCB, ffp16.MixedPrecision, ffp16.ModelToHalf,
              ffp16.NonNativeMixedPrecision, BareBF16)
_BATCH_REFS = ('pred', 'loss', 'loss_grad', 'xb', 'yb')  # what a learner keeps of its last batch after a fit

class Batches:
    "A fixed list of batches that fastai iterates like a `DataLoader` (no collation, no shuffling: same data per mode)."
    def __init__(self, batches): self.batches = batches
    def __iter__(self): return iter(self.batches)
    def __len__(self): return len(self.batches)
    def to(self, device): return self

def _runs(modes, opts) -> list:
    "`(key, mode, opt)` for each mode with each optimizer (the plain loops once: they always use torch's AdamW)."
    res = [(run_key(m, o), m, o) for o in opts for m in modes if m not in PLAIN_MODES]
    return res + [(m, m, 'fused') for m in modes if m in PLAIN_MODES]

def _learner(workload, mode, opt, device, batches, valid, init, lr, cb_timers, fused_ok):
    "A learner (or the plain loop) for one run, with its step clock; returns `(learner, record)`."
    model = copy.deepcopy(init).to(device)
    if mode in PLAIN_MODES:
        plain = PlainAMP(model, batches, device, lr, fused=fused_ok, channels_last=WORKLOADS[workload].channels_last,
                         compile_backend=compile_backend() if mode == PLAIN_COMPILED else None)
        return plain, plain.rec
    dls = DataLoaders(Batches(batches), Batches([valid]))
    dls.device = torch.device(device)
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), opt_func=OPTS[opt][1], lr=lr)
    learn.remove_cbs([cb for cb in learn.cbs if type(cb).__name__ == 'ProgressCallback'])
    if WORKLOADS[workload].channels_last: learn.add_cb(ChannelsLast())
    MODES[mode][1](learn, device)
    rec = new_record()
    if cb_timers:
        for cb in learn.cbs:
            if isinstance(cb, _PRECISION): time_events(cb, rec, device)
    learn.add_cbs([StepClock(rec, device, True), StepClock(rec, device, False)])
    return learn, rec

def _fit(learn, memory=None):
    "One epoch (one pass of the plain loop); `memory`: a `CpuMemory` callback for this fit."
    if isinstance(learn, PlainAMP): return learn.fit(measure_memory=memory is not None)
    fit = type(learn).fit
    # fastai's own pair (its ModelToHalf + NonNativeMixedPrecision) runs under fastai's plain `fit`: fp16cb's stacking
    # check around `Learner.fit` counts the pair as two setups. The timed steps are the same either way.
    if any(isinstance(cb, FastaiNonNative) for cb in learn.cbs): fit = getattr(fit, '__wrapped__', fit)
    try:
        with warnings.catch_warnings(), learn.no_logging():
            warnings.simplefilter('ignore')
            fit(learn, 1, cbs=[memory] if memory is not None else None)
    finally:
        for k in _BATCH_REFS: setattr(learn, k, None)  # the last batch's predictions (1 GB for the LM) are not its state

def _fit_parked(learn, device, park, memory=None):
    "`_fit` with the learner's tensors brought from the CPU first and sent back after, when `park`."
    if park: move_state(learn, device)
    try: _fit(learn, memory)
    finally:
        if park: move_state(learn, 'cpu')

def _graphs() -> int:
    "How many graphs dynamo compiled so far in this process (a recompilation counts: it compiles a graph)."
    try: from torch._dynamo.utils import counters
    except ImportError: return 0
    return counters['stats']['unique_graphs']

def _cold_compile():
    "Context: torch.compile's on-disk caches off (inductor's FX graph cache & co.): the first epoch compiles for real."
    try:
        import torch.compiler.config as cc
        return cc.patch(force_disable_caches=True)
    except (ImportError, AttributeError): return contextlib.nullcontext()

def _warm_up(learn, rec, device, parked, steps, warmup, warmup_max):
    """`warmup` untimed steps, then more (up to `warmup_max`) while a dynamic loss scale still overflows and skips steps;
    the wall time of the first fit (where a compiled model compiles) in `rec['first_fit_s']`, the graphs dynamo
    compiled in it in `rec['first_fit_graphs']` (0 for a compiled model whose graphs an earlier run of the same model
    class compiled: dynamo caches them per code object, guarded by dtypes and shapes). The first fit runs with the
    compiler's on-disk caches off: what it reports is a cold compile, not what an earlier process left on the disk."""
    n_fits = max(1, math.ceil(warmup/steps))
    for i in range(max(n_fits, math.ceil(warmup_max/steps))):
        if i == 0: sync(device); t0, g0 = time.perf_counter(), _graphs()
        with _cold_compile() if i == 0 else contextlib.nullcontext(): _fit_parked(learn, device, parked)
        if i == 0: sync(device); rec['first_fit_s'], rec['first_fit_graphs'] = time.perf_counter() - t0, _graphs() - g0
        if i + 1 >= n_fits and not any(rec['skips'][-steps:]): break
    clear_steps(rec)

def _should_park(park, is_cuda, n_runs, n_par, device) -> bool:
    "'auto': on CUDA when the learners' FP32 params, grads and Adam state (16 bytes/param each) would fill 40% of the GPU."
    if park != 'auto': return bool(park)
    return is_cuda and n_runs * 16 * n_par > .4 * torch.cuda.get_device_properties(device).total_memory

def _memory(learners, device, is_cuda, park) -> dict:
    "Peak bytes of a step per run: one more untimed fit each (optimizer state exists now; step times not kept)."
    mems = {}
    if is_cuda and not park:  # the baseline of each run: every other learner off the GPU
        for learn, _ in learners.values(): move_state(learn, 'cpu')
    for k, (learn, rec) in learners.items():
        n, ev = len(rec['steps']), dict(rec['events'])
        if is_cuda:
            torch.cuda.empty_cache(); before = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
            _fit_parked(learn, device, True)
            mems[k] = torch.cuda.max_memory_allocated() - before
        else:
            mem = CpuMemory()
            _fit(learn, mem)
            mems[k] = learn.mem_peak if isinstance(learn, PlainAMP) else mem.peak
        del rec['steps'][n:], rec['cb_steps'][n:], rec['skips'][n:]; rec['events'] = ev
    return mems

def _figures(learn, rec, batches, valid, mem, device, parked, timed) -> dict:
    """The results of one run; the model is evaluated in FP32 (on the device: brought back for it when parked; a
    compiled model's original module: an FP32 graph would compile again for nothing)."""
    if parked: move_state(learn, device)
    model = getattr(learn.model, '_orig_mod', learn.model)
    loss, acc = evaluate(model, valid)
    train_loss = statistics.mean(evaluate(model, b)[0] for b in batches)
    if parked: move_state(learn, 'cpu')
    n, steps = len(rec['steps']), len(batches)
    kept = stepped(rec)  # a run whose timed steps were all skipped has no step time
    return {'ms_step': 1e3*statistics.median(rec['steps'][i] for i in kept) if kept else None,
            'ms_cb': 1e3*statistics.median(rec['cb_steps'][i] for i in kept) if timed and kept else None,
            'ms_rounds': [1e3*statistics.median(rec['steps'][i:i+steps]) for i in range(0, n, steps)],
            'first_fit_s': rec.get('first_fit_s'), 'first_fit_graphs': rec.get('first_fit_graphs'),
            'timed_graphs': rec.get('timed_graphs', 0),
            'events_ms': {k: 1e3*v/n for k, v in rec['events'].items()}, 'mem_MB': mem/2**20, 'loss': loss, 'acc': acc,
            'train_loss': train_loss, 'n_steps': n, 'timed_skipped': sum(rec['skips']), 'skipped': rec['skipped'],
            'all_steps': rec['all'], 'channels_last': rec['channels_last']}

def _ratios(out, runs):
    "Speedup and memory vs fp32 with the same optimizer (`torch-amp` against fp32 with fused AdamW, when it ran)."
    for k, m, o in runs:
        ref = out.get(run_key('fp32', o)) or out.get('fp32')
        f = out[k]
        f['speedup'] = _div(ref['ms_step'], f['ms_step']) if ref else None
        f['mem_ratio'] = f['mem_MB']/ref['mem_MB'] if ref and ref['mem_MB'] else None
        f['cb_over_bound'] = f['ms_cb']/out['_workload']['bound_ms'] if f['ms_cb'] is not None else None

def _names(given, known:dict, sets:dict, what:str) -> tuple:
    res = []
    for name in given:
        if name in sets: res += list(sets[name])
        elif name in known: res.append(name)
        else: raise ValueError(f"unknown {what} {name!r} (expected {', '.join(list(known) + list(sets))})")
    return tuple(dict.fromkeys(res))

def _workload_run(wl, s, runs, device, is_cuda, steps, rounds, warmup, warmup_max, lr, cb_timers, park, fused_ok,
                  verbose) -> dict:
    "Every run of one workload, interleaved; returns its results."
    torch.manual_seed(0)
    init = WORKLOADS[wl].model(s)
    batches, valid = make_data(wl, s, device, steps)
    n_par = n_params(init)
    parked = _should_park(park, is_cuda, len(runs), n_par, device)
    if verbose: print(f"[{wl}] {WORKLOADS[wl].desc} | scale {s:g}, {n_par/1e6:.3g}M params, "
                      f"{sum(1 for _ in init.parameters())} tensors, batch {len(batches[0][0])}"
                      f"{', learners parked on the CPU between fits' if parked else ''}", file=sys.stderr)
    learners, failed = {}, {}
    for k, m, o in runs:  # built and warmed up one by one (untimed; the dynamic loss scales settle meanwhile)
        try:
            learners[k] = _learner(wl, m, o, device, batches, valid, init, lr, cb_timers, fused_ok)
            if parked: move_state(learners[k][0], 'cpu')
            _warm_up(*learners[k], device, parked, steps, warmup, warmup_max)
        except Exception as e:  # a mode that cannot train this workload here is reported; the others are measured
            failed[k] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1][:300]}"
            learners.pop(k, None)
            if verbose: print(f"  {k} failed in its warm-up, left out: {failed[k]}", file=sys.stderr)
    runs = [r for r in runs if r[0] not in failed]
    keys, bounds = [k for k, _, _ in runs], []
    for r in range(rounds):
        bounds.append(copy_bound(n_par, half_dtype(device), device))
        for k in (keys if r % 2 == 0 else keys[::-1]):  # alternate the order: no run always goes first
            g = _graphs()
            _fit_parked(learners[k][0], device, parked)
            learners[k][1]['timed_graphs'] = learners[k][1].get('timed_graphs', 0) + _graphs() - g  # should stay 0
            if verbose: print(f"  round {r+1}/{rounds} {k:15s} {1e3*statistics.median(learners[k][1]['steps'][-steps:]):9.2f} ms/step",
                              file=sys.stderr)
    mems = _memory(learners, device, is_cuda, parked)
    parked = parked or is_cuda  # `_memory` leaves every learner parked on CUDA
    bound, hot = statistics.median(bounds), copy_bound(n_par, half_dtype(device), device, cold=False)
    out = {'_workload': {'scale': s, 'n_params': n_par, 'bound_ms': 1e3*bound, 'bound_hot_ms': 1e3*hot,
                         'copy_GBps': 12*n_par/bound/1e9, 'batch': len(batches[0][0]), 'parked': parked, 'failed': failed}}
    for k, m, o in runs:
        learn, rec = learners.pop(k)
        out[k] = {'mode': m, 'opt': o, **_figures(learn, rec, batches, valid, mems[k], device, parked, cb_timers)}
    _ratios(out, runs)
    if is_cuda: torch.cuda.empty_cache()
    return out

def defaults(is_cuda:bool) -> tuple:
    "`(workloads, modes, optimizers)` run when none are given: what GPU users train on CUDA, the CPU set elsewhere."
    if is_cuda: return WORKLOAD_SETS['gpu'], GPU_MODES, ('adam', 'fused')
    return WORKLOAD_SETS['cpu'], CPU_MODES, ('adam',)

def run_bench(
    workloads=None, # names of `WORKLOADS` or of `WORKLOAD_SETS` (default: the 'gpu' set on CUDA, the 'cpu' set elsewhere)
    modes=None, # names of `MODES` (default: `GPU_MODES` on CUDA, `CPU_MODES` elsewhere)
    steps:int=3, # training steps per mode per round
    rounds:int=3, # timed rounds (after the warm-up)
    warmup:int=8, # untimed warm-up steps per mode (the dynamic loss scales fall from 2**24 meanwhile)
    device=None, # 'cpu' or 'cuda' (default: cuda when available)
    scale:float=None, # workload size factor (default 1 on CUDA, `CPU_SCALE` of each workload on CPU)
    lr:float=1e-3, # Adam learning rate
    verbose:bool=True,
    clock:str=None, # 'wall' or 'cpu' (process CPU time: robust to other processes sharing a CPU; default on CPU)
    opts=None, # names of `OPTS` (default: adam and fused on CUDA, adam elsewhere)
    cb_timers:bool=None, # time the precision callbacks' events (default: on a CPU; on CUDA they add syncs)
    compile_backend:str='auto', # backend of the compiled modes: 'auto' (inductor where it compiles, else aot_eager), 'inductor', 'aot_eager'
    park='auto', # learners' tensors on the CPU between their fits: 'auto' (when they would not fit the GPU), True, False
    warmup_max:int=None, # warm-up steps at most, while a dynamic loss scale still skips steps (default 4 * `warmup`)
) -> dict:
    "Run the benchmark; returns `{workload: {run: figures}}` plus `'meta'` and `'targets'`."
    device = device or ('cuda' if torch.cuda.is_available() else 'cpu')
    if steps < 1 or rounds < 1: raise ValueError("`steps` and `rounds` must be >= 1")
    warmup_max = 4 * warmup if warmup_max is None else warmup_max
    dev = resolve_device(device, ('cpu', 'cuda'), 'cpu or cuda')
    is_cuda = dev.type == 'cuda'
    dw, dm, do = defaults(is_cuda)
    workloads = _names(workloads or dw, WORKLOADS, WORKLOAD_SETS, 'workload')
    modes, opts = _names(modes or dm, MODES, MODE_SETS, 'mode'), _names(opts or do, OPTS, {}, 'optimizer')
    clock = clock or ('wall' if is_cuda else 'cpu')
    if clock not in ('wall', 'cpu') or (clock == 'cpu' and is_cuda): raise ValueError(f"bad clock {clock!r} for {device}")
    set_clock(clock)
    notes, fused_err = [], fused_adamw_ok(dev)
    if fused_err:
        notes.append(f"fused AdamW does not run on {device} with this torch ({fused_err}): the +fused runs are left out "
                     f"and torch-amp uses AdamW(foreach=True)")
        opts = tuple(o for o in opts if o != 'fused') or ('adam',)
    runs = _runs(modes, opts)
    backend = why = None
    if any(m in COMPILED_MODES for m in modes):
        backend, why = pick_compile_backend(compile_backend, dev)
        notes.append(f"compiled runs: torch.compile(model, backend={backend!r}) ({why}); their first epoch compiles: "
                     "untimed (warm-up), its wall time reported on its own")
    set_compile_backend(backend)
    cb_timers = (not is_cuda) if cb_timers is None else cb_timers
    res = {'meta': {'device': str(dev), 'torch': torch.__version__, 'steps': steps, 'rounds': rounds, 'warmup': warmup,
                    'warmup_max': warmup_max,
                    'threads': torch.get_num_threads(), 'clock': clock, 'machine': _machine(dev), 'cpu_flags': cpu_flags(), 'cb_timers': cb_timers,
                    'workloads': list(workloads), 'runs': [k for k, _, _ in runs], 'notes': notes,
                    'compile_backend': backend, 'compile_backend_why': why,
                    'date': time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}}
    for wl in workloads:
        s = scale if scale is not None else (1. if is_cuda else CPU_SCALE[wl])
        res[wl] = _workload_run(wl, s, runs, dev, is_cuda, steps, rounds, warmup, warmup_max, lr, cb_timers, park,
                                not fused_err, verbose)
    res['targets'] = targets(res)
    return res

# ---------------------------------------------------------------------------------------------------- targets
def _ms(res, wl, key): return (res.get(wl) or {}).get(key, {}).get('ms_step')
def _mem(res, wl, key): return (res.get(wl) or {}).get(key, {}).get('mem_MB')
def _cb(res, wl, key): return (res.get(wl) or {}).get(key, {}).get('ms_cb')  # None: the callbacks were not timed
def _bound(res, wl): return (res.get(wl) or {}).get('_workload', {}).get('bound_ms')

def _target(text, wl, opt, what, a, b, op, threshold) -> dict|None:
    "One check `a / b op threshold`; None when the benchmark did not run both sides."
    if a is None or b is None: return None
    v = a / b
    return {'target': text, 'workload': wl, 'opt': opt, 'value': v, 'what': what, 'op': op, 'threshold': threshold,
            'met': v >= threshold if op == '>=' else v <= threshold}

# fp16cb's master-weight modes, whose bookkeeping (the time in their callbacks) the bookkeeping targets measure
_BOOKKEEPING = {'bf16': 'to_bf16()', 'bf16-flat': 'to_bf16(flat_master=True)', 'fp16': 'to_fp16()',
                'fp16-flat': 'to_fp16(flat_master=True)'}
BARE = 'bare-bf16'

def targets(res:dict) -> list:
    """The speed targets the results can check, each with its value and whether it is met: the CPU ones (bookkeeping on
    the many-tensor model `book` within 1.3x the copy bound and >= 3x less than fastai's master-weight algorithm;
    `to_bf16` at >= 0.97x the bare bf16 model's speed and >= 1.05x torch autocast's on the compute-bound `mlp`), the GPU
    ones, and the compiled ones on every workload they ran on (compiled `to_bf16` >= 1.2x eager `to_bf16`, within 1.05x
    of the compiled plain loop; the backend named in the ratio). The bookkeeping rows need the callback timers
    (`--cb-timers`, default on a CPU)."""
    wls = [k for k in res if k not in ('meta', 'targets')]
    opts = OPTS
    out = []
    for o in opts:
        fastai, bf16, bare = run_key('fastai', o), run_key('bf16', o), run_key(BARE, o)
        for m, name in _BOOKKEEPING.items():
            k = run_key(m, o)
            out.append(_target(f"{name} bookkeeping (ms in its callbacks) within 1.3x the copy bound on the many-tensor "
                               "model (CPU)", 'book', o, f"{k} cb ms / copy bound ms", _cb(res, 'book', k),
                               _bound(res, 'book'), '<=', 1.3))
        for m, name in _BOOKKEEPING.items():
            k = run_key(m, o)
            out.append(_target(f"{name} bookkeeping >= 3x less than fastai's master-weight algorithm on the "
                               "many-tensor model (CPU)", 'book', o, f"{fastai} cb ms / {k} cb ms",
                               _cb(res, 'book', fastai), _cb(res, 'book', k), '>=', 3.))
        out.append(_target("to_bf16() at >= 0.97x the speed of the bare bf16 model (the limit) on the compute-bound MLP",
                           'mlp', o, f"{bare} ms / {bf16} ms", _ms(res, 'mlp', bare), _ms(res, 'mlp', bf16), '>=', .97))
        native = run_key('native', o)
        out.append(_target("to_bf16() >= 1.05x the speed of torch autocast (to_native_bf16 on a CPU, to_native_fp16 on "
                           "a GPU) on the compute-bound MLP", 'mlp', o, f"{native} ms / {bf16} ms", _ms(res, 'mlp', native),
                           _ms(res, 'mlp', bf16), '>=', 1.05))
    for o in opts:  # the default (per-param masters) as fast as flat masters: fastai's loop steps runs of masters fused
        for m in ('bf16', 'fp16'):
            k, flat = run_key(m, o), run_key(m + '-flat', o)
            for wl in ('book', 'resnet50_cl'):
                out.append(_target(f"{_BOOKKEEPING[m]} within 1.05x of {_BOOKKEEPING[m + '-flat']}'s step time", wl, o,
                                   f"{k} ms / {flat} ms", _ms(res, wl, k), _ms(res, wl, flat), '<=', 1.05))
        fp32, fp16 = run_key('fp32', o), run_key('fp16', o)
        for wl, need in (('resnet50_cl', 1.9), ('resnet50', 1.4)):
            out.append(_target(f"to_fp16() >= {need}x the speed of FP32 on ResNet-50 (GPU)", wl, o, f"{fp32} ms / {fp16} ms",
                               _ms(res, wl, fp32), _ms(res, wl, fp16), '>=', need))
    for wl in ('resnet50', 'resnet50_cl'):
        out.append(_target("to_fp16() with fused AdamW within 1.05x of the plain PyTorch AMP loop", wl, 'fused',
                           f"fp16+fused ms / {PLAIN} ms", _ms(res, wl, 'fp16+fused'), _ms(res, wl, PLAIN), '<=', 1.05))
    for o in opts:
        fp16, amp, bf16 = run_key('fp16', o), run_key('autocast', o), run_key('bf16', o)
        for wl in wls:
            out.append(_target("to_fp16() no slower than fastai's to_fp16() (AMP)", wl, o,
                               f"{amp} ms / {fp16} ms", _ms(res, wl, amp), _ms(res, wl, fp16), '>=', 1.))
        out.append(_target("to_fp16() >= 1.3x faster than fastai's to_fp16() on the LM", 'lm', o,
                           f"{amp} ms / {fp16} ms", _ms(res, 'lm', amp), _ms(res, 'lm', fp16), '>=', 1.3))
        out.append(_target("ResNet-50 with ChannelsLast >= 1.3x faster than NCHW (to_fp16)", 'resnet50', o,
                           f"resnet50 {fp16} ms / resnet50_cl {fp16} ms", _ms(res, 'resnet50', fp16),
                           _ms(res, 'resnet50_cl', fp16), '>=', 1.3))
        for wl in wls:
            out.append(_target("to_bf16() at least as fast as to_fp16()", wl, o, f"{fp16} ms / {bf16} ms",
                               _ms(res, wl, fp16), _ms(res, wl, bf16), '>=', 1.))
        for wl in wls:
            out.append(_target("to_fp16() peak memory no more than fastai's to_fp16() (AMP)", wl, o,
                               f"{fp16} MB / {amp} MB", _mem(res, wl, fp16), _mem(res, wl, amp), '<=', 1.))
    out.append(_target("to_fp16() with fused AdamW within 1.05x of the plain PyTorch AMP loop on the LM", 'lm', 'fused',
                       f"fp16+fused ms / {PLAIN} ms", _ms(res, 'lm', 'fp16+fused'), _ms(res, 'lm', PLAIN), '<=', 1.05))
    backend = (res.get('meta') or {}).get('compile_backend') or '?'
    for o in opts:
        eager, comp = run_key('bf16', o), run_key('bf16-compile', o)
        for wl in wls:
            out.append(_target("compiled to_bf16() >= 1.2x faster than eager to_bf16()", wl, o,
                               f"{eager} ms / {comp} ms ({backend})", _ms(res, wl, eager), _ms(res, wl, comp), '>=', 1.2))
            out.append(_target("compiled to_bf16() within 1.05x of the compiled plain PyTorch loop", wl, o,
                               f"{comp} ms / {PLAIN_COMPILED} ms ({backend})", _ms(res, wl, comp),
                               _ms(res, wl, PLAIN_COMPILED), '<=', 1.05))
    return [t for t in out if t is not None]

# ----------------------------------------------------------------------------------------------------- output
def _machine(device):
    if device.type == 'cuda': return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        for line in open('/proc/cpuinfo'):
            if line.startswith('model name'): name = line.split(':', 1)[1].strip(); break
    except OSError: pass
    return f"{name}, {os.cpu_count()} cores"

def _f(v, fmt, none='-'): return none if v is None else format(v, fmt)
def _div(a, b): return None if a is None or not b else a / b  # None: a side has no figure (every timed step skipped)

def _workload_table(wl, out) -> list:
    w, cl = out['_workload'], WORKLOADS[wl].channels_last
    lines = ['', f"**{wl}** - {WORKLOADS[wl].desc} (scale {w['scale']:g}: {w['n_params']/1e6:.3g}M params, batch "
             f"{w['batch']}); bookkeeping bound {w['bound_ms']:.2f} ms (copy {w['copy_GBps']:.2f} GB/s)", '',
             '| mode | ms/step | speedup vs fp32 | ms in precision cbs | cbs / bound | memory MB | mem vs fp32 | train loss | '
             'valid loss | valid acc | skipped steps |' + (' channels-last |' if cl else ''),
             '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|' + ('---:|' if cl else '')]
    for k, o in out.items():
        if k == '_workload': continue
        lines.append(f"| {k} | {_f(o['ms_step'], '.1f', 'every timed step skipped')} | {_f(o['speedup'], '.2f')}x | {_f(o['ms_cb'], '.2f')} | "
                     f"{_f(o['cb_over_bound'], '.2f')} | {o['mem_MB']:.1f} | {_f(o['mem_ratio'], '.2f')} | "
                     f"{o['train_loss']:.4f} | {o['loss']:.4f} | {o['acc']:.3f} | {o['skipped']}/{o['all_steps']}"
                     f"{f' ({t} timed)' if (t := o.get('timed_skipped')) else ''} |"
                     + (f" {_f(o['channels_last'], '.0%')} |" if cl else ''))
    lines += [f"\n{k} failed on this workload and was left out: {why}" for k, why in w.get('failed', {}).items()]
    return lines

_COMPILE_ROWS = ('bf16', 'bf16-compile') + PLAIN_MODES

def _compile_table(wl, out, meta) -> list:
    """The compiled comparison of one workload (when a compiled mode ran): per run its median ms/step over the timed
    steps, the medians of its rounds, the wall time of its first (compiling, untimed) epoch, and the ratios: a
    compiled run's speedup over its eager twin and compiled `to_bf16` over the compiled plain loop."""
    rows = [(k, o) for k, o in out.items() if k != '_workload' and o['mode'] in _COMPILE_ROWS]
    if not any(o['mode'] in COMPILED_MODES for _, o in rows): return []
    backend, why = meta.get('compile_backend'), meta.get('compile_backend_why')
    plain_c = out.get(PLAIN_COMPILED)
    lines = ['', f"**{wl}, compiled vs eager** - backend **{backend}** ({why}); ms/step: median over the timed steps "
             f"(first epoch excluded: it compiles; its wall time, validation included, compiler's on-disk caches off, in "
             f"its own column: short where an earlier run of this process compiled the same graphs, 0 graphs); a graph "
             f"compiled in the timed rounds would be a recompilation", '',
             '| run | compiled | backend | ms/step | round medians | first epoch s (wall) | graphs compiled: first epoch, '
             'timed rounds | speedup: eager ms / compiled ms | compiled to_bf16 ms / compiled plain ms |',
             '|---|---|---|---:|---|---:|---:|---:|---:|']
    for k, o in rows:
        compiled = o['mode'] in COMPILED_MODES
        twin = out.get(run_key({'bf16-compile': 'bf16', PLAIN_COMPILED: PLAIN}.get(o['mode'], ''), o['opt'])) if compiled else None
        speedup = _div(twin['ms_step'], o['ms_step']) if twin else None
        vs_plain = _div(o['ms_step'], plain_c['ms_step']) if o['mode'] == 'bf16-compile' and plain_c else None
        lines.append(f"| {k} | {'yes' if compiled else 'no'} | {backend if compiled else 'eager'} | {_f(o['ms_step'], '.1f')} | "
                     f"{' / '.join(format(v, '.1f') for v in o.get('ms_rounds') or [])} | {_f(o.get('first_fit_s'), '.2f')} | "
                     f"{_f(o.get('first_fit_graphs'), 'd')}, {_f(o.get('timed_graphs'), 'd')} | "
                     f"{_f(speedup, '.2f')}{'x' if speedup else ''} | {_f(vs_plain, '.2f')} |")
    return lines

def _targets_table(res) -> list:
    ts = res.get('targets') or []
    if not ts: return []
    cpu = not res['meta']['device'].startswith('cuda')
    lines = ['', f"**targets** (reported, never asserted: the CPU targets first, then the GPU ones, then the "
             f"compiled ones"
             f"{': this run is on a CPU' if cpu else ''})", '',
             '| target | workload | optimizer | ratio | value | needed | met |', '|---|---|---|---|---:|---:|---|']
    for t in ts:
        lines.append(f"| {t['target']} | {t['workload']} | {t['opt']} | {t['what']} | {t['value']:.2f} | "
                     f"{t['op']} {t['threshold']:g} | {'yes' if t['met'] else 'NO'} |")
    return lines

def format_table(res:dict) -> str:
    "The results as markdown tables, one per workload, then the targets."
    meta = res['meta']
    lines = [f"device: {meta['device']} ({meta['machine']}), torch {meta['torch']}, {meta['threads']} threads, "
             f"{meta['clock']} clock, {meta['rounds']} rounds x {meta['steps']} steps per mode, {meta['date']}"]
    lines += [f"note: {n}" for n in meta.get('notes', [])]
    for wl, out in res.items():
        if wl not in ('meta', 'targets'): lines += _workload_table(wl, out) + _compile_table(wl, out, meta)
    return '\n'.join(lines + _targets_table(res))

def _csv(s): return tuple(o.strip() for o in s.split(',') if o.strip())

def main(argv=None):
    p = argparse.ArgumentParser(prog='python -m bench', description=__doc__.split('\n')[0])
    sets = '; '.join(f"{k}: {','.join(v)}" for k, v in WORKLOAD_SETS.items())
    p.add_argument('--workloads', type=_csv, default=None,
                   help=f"comma-separated: {','.join(WORKLOADS)}, or a set ({sets}; default: gpu on CUDA, cpu elsewhere)")
    p.add_argument('--gpu', action='store_true', help='the GPU workloads (same as --workloads gpu)')
    p.add_argument('--compile', action='store_true',
                   help=f"the compiled comparison: --modes compile ({','.join(MODE_SETS['compile'])}) on "
                        f"{'/'.join(f'{k}: ' + ','.join(v) for k, v in COMPILE_WORKLOADS.items())} unless --workloads/--gpu say")
    p.add_argument('--compile-backend', default='auto', choices=('auto', 'inductor', 'aot_eager'),
                   help='backend of the compiled modes (auto: inductor where it compiles, a C++ compiler on a CPU; else aot_eager)')
    p.add_argument('--modes', type=_csv, default=None,
                   help=f"comma-separated: {','.join(MODES)}, or a set ({'; '.join(k + ': ' + ','.join(v) for k, v in MODE_SETS.items())}) "
                        f"(default: {','.join(GPU_MODES)} on CUDA; the same but {PLAIN} elsewhere)")
    p.add_argument('--opts', type=_csv, default=None,
                   help=f"comma-separated optimizers: {'; '.join(k + ': ' + v[0] for k, v in OPTS.items())} "
                        "(default: adam,fused on CUDA, adam elsewhere)")
    p.add_argument('--steps', type=int, default=3, help='training steps per mode per round')
    p.add_argument('--rounds', type=int, default=3, help='timed rounds (after the warm-up)')
    p.add_argument('--warmup', type=int, default=8, help='untimed warm-up steps per mode')
    p.add_argument('--warmup-max', type=int, default=None,
                   help='more warm-up steps, up to this many, while a dynamic loss scale still skips steps (default 4x --warmup)')
    p.add_argument('--device', default=None, help='cpu or cuda (default: cuda when available)')
    p.add_argument('--scale', type=float, default=None, help='workload size factor (default: 1 on CUDA, smaller on CPU)')
    p.add_argument('--threads', type=int, default=None, help='torch.set_num_threads')
    p.add_argument('--clock', default=None, choices=('wall', 'cpu'),
                   help='wall time, or process CPU time (default on CPU: robust to a shared machine)')
    p.add_argument('--cb-timers', action=argparse.BooleanOptionalAction, default=None,
                   help='time the precision callbacks (default: on a CPU only; on CUDA the timers synchronise the GPU)')
    p.add_argument('--park', default='auto', choices=('auto', 'yes', 'no'),
                   help="keep idle learners' tensors on the CPU between fits (auto: when they would not fit the GPU)")
    p.add_argument('--json', default=None, help='also write the results as JSON to this file')
    a = p.parse_args(argv)
    if a.threads: torch.set_num_threads(a.threads)
    if a.gpu and a.workloads: p.error("--gpu and --workloads: give one of them")
    if a.compile and a.modes: p.error("--compile and --modes: give one of them (--modes compile,torch-amp: the set and more)")
    workloads, modes = ('gpu',) if a.gpu else a.workloads, a.modes
    if a.compile:
        modes = ('compile',)
        on_cuda = (a.device or ('cuda' if torch.cuda.is_available() else 'cpu')).startswith('cuda')
        workloads = workloads or COMPILE_WORKLOADS['cuda' if on_cuda else 'cpu']
    try: res = run_bench(workloads, modes, a.steps, a.rounds, warmup=a.warmup,
                         warmup_max=a.warmup_max, device=a.device,
                         scale=a.scale, clock=a.clock, opts=a.opts, cb_timers=a.cb_timers,
                         park={'yes': True, 'no': False}.get(a.park, a.park), compile_backend=a.compile_backend)
    except ValueError as e: p.error(str(e))  # bad input: a usage error (exit 2), not a traceback
    print(format_table(res))
    if a.json:
        with open(a.json, 'w') as f: json.dump(res, f, indent=1)
    return res
