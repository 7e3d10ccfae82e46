"""16-bit weight storage without FP32 masters (NVIDIA's "Training with mixed precision", NVCaffe, 2017), and the
rounding of stepped FP32 values back to 16-bit: to nearest, or stochastically."""
from __future__ import annotations
from functools import partial
import torch
from torch import Tensor
from fastcore.foundation import L
from fastai.optimizer import OptimWrapper

from .optstate import fastai_update, opt_state, opt_states, rekey, elementwise, steps_param_by_param, sliced_update
from .lift import lift_chunks, Scratch
from .layout import memory_order, flat_views, laid_out_as
from .store import WeightStore
from .state_storage import StateStorage, round_bf16_stochastic_

__all__ = ['HalfStorage', 'round_stochastic', 'round_to']

_HALF = (torch.float16, torch.bfloat16)

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

def round_to(x:Tensor, dtype:torch.dtype, stochastic:bool=False, generator=None, inplace:bool=False) -> Tensor:
    """`x` in `dtype`: to nearest (even), or stochastically (bf16 from FP32: the 16-bit dither of the dropped bits, in
    place in `x` when `inplace`; else the general rule above)."""
    if not stochastic or dtype == x.dtype: return x.to(dtype)
    if dtype == torch.bfloat16 and x.dtype == torch.float32:
        return round_bf16_stochastic_(x if inplace else x.clone(), generator)
    return round_stochastic(x, dtype, generator)

class _Batch:
    "Small 16-bit params stepped together in the scratch (`HalfStorage._step_batch`): one device, dtype and factor."
    def __init__(self): self.ps, self.hypers, self.f, self.numel = [], [], None, 0
    def takes(self, p, f, n:int) -> bool:
        "Whether `p` (unscaled by `f`) joins: the same device, dtype and factor, and all of it within `n` elements."
        if not self.ps: return True
        q = self.ps[0]
        return p.device == q.device and p.dtype == q.dtype and f == self.f and self.numel + p.numel() <= n
    def add(self, p, f, hyper:dict):
        self.ps.append(p); self.hypers.append(hyper); self.f = f; self.numel += p.numel()

