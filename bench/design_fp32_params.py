"""Design study: FP32 params in the model, 16-bit compute by per-forward casts (FSDP2's `MixedPrecisionPolicy` style),
against fp16cb's weight store (a 16-bit model during the fit, FP32 masters in the optimizer, grads lifted and the
masters copied back each step). `python -m bench.design_fp32_params [--rounds 5] [--steps 4] [--threads 1]`.

The prototype, `FP32Params`: `learn.model`'s params stay the FP32 Parameters for the whole fit. A forward pre-hook on
each module that owns floating params (BatchNorm excepted) puts `p.to(dtype)` (an autograd-tracked cast, new each
forward) in `module._parameters[name]` for the call, and a forward hook puts the FP32 Parameter back; grads arrive FP32
on the FP32 params, so the optimizer is plain fastai. BatchNorm keeps FP32 params and gets the 16-bit activations as
fp16cb's `to_bf16` gives it them (torch's mixed-dtype BatchNorm kernel: 16-bit in, FP32 statistics, 16-bit out).

What is measured, all modes interleaved in one process (each round fits every mode once, in a rotated order):
- ms/step: a training batch from `before_batch` to `after_batch` (forward, loss, backward, fastai's Adam, zero_grad,
  the precision callbacks), process CPU time (other jobs on the shared cores do not inflate it; wall clock beside);
  the first batch of each fit dropped; per round the median step, then the median over rounds, and per round the
  ratio to FP32's median, then the median of those ratios.
- bytes/param of the training state: the unique storages of the live tensors (the garbage collector's tensors and
  their grads, keyed by storage address, exact bytes on a CPU), minus what was alive before the learner was made (the
  data) and the batch (xb, yb, pred, loss); tensors saved for backward are tracked by saved-tensor hooks (weak refs),
  and those alive at a probe are taken out of the state again unless they are a param's storage: a param cast of the
  prototype is counted as `copies`, anything else as `activations` (reported apart, not in the state). Probes: before
  the backward, after each param's grad is accumulated (`register_post_accumulate_grad_hook`), after the backward
  (the backward peak is the largest of these), and after the optimizer step, before zero_grad (the step peak). fp16cb's
  lift scratch (one chunk of FP32 grads kept between steps) is reported apart. Not counted: transient per-op
  temporaries (Adam's per-param scratch, one layer's grad before it is accumulated), which RSS or an allocator hook
  would see but the garbage collector does not; they are at most one param's worth and alike in all modes.
- correctness: 50 steps from one seed on the same batches for FP32, `to_bf16` and the prototype; the distances of the
  final weights, relative to the weights' norm and to the update's norm (w50 - w0)."""
from __future__ import annotations
import argparse, gc, statistics, time, warnings, weakref
from functools import partial
import torch
from torch import nn
from fastai.basics import Learner, DataLoaders, Adam, CrossEntropyLossFlat, Callback
import fp16cb  # noqa: F401 (Learner.to_bf16 & co. become fp16cb's)

# ------------------------------------------------------------------------------------------------- the prototype
def _cast(b, dtype):
    "The floating tensors of `b` (nested tuples, lists, dicts) in `dtype`."
    if isinstance(b, torch.Tensor): return b.to(dtype) if b.is_floating_point() and b.dtype != dtype else b
    if isinstance(b, (list, tuple)): return type(b)(_cast(o, dtype) for o in b)
    if isinstance(b, dict): return {k: _cast(v, dtype) for k, v in b.items()}
    return b

