"""The lift: how the 16-bit grads reach FP32 inside the step, a bounded chunk at a time. The model's 16-bit params
and grads as views into one flat buffer per run (`BufferRun`), the chunks of masters the optimizer steps together
(`lift_chunks`, `chunk_limit`), and each chunk's plan (`LiftPlan`): one scratch buffer viewed as the masters' grads,
filled by copies coalesced in memory order and reused by every chunk; and the copies that round a chunk's stepped
masters into the model (`to_model_copies`), made once."""
from __future__ import annotations
import operator
from dataclasses import dataclass, field
import torch
from torch import Tensor

from .layout import flat_views, memory_order, shared
from .backward import grad_hook

__all__ = ['BufferRun', 'storage_runs', 'Scratch', 'LiftPlan', 'Chunk', 'to_model_copies', 'merged',
           'lift_chunks', 'LIFT_CHUNK', 'OTHER_CHUNK', 'chunk_limit']

_grad_of = operator.attrgetter('grad')

# The most elements of grads a chunk lifts to FP32 at once, by device type. On a CPU a chunk its caches hold (2 MiB of
# FP32): the copy in, the optimizer's passes and the copy out to the model find it there. On a GPU a chunk the device
# takes longer over than the host takes to launch it: each chunk costs the host ~100-150 us (an optimizer `step` call,
# the copies' launches), and a 2^22 chunk only ~70 us of an H100 (40 bytes an element at ~2.4 TB/s; the H100 run of
# 2026-11-25 stepped a 185M-param LM in 56 such chunks). 2^25 (128 MiB of FP32, ~0.6 ms a chunk) keeps the device busy.
LIFT_CHUNK = {"cpu": 2**19}
OTHER_CHUNK = 2**25

def chunk_limit(device, limit:int|None=None) -> int:
    """The chunk size on `device`: `limit` when given, else `LIFT_CHUNK`'s for its type (`OTHER_CHUNK` where it has
    none)."""
    return limit or LIFT_CHUNK.get(torch.device(device).type, OTHER_CHUNK)

