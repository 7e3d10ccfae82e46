"""16-bit params stepped in FP32 by the optimizer's own code (`half_storage`, as NVIDIA's NVCaffe, optimi and torchao
step a 16-bit model): each param lifted to FP32 with its grad (unscaled there, in FP32), stepped, and rounded back, to
nearest or stochastically (updates under half a 16-bit spacing then still move the weights on average), a bounded
chunk at a time (`weights.loop.state_chunk`) in a scratch kept for the fit. The optimizer's state stays keyed by the
model's params. Reached through fastai's `Optimizer.step` and `OptimWrapper.step` rows (`weights.loop.HALF`), and
fastai's `Learner._step` for an optimizer with a `step` of its own (`weights.params.AROUND`)."""
from __future__ import annotations
from contextlib import contextmanager
from functools import partial
import torch
from torch import Tensor

from ..weights.loop import state_chunk, chunks
from ..weights.drivers import FusedRun, flag_ranks
from ..weights.optstate import fastai_update, opt_states, elementwise, steps_param_by_param, sliced_update
from ..weights.layout import memory_order, flat_views, with_layout_of
from .state_storage import StateStorage, round_bf16_stochastic_, noise16
from .fused16 import lifted_adam, lifted_param

__all__ = ['LiftedSteps', 'Scratch', 'round_stochastic', 'round_fp16_stochastic_', 'round_to', 'HALF_DTYPES']

HALF_DTYPES = (torch.float16, torch.bfloat16)

def laid_out_as(t:Tensor, like:Tensor) -> Tensor:
    """`t` when its elements are in `like`'s memory order (the same strides), else a copy laid out as `like`: what a
    step that reads both in memory order (a slice at a time) needs of a grad someone replaced with another layout."""
    return t if tuple(t.stride()) == tuple(like.stride()) else with_layout_of(t, like)

def rekey(states:list, a, b):
    "`a`'s per-param state, in each of `states` that has some, keyed by `b` instead."
    for st in states:
        if a in st: st[b] = st.pop(a)

def round_stochastic(x:Tensor, dtype:torch.dtype, generator=None) -> Tensor:
    """`x` (FP32) rounded to `dtype`, up or down at random with the probabilities that make the result exact on
    average: E[round(x)] = x, so updates smaller than half a 16-bit spacing still move the weights in expectation."""
    y = x.to(dtype)  # nearest
    d = x - y.float()  # exact: y is one of the two neighbours of x
    other = torch.nextafter(y, torch.where(d > 0, torch.inf, -torch.inf).to(dtype))  # the neighbour on x's other side
    gap = other.float() - y.float()
    prob = torch.where(d != 0, d / gap, torch.zeros_like(d)).nan_to_num_(0.)  # in [0, 1/2]
    u = torch.rand(x.shape, generator=generator, device=x.device)
    return torch.where(u < prob, other, y)

_FP16_TINY = 2.**-14  # fp16's smallest normal: under it, its spacing is 2^-24 whatever the exponent

def round_fp16_stochastic_(x:Tensor, generator=None) -> Tensor:
    """`x` (FP32, overwritten) rounded to fp16 stochastically (unbiased), in a few elementwise passes: where fp16 is
    normal, a random 13-bit integer is added to the 13 bits of FP32's mantissa that fp16 drops, which are then cleared
    (as bf16's dither); under fp16's smallest normal, where its spacing is 2^-24, `floor(x * 2^24 + u) / 2^24` with the
    same draws as `u` (on a CPU, for those elements only). About 4 times faster than the general rule
    (`round_stochastic`); inf and NaN kept."""
    noise = noise16(x, generator).bitwise_and_(0x1FFF)
    tiny = x.abs() < _FP16_TINY
    at = tiny.nonzero(as_tuple=True) if x.device.type == 'cpu' else None  # (on a GPU a device sync: all of them)
    low = _below_normal(x, noise) if at is None else _below_normal(x[at], noise[at])
    bits = x.view(torch.int32)  # sign and magnitude: adding to the low bits moves |x| up, clearing them moves it down
    bits.add_(noise).bitwise_and_(-8192)
    if at is None: return torch.where(tiny, low, x).to(torch.float16)
    x[at] = low
    return x.to(torch.float16)  # exact: the dropped bits are 0, or a multiple of 2^-24

