"""fastai's Adam as one compiled pass per run of params, on a CPU: bf16 state's step, and `half_storage`'s step of its
lifted params. The usual step with bf16 state widens the moments to FP32 (a pass), runs fastai's callbacks on them (a
pass each), then dithers and rounds them back (three passes): on a CPU, where every pass goes to memory and back, that
is about 1.5x the step with FP32 state. Here one `torch.compile`d function reads the weights, the grads and the two
moments once, and writes the weights and the moments once: fastai's Adam (decoupled weight decay, `average_grad` with
dampening, `average_sqr_grad`, `adam_step`), bf16 moments rounded back stochastically (as torchao compiles its
optimizers' step per param).

- **When:** fastai's `Adam` with decoupled weight decay (its default) or none, on a CPU, with stochastic rounding, and
  states that agree (the same step count and flags, both moments there: not the first step):
  - bf16 state (`adam_run`, `adam_param`): a run of FP32 params (`weights.drivers.FusedRun`) whose bf16 moments lie one
    key after the other in memory (`_fresh`), or a param stepped alone;
  - `half_storage` (`lifted_adam`, `lifted_param`): a stretch of 16-bit params lifted to FP32 in the scratch (its state
    FP32, or widened for the step), a slice of a big one, or one stepped in the backward. The 16-bit weights are
    rounded back after it as after the usual step.
  Anything else takes the usual step: other optimizers, the first step, a GPU (not measured there yet), rounding to
  nearest (which keeps fastai's eager arithmetic bit for bit: an FP32 rounding could flip a nearest 16-bit value).
- **The same arithmetic:** fastai's scalars are computed as fastai computes them (in Python, in double), and the
  elementwise steps are fastai's, in its order: 99.5% of the weights come out bit for bit as fastai's eager step makes
  them, the others within an FP32 rounding (the compiler does not fuse a multiply and an add that eager fuses, and the
  other way round).
- **Its own dither:** the noise of bf16 state's stochastic rounding is the hash 8-bit state's quantizer draws with
  (`state8.hash32`) of each element's place and a key drawn from the rounding's generator per moment and call:
  exactly uniform 16-bit values, no table to gather from. Not the eager path's table of noise: other draws, as
  unbiased; the same on resume and on every rank.
- **Compiled once:** dynamic shapes (one graph per kernel for every run's size), the scalars passed as a tensor (a new
  learning rate compiles nothing), each run's memory as tensors over storages of their own (a view's offset, or a
  `.grad` set, would make dynamo guard and compile again). Where compiling fails (no C++ compiler), it warns once and
  the usual step goes on."""
from __future__ import annotations
import warnings, weakref
from functools import partial
import torch
from torch import Tensor
from fastai.optimizer import weight_decay, average_grad, average_sqr_grad, step_stat, adam_step, debias


from ..distributed import is_dtensor
from ..weights.drivers import _same_order, is_param_state
from ..weights.layout import spans, shared, memory_order
from .state8 import _quiet, hash32

__all__ = ['COMPILE', 'is_adam', 'adam_run', 'adam_param', 'lifted_adam', 'lifted_param']

COMPILE = {'cpu': True}  # device type -> whether bf16 state's Adam step runs compiled there (False: the usual step)
_FN = {}
KEYS, BF16 = ('grad_avg', 'sqr_avg'), torch.bfloat16

def is_adam(cbs:list) -> bool:
    "Whether fastai optimizer callbacks `cbs` are fastai's `Adam` with decoupled weight decay (`decouple_wd=True`)."
    if len(cbs) != 5: return False
    ag = cbs[1]
    return (cbs[0] is weight_decay and isinstance(ag, partial) and ag.func is average_grad and not ag.args
            and ag.keywords == {'dampening': True} and cbs[2] is average_sqr_grad and cbs[3] is step_stat
            and cbs[4] is adam_step)

def _round16(x:Tensor, key:Tensor) -> Tensor:
    """`x` (FP32) rounded to bf16 stochastically: 16 random bits (`state8.hash32` of each element's place, `key` an
    int32 draw) added to those bf16 drops, which are then cleared."""
    noise = hash32(torch.arange(x.numel(), dtype=torch.int32, device=x.device), key.to(torch.int32)) & 0xFFFF
    bits = (x.view(torch.int32) + noise) & -65536
    return bits.view(torch.float32).to(torch.bfloat16)