class BufferRun:
    """Params of one dtype whose masters are consecutive in one FP32 buffer: their data and grads become views into two
    flat buffers of their dtype, so each copy between them and the masters is one vectorised op.
    `keep_none`: a param without grad keeps none (FP32's semantics: it is not stepped); else it gets a zero grad.
    With `keep_none`, a param without grad still gets its view at once (else autograd would allocate a grad of its own
    for the first backward, on top of the buffer: a peak of 2 bytes/param more on each fit's first step); a hook
    notes which of them the backward reaches, and the others lose the view again when the step `settle`s.
    `per_step` (a torch optimizer, whose `zero_grad` sets grads to None): every param is watched at every step, and
    one that no backward of the step reached has no grad for it, as in FP32."""
    def __init__(self, params, master:Tensor, keep_none:bool=False,
                 with_grad:bool=True, # False: no grad buffer (each grad is consumed by a step in the backward)
                 per_step:bool=False, # grads are None after a step unless a backward reaches them (torch's `zero_grad`)
                 bufs:tuple=None): # `(data, grad)`: 1-d parts of larger buffers to use (None: buffers of its own)
        n = sum(p.numel() for p in params)
        p0 = params[0]
        self.params, self.master, self.keep_none, self.per_step = params, master, keep_none, per_step and with_grad
        if bufs is None: bufs = _buffers(n, p0, with_grad)
        self.buf, self.grad = bufs
        if self.grad is not None: self.grad.zero_()
        self.views = flat_views(self.buf, params)
        self.grad_views = flat_views(self.grad, params) if with_grad else [None] * len(params)
        with torch.no_grad(): torch._foreach_copy_(self.views, [p.data for p in params])  # exact current values
        pending, self.reached = [], set()  # params with no grad yet; those a backward reached
        for p, v, g in zip(params, self.views, self.grad_views):
            p.data = v
            if g is None: p.grad = None; continue
            if p.grad is not None: g.copy_(p.grad)
            elif keep_none: pending.append(p)
            p.grad = g
        self.watched = list(params) if self.per_step else pending
        self._hooks = [grad_hook(p, self._reach) for p in self.watched]

    def _reach(self, p): self.reached.add(id(p))

    def settle(self):
        """After a step's backward(s): a watched param that no backward reached since the last settle has no grad (the
        view goes, None). Without `per_step`, once only: after the first step a param keeps its grad, as fastai's
        does."""
        if not self.watched: return
        for p in self.watched:
            if id(p) not in self.reached and self._owns(p.grad, self.grad): p.grad = None
        self.reached = set()
        if not self.per_step: self._unhook()

    def _unhook(self):
        for h in self._hooks: h.remove()
        self.watched, self._hooks = [], []

    def _owns(self, t:Tensor, buf:Tensor) -> bool:
        return t is not None and buf is not None and t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()

    def reattach_grads(self) -> list:
        "Grads that someone replaced go back into the flat grad buffer; returns the params left without grad."
        if self.grad is None: return []
        if all(map(operator.is_, map(_grad_of, self.params), self.grad_views)): return []  # the usual case, ~50ns/param
        missing = []
        for p, g in zip(self.params, self.grad_views):
            if p.grad is g: continue
            if p.grad is None:
                g.zero_()
                if self.keep_none: missing.append(p); continue
            else: g.copy_(p.grad)
            p.grad = g
        return missing

    def linked(self) -> bool:
        "Whether the first param still views the buffers (a `.to()` replaces every param's tensor, and its grad's)."
        p = self.params[0]
        g = p.grad
        return (p.untyped_storage().data_ptr() == self.buf.untyped_storage().data_ptr()
                and (g is None or self.grad is None
                     or g.untyped_storage().data_ptr() == self.grad.untyped_storage().data_ptr()))

    def relink(self):
        "Point the params (and grads) that someone replaced (same device and dtype) at fresh views into the buffers."
        self.views = flat_views(self.buf, self.params)
        if self.grad is not None: self.grad_views = flat_views(self.grad, self.params)
        for p, v, g in zip(self.params, self.views, self.grad_views):
            p.data = v
            if p.grad is not None and g is not None: p.grad = g

    def release(self):
        """Give the params that still view our buffers tensors of their own over their parts of them (after the fit; no
        copy: the FP32 values replace them next, and the buffers go with the last of them)."""
        if self.watched and not self.per_step: self.settle()  # a fit that ended before any step
        self._unhook()
        for p in self.params:
            if self._owns(p.data, self.buf): p.data = shared(p.data)
            if self._owns(p.grad, self.grad):  # cleared since `before_step`; a 16-bit grad can't go on an FP32 param
                p.grad = shared(p.grad) if p.grad.dtype == p.dtype else None

def storage_runs(models:list, masters:list, with_grad:bool=True, per_step:bool=False, key=None) -> list:
    """Non-flat masters stay one `nn.Parameter` per param (per-param optimizer state and steps), but their data moves
    into one FP32 buffer per device, ordered by the model's dtype, then by `key(index)` (the masters' param group and
    optimizer flags: what the fastai driver steps as one flat tensor is then consecutive), stably: returns the runs. (No
    FP32 grad buffer: the grads are lifted to FP32 a bounded chunk at a time as the optimizer steps, see
    `FP32Masters`.)"""
    by_dev, order = {}, ((lambda i: (str(models[i].dtype), key(i))) if key is not None
                         else (lambda i: str(models[i].dtype)))
    for i in sorted(range(len(models)), key=order): by_dev.setdefault(models[i].device, []).append(i)
    runs = []
    for dev, idx in by_dev.items():
        n = sum(models[i].numel() for i in idx)
        data = torch.empty(n, device=dev)
        o = 0
        for i in idx:
            m, k = masters[i], masters[i].numel()
            view = flat_views(data[o:o+k], [models[i]])[0]  # laid out as the model param (channels_last stays)
            view.copy_(m.data)
            m.data, o = view, o + k
            m.grad = None
        o, j = 0, 0
        while j < len(idx):
            k = j
            while k < len(idx) and models[idx[k]].dtype == models[idx[j]].dtype: k += 1
            ps = [models[i] for i in idx[j:k]]
            size = sum(p.numel() for p in ps)
            runs.append(BufferRun(ps, data[o:o+size], keep_none=True, with_grad=with_grad, per_step=per_step))
            o, j = o + size, k
    return runs