class FP32Params(Callback):
    "The model's params stay FP32 (the masters); each module computes with `dtype` casts of them made per forward."
    order = -50
    def __init__(self, dtype=torch.bfloat16): self.dtype, self.handles, self.track = dtype, [], None

    def _pre(self, m, args, kwargs):
        m._fp32_stash = dict(m._parameters)  # the FP32 Parameters, put back by `_post`
        for n, p in m._fp32_stash.items():
            if p is not None and p.is_floating_point() and p.dtype != self.dtype:
                m._parameters[n] = c = p.to(self.dtype)  # autograd-tracked: its grad flows to p, as FP32
                if self.track is not None: self.track.append(weakref.ref(c))  # memory probes only
        return _cast(args, self.dtype), _cast(kwargs, self.dtype)

    def _post(self, m, args, out):
        stash = m.__dict__.pop('_fp32_stash', None)
        if stash is not None: m._parameters.update(stash)

    def before_fit(self):
        model = self.learn.model
        self.handles = [model.register_forward_pre_hook(lambda m, a, k: (_cast(a, self.dtype), _cast(k, self.dtype)),
                                                        with_kwargs=True, prepend=True)]  # the inputs, as fp16cb does
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm): continue  # FP32 params, 16-bit activations
            if not any(p is not None and p.is_floating_point() for p in m._parameters.values()): continue
            self.handles += [m.register_forward_pre_hook(self._pre, with_kwargs=True),
                             m.register_forward_hook(self._post, always_call=True)]  # put back even if forward raises

    def after_pred(self): self.learn.pred = _cast(self.learn.pred, torch.float32)  # the loss in FP32
    def after_fit(self):
        for h in self.handles: h.remove()
        self.handles = []

class _CastBucket(torch.autograd.Function):
    """The 16-bit copies of a bucket of FP32 params in one fused pass (`_foreach_copy_`), one autograd node for all of
    them; in the backward their grads come back FP32 in one pass, each on its FP32 param (None where unused)."""
    @staticmethod
    def forward(ctx, dtype, *ps):
        ctx.dtypes = [p.dtype for p in ps]
        ctx.set_materialize_grads(False)
        out = [torch.empty(p.shape, dtype=dtype, device=p.device) for p in ps]
        torch._foreach_copy_(out, list(ps))
        return tuple(out)

    @staticmethod
    def backward(ctx, *gs):
        idx = [i for i, g in enumerate(gs) if g is not None]
        res = [None] * len(gs)
        got = [torch.empty(gs[i].shape, dtype=ctx.dtypes[i], device=gs[i].device) for i in idx]
        if got: torch._foreach_copy_(got, [gs[i] for i in idx])
        for i, g in zip(idx, got): res[i] = g
        return (None, *res)

class BucketedFP32Params(FP32Params):
    """`FP32Params` with the casts made per bucket (consecutive modules, about `bucket` elements, as FSDP2 casts per
    unit): one forward pre-hook on each bucket's first module makes all its copies in one pass (`_CastBucket`), none on
    the others; the root's forward hook puts every FP32 Parameter back. A bucket's copies live until its backward."""
    def __init__(self, dtype=torch.bfloat16, bucket:int=2**18): super().__init__(dtype); self.bucket = bucket

    def before_fit(self):
        model = self.learn.model
        self.handles = [model.register_forward_pre_hook(lambda m, a, k: (_cast(a, self.dtype), _cast(k, self.dtype)),
                                                        with_kwargs=True, prepend=True)]
        self.buckets, cur, n = [], [], 0
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm): continue
            own = [(m, k, p) for k, p in m._parameters.items()
                   if p is not None and p.is_floating_point() and p.dtype != self.dtype]
            cur, n = cur + own, n + sum(p.numel() for _, _, p in own)
            if cur and n >= self.bucket: self.buckets.append(cur); cur, n = [], 0
        if cur: self.buckets.append(cur)
        for b in self.buckets: self.handles.append(b[0][0].register_forward_pre_hook(partial(self._cast_bucket, b)))
        self.handles.append(model.register_forward_hook(self._restore, always_call=True))

    def _cast_bucket(self, b, m, args):
        outs = _CastBucket.apply(self.dtype, *[p for _, _, p in b])
        for (mod, k, _), o in zip(b, outs): mod._parameters[k] = o
        if self.track is not None: self.track += [weakref.ref(o) for o in outs]

    def _restore(self, m, args, out):
        for b in self.buckets:
            for mod, k, p in b: mod._parameters[k] = p