def _below_normal(x:Tensor, u:Tensor) -> Tensor:
    "fp16's stochastic rounding of `x` under its smallest normal, with the 13-bit draws `u`: on the grid of 2^-24."
    return torch.floor(x * 2.**24 + u * 2.**-13) * 2.**-24  # exact: powers of two, an integer under 2^11

def round_to(x:Tensor, dtype:torch.dtype, stochastic:bool=False, generator=None, inplace:bool=False) -> Tensor:
    """`x` in `dtype`: to nearest (even), or stochastically (from FP32: the dither of the dropped bits, bf16's or
    fp16's, in place in `x` when `inplace`; else the general rule above)."""
    if not stochastic or dtype == x.dtype: return x.to(dtype)
    if dtype == torch.bfloat16 and x.dtype == torch.float32:
        return round_bf16_stochastic_(x if inplace else x.clone(), generator)
    if dtype == torch.float16 and x.dtype == torch.float32:
        return round_fp16_stochastic_(x if inplace else x.clone(), generator)
    return round_stochastic(x, dtype, generator)

class Scratch:
    """The FP32 memory a chunk is lifted into: one buffer per device, the size of the largest chunk, made at its first
    use, kept for the fit and reused by every chunk of every step: no allocation, no page fault in the step (on a CPU,
    glibc would hand a freed buffer back to the system and fault it in again each step)."""
    def __init__(self, sizes:dict): self.sizes, self.bufs = sizes, {}  # sizes: {device: elements}
    def __call__(self, device, n:int) -> Tensor:
        "`n` elements of the device's buffer (made at its first use, the size of the device's largest chunk)."
        buf = self.bufs.get(device)
        if buf is None or buf.numel() < n:
            buf = self.bufs[device] = torch.empty(max(n, self.sizes.get(device, 0)), dtype=torch.float32, device=device)
        return buf[:n]
    def release(self): self.bufs = {}

class _Batch:
    "Small 16-bit params stepped together in the scratch (`LiftedSteps._step_batch`): one device, dtype and factor."
    def __init__(self): self.ps, self.hypers, self.f, self.numel = [], [], None, 0
    def takes(self, p, f, n:int) -> bool:
        "Whether `p` (unscaled by `f`) joins: the same device, dtype and factor, and all of it within `n` elements."
        if not self.ps: return True
        q = self.ps[0]
        return p.device == q.device and p.dtype == q.dtype and f == self.f and self.numel + p.numel() <= n
    def add(self, p, f, hyper:dict):
        self.ps.append(p); self.hypers.append(hyper); self.f = f; self.numel += p.numel()
    def order(self, state:dict) -> list:
        """The params' indices in the order they are lifted: by param group (their hypers), then by optimizer flags
        (fastai's `do_wd`, `weights.drivers.flag_ranks`), so that what fastai's callbacks can step as one lies
        together."""
        groups, ranks = {}, flag_ranks(self.ps, state)
        for h in self.hypers: groups.setdefault(id(h), len(groups))
        return sorted(range(len(self.ps)), key=lambda i: (groups[id(self.hypers[i])], ranks[i]))
    def runs(self, ps:list, hypers:list, w:Tensor, g:Tensor) -> list:
        """`(FusedRun, index of its first param)` of each stretch of `ps` (lifted in that order) of one group (the same
        `hypers`), their FP32 weights and grads consecutive in the scratch (`w`, `g`): fastai's callbacks step each
        stretch of equal state as one flat tensor (`weights.drivers.FusedRun`), as the default path steps the model's
        FP32 params."""
        res, i, off = [], 0, [0]
        for p in ps: off.append(off[-1] + p.numel())
        for j in range(1, len(ps) + 1):
            if j < len(ps) and hypers[j] is hypers[i]: continue
            if j - i > 1:
                res.append((FusedRun([(p, None) for p in ps[i:j]], w[off[i]:off[j]], g[off[i]:off[j]]), i))
            i = j
        return res

