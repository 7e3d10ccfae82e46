"""The fused inf/NaN check of a step's gradients (one pass, no host sync: the step reads its result once), its
generic fallback where a device's kernel lacks a dtype, and what a skipped or calibrating step looks at besides:
which params overflowed, whether the gradients underflowed."""
from __future__ import annotations
import operator
import torch
from torch import Tensor

from .scalers import FP16_MIN_NORMAL

__all__ = ['test_overflow', 'grad_overflow', 'OverflowCheck', 'check_and_unscale_', 'fused_supported',
           'nonfinite_flags', 'underflow_flag', 'read_stats']

# ---- the fused check
def test_overflow(x:Tensor) -> bool:
    "Whether `x` holds an inf, -inf or NaN anywhere."
    return not bool(torch.isfinite(x).all())

def _by_device(tensors) -> dict:
    res = {}
    for t in tensors: res.setdefault((t.device, t.dtype), []).append(t)
    return res

def _real(ts) -> list:
    "The non-empty tensors of `ts`, complex ones as real views (the checks and reductions want real numbers)."
    return [torch.view_as_real(t) if t.is_complex() else t for t in ts if t.numel()]

def _max_abs(tensors) -> Tensor:
    "Largest |value| over `tensors` (NaN if any is NaN), as a 0-dim FP32 tensor on their device; no host sync."
    ts = _real(tensors)
    if not ts: return torch.zeros((), device=tensors[0].device if tensors else 'cpu')
    if ts[0].device.type != 'cpu': return torch.stack(torch._foreach_norm(ts, float('inf'))).float().max()
    # on the CPU `_foreach_norm(inf)` is a slow generic reduction (6.8 ms vs 0.34 ms for `aminmax` on 2M floats)
    return torch.stack([torch.stack(torch.aminmax(t)).abs().max().float() for t in ts]).max()

def grad_overflow(pgs:list) -> bool:
    "Whether any gradient of any param of the groups `pgs` holds an inf or NaN; a single host sync."
    grads = [p.grad for pg in pgs for p in pg if p.grad is not None]
    if not grads: return False
    maxes = [_max_abs(ts).to(grads[0].device) for ts in _by_device(grads).values()]
    return not bool(torch.isfinite(torch.stack(maxes)).all())

def _not_implemented(e:Exception) -> bool:
    "Whether `e` is a kernel refusing a dtype (torch says so with NotImplementedError, some builds a RuntimeError)."
    return isinstance(e, NotImplementedError) or 'not implemented for' in str(e)

_REFUSED = set()  # (device type, dtype) whose fused check-and-unscale kernel refused them: use the generic pass

def fused_supported(device_type:str, dtype:torch.dtype) -> bool:
    "Whether the fused kernel took `dtype` on `device_type` so far (it is tried once per pair; a refusal is kept)."
    return (device_type, dtype) not in _REFUSED

def _generic_check_and_unscale(ts:list, found:Tensor, inv_scale:float):
    """What the fused kernel does, from stock foreach ops (no host sync): flag an inf/NaN anywhere into `found`,
    multiply by `inv_scale`. For the dtypes a device's kernel lacks (bf16 on CUDA) and complex grads (as real views)."""
    ts = _real(ts)
    if not ts: return
    norms = torch.stack(torch._foreach_norm(ts, float('inf')))  # inf or NaN exactly when a tensor holds one
    found.add_(norms.isfinite().all().logical_not().to(found.dtype))
    if inv_scale == 0.: torch._foreach_mul_(ts, 0.)  # as the kernel: finite -> 0, inf/NaN -> NaN
    elif inv_scale != 1.: torch._foreach_mul_(ts, inv_scale)

def check_and_unscale_(ts:list, found:Tensor, inv:Tensor, inv_scale:float):
    """`torch._amp_foreach_non_finite_check_and_unscale_` on tensors of one device and dtype, or the generic pass where
    the kernel does not take their dtype on that device (probed on first use, per (device type, dtype))."""
    key = (ts[0].device.type, ts[0].dtype)
    if key not in _REFUSED and not ts[0].is_complex():
        try: return torch._amp_foreach_non_finite_check_and_unscale_(ts, found, inv)
        except (NotImplementedError, RuntimeError) as e:
            if not _not_implemented(e): raise
            _REFUSED.add(key)
    _generic_check_and_unscale(ts, found, inv_scale)

# up to this many tensors (the flat buffers of a store, one per chunk-sized flat master at most), a check at scale 1
# reads them with one `aminmax` each; more: the fused kernel
_FEW = 64

