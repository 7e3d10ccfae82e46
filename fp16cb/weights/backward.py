"""The step in the backward (`step_in_backward=True`): each param stepped from a hook as soon as the backward has
accumulated its grad, and the grad dropped there, so that no param's grad outlives its own step (a fastai `Optimizer`,
a loss scale of 1). A grad holding inf/NaN is zeroed on the device before its param is stepped (no host sync: that
param's optimizer takes a step with a zero grad, its momentum and moments decaying, its weight decay applied) and flags
the step, which the check of the step reports (`found`)."""
from __future__ import annotations
import torch

__all__ = ['BackwardSteps', 'grad_hook']

def grad_hook(p, fn):
    """`fn` called when a backward has accumulated `p`'s grad; on a param frozen now too (trainable again later, it is
    followed like the others; torch only refuses the registration on a frozen tensor)."""
    if p.requires_grad: return p.register_post_accumulate_grad_hook(fn)
    p.requires_grad_(True)
    try: return p.register_post_accumulate_grad_hook(fn)
    finally: p.requires_grad_(False)

class BackwardSteps:
    "The hooks of `params` that step each one with `step_one(p)` in the backward, and what they saw (inf/NaN flags)."
    def __init__(self, params:list, step_one):
        self.step_one, self.seen, self.bad, self.bad_last = step_one, {}, {}, {}
        self.had_grad = {id(p): p for p in params if p.grad is not None}  # fastai steps them at every step from now on
        self.hooks = [grad_hook(p, self._on_grad) for p in params]

    def _on_grad(self, p):
        "A param's grad is complete: check it (on the device), step the param with it, drop it."
        g = p.grad
        if g is None: return  # an undefined grad (a branch not taken in this backward): not reached
        bad = torch.isfinite(torch.view_as_real(g) if g.is_complex() else g).all().logical_not_()
        f = self.seen.get(g.device)
        self.seen[g.device] = bad.clone() if f is None else f.logical_or_(bad)
        self.bad[id(p)] = bad  # which params' grads held inf/NaN: a skipped step's attribution
        self.had_grad[id(p)] = p
        g.masked_fill_(bad, 0)
        self.step_one(p)
        p.grad = None

    def stepped(self) -> bool: return bool(self.seen)

    def _step_unreached(self):
        """Params that had a grad before but that this backward did not reach (a branch not taken): fastai's optimizer
        steps them with their zeroed grad (momentum, weight decay), so they are stepped with a zero grad here too."""
        if len(self.had_grad) == len(self.bad): return
        for k, p in self.had_grad.items():
            if k in self.bad: continue
            p.grad = torch.zeros_like(p)
            self.step_one(p)
            p.grad = None

    def found(self):
        """After the backward: `[found]`, whether any grad of it held inf/NaN (None: it reached no param), the params it
        did not reach stepped first."""
        self._step_unreached()
        seen, self.seen = list(self.seen.values()), {}
        self.bad_last, self.bad = self.bad, {}
        if not seen: return None
        dev = seen[0].device
        return torch.stack([f.to(dev) for f in seen]).any().float().reshape(1)

    def flags(self, params:list):
        """Whether each of `params`' grads held inf/NaN in the last backward (its hook's flag; none: False), on the
        device."""
        bads = [self.bad_last.get(id(p)) for p in params]
        first = next((b for b in bads if b is not None), None)
        if first is None: return None
        return torch.stack([b.to(first.device) if b is not None
                            else torch.zeros((), dtype=torch.bool, device=first.device) for b in bads])

    def remove(self):
        for h in self.hooks: h.remove()
        self.hooks = []