def _buffers(n:int, like:Tensor, with_grad:bool=True) -> tuple:
    "`(data, grad)`: flat buffers of `n` elements in `like`'s dtype and device (grad None without `with_grad`)."
    return (torch.empty(n, dtype=like.dtype, device=like.device),
            torch.zeros(n, dtype=like.dtype, device=like.device) if with_grad else None)

def merged(ts:list) -> list:
    "The 1-d tensors `ts`, neighbours in memory merged into one (the flat runs' shared grad buffer: one tensor)."
    return _coalesce([(t, t) for t in ts])[0]


class Scratch:
    """The FP32 memory the lift writes a chunk's grads into: one buffer per device, the size of the largest chunk (at
    most the chunk limit, or the largest master where one is bigger), made with the plans at the fit's set-up, kept for
    the fit and reused by every chunk of every step: no allocation, no page fault in the step (on a CPU, glibc would
    hand a freed buffer back to the system and fault it in again each step), and no allocator setting for the user."""
    def __init__(self, sizes:dict): self.sizes, self.bufs = sizes, {}  # sizes: {device: elements}
    def __call__(self, device, n:int) -> Tensor:
        "`n` elements of the device's buffer (made at its first use, the size of the device's largest chunk)."
        buf = self.bufs.get(device)
        if buf is None or buf.numel() < n:
            buf = self.bufs[device] = torch.empty(max(n, self.sizes.get(device, 0)), dtype=torch.float32, device=device)
        return buf[:n]
    def release(self): self.bufs = {}

class LiftPlan:
    """How one chunk's masters get their FP32 grads, made once: a part of the store's `Scratch` viewed as each master's
    grad, and the 16-bit grads copied from (coalesced: one copy per contiguous run). Valid while those are still the
    params' grads. `live`: the chunk's `(master, group)` with a grad, in the chunk's order."""
    def __init__(self, items:list, scratch:Scratch):
        # the scratch is laid out in the order of the 16-bit grads' memory, so that the copy coalesces into one per
        # buffer
        items = [it for it in items if it[2] is not None]
        self.live = [(m, gi) for m, gi, _ in items]
        items = sorted(items, key=lambda it: _region(it[2][0][0].grad)[:2])
        self.masters, self.gis = [m for m, _, _ in items], [gi for _, gi, _ in items]
        self.runs = None  # the fastai driver's `FusedRun`s of this plan (made at its first fused step)
        self.objs, pairs, self.groups = [], [], {}
        buf = scratch(self.masters[0].device, sum(m.numel() for m in self.masters))
        self.views = flat_views(buf, self.masters)
        for (m, gi, sources), v in zip(items, self.views):
            for o, off in sources:
                g = o.grad
                self.objs.append(o)
                pairs.append((v if off == 0 and g.shape == v.shape else v.view(-1)[off:off + g.numel()], g))
            self.groups.setdefault(gi, []).append(v)
        self.srcs = [g for _, g in pairs]  # what each source's grad must still be (`valid`)
        self.dsts, self.copy_srcs = _coalesce(pairs)
        # a group's scratch, merged
        self.groups = {gi: _coalesce([(v, v) for v in vs])[0] for gi, vs in self.groups.items()}

    absent = ()  # the sources left out because they had no grad (a partial plan: valid while they still have none)

    @classmethod
    def make(cls, items:list, scratch:Scratch, partial:bool=False):
        """The plan of `items`, or None when it has no master or one of their sources has no grad now. `partial`: of the
        masters whose sources all have a grad now (a param no backward reached is not stepped, as in FP32)."""
        if partial:
            has = lambda it: it[2] is not None and all(o.grad is not None for o, _ in it[2])
            absent = [o for it in items if it[2] is not None and not has(it) for o, _ in it[2]]
            plan = cls.make([it for it in items if has(it)], scratch)
            if plan is not None: plan.absent = absent
            return plan
        objs = [o for _, _, sources in items if sources is not None for o, _ in sources]
        return cls(items, scratch) if objs and all(o.grad is not None for o in objs) else None

    def valid(self) -> bool:
        "Whether the sources' grads are still the tensors the plan copies from (and the absent ones still absent)."
        return all(map(operator.is_, map(_grad_of, self.objs), self.srcs)) and all(o.grad is None for o in self.absent)

    def lift(self) -> dict:
        """The 16-bit grads copied into the scratch (one fused copy), each master's grad its view: `{group: its
        scratch}`."""
        torch._foreach_copy_(self.dsts, self.copy_srcs)
        for m, v in zip(self.masters, self.views): m.grad = v
        return self.groups

    def free(self):
        for m in self.masters: m.grad = None