class OverflowCheck:
    "Unscale gradients in place and detect inf/NaN in the same fused pass; optionally the largest |grad| too."
    approx = False  # the last check summed the grads (a CPU, scale 1): a found overflow is to be confirmed by `exact`
    def __init__(self): self._bufs, self._grads, self._groups = {}, None, None

    def _grouped(self, grads) -> dict:
        "`grads` by (device, dtype), cached while the caller passes the very same tensors (it does, step after step)."
        if not (self._grads is not None and len(grads) == len(self._grads)
                and all(map(operator.is_, grads, self._grads))):
            self._grads, self._groups = list(grads), _by_device(grads)
        return self._groups

    def _buf(self, device):
        if device not in self._bufs:
            self._bufs[device] = (torch.zeros(1, device=device), torch.ones(1, device=device))
        return self._bufs[device]

    def __call__(self,
        grads:list, # FP32 master gradients, unscaled in place
        inv_scale:float, # 1/loss_scale
        with_max:bool=False, # also return the largest |unscaled grad|
    ) -> Tensor: # `[found_inf]` or `[found_inf, max_abs_grad]` on the first grad's device; read it once per step
        if inv_scale == 1. and len(grads) <= _FEW: return self._check_only(grads, with_max)
        return self._check_and_unscale(grads, inv_scale, with_max)

    def _check_and_unscale(self, grads, inv_scale:float, with_max:bool) -> Tensor:
        "The fused kernel: one call per (device, dtype) whatever the number of tensors."
        groups = self._grouped(grads)
        first = grads[0].device if grads else torch.device('cpu')
        founds, maxes = {}, []
        for (device, _), ts in groups.items():
            found, inv = self._buf(device)
            if device not in founds:  # once per device: its dtypes (e.g. bf16 + FP32 BatchNorm) share the flag
                found.zero_(); inv.fill_(inv_scale); founds[device] = found
            check_and_unscale_(ts, found, inv, inv_scale)
            if with_max: maxes.append(_max_abs(ts).to(first).reshape(1))
        founds = [f.to(first) for f in founds.values()]
        found = (founds[0] if len(founds) == 1 else torch.stack(founds).sum(0) if founds else
                 torch.zeros(1, device=first))
        if not with_max: return found
        return torch.cat([found, torch.stack(maxes).max().reshape(1) if maxes else torch.zeros(1, device=first)])

    def _check_only(self, grads, with_max:bool) -> Tensor:
        """Unscaling by 1 changes nothing: a read-only `aminmax` pass (an inf/NaN shows in a min or a max) gives both
        stats. One `aminmax` per tensor: for the few flat buffers `MixedPrecision` passes, not for hundreds of grads."""
        first = grads[0].device if grads else torch.device('cpu')
        ts = _real(grads)
        if not ts: return torch.zeros(2 if with_max else 1, device=first)
        self.approx = not with_max and _summable(ts)
        if self.approx:
            return torch.stack([t.sum().float() for t in ts]).isfinite().all().logical_not_().float().reshape(1)
        return self.exact(ts, with_max)

    def exact(self, grads:list, with_max:bool=False) -> Tensor:
        "`[found_inf]` (and the largest |grad|) from one `aminmax` per tensor: an inf/NaN shows in a min or a max."
        first = grads[0].device
        ts = _real(grads)
        mm = torch.stack([torch.stack(torch.aminmax(t)).to(first, torch.float32) for t in ts])
        found = torch.isfinite(mm).all().logical_not_().float().reshape(1)
        return torch.cat([found, mm.abs().max().reshape(1)]) if with_max else found


def _summable(ts:list) -> bool:
    """Whether the check may sum `ts`: on a CPU a sum is one pass, ~30% cheaper than `aminmax`, and an inf/NaN anywhere
    makes it non-finite. Its one false alarm, finite values summing past the dtype's range, is why a found overflow is
    confirmed by the exact check (`OverflowCheck.exact`, on overflow steps only). Not for fp16, whose sum overflows at
    65504, nor on other devices, where `aminmax` is as fast."""
    return all(t.device.type == 'cpu' and t.dtype != torch.float16 for t in ts)


def underflow_flag(stats:Tensor, grads:list, loss:Tensor, min_normal:float=FP16_MIN_NORMAL) -> Tensor:
    """A calibrating step's `stats` (`[found, max |grad|]`) with a third entry, 1 when its gradients underflowed at the
    scale they were made with: more than half of the nonzero `grads` (the 16-bit ones, as the backward left them) lie
    under `min_normal` (fp16: 2^-14), where fp16 rounds to a fixed spacing of 2^-24 and flushes to zero, or every
    gradient is zero although `loss` is not (all flushed; a masked batch's zero loss says nothing). An ordinary
    distribution has few such values (the digits CNN's first step at scale 1: under 1%). Two counts per tensor, on the
    device (no host sync); only the calibrating step pays them."""
    ts, dev = _real(grads), stats.device
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    nonzero = sum((torch.count_nonzero(t).to(dev) for t in ts), zero)
    small = nonzero - sum((torch.count_nonzero(t.abs() >= min_normal).to(dev) for t in ts), zero)
    # fastai's TensorBase: plain
    flushed = (stats[1] == 0) & (loss.detach().as_subclass(Tensor).abs().reshape(()).to(dev) != 0)
    return torch.cat([stats, ((2 * small > nonzero) | flushed).to(stats.dtype).reshape(1)])


def nonfinite_flags(grads:list) -> Tensor|None:
    """Whether each of `grads` (None: no grad) holds an inf/NaN, as a bool tensor on the first one's device: one
    reduction per tensor and no host sync (a skipped step's attribution; read later, by `OverflowLog.read`)."""
    ts = [g for g in grads if g is not None]
    if not ts: return None
    dev = ts[0].device
    finite = [torch.isfinite(g).all().to(dev) if g is not None else torch.ones((), dtype=torch.bool, device=dev)
              for g in grads]
    return torch.stack(finite).logical_not_()


def read_stats(stats:Tensor, reduce=None) -> tuple:
    """The step's one host sync, after `reduce` (DDP: every rank's worst, `distributed.step_reducer`; None: one
    process): `(found_inf, max |grad| or None, underflow)`; `underflow` (any rank's) is read where `underflow_flag`
    added it, the calibrating step; else False."""
    s = (stats if reduce is None else reduce(stats)).tolist()
    return s[0] > 0, (s[1] if len(s) > 1 else None), len(s) > 2 and s[2] > 0
