"""FP16 master-weight storage (NVIDIA's "Training with mixed precision" NVCaffe slides, 2017): one 16-bit copy of the
weights and no FP32 masters. The vanishing-update problem is solved by the slides' modified momentum rule: the momentum
buffer accumulates the raw gradients, G = m*G + dW (never the tiny lr*dW, which underflows in 16-bit), and the weight
update W = W - lr*G is computed in FP32 and only its result is stored back in 16-bit.

`HalfStorage` does this for any fastai optimizer: at each step the 16-bit weights and their loss-scaled grads are
lifted to FP32 (the grads unscaled there, never in 16-bit), the optimizer's own callbacks run on them with their state
(momentum, Adam's averages) in FP32, and the result is rounded back into the 16-bit weights, to nearest or
stochastically. Weight decay and L2 act on those FP32 values too (OpenSeq2Seq's guide: regularizers on FP32 values).
Memory per trainable parameter: 2 bytes of weight + 2 of grad + the optimizer state (FP32), against 2 + 2 + 4 (FP32
master) + 4 (its grad) + the state with FP32 masters."""
from __future__ import annotations
import torch
from torch import Tensor
from fastcore.foundation import L
from fastai.optimizer import Optimizer

__all__ = ['round_stochastic', 'round_to', 'HalfStorage', 'state_bytes']

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

def round_to(x:Tensor, dtype:torch.dtype, stochastic:bool=False, generator=None) -> Tensor:
    "`x` in `dtype`: to nearest (even), or stochastically."
    return round_stochastic(x, dtype, generator) if stochastic and dtype != x.dtype else x.to(dtype)

def _chunks(params:list, n:int) -> list:
    "Consecutive runs of `params` of at most `n` elements (one param per run at least)."
    res, cur, k = [], [], 0
    for p in params:
        if cur and k + p.numel() > n: res.append(cur); cur, k = [], 0
        cur.append(p); k += p.numel()
    return res + ([cur] if cur else [])

class HalfStorage:
    """Steps an optimizer whose params are the 16-bit model weights themselves, in FP32 math: a chunk of params at a
    time is lifted to FP32 (weights, and grads times `grad_factor`), stepped by the optimizer's own code with FP32 state,
    and stored back rounded. What `MixedPrecision(half_storage=True)` uses instead of FP32 masters."""
    def __init__(self,
        opt, # the learner's optimizer (a fastai `Optimizer`, or an `OptimWrapper`: stepped as one chunk)
        stochastic:bool=True, # round the stored weights stochastically (False: to nearest even)
        chunk:int=2**22, # elements lifted to FP32 at once (bounds the transient FP32 memory)
        generator=None, # a `torch.Generator` for the stochastic rounding
    ):
        self.opt, self.stochastic, self.chunk, self.generator = opt, stochastic, chunk, generator
        self.stepped, self.grad_factor, self.factors = False, 1., {}  # 1/loss scale (times a clip coefficient); per param
        self._prev_step, self._inner_step = vars(opt).get('step'), opt.step
        opt.step = self.step

    master_pgs = None  # no FP32 masters
    @property
    def model_pgs(self) -> list: return [[p for p in pg if getattr(p, 'requires_grad', False)] for pg in self.opt.param_lists]
    @property
    def params(self) -> list:
        return [p for pg in self.opt.param_lists for p in pg if getattr(p, 'requires_grad', False)]

    def grads(self) -> list:
        "The model's (loss-scaled, 16-bit) grads."
        return [p.grad for p in self.params if p.grad is not None]

    def zero_model_grads(self, reattach:bool=True):
        gs = self.grads()
        if gs: torch._foreach_zero_(gs)

    def unscaled_norms(self, pgs=None) -> list:
        "The FP32 norm of the unscaled grads of each param group (for clipping)."
        pgs = pgs if pgs is not None else self.opt.param_lists
        return [torch.stack([p.grad.float().norm() for p in pg if p.grad is not None] or [torch.zeros(())]).norm() * self.grad_factor
                for pg in pgs]

    def step(self, *args, **kwargs):
        "Lift each chunk to FP32, let the optimizer step it, round it back into the 16-bit weights."
        groups = [list(pg) for pg in self.opt.param_lists]
        one = not isinstance(self.opt, Optimizer)  # a torch optimizer behind an `OptimWrapper`: all at once
        todo = [p for pg in groups for p in pg if p.grad is not None]
        for chunk in ([todo] if one else _chunks(todo, self.chunk)):
            ids = {id(p) for p in chunk}
            saved = [(p, p.data, p.grad) for p in chunk]
            for p in chunk:
                factor = self.grad_factor * self.factors.get(id(p), 1.)
                p.data = p.data.float()
                p.grad = p.grad.float() if factor == 1. else p.grad.float().mul_(factor)
            try:
                if one: self._inner_step(*args, **kwargs)
                else:
                    self.opt.param_lists = L(L(p for p in pg if id(p) in ids) for pg in groups)
                    self._inner_step(*args, **kwargs)
            finally:
                if not one: self.opt.param_lists = L(L(pg) for pg in groups)
                for p, data, grad in saved:
                    if data.dtype != torch.float32:
                        with torch.no_grad(): data.copy_(round_to(p.data, data.dtype, self.stochastic, self.generator))
                    else: data.copy_(p.data)
                    p.data, p.grad = data, grad
        self.stepped = True

    def restore_opt(self):
        "Give the optimizer its own `step` back."
        if self._prev_step is None: self.opt.__dict__.pop('step', None)
        else: self.opt.step = self._prev_step

def state_bytes(learn) -> dict:
    """Bytes per trainable parameter, by role, of what a learner holds during a fit: model weights and grads, FP32
    masters and their grads, optimizer state (unique storages counted once)."""
    from .callbacks import MixedPrecision
    mp = next((cb for cb in learn.cbs if isinstance(cb, MixedPrecision)), None)
    params = [p for p in learn.model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    seen = set()
    def size(ts):
        tot = 0
        for t in ts:
            if t is None or not isinstance(t, Tensor) or t.dim() == 0: continue
            k = t.untyped_storage().data_ptr()
            if k in seen: continue
            seen.add(k); tot += t.untyped_storage().nbytes()
        return tot
    res = {'weights': size(p.data for p in params), 'grads': size(p.grad for p in params)}
    masters = mp.master.master_params if mp is not None and hasattr(mp.master, 'master_params') else []
    res['masters'] = size(m.data for m in masters) + size(getattr(mp.master, '_run_masters', []) if mp else [])
    res['master grads'] = size(getattr(mp.master, '_run_master_grads', []) if mp else [])
    st = getattr(learn.opt, 'state', {})
    res['optimizer state'] = size(v for s in st.values() for v in s.values())
    return {k: v / n for k, v in res.items()} | {'total': sum(res.values()) / n}