@dataclass(eq=False)
class Chunk:
    """A bounded part of one optimizer step, decided at the fit's set-up: its `(master, group, sources)` items in the
    masters' buffer order; whether it is one master bigger than the chunk limit, stepped a slice at a time (`sliced`);
    its params that train in their own dtype (`owns`, `(param, group)`); the copies that round its masters into the
    model (`out`); and its `LiftPlan`, kept from step to step while the grads it reads stay the same tensors (`plan`),
    with the one of the step under way between its lift and its landing (`lifted`)."""
    items: list
    sliced: bool = False
    owns: list = field(default_factory=list)
    out: tuple = ((), ())
    plan: LiftPlan|None = None
    lifted: LiftPlan|None = None
    def __iter__(self): return iter(self.items)
    def __len__(self): return len(self.items)
    @property
    def device(self): return self.items[0][0].device
    def elements(self) -> int: return sum(m.numel() for m, _, src in self.items if src is not None)

def to_model_copies(items:list) -> tuple:
    """`(dsts, srcs)`: the copies that round the masters of `items` (`(master, group, sources)`) into the model's 16-bit
    params (coalesced: one copy per contiguous run), made once; the buffers behind them stay for the fit."""
    pairs = []
    for m, _, sources in items:
        for o, off in sources or ():
            if isinstance(o, BufferRun): pairs.append((o.buf, o.master)); continue
            pairs.append((o.detach(), flat_views(memory_order(m)[off:off + o.numel()], [o])[0]))
    return _coalesce(pairs)

def _region(t:Tensor) -> tuple:
    "`(storage, first element, element count, strides)` of the dense tensor `t` (a grad view, a scratch view)."
    return t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), tuple(t.stride())

def _coalesce(pairs:list) -> tuple:
    """`(dsts, srcs)` copying what the `(dst, src)` pairs copy, with neighbours merged: where a pair continues the
    previous one in both memories (same strides: element order is memory order), the two become one 1-d copy."""
    merged = []  # [dst, src, dst region, src region, mergeable]
    for d, s in pairs:
        rd, rs = _region(d), _region(s)
        ok = rd[3] == rs[3]  # the same strides: copying the pair is copying its memory in order
        last = merged[-1] if merged else None
        if (ok and last is not None and last[4] and last[2][0] == rd[0] and last[3][0] == rs[0]
                and last[2][1] + last[2][2] == rd[1] and last[3][1] + last[3][2] == rs[1]):
            last[2], last[3] = (rd[0], last[2][1], last[2][2] + rd[2]), (rs[0], last[3][1], last[3][2] + rs[2])
            last[0], last[1] = _flat_region(last[0], last[2]), _flat_region(last[1], last[3])
        else: merged.append([d, s, rd[:3], rs[:3], ok])
    return [m[0] for m in merged], [m[1] for m in merged]

def _flat_region(t:Tensor, region:tuple) -> Tensor:
    "The 1-d tensor over `region` (`(storage, first, count)`) of `t`'s storage."
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), region[1], (region[2],))

def lift_chunks(items:list, limit) -> list:
    """`items` (`(param, group, sources)` in the optimizer's order) cut into consecutive chunks of one device whose
    masters hold at most `limit(device)` elements together (a bigger master is a chunk of its own)."""
    chunks, cur, n = [], [], 0
    for it in items:
        k = it[0].numel() if it[2] is not None else 0
        if cur and (n + k > limit(cur[0][0].device) or it[0].device != cur[0][0].device):
            chunks.append(cur); cur, n = [], 0
        cur.append(it); n += k
    return chunks + ([cur] if cur else [])

