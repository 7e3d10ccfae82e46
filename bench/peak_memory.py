"""The true peak: the memory a fit holds at every moment, not only between steps. For each mode, a fit of two epochs
with fastai's `Adam` and a `learn.save` after each epoch (as `SaveModelCallback` does), on a model with one large param
(`Linear(4096, 4096)`) and on a small GPT-2 (`bench.workloads.GPT`: vocab 50257, d=256, 4 blocks, the head tied to the
embedding: 16.0M params, 12.9M of them the embedding). Reported, in bytes per param above the data set: the memory
between steps (at each training batch's start, after the first step), and its peak over each optimizer step, each
backward (activations included, and the steps taken there with `step_in_backward`), the mid-fit saves and the fit's end
(the teardown that gives the FP32 learner back). On a CPU the figures are torch's own allocations, exact, from the
profiler's memory events (every allocation and free, in order, from before the model is made); on a GPU, `torch.cuda`'s
allocated and peak-allocated bytes."""
from __future__ import annotations
import gc, os, tempfile, warnings
from contextlib import contextmanager
import torch
from torch import nn
from fastai.basics import Learner, DataLoaders, Adam, MSELossFlat, CrossEntropyLossFlat, Callback

__all__ = ['MODES', 'PEAK_MODES', 'PEAK_MODELS', 'PHASES', 'Tracker', 'measure_peaks', 'format_peaks']

# every mode measured here and by `bench.state_memory`, by name: the learner set to it
MODES = {'fp32': lambda l: l, 'fastai to_fp16': lambda l: l.to_fp16_fastai(), 'to_bf16': lambda l: l.to_bf16(),
         'to_bf16 flat': lambda l: l.to_bf16(flat_master=True), 'to_fp16': lambda l: l.to_fp16(),
         'to_bf16 half_storage': lambda l: l.to_bf16(half_storage=True), 'to_native_bf16': lambda l: l.to_native_bf16(),
         'to_bf16 step_in_backward': lambda l: l.to_bf16(step_in_backward=True),
         'to_bf16 half_storage step_in_backward': lambda l: l.to_bf16(half_storage=True, step_in_backward=True),
         'to_bf16 state_dtype': lambda l: l.to_bf16(state_dtype=torch.bfloat16),
         'to_bf16 flat state_dtype': lambda l: l.to_bf16(flat_master=True, state_dtype=torch.bfloat16),
         'to_bf16 half_storage state_dtype': lambda l: l.to_bf16(half_storage=True, state_dtype=torch.bfloat16),
         'to_bf16 step_in_backward state_dtype': lambda l: l.to_bf16(step_in_backward=True, state_dtype=torch.bfloat16),
         'to_bf16 half_storage step_in_backward state_dtype':
             lambda l: l.to_bf16(half_storage=True, step_in_backward=True, state_dtype=torch.bfloat16),
         'to_bf16 state8': lambda l: l.to_bf16(state_dtype='8bit'),
         'to_bf16 half_storage state8': lambda l: l.to_bf16(half_storage=True, state_dtype='8bit'),
         'to_bf16 step_in_backward state8': lambda l: l.to_bf16(step_in_backward=True, state_dtype='8bit'),
         'to_bf16 half_storage step_in_backward state8':
             lambda l: l.to_bf16(half_storage=True, step_in_backward=True, state_dtype='8bit')}
PEAK_MODES = ['fp32', 'to_bf16', 'to_bf16 state_dtype', 'to_bf16 half_storage', 'to_bf16 half_storage state_dtype',
              'to_bf16 step_in_backward', 'to_bf16 half_storage step_in_backward state_dtype', 'to_bf16 state8',
              'to_bf16 half_storage state8', 'to_bf16 half_storage step_in_backward state8']
PHASES = ('between', 'step', 'backward', 'save', 'end')

def _linear(): return nn.Sequential(nn.Linear(4096, 4096))
def _gpt():
    from bench.workloads import GPT
    return GPT(vocab=50257, d=256, n_layers=4, n_heads=4, seq=32)

def _linear_data(g, n:int, bs:int=16):
    x, y = torch.randn(n * bs, 4096, generator=g), torch.randn(n * bs, 4096, generator=g)
    return list(zip(x, y)), MSELossFlat()

def _gpt_data(g, n:int, bs:int=2):
    t = torch.randint(0, 50257, (n * bs, 33), generator=g)
    return list(zip(t[:, :-1], t[:, 1:])), CrossEntropyLossFlat()

PEAK_MODELS = {'one large param: Linear(4096, 4096)': (_linear, _linear_data),
               'GPT-2 small: vocab 50257, d=256, 4 blocks, tied head': (_gpt, _gpt_data)}