class HalfStorage(WeightStore):
    """FP16 master-weight storage (NVIDIA's "Training with mixed precision" NVCaffe slides, 2017): one 16-bit copy of
    the weights and no FP32 masters. Each param is lifted to FP32 as the optimizer reaches it (weights, and grads
    unscaled there, never in 16-bit), stepped by the optimizer's own code with FP32 state, and rounded back (to nearest,
    or stochastically: updates under half a 16-bit spacing then still move the weights on average). A fastai
    `Optimizer` is stepped once, one param lifted at a time (an elementwise one: a slice at a time, in a scratch kept
    for the fit); a torch optimizer (`OptimWrapper`) is stepped once per chunk (`chunk_limit`), that chunk's params
    lifted (their state moved to the FP32 copies and back).
    Params that are not 16-bit (BatchNorm's FP32, float64, complex) are stepped in their own dtype."""
    def __init__(self, opt,
        stochastic:bool=True, # round the stored weights (and 16-bit state) stochastically (False: to nearest even)
        generator=None, # a `torch.Generator` of its own for the stochastic rounding (not the global RNG)
        names:dict=None, model=None,
        in_backward:bool=False, # step each param in the backward (`arm_in_backward`)
        fp32_of=None, # `param -> exact FP32 value` (from `ModelToHalf`): `Lookahead`'s slow weights start from these
        state_dtype:torch.dtype=None, # the optimizer's state in this dtype between steps (`StateStorage`; None: FP32)
        keep=(), # ids of params kept though frozen since (`WeightStore`)
    ):
        super().__init__(opt, names, model, keep)
        self.stochastic, self.generator = stochastic, generator
        # the same generator: one stream, one checkpoint
        self.state_storage = StateStorage(state_dtype, stochastic, generator)
        self.params = [p for pg in self.model_pgs + self.own_pgs for p in pg]
        self._group_of = {id(p): gi for gi, (a, b) in enumerate(zip(self.model_pgs, self.own_pgs)) for p in a + b}
        self._dtypes = {id(p): p.dtype for p in self.params}
        self._fp32_slow_weights(fp32_of)
        self.state_storage.narrow_all(opt_state(self.core))
        self._sliced_ok = elementwise(self.core) and steps_param_by_param(self.core)
        # the scratch: a slice's weights and grads in FP32 per device (one chunk at most; less for a small model)
        sizes = {}
        for p in self.params:
            if p.dtype in _HALF: sizes[p.device] = sizes.get(p.device, 0) + p.numel()
        sizes = {d: 2 * min(n, self._slice(d)) for d, n in sizes.items()}
        self.scratch, self._views = Scratch(sizes), {}
        if in_backward: self.arm_in_backward()

    def _slice(self, device) -> int:
        "Elements of a param stepped at once in the scratch: half a chunk (its weights and grads fill one chunk)."
        return max(1, self.chunk_limit(device) // 2)

    def _fp32_slow_weights(self, fp32_of):
        """fastai's `Lookahead` keeps a slow copy of each param, which would be 16-bit here and outlive the fit: it is
        FP32 instead (made from the exact FP32 values; the sync reads the 16-bit weights into FP32 and rounds once
        back)."""
        if self.opt is self.core or 'slow_weights' not in vars(self.opt): return
        half = lambda p: p.dtype in (torch.float16, torch.bfloat16)
        if self.opt.slow_weights is None:
            val = (lambda p: fp32_of(p).to(p.device)) if fp32_of is not None else (lambda p: p.detach())
            self.opt.slow_weights = L(L(val(p).float().clone() if half(p) else p.detach().clone() for p in pg)
                                      for pg in self.core.param_lists)
        else: self.opt.slow_weights = L(L(s.float() if half(s) else s for s in sg) for sg in self.opt.slow_weights)

    def _step_one(self, p):
        """In the backward: `p` lifted to FP32 with its grad, stepped by fastai's optimizer (state keyed by `p`), stored
        back; a param bigger than a slice (an elementwise optimizer), a slice at a time, its 16-bit state too."""
        n = self._slice(p.device)
        if self._sliced_ok and p.dtype in _HALF and p.numel() > n:
            lift = partial(self._lift_slice, memory_order(p), memory_order(laid_out_as(p.grad, p)), None)
            sliced_update(self.core, p, self.core.hypers[self._group_of[id(p)]], n, lift,
                          partial(self._land_slice, memory_order(p)), self.state_storage)
            return self._stepped([p])
        q = self._lift(p)
        with self.state_storage.lifted([p], self.core.state):
            fastai_update(self.core, q, self.core.hypers[self._group_of[id(p)]], key=p)
        self._store(p, q)

    def grads(self) -> list: return [p.grad for p in self.params if p.grad is not None]
    def _grads_to_check(self) -> list: return self.grads()
    def _grads_by_param(self) -> tuple: return self.params, [p.grad for p in self.params]

    def _lift(self, p):
        """What the optimizer steps for `p`: a 16-bit param's FP32 copy with its grad unscaled in FP32 (the param itself
        is never touched: DDP's hooks, and autograd's, stay on it); another dtype's param itself, its grad unscaled in
        place."""
        f = self._factor(self._group_of.get(id(p), 0))
        if p.dtype not in (torch.float16, torch.bfloat16):
            if f is not None: p.grad.mul_(f)
            return p
        q = p.detach().float()
        q.grad = p.grad.float() if f is None else p.grad.float().mul_(f)
        return q

    def _store(self, p, q):
        "`p`'s stepped FP32 value `q` back into its 16-bit storage, rounded once (to nearest, or stochastically)."
        if q is p: return
        with torch.no_grad(): p.copy_(round_to(q, p.dtype, self.stochastic, self.generator, inplace=True))  # q is ours
        self._stepped([p])

    def _step_impl(self, *args, **kwargs):
        return self._through_core(self._step_torch if isinstance(self.core, OptimWrapper) else self._lifted_loop,
                                  *args, **kwargs)

    def _lifted_loop(self, step, *args, **kwargs):
        """fastai's `Optimizer.step` loop, on lifted params (the state stays keyed by the model's param). An elementwise
        optimizer steps in the scratch, no allocation: a 16-bit param of a slice or more a slice at a time
        (`sliced_update`), smaller ones together (`_step_batch`: lifted by one copy, rounded back by one), each set of
        weights and grads lifted, stepped and rounded back into the params while in the caches."""
        core, batch = self.core, _Batch()
        for p, pg, state, hyper in core.all_params(with_grad=True):
            if self._sliced_ok and p.dtype in _HALF:
                n, f = self._slice(p.device), self._factor(self._group_of.get(id(p), 0))
                if p.numel() < n:
                    if not batch.takes(p, f, n): self._step_batch(batch); batch = _Batch()
                    batch.add(p, f, hyper); continue
                self._step_batch(batch); batch = _Batch()  # the scratch is the slices' now
                lift, land = (partial(self._lift_slice, memory_order(p), memory_order(laid_out_as(p.grad, p)), f),
                              partial(self._land_slice, memory_order(p)))
                sliced_update(core, p, hyper, n, lift, land, self.state_storage)  # state widened a slice at a time
                self._stepped([p])
                continue
            q = self._lift(p)
            with self.state_storage.lifted([p], core.state): fastai_update(core, q, hyper, key=p)
            self._store(p, q)
        self._step_batch(batch)

    def _step_batch(self, b:_Batch):
        """Small 16-bit params of one device, dtype and unscale factor, together under a slice: their weights and grads
        lifted into the scratch by one copy each (each view laid out as its param), the grads unscaled by one multiply,
        each param stepped there by fastai's callbacks (its state keyed by the param), all rounded back by one copy."""
        if not b.ps: return
        k = b.numel
        buf = self.scratch(b.ps[0].device, 2 * k)
        w, g = buf[:k], buf[k:2 * k]
        key = (tuple(map(id, b.ps)), buf.data_ptr())  # the same params each step, mostly: their views made once
        if key not in self._views:
            if len(self._views) > 64: self._views.clear()
            self._views[key] = flat_views(w, b.ps), flat_views(g, b.ps)
        qs, gs = self._views[key]
        torch._foreach_copy_(qs, [p.detach() for p in b.ps]); torch._foreach_copy_(gs, [p.grad for p in b.ps])
        if b.f is not None: g.mul_(b.f)
        try:
            with self.state_storage.lifted(b.ps, self.core.state):
                for p, view, gq, hyper in zip(b.ps, qs, gs, b.hypers):
                    q = view.detach(); q.grad = gq
                    fastai_update(self.core, q, hyper, key=p)
                    # a step that replaced the tensor instead of updating it
                    if q.data_ptr() != view.data_ptr(): view.copy_(q)
        finally:
            # even when interrupted: the params stepped so far keep their step (the others round back to themselves)
            r = round_to(w, b.ps[0].dtype, self.stochastic, self.generator, inplace=True)
            with torch.no_grad():
                torch._foreach_copy_([memory_order(p) for p in b.ps], r.split([p.numel() for p in b.ps]))
        self._stepped(b.ps)

    def _lift_slice(self, w16:Tensor, g16:Tensor, f, s:slice) -> Tensor:
        """Slice `s` of a 16-bit param (`w16`, in memory order) and of its grad (`g16`) lifted into the scratch,
        unscaled."""
        k = s.stop - s.start
        buf = self.scratch(w16.device, 2 * k)
        q, g = buf[:k].copy_(w16[s]), buf[k:].copy_(g16[s])
        q.grad = g if f is None else g.mul_(f)
        return q

    def _land_slice(self, w16:Tensor, s:slice, q:Tensor):
        "The stepped slice `q` rounded back into the 16-bit param (`w16`, in memory order), in place in the scratch."
        w16[s].copy_(round_to(q, w16.dtype, self.stochastic, self.generator, inplace=True))

    def _step_torch(self, step, *args, **kwargs):
        """A torch optimizer (`OptimWrapper`): stepped once per chunk of params (an optimizer not known to be
        elementwise: once, all of them), those lifted and their state moved to the lifted copies and back; the other
        params' grads are set aside meanwhile (torch skips params without one)."""
        groups, states = self.core.opt.param_groups, opt_states(self.core)  # a wrapper's and its inner optimizer's
        state = states[-1]
        with_grad = [(p, (gi, i), True) for gi, g in enumerate(groups) for i, p in enumerate(g['params'])
                     if p.grad is not None]
        grads, out = {p: p.grad for p, _, _ in with_grad}, None
        for p in grads: p.grad = None
        try:
            # not known to be elementwise (`fp16cb.compat`): one `step` for all params
            whole = lambda device: float('inf')
            for chunk in lift_chunks(with_grad, self.chunk_limit if elementwise(self.core) else whole):
                lifted = []
                for p, (gi, i), _ in chunk:
                    p.grad = grads[p]
                    q = self._lift(p)
                    groups[gi]['params'][i] = q
                    if q is not p:
                        p.grad = None
                        rekey(states, p, q)
                    lifted.append((gi, i, p, q))
                wide = self.state_storage.widen([q for *_, q in lifted], state)  # 16-bit state: in FP32 for the step
                try: out = step(*args, **kwargs)
                finally:
                    for gi, i, p, q in lifted:
                        groups[gi]['params'][i] = p
                        if q is not p:
                            rekey(states, q, p)
                            self._store(p, q)
                        p.grad = None
                    self.state_storage.narrow([p for _, _, p, _ in lifted], state, wide)
        finally:
            for p, g in grads.items(): p.grad = g
        return out

    def _let_go(self):
        super()._let_go()
        self._views = {}  # views of the scratch

    def zero_model_grads(self):
        """As the optimizer's `zero_grad` would: zeroed (fastai), or None (a torch optimizer: unreached params not
        stepped)."""
        if self.none_after_step:
            for p in self.params: p.grad = None
            return
        gs = self.grads()
        if gs: torch._foreach_zero_(gs)

    def check_linked(self):
        "The optimizer steps the model's own params: only a change of their dtype (`.float()`) would go unnoticed."
        for p in self.params[:1] + self.params[-1:]:
            if p.dtype != self._dtypes[id(p)]:
                raise RuntimeError(f"mixed precision (half_storage): the model's parameter "
                                   f"{self.names.get(id(p), tuple(p.shape))} changed dtype during the fit "
                                   f"({self._dtypes[id(p)]} -> {p.dtype}): something after the setup converted the "
                                   f"model. Convert it before `learn.to_fp16()`/`to_bf16()`, or after the fit.")
