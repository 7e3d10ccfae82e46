"""How the benchmark measures: a step clock (wall, or process CPU time), timers around the precision callbacks, the
memory a step holds (CPU: counted tensor by tensor; CUDA: `max_memory_allocated`), the bookkeeping bound, parking an
idle learner's tensors on the CPU."""
from __future__ import annotations
import time
import torch
from fastai.basics import Callback, CrossEntropyLossFlat
from fp16cb.dtypes import cpu_flags  # noqa: F401 (the results' `cpu_flags`)

__all__ = ['set_clock', 'clock', 'sync', 'new_record', 'clear_steps', 'stepped', 'end_step', 'StepClock', 'time_events', 'SavedTensors', 'CpuMemory',
           'held_bytes', 'copy_bound', 'evaluate', 'channels_last_share', 'move_state']

_now = time.perf_counter

def set_clock(kind:str):
    "'wall' (`perf_counter`) or 'cpu' (this process's CPU time: other processes sharing the cores do not inflate it)."
    global _now
    _now = time.process_time if kind == 'cpu' else time.perf_counter
def clock() -> float: return _now()

def sync(device):
    if torch.device(device).type == 'cuda': torch.cuda.synchronize()

def new_record() -> dict:
    "What a mode's timed steps fill in (`skips`: per step in `steps`, whether it was skipped for an overflow)."
    return {'steps': [], 'cb_steps': [], 'skips': [], 'cb': 0., 'events': {}, 't0': 0., 'skipped': 0, 'all': 0,
            'channels_last': None, 'skip': False}

def clear_steps(rec:dict):
    "Forget the steps timed so far (after a warm-up); the run's counts of all and skipped steps go on."
    rec.update(steps=[], cb_steps=[], skips=[], events={})

def stepped(rec:dict) -> list:
    "Indices of the timed steps that ran the optimizer: a skipped step runs none, so it is never timed as a step."
    return [i for i, s in enumerate(rec['skips']) if not s]

def channels_last_share(model) -> float|None:
    "The share of the 4-d params with a kernel bigger than 1x1 that are channels-last now (None: there are none)."
    ws = [p for p in model.parameters() if p.dim() == 4 and p.shape[2] * p.shape[3] > 1]
    return sum(p.is_contiguous(memory_format=torch.channels_last) for p in ws) / len(ws) if ws else None

_STEP_EVENTS = ('before_batch', 'after_pred', 'after_loss', 'before_backward', 'after_backward', 'before_step',
                'after_step', 'after_cancel_step', 'after_cancel_batch', 'after_batch')

class StepClock(Callback):
    "Times each training batch: `first` starts it at `before_batch`, the last callback ends it at `after_batch`."
    def __init__(self, rec, device, first):
        self.rec, self.device, self.first = rec, device, first
        self.order = -10**6 if first else 10**6
    def before_batch(self):
        if self.first and self.training: sync(self.device); self.rec['t0'] = clock()
    def after_pred(self):  # the layout the model trains in (after every before_fit/before_batch conversion)
        if not self.first and self.training: self.rec['channels_last'] = channels_last_share(self.learn.model)
    def after_cancel_step(self):
        if not self.first and self.training: self.rec['skip'] = True  # fp16cb, autocast: an overflow skips the step
    def after_cancel_batch(self):
        if not self.first and self.training: self.rec['skip'] = True  # fastai's algorithm skips the whole batch
    def after_batch(self):
        if not self.first and self.training:
            sync(self.device); self.rec['steps'].append(clock() - self.rec['t0'])
            self.rec['cb_steps'].append(self.rec['cb']); self.rec['cb'] = 0.
            end_step(self.rec)

def end_step(rec):
    "Count the step that just ended (and whether it was skipped) in `rec`."
    rec['skips'].append(rec['skip']); rec['skipped'] += rec['skip']; rec['all'] += 1; rec['skip'] = False

_STORE_WORK = ('lift', 'land', '_lift_slice', '_land_slice')  # the weight store's bookkeeping inside `opt.step()`

def _time_store(store, rec, device):
    "Wrap the bookkeeping a weight store does inside the optimizer's step (grads to FP32, masters to the model)."
    for name in _STORE_WORK:
        f = getattr(store, name, None)
        if f is None or getattr(f, '_timed', False): continue
        def timed(*a, f=f, name=name, **k):
            sync(device); t = clock()
            try: return f(*a, **k)
            finally:
                sync(device); dt = clock() - t
                rec['cb'] += dt; rec['events']['store.' + name] = rec['events'].get('store.' + name, 0.) + dt
        timed._timed = True
        setattr(store, name, timed)

def time_events(cb, rec, device):
    """Wrap `cb`'s per-batch event methods so their time adds to `rec['cb']` while training (on CUDA each is
    synchronised: only for `--cb-timers`, as the syncs stall the GPU queue), and the weight store's bookkeeping inside
    the optimizer's step (the FP32 grads made from the 16-bit ones, chunk by chunk; the masters copied to the model)."""
    for name in _STEP_EVENTS:
        f = getattr(cb, name, None)
        if f is None or getattr(f, '_timed', False): continue
        def timed(f=f, name=name):
            if not cb.learn.training: return f()
            if getattr(cb, "store", None) is not None: _time_store(getattr(cb.store, "lifted", cb.store), rec, device)
            sync(device); t = clock()
            try: return f()
            finally:
                sync(device); dt = clock() - t
                rec['cb'] += dt; rec['events'][name] = rec['events'].get(name, 0.) + dt
        timed._timed = True
        setattr(cb, name, timed)