class Tracker:
    """Marks moments of a fit (`mark(name)`); `marks()` gives `[(name, bytes allocated at the mark, peak since the mark
    before)]`, relative to what was allocated when `start()` was called. CPU: the profiler's memory events; CUDA: its
    allocator's statistics."""
    def __init__(self, device): self.cuda, self._marks = torch.device(device).type == 'cuda', []

    @contextmanager
    def running(self):
        if self.cuda:
            torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            yield self
            return
        os.environ.setdefault('KINETO_LOG_LEVEL', '5')  # the profiler's start and stop lines on stderr
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof: yield self
        self._prof = prof

    def mark(self, name:str):
        if not self.cuda:
            with torch.profiler.record_function('mark:' + name): return
        torch.cuda.synchronize()
        now, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        self._marks.append((name, now - self._base, peak - self._base))
        torch.cuda.reset_peak_memory_stats()

    def marks(self) -> list:
        if self.cuda: return self._marks
        evs = sorted(((e.start_ns(), e.name(), e.nbytes() if e.name() == '[memory]' else 0)
                      for e in self._prof.profiler.kineto_results.events()
                      if e.name() == '[memory]' or e.name().startswith('mark:')), key=lambda o: o[0])
        res, now, peak = [], 0, 0
        for _, name, n in evs:
            if name == '[memory]':
                now += n; peak = max(peak, now)
                continue
            res.append((name[5:], now, peak))
            peak = now
        return res

class _Starts(Callback):
    "Marks the start of each phase (before every other callback), and the memory between steps."
    order = -10**6
    def __init__(self, tracker:Tracker): self.tracker = tracker
    def _mark(self, name:str):
        if self.training: self.tracker.mark(name)
    def before_batch(self):
        if self.epoch or self.iter: self._mark('between')  # after a step
    def before_backward(self): self._mark('backward:start')
    def before_step(self): self._mark('step:start')
    def after_fit(self): self.tracker.mark('end:start')

class _Ends(Callback):
    "Marks the end of each phase (after every other callback); a checkpoint each epoch (`SaveModelCallback`'s way)."
    order = 10**6
    def __init__(self, tracker:Tracker): self.tracker = tracker
    def after_backward(self):
        if self.training: self.tracker.mark('backward')
    def after_step(self):
        if self.training: self.tracker.mark('step')
    def after_epoch(self):
        self.tracker.mark('save:start')
        self.learn.save('peak')
        self.tracker.mark('save')

def run_one(model:str, mode:str, epochs:int=1, n_batches:int=3, seed:int=0, device='cpu') -> dict:
    """`{phase: bytes per param}` of one fit of `mode` on `model` (a key of `PEAK_MODELS`, or its `(make, data)`):
    'between' the largest between steps, the others the peak over that phase; 'n' the params."""
    make, data = PEAK_MODELS[model] if isinstance(model, str) else model
    g = torch.Generator().manual_seed(seed)
    items, loss = data(g, n_batches)
    if 'state8' in mode:  # the 8-bit maps and their search tables: made once per process, not per param (counted out)
        from fp16cb.storage import state8
        for signed in (True, False): state8._lut(signed, device)
    from fp16cb.storage.state_storage import _noise_table
    _noise_table(device)  # the stochastic rounding's noise table (512 KiB on a CPU): once per process, counted out too
    with tempfile.TemporaryDirectory() as tmp:
        dls = DataLoaders.from_dsets(items, items[:len(items) // n_batches], bs=len(items) // n_batches, shuffle=False,
                                     device=device)
        tracker = Tracker(device)
        with tracker.running():  # from before the model is made: every allocation and free after the data set's is seen
            torch.manual_seed(seed)
            net = make()
            n = sum(p.numel() for p in net.parameters())
            learn = MODES[mode](Learner(dls, net, loss_func=loss, opt_func=Adam, lr=1e-4, path=tmp))
            with learn.no_bar(), learn.no_logging(): learn.fit(epochs, cbs=[_Starts(tracker), _Ends(tracker)])
            tracker.mark('end')
        res = {'n': n}
        for name, now, peak in tracker.marks():
            if name.endswith(':start'): continue
            v = now if name == 'between' else peak
            res[name] = max(res.get(name, 0), v / n)
        del learn, net; gc.collect()
    return res

def measure_peaks(models=None, modes=None, **kwargs) -> dict:
    "`{model: {mode: {phase: bytes per param}}}` (`run_one`), each mode in a fit of its own."
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return {m: {mode: run_one(m, mode, **kwargs) for mode in (modes or PEAK_MODES)}
                for m in (models or PEAK_MODELS)}

def format_peaks(res:dict) -> str:
    "A markdown table per model: each phase's figure, the mode's peak, and whether it is above FP32's peak."
    out = []
    for model, by_mode in res.items():
        n = next(iter(by_mode.values()))['n']
        ref = max(by_mode['fp32'][p] for p in PHASES) if 'fp32' in by_mode else None
        out.append(f"{model} ({n/1e6:.1f}M params), fastai Adam, bytes/param above the data set:\n")
        out.append("| mode | between steps | step | backward | mid-fit save | fit's end | peak | above FP32's peak |")
        out.append("|---|---|---|---|---|---|---|---|")
        for mode, r in by_mode.items():
            peak = max(r[p] for p in PHASES)
            worst = [p for p in PHASES if ref is not None and r[p] > ref * 1.005]
            out.append(f"| {mode} | " + " | ".join(f"{r[p]:.1f}" for p in PHASES) + f" | {peak:.1f} | "
                       + (', '.join(worst) if worst else 'no') + " |")
        out.append("")
    return "\n".join(out)