def _moments(p:Tensor, g:Tensor, m:Tensor, v:Tensor, c:Tensor) -> tuple:
    """fastai's Adam on the flat FP32 weights `p` (in place; grads `g`) from the FP32 moments `m`, `v`: the new moments.
    `c`: decay, mom, 1-mom, sqr_mom, 1-sqr_mom, debias2, eps, -lr/debias1 (as fastai computes them)."""
    p.mul_(c[0])
    m = m * c[1] + g * c[2]  # average_grad(dampening=True)
    v = v * c[3] + g * g * c[4]  # average_sqr_grad
    p.add_(c[7] * (m / ((v / c[5]).sqrt() + c[6])))  # adam_step
    return m, v

def _adam16(p:Tensor, g:Tensor, m16:Tensor, v16:Tensor, c:Tensor, seeds:Tensor):
    "fastai's Adam (`_moments`), its moments `m16`, `v16` stored in bf16 and rounded back stochastically, in place."
    m, v = _moments(p, g, m16.float(), v16.float(), c)
    m16.copy_(_round16(m, seeds[0]))
    v16.copy_(_round16(v, seeds[1]))

def _adam32(p:Tensor, g:Tensor, m:Tensor, v:Tensor, c:Tensor):
    "fastai's Adam (`_moments`) with FP32 moments, all updated in place: a lifted run of 16-bit params (`lifted_adam`)."
    m2, v2 = _moments(p, g, m, v, c)
    m.copy_(m2)
    v.copy_(v2)

def _compiled(device, fn=_adam16):
    "The compiled `fn` for `device`'s type, or None where the compiled steps are off there or compiling failed."
    kind = torch.device(device).type
    if not COMPILE.get(kind): return None
    if (fn, kind) not in _FN: _FN[(fn, kind)] = torch.compile(fn, dynamic=True)
    return _FN[(fn, kind)]

def _scalars(hyper:dict, scalars:dict) -> tuple:
    "`(c, step)`: `_adam16`'s scalars as fastai's callbacks compute them for this step, and the new step count."
    lr, mom, sqr_mom, eps, wd = (hyper[k] for k in ('lr', 'mom', 'sqr_mom', 'eps', 'wd'))
    step = scalars.get('step', 0) + 1
    decay = 1 - lr * wd if scalars.get('do_wd', True) and wd != 0 else 1.
    c = [decay, mom, 1 - mom, sqr_mom, 1 - sqr_mom, debias(sqr_mom, 1 - sqr_mom, step), eps,
         -lr / debias(mom, 1 - mom, step)]
    return torch.tensor(c, dtype=torch.float64).float(), step

def _pieces(storage, params:list, state:dict) -> tuple:
    """`(found, state dicts)`: `found`, `(offsets, [(first, end, grad_avg, sqr_avg)], cache)`, the element offsets of
    `params` in their run; the run cut where one of its two bf16 moments does not go on in memory, each piece's moments
    as 1-d tensors over their memory (each laid out as its param); and a cache of the tensors stepped (`_parts`). None
    when they are not so, or a state holds more than Adam's (then the usual step). Found once per widening plan
    (`StateStorage._plan`, which holds while the dicts hold exactly those tensors and as many entries)."""
    plan = storage._plan(params, state)
    if len(plan.groups) != 1: return None, plan.ds
    g = plan.groups[0]
    if not hasattr(g, 'pieces'): g.pieces = _cut(g, params) if all(_adams(d) for d in plan.ds) else None
    return g.pieces, plan.ds

SCALARS = {'step', 'do_wd', 'force_train'}  # what fastai's Adam keeps beside the moments (flags set by fastai)

def _adams(d) -> bool:
    "Whether the state dict `d` holds fastai's Adam's state after a step, nothing else: both moments and a step count."
    return bool(d) and 'step' in d and all(k in d for k in KEYS) and set(d) <= SCALARS | set(KEYS)