# ------------------------------------------------------------------------------------------------ workloads, modes
def mlp(): return nn.Sequential(*[o for _ in range(3) for o in (nn.Linear(1024, 1024), nn.ReLU())], nn.Linear(1024, 1024))
def cnn(c=32):
    def blk(ci, co, s): return nn.Sequential(nn.Conv2d(ci, co, 3, s, 1, bias=False), nn.BatchNorm2d(co), nn.ReLU())
    return nn.Sequential(blk(3, c, 1), blk(c, c, 1), blk(c, 2*c, 2), blk(2*c, 2*c, 1), blk(2*c, 4*c, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4*c, 10))
WORKLOADS = {'mlp': ('4 x Linear(1024,1024) + ReLU, batch 256', mlp, (1024,), 256),
             'cnn': ('5 x conv3x3+BN+ReLU (32-128 ch), 32x32 images, batch 64', cnn, (3, 32, 32), 64),
             'many': ('not by default: 150 x Linear(116,116) + ReLU, batch 8 (hooks and casts per module dominate)',
                      lambda: nn.Sequential(*[o for _ in range(150) for o in (nn.Linear(116, 116), nn.ReLU())], nn.Linear(116, 10)),
                      (116,), 8)}
MODES = {'fp32': lambda l: l, 'to_bf16': lambda l: l.to_bf16(),
         'proto_fp32_params': lambda l: l.add_cb(FP32Params(torch.bfloat16)),
         'proto_bucketed': lambda l: l.add_cb(BucketedFP32Params(torch.bfloat16)),
         'to_bf16_half_storage': lambda l: l.to_bf16(half_storage=True)}

def batches(wl, n, seed=0):
    _, _, shape, bs = WORKLOADS[wl]
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(torch.Size(shape).numel(), 10, generator=g)
    xs = [torch.randn(bs, *shape, generator=g) for _ in range(n)]
    return [(x, (x.reshape(bs, -1) @ teacher).argmax(1)) for x in xs]

class Batches:
    "A fixed list of batches fastai iterates like a DataLoader (no collation, no shuffling)."
    def __init__(self, b): self.b = b
    def __iter__(self): return iter(self.b)
    def __len__(self): return len(self.b)
    def to(self, device): return self

def learner(wl, mode, train, seed=0, lr=1e-3):
    torch.manual_seed(seed)
    dls = DataLoaders(Batches(train), Batches([tuple(t[:8] for t in train[0])]))
    dls.device = torch.device('cpu')
    learn = Learner(dls, WORKLOADS[wl][1](), loss_func=CrossEntropyLossFlat(), opt_func=Adam, lr=lr)
    learn.remove_cbs([cb for cb in learn.cbs if type(cb).__name__ == 'ProgressCallback'])
    return MODES[mode](learn)

def fit(learn, n_epoch=1, cbs=None):
    with warnings.catch_warnings(), learn.no_logging():
        warnings.simplefilter('ignore')
        learn.fit(n_epoch, cbs=cbs)
    for k in ('pred', 'loss', 'loss_grad', 'xb', 'yb'): setattr(learn, k, None)