def _storage(t): return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()

class SavedTensors:
    "Context manager: the storages autograd saves for backward inside it (saved-tensor hooks), each counted once."
    def __init__(self): self.saved, self._ctx = {}, None
    def __enter__(self):
        def pack(t): k, n = _storage(t); self.saved[k] = n; return t
        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__(); return self
    def __exit__(self, *exc): self._ctx.__exit__(*exc)
    def bytes(self, params) -> int:
        "Bytes saved that are not the storage of one of `params`."
        own = {_storage(p)[0] for p in params}
        return sum(n for k, n in self.saved.items() if k not in own)

class CpuMemory(Callback):
    """Bytes a training step holds (CPU): params + grads (model and masters) + optimizer state + kept FP32 originals
    (each storage counted once) + tensors saved for backward that are not params; max over batches."""
    order = 10**6 - 1
    def __init__(self): self.peak, self._saved, self._saved_bytes = 0, None, 0
    def before_batch(self):
        if self.training: self._saved = SavedTensors().__enter__()
    def _exit(self):
        if self._saved is None: return
        self._saved.__exit__(None, None, None)
        self._saved_bytes = self._saved.bytes(list(self.learn.model.parameters()) +
                                              [p for pg in self.learn.opt.param_lists for p in pg])
        self._saved = None
    def after_loss(self): self._exit()
    def after_batch(self): self._exit()  # a cancelled batch
    def after_backward(self):
        if self.training: self.peak = max(self.peak, held_bytes(self.learn) + self._saved_bytes)

def _states(opt) -> list:
    "An optimizer's state dicts: fastai's `Optimizer.state`, a torch optimizer's, or both for `OptimWrapper`."
    return [getattr(opt, 'state', {}), getattr(getattr(opt, 'opt', None), 'state', {})]

def _opt_tensors(opt):
    for st in _states(opt):
        for s in st.values():
            for v in (s.values() if isinstance(s, dict) else []):
                if isinstance(v, torch.Tensor): yield v

def _params_of(opt):
    if hasattr(opt, 'param_lists'): return [p for pg in opt.param_lists for p in pg]
    return [p for g in opt.param_groups for p in g['params']]

def held_bytes(learn) -> int:
    "Bytes of the storages of the params and grads (model and masters), optimizer state and kept FP32 originals."
    held = {}
    def add(t):
        if isinstance(t, torch.Tensor) and t.numel(): k, n = _storage(t); held[k] = n
    for p in list(learn.model.parameters()) + _params_of(learn.opt): add(p.data); add(p.grad)
    for v in _opt_tensors(learn.opt): add(v)
    for cb in getattr(learn, 'cbs', []):
        for rec in (getattr(cb, 'originals', None) or {}).values(): add(rec.original)  # fp16cb keeps exact FP32 originals
        for pg in (getattr(cb, 'master_pgs', None) or []):
            for m in pg: add(m.data); add(m.grad)
        master = getattr(cb, 'master', None)  # fp16cb: the master grads are dropped between steps, not their buffers
        for t in (master.buffers() if hasattr(master, 'buffers') else []): add(t)
    return sum(held.values())

def move_state(learn, device):
    "Model (params, grads, buffers) and optimizer state of `learn` (a fastai `Learner` or `PlainAMP`) to `device`."
    learn.model.to(device)
    for st in _states(learn.opt):
        for s in st.values():
            if isinstance(s, dict):
                for k, v in s.items():
                    if isinstance(v, torch.Tensor): s[k] = v.to(device)

def copy_bound(n_params, dtype, device, reps=3, cold=True) -> float:
    """Seconds for the bookkeeping bound of `n_params`: a 16->32 plus a 32->16 `_foreach_copy_` of that many elements
    (12 bytes/param), the best of `reps`; `cold`: the caches are flushed before each copy, as in a training step."""
    a, b = torch.empty(n_params, dtype=dtype, device=device).normal_(), torch.empty(n_params, device=device)
    flush = torch.empty((64 if torch.device(device).type == 'cpu' else 256) * 2**20 // 4, device=device) if cold else None
    ts = []
    for _ in range(reps):
        t = 0.
        for dst, src in ((b, a), (a, b)):
            if cold: flush.zero_()
            sync(device); t0 = clock()
            torch._foreach_copy_([dst], [src])
            sync(device); t += clock() - t0
        ts.append(t)
    return min(ts)

@torch.no_grad()
def evaluate(model, xy) -> tuple:
    "FP32 loss and accuracy of `model` on the batch `xy` (classes or next tokens on the last dim)."
    x, y = xy
    model.eval()
    pred = model(x).float()
    return float(CrossEntropyLossFlat()(pred, y)), float((pred.argmax(-1) == y).float().mean())