def _cut(g, params:list):
    "`_pieces` of the widening group `g` of `params` (key-major entries: each key's tensors in `params`' order)."
    n = len(params)
    if g.owners is not None or len(g.entries) != 2 * n: return None
    keys = [g.entries[0][1], g.entries[n][1]]
    if (sorted(keys) != sorted(KEYS) or any(e[1] != keys[i // n] for i, e in enumerate(g.entries))
            or any(t.stride() != p.stride() for t, p in zip(g.lows, params + params))): return None
    offs = [0]
    for p in params: offs.append(offs[-1] + p.numel())
    runs = {k: spans(g.lows[i * n:(i + 1) * n]) for i, k in enumerate(keys)}
    if any(span is None for rs in runs.values() for _, _, span in rs): return None
    cuts = sorted({i for rs in runs.values() for i, _, _ in rs} | {n})
    def part(k, i, j):  # params i:j's moment `k`, within the run of it that holds them
        a, _, span = next(r for r in runs[k] if r[0] <= i < r[1])
        return span[offs[i] - offs[a]:offs[j] - offs[a]]
    return offs, [(i, j, part('grad_avg', i, j), part('sqr_avg', i, j)) for i, j in zip(cuts, cuts[1:])], {}

def _stretches(pieces:list, sigs:list) -> list:
    "`(first, end, piece)`: each piece cut further where the params' states differ (step count, flags: `sigs`)."
    res = []
    for piece in pieces:
        i, j = piece[0], piece[1]
        for k in range(i + 1, j + 1):
            if k == j or sigs[k] != sigs[k - 1]: res.append((i, k, piece)); i = k
    return res

def _kernel(storage, core, device):
    "The compiled step, when it applies to fastai optimizer `core` with its state stored by `storage` on `device`."
    if storage.dtype != torch.bfloat16 or not storage.stochastic or not is_adam(core.cbs): return None
    return _compiled(device)

def _adam(fn, calls:list, storage) -> bool:
    """Each of `calls` (`(weights, grads, grad_avg, sqr_avg, scalars)`, each over a storage of its own: a view's offset
    would compile a graph per offset) stepped by `fn`, with its seeds. False, nothing done, where compiling failed."""
    seeds = torch.randint(-2**31, 2**31, (len(calls), 2), generator=storage.generator).int()
    return _call(fn, [(*call, seed) for call, seed in zip(calls, seeds)])

def _call(fn, calls:list) -> bool:
    "`fn(*call)` for each of `calls`: False, nothing done, where compiling failed (then off for the device type)."
    done = 0
    try:
        with _quiet():
            for call in calls: fn(*call); done += 1
    except Exception as e:  # no C++ compiler: the usual step from now on (when nothing was stepped yet)
        if done: raise
        COMPILE[calls[0][0].device.type] = False
        warnings.warn(f"fp16cb: torch.compile of the fused Adam step failed ({type(e).__name__}: {str(e)[:200]}); "
                      "stepping as usual (slower). `fp16cb.storage.fused16.COMPILE['cpu'] = False` skips the attempt.")
        return False
    return True

def adam_run(storage, core, run, hyper:dict) -> bool:
    """`run` (a `FusedRun` of fastai optimizer `core`) stepped by the compiled Adam, its moments stored in bf16 by
    `storage` (a `StateStorage`): True when it was (else nothing was done: the usual step)."""
    if len(run.params) < 2 or (fn := _kernel(storage, core, run.master.device)) is None: return False
    found, ds = _pieces(storage, run.params, core.state)
    if found is None: return False
    sigs = [(d['step'], bool(d.get('do_wd', True))) for d in ds]  # (what Adam's step reads of the state's scalars)
    parts, scalars, calls = _parts(found, run), {}, []
    for i, j, piece in _stretches(found[1], sigs):
        if sigs[i] not in scalars: scalars[sigs[i]] = _scalars(hyper, dict(zip(('step', 'do_wd'), sigs[i])))
        calls.append((*parts(i, j, piece), scalars[sigs[i]][0]))
    if not _adam(fn, calls, storage): return False
    for d, (step, _) in zip(ds, sigs): d['step'] = step + 1
    run.parts.clear()
    return True

def _parts(found:tuple, run):
    """`parts(first, end, piece)`: params first:end of `run` as `(weights, grads, grad_avg, sqr_avg)`, each over a
    storage of its own (`shared`). The weights' and moments' kept with the widening plan while the run is the same (a
    weak reference: a run let go goes); the grads' made anew each step, so that grads dropped (a skipped step) are
    not kept alive by them."""
    offs, cache = found[0], found[2]
    if (ref := cache.get('run')) is None or ref() is not run: cache.clear(); cache['run'] = weakref.ref(run)
    def parts(i, j, piece):
        part = slice(offs[i], offs[j])
        if (i, j) not in cache:
            rel = slice(offs[i] - offs[piece[0]], offs[j] - offs[piece[0]])
            cache[(i, j)] = tuple(map(shared, (run.master[part], piece[2][rel], piece[3][rel])))
        w, m, v = cache[(i, j)]
        return w, shared(run.grad[part]), m, v
    return parts

def adam_param(storage, core, p, hyper:dict) -> bool:
    """The one param `p` of fastai optimizer `core` (one too big for a run, or stepped in the backward) stepped by the
    compiled Adam, its moments stored in bf16 by `storage`: True when it was (else nothing was done)."""
    st = core.state.get(p)
    if not _adams(st) or p.grad is None or is_dtensor(p) or (fn := _kernel(storage, core, p.device)) is None:
        return False
    ts = [p, p.grad, st['grad_avg'], st['sqr_avg']]
    if (any(t.dtype != BF16 for t in ts[2:]) or not all(_same_order(p, t) for t in ts[1:])): return False
    c, step = _scalars(hyper, st)
    if not _adam(fn, [(*(shared(memory_order(t)) for t in ts), c)], storage): return False
    st['step'] = step
    return True

def lifted_adam(core, stochastic:bool, device):
    """The compiled step of a stretch of lifted params (`half_storage`: 16-bit weights lifted to FP32 in a scratch,
    stepped, rounded back stochastically), for `weights.drivers.FusedRun.step`: `step(weights, grads, moments, scalars,
    hyper)` steps the flat FP32 weights, grads and moments (`{key: flat tensor}`) in one pass and gives the new state
    (None: it does not apply, the usual step). None when fastai optimizer `core` is not fastai's `Adam` with decoupled
    weight decay, the weights round to nearest (bit for bit as fastai's eager step: kept so), or compiling is off on
    `device`. The 16-bit rounding that follows dwarfs what the compiler's fusing changes (an FP32 rounding here and
    there)."""
    if not stochastic or not is_adam(core.cbs) or (fn := _compiled(device, _adam32)) is None: return None
    def step(w:Tensor, g:Tensor, flat:dict, scalars:dict, hyper:dict) -> dict|None:
        if not _adams({**scalars, **flat}) or any(t.dtype != torch.float32 for t in flat.values()): return None
        c, n = _scalars(hyper, scalars)
        ts = (shared(t).detach() for t in (w, g, flat['grad_avg'], flat['sqr_avg']))  # (no `.grad`: dynamo guards it)
        if not _call(fn, [(*ts, c)]): return None
        return {**scalars, 'step': n, **flat}
    return step

def lifted_param(kernel, q:Tensor, st:dict, hyper:dict) -> bool:
    """`q`, a 16-bit param lifted to FP32 with its grad (stepped on its own: in the backward), stepped by `kernel`
    (`lifted_adam`'s) with its param's state `st`, each tensor in `q`'s memory order: whether it was (else nothing was
    done: the usual step)."""
    if kernel is None or q.grad is None or not st: return False
    ts = {k: v for k, v in st.items() if is_param_state(v, q)}
    if not all(_same_order(q, t) for t in (q.grad, *ts.values())): return False
    new = kernel(memory_order(q), memory_order(q.grad), {k: memory_order(v) for k, v in ts.items()},
                 {k: v for k, v in st.items() if k not in ts}, hyper)
    if new is None: return False
    st.update((k, v) for k, v in new.items() if k not in ts)
    return True