class LiftedSteps:
    """How the optimizer steps 16-bit params: each lifted to FP32 (its weights, and its grad multiplied by `factor(gi)`
    of its group: 1/loss scale times a clip coefficient, None: 1), stepped by the optimizer's own code with its FP32
    state (stored narrow between steps: `storage`), rounded back. Params of another dtype (BatchNorm's FP32, float64,
    complex) are stepped as they are, their grads unscaled in place."""
    def __init__(self,
        factor, # `group index -> what its grads are multiplied by in FP32` (None: by 1)
        storage:StateStorage, # the optimizer's state between steps (FP32, or 16/8 bits widened around each chunk)
        stochastic:bool=True, # round the weights back stochastically (False: to nearest even)
        generator=None, # the stochastic rounding's own `torch.Generator`
        stepped=None, # called with params as they are stepped (the callback lets their FP32 originals go)
    ):
        self.factor, self.storage, self.stochastic, self.generator = factor, storage, stochastic, generator
        self.stepped = stepped or (lambda ps: None)
        self.scratch, self._views, self._kind = Scratch({}), {}, (None, False, False)
        self.tally = None  # on a health-check step, a list: each landing adds `(updates lost, updates)` (`_count`)

    def _count(self, old16:Tensor, q:Tensor):
        """On a tally step: of the elements of `q` (stepped FP32) that the update moved off `old16` (their 16-bit
        values), how many round to nearest back onto it: the updates under half a 16-bit spacing (on the device)."""
        if self.tally is None or old16.dtype not in HALF_DTYPES: return
        moved = q != old16.float()
        self.tally.append(torch.stack([(moved & (q.to(old16.dtype) == old16)).sum(), moved.sum()]))

    def _kinds(self, core) -> tuple:
        "`(elementwise, fastai's loop too)` of `core`, read once per optimizer (`fp16cb.compat` declares it)."
        if self._kind[0] is not core:
            ew = elementwise(core)
            self._kind = (core, ew, ew and steps_param_by_param(core))
        return self._kind[1:]

    def size_for(self, params:list):
        "The scratch sized for `params` (a slice's weights and grads per device, one chunk at most; less for a few)."
        sizes = {}
        for p in params:
            if p.dtype in HALF_DTYPES: sizes[p.device] = sizes.get(p.device, 0) + p.numel()
        self.scratch.sizes = {d: 2 * min(n, self._slice(d)) for d, n in sizes.items()}

    def _slice(self, device) -> int:
        "Elements of a param stepped at once in the scratch: half a chunk (its weights and grads fill one chunk)."
        return max(1, state_chunk(device) // 2)

    # -- one param
    def lift(self, p, f):
        """What the optimizer steps for `p`: a 16-bit param's FP32 copy with its grad multiplied by `f` in FP32 (the
        param itself is never touched: DDP's hooks, and autograd's, stay on it); another dtype's param itself, its grad
        multiplied in place."""
        if p.dtype not in HALF_DTYPES:
            if f is not None: p.grad.mul_(f)
            return p
        q = p.detach().float()
        q.grad = p.grad.float() if f is None else p.grad.float().mul_(f)
        return q

    def land(self, p, q):
        "`p`'s stepped FP32 value `q` back into its 16-bit storage, rounded once (to nearest, or stochastically)."
        if q is p: return
        self._count(p.detach(), q)
        with torch.no_grad(): p.copy_(round_to(q, p.dtype, self.stochastic, self.generator, inplace=True))  # q is ours
        self.stepped([p])

    def step_one(self, core, p, hyper:dict, f=None):
        """fastai's update of `p` alone (the step in the backward): lifted, stepped (its state keyed by `p`; fastai's
        Adam by the compiled pass where it applies, `fused16.lifted_param`), landed; a param bigger than a slice, with
        an elementwise optimizer, a slice at a time, its narrow state too."""
        if self._kinds(core)[0] and p.dtype in HALF_DTYPES and p.numel() > self._slice(p.device):
            return self._sliced(core, p, hyper, f)
        q = self.lift(p, f)
        with self.storage.lifted([p], core.state):
            kernel = lifted_adam(core, self.stochastic, p.device) if q is not p else None  # (FP32 param: eager)
            if not lifted_param(kernel, q, core.state.get(p), hyper): fastai_update(core, q, hyper, key=p)
        self.land(p, q)

    def _sliced(self, core, p, hyper, f):
        lift = partial(self._lift_slice, memory_order(p), memory_order(laid_out_as(p.grad, p)), f)
        sliced_update(core, p, hyper, self._slice(p.device), lift, partial(self._land_slice, memory_order(p)),
                      self.storage, lifted_adam(core, self.stochastic, p.device))
        self.stepped([p])

    # -- fastai's loop
    def fastai_loop(self, core):
        """fastai's `Optimizer.step` on lifted params (the state stays keyed by the model's param). An elementwise
        optimizer steps in the scratch, no allocation: a 16-bit param of a slice or more a slice at a time, smaller ones
        together (`_step_batch`: lifted by one copy, rounded back by one)."""
        batch, fast = _Batch(), self._kinds(core)[1]
        for gi, (pg, hyper) in enumerate(zip(core.param_lists, core.hypers)):
            f = self.factor(gi)
            for p in pg:
                if p.grad is None: continue
                if fast and p.dtype in HALF_DTYPES:
                    n = self._slice(p.device)
                    if p.numel() < n:
                        if not batch.takes(p, f, n): self._step_batch(core, batch); batch = _Batch()
                        batch.add(p, f, hyper); continue
                    self._step_batch(core, batch); batch = _Batch()  # the scratch is the slices' now
                    self._sliced(core, p, hyper, f)
                    continue
                self.step_one(core, p, hyper, f)
        self._step_batch(core, batch)

    def _step_batch(self, core, b:_Batch):
        """Small 16-bit params of one device, dtype and factor, together under a slice: their weights and grads lifted
        into the scratch by one copy each (each view laid out as its param; the params grouped by `_Batch.order`), the
        grads multiplied by one multiply, stepped there by fastai's callbacks (each stretch of equal state as one flat
        tensor, the others param by param; the state keyed by the param), all rounded back by one copy."""
        if not b.ps: return
        k = b.numel
        buf = self.scratch(b.ps[0].device, 2 * k)
        w, g = buf[:k], buf[k:2 * k]
        key = (tuple(map(id, b.ps)), buf.data_ptr())  # the same params each step, mostly: their views made once
        if key not in self._views:
            if len(self._views) > 64: self._views.clear()
            order = b.order(core.state)
            ps, hypers = [b.ps[i] for i in order], [b.hypers[i] for i in order]
            self._views[key] = order, flat_views(w, ps), flat_views(g, ps), b.runs(ps, hypers, w, g)
        order, qs, gs, runs = self._views[key]
        ps, hypers = [b.ps[i] for i in order], [b.hypers[i] for i in order]
        torch._foreach_copy_(qs, [p.detach() for p in ps]); torch._foreach_copy_(gs, [p.grad for p in ps])
        if b.f is not None: g.mul_(b.f)
        try:
            with self.storage.lifted(ps, core.state):
                fused, kernel = set(), lifted_adam(core, self.stochastic, w.device)
                for run, i in runs: fused.update(map(id, run.step(core, hypers[i], kernel)))
                for p, view, gq, hyper in zip(ps, qs, gs, hypers):
                    if id(p) in fused: continue
                    q = view.detach(); q.grad = gq
                    fastai_update(core, q, hyper, key=p)
                    # a step that replaced the tensor instead of updating it
                    if q.data_ptr() != view.data_ptr(): view.copy_(q)
            if self.storage.dtype is not None:  # (their FP32 state buffers go: it is stored narrow between steps)
                for run, _ in runs: run.parts.clear()
        finally:
            # even when interrupted: the params stepped so far keep their step (the others round back to themselves)
            if self.tally is not None: self._count(torch.cat([memory_order(p) for p in ps]), w)
            r = round_to(w, ps[0].dtype, self.stochastic, self.generator, inplace=True)
            with torch.no_grad():
                torch._foreach_copy_([memory_order(p) for p in ps], r.split([p.numel() for p in ps]))
        self.stepped(b.ps)

    def _lift_slice(self, w16:Tensor, g16:Tensor, f, s:slice) -> Tensor:
        "Slice `s` of a 16-bit param (`w16`, in memory order) and of its grad (`g16`) lifted into the scratch."
        k = s.stop - s.start
        buf = self.scratch(w16.device, 2 * k)
        q, g = buf[:k].copy_(w16[s]), buf[k:].copy_(g16[s])
        q.grad = g if f is None else g.mul_(f)
        return q

    def _land_slice(self, w16:Tensor, s:slice, q:Tensor):
        "The stepped slice `q` rounded back into the 16-bit param (`w16`, in memory order), in place in the scratch."
        self._count(w16[s], q)
        w16[s].copy_(round_to(q, w16.dtype, self.stochastic, self.generator, inplace=True))

    # -- any other optimizer: its own `step`, on lifted params put in its param lists for the call
    def torch_step(self, wrapper, step):
        """A torch optimizer (`OptimWrapper`): `step()` once per chunk of params (an optimizer not known to be
        elementwise: once, all of them), each chunk lifted into its param groups, the others' grads set aside (torch
        skips params without one)."""
        groups = wrapper.opt.param_groups
        return self.swapped_step([g['params'] for g in groups], opt_states(wrapper), step, self._kinds(wrapper)[0])

    def swapped_step(self, lists:list, states:list, step, chunked:bool=True):
        """`step()` with the params of `lists` (the optimizer's own lists, per group) that have a grad lifted into
        them, their state in `states` keyed by the lifted copies for the call, a chunk at a time (`chunked`) or all at
        once; each landed after."""
        with_grad = [(p, gi, i) for gi, ps in enumerate(lists) for i, p in enumerate(ps) if p.grad is not None]
        grads, out = {p: p.grad for p, _, _ in with_grad}, None
        for p in grads: p.grad = None
        try:
            whole = lambda device: float('inf')  # not known to be elementwise: one call over all of them
            for chunk in chunks(with_grad, key=lambda it: it[0], limit=state_chunk if chunked else whole):
                with self._swapped(lists, states, [(p, gi, i, grads[p]) for p, gi, i in chunk]):
                    out = step()
        finally:
            for p, g in grads.items(): p.grad = g
        return out

    @contextmanager
    def _swapped(self, lists, states, chunk):
        "Within: each param of `chunk` replaced in `lists` by its lift (its state too); after, landed and put back."
        lifted = []
        for p, gi, i, g in chunk:
            p.grad = g
            q = self.lift(p, self.factor(gi))
            lists[gi][i] = q
            if q is not p:
                p.grad = None
                rekey(states, p, q)
            lifted.append((gi, i, p, q))
        wide = self.storage.widen([q for *_, q in lifted], states[-1])  # narrow state: in FP32 for the step
        try: yield
        finally:
            for gi, i, p, q in lifted:
                lists[gi][i] = p
                rekey(states, q, p)  # (each param's state put last, in the params' order: the order FP32's has)
                if q is not p: self.land(p, q)
                p.grad = None
            self.storage.narrow([p for _, _, p, _ in lifted], states[-1], wide)

    def release(self):
        "The fit's end: the scratch and its views go."
        self.scratch.release()
        self._views = {}