# ------------------------------------------------------------------------------------------------------- timing
class StepClock(Callback):
    """Times each training batch in process CPU time (`first`: starts it at before_batch; the other, last of all
    callbacks, marks the forward's end at after_loss, the backward's at after_backward and the end at after_batch) and
    in wall time; drops each fit's first batch. `rec['cpu']`: `(step, forward+loss, backward, opt step+zero_grad)`."""
    def __init__(self, rec, first): self.rec, self.first, self.order = rec, first, (-10**6 if first else 10**6)
    def before_fit(self): self.rec['i'] = 0
    def before_batch(self):
        if self.first and self.training: self.rec['t'] = [time.process_time()]; self.rec['w0'] = time.perf_counter()
    def after_loss(self):
        if not self.first and self.training: self.rec['t'].append(time.process_time())
    def after_backward(self):
        if not self.first and self.training: self.rec['t'].append(time.process_time())
    def after_batch(self):
        if self.first or not self.training: return
        t, w = self.rec['t'] + [time.process_time()], time.perf_counter()
        if self.rec['i'] > 0 and len(t) == 4:
            self.rec['cpu'].append((t[3] - t[0], t[1] - t[0], t[2] - t[1], t[3] - t[2])); self.rec['wall'].append(w - self.rec['w0'])
        self.rec['i'] += 1

# ------------------------------------------------------------------------------------------------------- memory
def live_storages() -> dict:
    "`{storage address: bytes}` of every tensor the garbage collector sees and of their grads."
    res = {}
    def add(t):
        if isinstance(t, torch.Tensor) and t.device.type == 'cpu':
            s = t.untyped_storage()
            if s.nbytes(): res[s.data_ptr()] = s.nbytes()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        objs = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for o in objs:
        add(o)
        if o.is_leaf and o.grad is not None: add(o.grad)
    return res

def _ptr(t): return t.untyped_storage().data_ptr()

class MemProbe(Callback):
    "Training state (and copies, activations) at the probes, on the training batches from index `at` on."
    order = -100  # after_step before anything else of ours (fp16cb's after_step), as bench.state_memory
    def __init__(self, baseline, at=2):
        self.baseline, self.at, self.i, self.proto = baseline, at, 0, None
        self.res = {'bwd': [], 'step': []}
    def _on(self): return self.training and self.i >= self.at
    def before_batch(self):
        if not self._on(): return
        self.saved, self.proto = [], next((cb for cb in self.learn.cbs if isinstance(cb, FP32Params)), None)  # bucketed too
        if self.proto is not None: self.proto.track = []
        def pack(t): self.saved.append(weakref.ref(t)); return t
        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()
    def after_loss(self):
        if self._on(): self._ctx.__exit__(None, None, None)
    def probe(self, phase):
        l, live = self.learn, live_storages()
        params = {_ptr(p) for p in l.model.parameters()}
        batch = {_ptr(t) for t in (*l.xb, *l.yb, l.pred, l.loss, l.loss_grad) if isinstance(t, torch.Tensor)}
        store = getattr(getattr(l, 'mixed_precision', None), 'store', None)
        scratch = {_ptr(b): b.untyped_storage().nbytes() for b in getattr(getattr(store, 'scratch', None), 'bufs', {}).values()}
        casts = {_ptr(c): c.untyped_storage().nbytes() for r in (self.proto.track if self.proto else []) if (c := r()) is not None}
        saved = {_ptr(t): t.untyped_storage().nbytes() for r in self.saved if (t := r()) is not None}
        acts = {k: n for k, n in saved.items() if k not in params and k not in casts}
        state = sum(n for k, n in live.items() if k not in self.baseline and k not in batch and k not in scratch
                    and k not in acts and k not in casts)
        self.res[phase].append({'state': state, 'copies': sum(casts.values()), 'acts': sum(acts.values()),
                                'scratch': sum(scratch.values())})
    def before_backward(self):
        if not self._on(): return
        self.probe('bwd')
        self.hooks = [p.register_post_accumulate_grad_hook(lambda p: self.probe('bwd'))
                      for p in self.learn.model.parameters() if p.requires_grad]
    def after_backward(self):
        if not self._on(): return
        for h in self.hooks: h.remove()
        self.probe('bwd')
    def after_step(self):
        if self._on(): self.probe('step')
    def after_batch(self):
        if self.training:
            self.i += 1
            if self.proto is not None: self.proto.track = None

def memory(wl, mode, train):
    gc.collect()
    baseline = live_storages()
    learn = learner(wl, mode, train)
    n = sum(p.numel() for p in learn.model.parameters() if p.requires_grad)
    probe = MemProbe(baseline)
    fit(learn, cbs=probe)
    bwd = max(probe.res['bwd'], key=lambda r: r['state'] + r['copies'])
    step = max(probe.res['step'], key=lambda r: r['state'])
    del learn; gc.collect()
    return {'step_peak': step['state'] / n, 'bwd_peak': (bwd['state'] + bwd['copies']) / n, 'bwd_copies': bwd['copies'] / n,
            'acts': max(r['acts'] for r in probe.res['bwd']) / n, 'scratch_MiB': step['scratch'] / 2**20, 'n_params': n}

# -------------------------------------------------------------------------------------------- correctness, parts
def correctness(wl, steps=50, n_batches=10):
    train, res = batches(wl, n_batches, seed=1), {}
    for mode in ('fp32', 'to_bf16', 'proto_fp32_params', 'proto_bucketed'):
        learn = learner(wl, mode, train)
        w0 = torch.cat([p.detach().float().flatten().clone() for p in learn.model.parameters()])
        fit(learn, steps // n_batches)
        res[mode] = (w0, torch.cat([p.detach().float().flatten() for p in learn.model.parameters()]))
    def dist(a, b):
        (w0, wa), (_, wb) = res[a], res[b]
        d = (wa - wb).norm()
        return {'max_abs': float((wa - wb).abs().max()), 'rel_w': float(d / wb.norm()), 'rel_update': float(d / (wb - w0).norm())}
    return {'proto vs to_bf16': dist('proto_fp32_params', 'to_bf16'), 'proto vs fp32': dist('proto_fp32_params', 'fp32'),
            'to_bf16 vs fp32': dist('to_bf16', 'fp32'), 'bucketed vs to_bf16': dist('proto_bucketed', 'to_bf16'),
            'bucketed vs proto': dist('proto_bucketed', 'proto_fp32_params')}

def parts(model, reps=7):
    "ms of the bookkeeping each design adds, on `model`'s params: the casts and grad path vs the store's lift + copy-back."
    ps = [p.detach() for p in model.parameters()]
    p16, g16, g32 = [p.to(torch.bfloat16) for p in ps], [p.to(torch.bfloat16) for p in ps], [torch.zeros_like(p) for p in ps]
    def med(f):
        ts = []
        for _ in range(reps): t = time.process_time(); f(); ts.append(time.process_time() - t)
        return 1e3 * statistics.median(ts)
    cast = med(lambda: [p.to(torch.bfloat16) for p in ps])                          # forward: FP32 -> bf16 casts
    grad = med(lambda: [g.add_(h.to(torch.float32)) for g, h in zip(g32, g16)])     # backward: bf16 grad -> FP32, accumulated
    lift = med(lambda: torch._foreach_copy_(g32, g16))                               # store: 16-bit grads -> FP32
    back = med(lambda: torch._foreach_copy_(p16, ps))                                # store: masters -> 16-bit model
    return {'proto cast (fwd)': cast, 'proto grad to FP32 + accumulate (bwd)': grad, 'store lift': lift, 'store copy-back': back}

# ---------------------------------------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--rounds', type=int, default=5); ap.add_argument('--steps', type=int, default=4, help='timed steps per fit')
    ap.add_argument('--threads', type=int, default=1); ap.add_argument('--workloads', default='mlp,cnn')
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    flags = open('/proc/cpuinfo').read()
    name = next((l.split(':', 1)[1].strip() for l in flags.splitlines() if l.startswith('model name')), '?')
    print(f"CPU: {name}, avx512_bf16: {'avx512_bf16' in flags}, amx_bf16: {'amx_bf16' in flags}; torch {torch.__version__}, "
          f"{args.threads} thread(s); {args.rounds} rounds x {args.steps} timed steps per mode, modes interleaved")
    t_start, wls = time.perf_counter(), args.workloads.split(',')
    for wl in wls:
        train = batches(wl, args.steps + 1)
        learns = {m: learner(wl, m, train) for m in MODES}
        recs = {m: {'cpu': [], 'wall': []} for m in MODES}
        for m, l in learns.items(): l.add_cbs([StepClock(recs[m], True), StepClock(recs[m], False)])
        per_round = {m: [] for m in MODES}  # per round: (step, fwd, bwd, opt) cpu medians, wall median
        for r in range(args.rounds + 1):  # round 0: warm-up (Adam's state, the allocator, oneDNN's kernels)
            order = list(MODES)[r % len(MODES):] + list(MODES)[:r % len(MODES)]
            for m in order:
                recs[m]['cpu'], recs[m]['wall'] = [], []
                fit(learns[m])
                if r: per_round[m].append(tuple(statistics.median(c[j] for c in recs[m]['cpu']) for j in range(4))
                                          + (statistics.median(recs[m]['wall']),))
        n = sum(p.numel() for p in learns['fp32'].model.parameters())
        mem = {m: memory(wl, m, batches(wl, 3)) for m in MODES}
        med = lambda m, j: 1e3 * statistics.median(r[j] for r in per_round[m])
        ratio = lambda m, j: statistics.median(a[j] / b[j] for a, b in zip(per_round[m], per_round['fp32']))
        print(f"\n[{wl}] {WORKLOADS[wl][0]}: {n/1e6:.3f}M params; ms are process CPU time unless 'wall'")
        print(f"{'mode':<22}{'ms/step':>8}{'x fp32':>8}{'fwd':>7}{'bwd':>7}{'opt':>7}{'wall ms':>8}{'x fp32':>8}"
              f"{'B/p step':>9}{'B/p bwd':>8}{'copies':>7}{'acts':>8}{'scratch':>9}")
        for m in MODES:
            k = mem[m]
            print(f"{m:<22}{med(m, 0):>8.1f}{ratio(m, 0):>7.2f}x{med(m, 1):>7.1f}{med(m, 2):>7.1f}{med(m, 3):>7.1f}"
                  f"{med(m, 4):>8.1f}{ratio(m, 4):>7.2f}x{k['step_peak']:>9.2f}{k['bwd_peak']:>8.2f}{k['bwd_copies']:>7.2f}"
                  f"{k['acts']:>8.2f}{k['scratch_MiB']:>7.2f}Mi")
        print("per-round ms/step: " + '; '.join(f"{m}: " + ' '.join(f"{1e3*r[0]:.1f}" for r in per_round[m]) for m in MODES))
        print("bookkeeping parts, ms (median of 7, this model's params): " +
              ', '.join(f"{k} {v:.2f}" for k, v in parts(learns['fp32'].model).items()))
        del learns; gc.collect()
        for steps in (1, 50):
            res = correctness(wl, steps, min(steps, 10))
            for k, d in res.items():
                print(f"{steps:>2} steps, {k:<17}: max|dw| {d['max_abs']:.2e}, |dw|/|w| {d['rel_w']:.2e}, "
                      f"|dw|/|w_end-w0| {d['rel_update']:.2e}")
            same = res['proto vs to_bf16']['rel_w'] <= 2**-8  # within one bf16 rounding of fp16cb's result
            near = res['proto vs fp32']['rel_w'] <= 1.1 * res['to_bf16 vs fp32']['rel_w'] + 1e-7  # no farther from FP32
            print(f"{steps:>2} steps: proto within 2^-8 of to_bf16: {'PASS' if same else 'FAIL'}; proto no farther from "
                  f"FP32 than to_bf16 (x1.1): {'PASS' if near else 'FAIL'}")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")

if __name__ == '__main__': main()
