"""Loss scaling, the third module of a training step (after the callback's events and the weight store): the scalers
that pick the loss scale step after step, the fused inf/NaN check (one host synchronisation per step, all-reduced
across ranks), the accounting of skipped steps, and what a skip must undo (BatchNorm's running statistics)."""
from __future__ import annotations
import math, operator, warnings
from collections import deque
from contextlib import contextmanager
from statistics import NormalDist
import torch
from torch import Tensor, nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from .dtypes import FP16_MAX, resolve_dtype
from .validation import check_positive, check_real, check_int, check_bool

__all__ = ['LossScaler', 'StaticScaler', 'BackoffScaler', 'LogNormalScaler', 'LossScaleError', 'make_scaler',
           'GradScalerAdapter', 'SEED_LOSS_SCALE', 'FP16_MAX', 'test_overflow', 'grad_overflow', 'OverflowCheck',
           'check_and_unscale_', 'fused_supported', 'BNStatsGuard', 'count_skip', 'lr_find_stops_on',
           'warn_all_skipped', 'world_size', 'is_multiprocess', 'is_ddp', 'syncs', 'reduce_max_', 'StepRecord',
           'nonfinite_flags', 'OverflowLog', 'underflow_flag', 'read_stats', 'FP16_TINY']

FP16_TINY = 2.**-14  # the smallest normal float16: under it fp16 rounds to a fixed spacing of 2^-24 and flushes to zero

# ---- scalers
class LossScaleError(FloatingPointError):
    "Training cannot go on: gradients keep overflowing whatever the loss scale."

def _check_scale_range(min_scale, max_scale) -> tuple:
    "`(min_scale, max_scale)` as floats, both > 0 and min <= max (an error names both: neither is clamped silently)."
    max_scale = check_positive('max_loss_scale', max_scale)
    return check_real('min_loss_scale', min_scale, 0., max_scale, lo_open=True, hi_name='max_loss_scale'), max_scale

_HINT = ("Likely causes: NaN/inf in the inputs, targets or loss; a learning rate that is too high (the weights "
         "diverged); or activations beyond the fp16 range in the forward pass (try `learn.to_bf16()`, which has "
         "FP32's range).")

class LossScaler:
    """Base strategy: `scale` is the current loss scale; `update` is called once per optimizer step after the overflow
    check (a step that another callback cancels is no step: the scaler sees nothing of it, as torch's `GradScaler.update`
    is never called for it)."""
    needs_max_grad = False  # whether `update` wants the largest |unscaled grad| of the step (costs one fused pass)
    calibrating = False  # whether this step sets the scale from the gradients (and is checked for underflow first)
    _state_names = ('scale', 'skipped_in_a_row', 'n_skipped', 'n_steps')

    def __init__(self,
        scale:float, # initial loss scale
        max_skipped:int=50, # more overflowing steps in a row than this is an error, not training
    ):
        self.scale = check_positive('loss_scale', scale)
        self.max_skipped = check_int('max_skipped', max_skipped, 1)
        self.skipped_in_a_row, self.n_skipped, self.n_steps = 0, 0, 0

    def update(self,
        found_inf:bool, # whether this step's gradients held an inf/NaN (the step is then skipped)
        grad_stats=None, # the statistics the strategy asked for (`needs_max_grad`: largest |unscaled grad|)
        underflow:bool=False, # a calibrating step whose gradients underflowed at this scale (the step is then skipped)
    ):
        "Count the step, then let the strategy move `scale`; fail loudly when steps keep overflowing."
        self.n_steps += 1
        if found_inf or underflow:
            self.n_skipped += 1; self.skipped_in_a_row += 1
        else: self.skipped_in_a_row = 0
        if underflow and not found_inf: self._underflow(grad_stats)
        else: self._update(found_inf, grad_stats)
        if self.skipped_in_a_row > self.max_skipped:
            self._fail(f"{self.skipped_in_a_row} steps in a row had inf/NaN gradients and were skipped "
                       f"(loss scale now {self.scale:g}).")

    def _update(self, found_inf, grad_stats): pass
    def _underflow(self, grad_stats): "A calibrating step underflowed (only a calibrating strategy is told so)."

    @property
    def is_dynamic(self) -> bool:
        "Whether the scale moves with the gradients (a static scale never does)."
        return False

    @property
    def floor(self) -> float:
        "The lowest scale this strategy goes to (a static scale: itself)."
        return self.scale

    def _fail(self, what): raise LossScaleError(f"Mixed-precision training stopped: {what} {_HINT}")

    def state_dict(self) -> dict:
        return {'type': type(self).__name__, **{k: getattr(self, k) for k in self._state_names}}

    def load_state_dict(self, sd:dict):
        if sd.get('type', type(self).__name__) != type(self).__name__:
            raise ValueError(f"state of a {sd['type']} cannot be loaded into a {type(self).__name__}")
        for k in self._state_names:
            if k in sd: setattr(self, k, sd[k])

    def __repr__(self): return f"{type(self).__name__}(scale={self.scale:g})"

class StaticScaler(LossScaler):
    "A fixed loss scale; an overflowing step is still skipped (and counted)."

class BackoffScaler(LossScaler):
    """Divide by `factor` on overflow (after `hysteresis` overflows); multiply by it after `wait` clean steps in a row.
    With `calibrate`, the first step runs at `init_scale` (1 by default: nothing to overflow but what fp16 cannot hold
    anyway) and is applied when finite; its largest |unscaled grad| `g` then sets the scale: the largest power of 2
    under `max_value / (headroom * g)`, within `[min_scale, max_scale]`. No start from the ceiling whose first steps
    are all skipped (fastai v2's 2^24 start skipped 5 to 11 of them: Micikevicius et al. 2018 pick the scale from the
    gradients' range, as does `gradient_report`). A calibrating step whose gradients underflowed (most of its nonzero
    16-bit gradients under `min_normal`, where fp16 rounds coarsely and flushes to zero, or all of them zero for a
    nonzero loss: `underflow_flag`) is skipped instead of applied, and still sets the scale."""
    _state_names = LossScaler._state_names + ('clean_in_a_row', 'overflows_left', 'calibrated')

    def __init__(self,
        init_scale:float=2.**24, # starting scale (`MixedPrecision`'s `max_loss_scale` in fastai v2)
        factor:float=2., # divide by this on overflow, multiply after `wait` clean steps (`div_factor`)
        wait:int=500, # clean steps in a row before the scale grows (`scale_wait`)
        min_scale:float=1., # the scale never goes under this; needing to is an error
        max_scale:float=2.**24, # the scale never goes above this
        hysteresis:int=1, # the scale drops only after this many overflows (each one still skips its step)
        max_skipped:int=50, # more overflowing steps in a row than this is an error
        calibrate:bool=False, # set the scale from the largest |grad| of the first finite step (run at `init_scale`)
        headroom:float=2.**4, # calibration leaves the largest scaled grad this factor under `max_value`
        max_value:float=FP16_MAX, # largest finite value of the 16-bit dtype (fp16: 65504)
        min_normal:float=FP16_TINY, # smallest normal value of the 16-bit dtype (fp16: 2^-14): calibration's underflow check
    ):
        factor, wait = check_positive('div_factor', factor, strict_min=1.), check_int('scale_wait', wait, 1)
        min_scale, max_scale = _check_scale_range(min_scale, max_scale)
        hysteresis = check_int('hysteresis', hysteresis, 1)
        check_positive('headroom', headroom, strict_min=0.); check_positive('max_value', max_value)
        calibrate, min_normal = check_bool('calibrate', calibrate), check_positive('min_normal', min_normal)
        super().__init__(min(max(check_positive('loss_scale', init_scale), min_scale), max_scale), max_skipped)
        self.factor, self.wait, self.min_scale, self.max_scale, self.hysteresis = factor, wait, min_scale, max_scale, hysteresis
        self.clean_in_a_row, self.overflows_left = 0, hysteresis
        self.calibrated, self.headroom, self.max_value = not calibrate, float(headroom), float(max_value)
        self.min_normal = float(min_normal)

    @property
    def needs_max_grad(self) -> bool:
        "Only the calibrating step needs the largest |grad| (read in the same sync as the overflow flag)."
        return not self.calibrated

    calibrating = property(lambda self: not self.calibrated, doc="Whether the next step sets the scale (until one does).")

    def calibrated_scale(self, max_grad:float) -> float:
        "The largest power of 2 that keeps `max_grad * headroom` under `max_value`, within `[min_scale, max_scale]`."
        if not (max_grad > 0 and math.isfinite(max_grad)): return self.max_scale  # nothing seen: fastai v2's start
        e = math.floor(math.log2(self.max_value / (self.headroom * max_grad)))
        return min(max(2. ** max(min(e, 1023), -1022), self.min_scale), self.max_scale)

    def _calibrate(self, found_inf, max_grad):
        "An overflowing first step is skipped and the next tried lower (persistent overflow ends at `max_skipped`)."
        if found_inf:
            self.scale = max(min(self.scale / self.factor, 1.), self.min_scale)
            return
        if max_grad is None: raise ValueError("BackoffScaler.update needs the largest |unscaled grad| to calibrate")
        if max_grad == 0: return  # an all-zero gradient of a zero loss (a masked batch) says nothing: calibrate later
        self.scale, self.calibrated = self.calibrated_scale(max_grad), True

    def _underflow(self, max_grad):
        "The calibrating step was skipped for underflow: its largest |grad| (0: every one flushed) still sets the scale."
        if self.calibrated: return
        self.scale, self.calibrated = self.calibrated_scale(max_grad if max_grad is not None else 0.), True

    def _update(self, found_inf, grad_stats):
        if not self.calibrated: return self._calibrate(found_inf, grad_stats)
        if found_inf:
            self.clean_in_a_row = 0
            self.overflows_left -= 1
            if self.overflows_left > 0: return  # hysteresis: tolerate this overflow (the step is still skipped)
            # as Megatron/DeepSpeed: once the hysteresis is used up, every overflow drops the scale until it grows again
            self.overflows_left = 0
            if self.scale <= self.min_scale:
                self._fail(f"gradients overflow even at min_loss_scale={self.min_scale:g}: the loss scale would fall "
                           f"under it.")
            self.scale = max(self.scale / self.factor, self.min_scale)
        else:
            self.clean_in_a_row += 1
            if self.clean_in_a_row >= self.wait:
                self.clean_in_a_row, self.overflows_left = 0, self.hysteresis
                self.scale = min(self.scale * self.factor, self.max_scale)

    is_dynamic = property(lambda self: True, doc="Backoff scaling moves the scale: down on overflow, up after `wait` clean steps.")
    floor = property(lambda self: self.min_scale, doc="`min_scale`.")

    def __repr__(self):
        cal = '' if self.calibrated else ', uncalibrated'
        return f"BackoffScaler(scale={self.scale:g}, factor={self.factor:g}, wait={self.wait}{cal})"

def _censored_mean(mu, sigma, cutoff):
    "E[X | X > cutoff] for X ~ N(mu, sigma^2): the mean of a normal observation known only to exceed `cutoff`."
    a = (cutoff - mu) / sigma
    if a > 30: return mu + sigma * (a + 1 / a)  # asymptotic inverse Mills ratio: erfc underflows here
    sf = .5 * math.erfc(a / math.sqrt(2))
    return mu + sigma * math.exp(-a * a / 2) / math.sqrt(2 * math.pi) / sf

class LogNormalScaler(LossScaler):
    """OpenSeq2Seq's LogNormal automatic loss scaling (its mixed-precision guide): log2 of each step's largest |unscaled grad| is modelled as normal with a
    running mean and variance; the next scale is the largest for which the scaled maximum overflows `max_value`
    with probability `overflow_prob`: `log2(scale) = log2(max_value) - (mu + z*sigma)`, `z = Phi^-1(1-overflow_prob)`.

    Overflowing steps enter the statistics as *censored* observations: their maximum is unknown but above the cutoff
    `c = log2(max_value/scale)`, so we add `E[X | X > c]` under the current fit (skipping them would bias the
    estimate low exactly where it matters, in the tail); and the scale is divided by `backoff` at least, so that
    persistent overflow (NaN in the loss) drives it to `min_scale` and to the loud failure. Until the first clean
    step there are no statistics: the scale only backs off. For the first `warmup` observations sigma is taken as at
    least 1 bit, since a spread estimated from a handful of steps is unreliable."""
    needs_max_grad = True
    _state_names = LossScaler._state_names + ('mu', 'var', 'n_obs')

    def __init__(self,
        init_scale:float=2.**16, # the scale until the first clean step gives a first observation
        overflow_prob:float=1e-3, # target probability that a step overflows
        window:int=100, # statistics: exact mean/variance of the first `window` observations, then an EMA of that span
        warmup:int=10, # observations before the spread estimate is trusted (sigma >= 1 bit before)
        min_sigma:float=.25, # floor of the spread, in bits (a constant gradient maximum has zero variance)
        min_scale:float=1., # the scale never goes under this; an overflow at it is an error
        max_scale:float=2.**24, # the scale never goes above this
        backoff:float=2., # an overflow divides the scale by at least this
        pow2:bool=True, # round the scale down to a power of 2 (exact scaling/unscaling, a stable scale)
        max_value:float=FP16_MAX, # largest finite value of the 16-bit dtype (fp16: 65504)
        max_skipped:int=50, # more overflowing steps in a row than this is an error
    ):
        overflow_prob = check_real('overflow_prob', overflow_prob, 0., .5, lo_open=True, hi_open=True)
        window, warmup = check_int('window', window, 1), check_int('warmup', warmup, 0)
        min_sigma, backoff = check_real('min_sigma', min_sigma, 0.), check_positive('backoff', backoff, strict_min=1.)
        min_scale, max_scale = _check_scale_range(min_scale, max_scale)
        max_value, pow2 = check_positive('max_value', max_value), check_bool('pow2', pow2)
        super().__init__(min(max(check_positive('loss_scale', init_scale), min_scale), max_scale), max_skipped)
        self.overflow_prob, self.window, self.warmup, self.min_sigma = overflow_prob, window, warmup, min_sigma
        self.min_scale, self.max_scale, self.backoff, self.pow2 = min_scale, max_scale, backoff, pow2
        self.max_value, self.z = max_value, NormalDist().inv_cdf(1 - overflow_prob)
        self.mu, self.var, self.n_obs = 0., 0., 0

    @property
    def sigma(self) -> float:
        "The spread (in bits) the scale is chosen with: the estimate, floored by `min_sigma` (and 1 in warm-up)."
        floor = self.min_sigma if self.n_obs >= self.warmup else max(self.min_sigma, 1.)
        return max(math.sqrt(self.var), floor)

    def observe(self, x:float):
        "Add `x = log2(max|grad|)` to the running mean and variance (Welford, exponentially weighted after `window`)."
        self.n_obs += 1
        a = max(1. / self.n_obs, 1. / self.window)
        d = x - self.mu
        self.mu += a * d
        self.var = (1 - a) * (self.var + a * d * d)

    def target(self) -> float:
        "The scale for which the modelled maximum overflows with probability `overflow_prob` (clamped, rounded)."
        t = math.log2(self.max_value) - (self.mu + self.z * self.sigma)
        if self.pow2: t = math.floor(t)
        return min(max(2. ** max(min(t, 1023.), -1022.), self.min_scale), self.max_scale)

    def _update(self, found_inf, max_grad):
        if not found_inf:
            if max_grad is None: raise ValueError("LogNormalScaler.update needs the largest |unscaled grad| of the step")
            if max_grad > 0 and math.isfinite(max_grad): self.observe(math.log2(max_grad))
            if self.n_obs: self.scale = self.target()
            return
        if self.scale <= self.min_scale:
            self._fail(f"gradients overflow even at min_loss_scale={self.min_scale:g}: the loss scale would fall under it.")
        if self.n_obs:
            cutoff = math.log2(self.max_value / self.scale)
            self.observe(_censored_mean(self.mu, self.sigma, cutoff))
        self.scale = max(min(self.target() if self.n_obs else self.scale, self.scale / self.backoff), self.min_scale)

    is_dynamic = property(lambda self: True, doc="The scale follows the statistics of the gradients.")
    floor = property(lambda self: self.min_scale, doc="`min_scale`.")

    def __repr__(self):
        return f"LogNormalScaler(scale={self.scale:g}, mu={self.mu:.2f}, sigma={self.sigma:.2f}, overflow_prob={self.overflow_prob:g})"

class GradScalerAdapter:
    """torch's `GradScaler` behind the `LossScaler` interface (`scale`, `is_dynamic`, `floor`, `state_dict`), so that
    health checks and diagnostics read `NativeMixedPrecision` as they read `MixedPrecision`. GradScaler updates itself."""
    def __init__(self, gs): self.gs = gs
    @property
    def scale(self) -> float: return self.gs.get_scale() if self.gs is not None and self.gs.is_enabled() else 1.
    @property
    def is_dynamic(self) -> bool: return self.gs is not None and self.gs.is_enabled()
    floor = 1.  # GradScaler has no floor; a scale held under 1 means gradients too large for fp16 even unscaled
    def state_dict(self) -> dict: return self.gs.state_dict() if self.gs is not None else {}
    def load_state_dict(self, sd:dict):
        if self.gs is not None and self.gs.is_enabled(): self.gs.load_state_dict(sd)
    def __repr__(self): return f"GradScalerAdapter(scale={self.scale:g})"

SEED_LOSS_SCALE = 512.  # `MixedPrecision`'s default `loss_scale`: with `dynamic`, any other value is the starting scale

def _max_value(dtype) -> float: return FP16_MAX if dtype is None else torch.finfo(resolve_dtype(dtype)).max
def _min_normal(dtype) -> float: return FP16_TINY if dtype is None else torch.finfo(resolve_dtype(dtype)).tiny

def make_scaler(scaler, *, loss_scale, dynamic, max_loss_scale, div_factor, scale_wait, min_loss_scale=1.,
                max_skipped=50, dtype=None) -> LossScaler:
    """A `LossScaler` from `MixedPrecision`'s arguments: `None` keeps fastai v2's original behaviour (but for the start:
    with `dynamic` and the default `loss_scale`, the first step calibrates the scale), a name or an instance picks.
    `dtype`: the model's 16-bit dtype, whose largest finite value 'lognormal' keeps the gradients under (fp16's if None)."""
    if isinstance(scaler, LossScaler): return scaler
    if scaler is None: scaler = 'backoff' if dynamic else 'static'
    if not isinstance(scaler, str): raise ValueError(f"`scaler` must be None, a LossScaler or a name, got {scaler!r}")
    name = scaler.lower()
    if name == 'static': return StaticScaler(loss_scale, max_skipped=max_skipped)
    if name == 'backoff':  # `loss_scale` other than fastai's default 512: the start; else the first step calibrates it
        calibrate = loss_scale == SEED_LOSS_SCALE
        return BackoffScaler(1. if calibrate else loss_scale, div_factor, scale_wait, min_scale=min_loss_scale,
                             max_scale=max_loss_scale, max_skipped=max_skipped, calibrate=calibrate, max_value=_max_value(dtype),
                             min_normal=_min_normal(dtype))
    if name == 'lognormal':  # starts at 2**16, within [min_loss_scale, max_loss_scale]
        return LogNormalScaler(min(max(2.**16, min_loss_scale), max_loss_scale), min_scale=min_loss_scale,
                               max_scale=max_loss_scale, max_skipped=max_skipped, max_value=_max_value(dtype))
    raise ValueError(f"unknown loss scaler {scaler!r}: expected 'backoff', 'lognormal', 'static' or a LossScaler instance")

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

_FEW = 8  # up to this many tensors, a check at scale 1 reads them with one `aminmax` each; more: the fused kernel

class OverflowCheck:
    "Unscale gradients in place and detect inf/NaN in the same fused pass; optionally the largest |grad| too."
    def __init__(self): self._bufs, self._grads, self._groups = {}, None, None

    def _grouped(self, grads) -> dict:
        "`grads` by (device, dtype), cached while the caller passes the very same tensors (it does, step after step)."
        if not (self._grads is not None and len(grads) == len(self._grads) and all(map(operator.is_, grads, self._grads))):
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
        found = founds[0] if len(founds) == 1 else torch.stack(founds).sum(0) if founds else torch.zeros(1, device=first)
        if not with_max: return found
        return torch.cat([found, torch.stack(maxes).max().reshape(1) if maxes else torch.zeros(1, device=first)])

    def _check_only(self, grads, with_max:bool) -> Tensor:
        """Unscaling by 1 changes nothing: a read-only `aminmax` pass (an inf/NaN shows in a min or a max) gives both
        stats. One `aminmax` per tensor: for the few flat buffers `MixedPrecision` passes, not for hundreds of grads."""
        first = grads[0].device if grads else torch.device('cpu')
        ts = _real(grads)
        if not ts: return torch.zeros(2 if with_max else 1, device=first)
        mm = torch.stack([torch.stack(torch.aminmax(t)).to(first, torch.float32) for t in ts])
        found = torch.isfinite(mm).all().logical_not_().float().reshape(1)
        return torch.cat([found, mm.abs().max().reshape(1)]) if with_max else found


# ---- across ranks: the step's one sync takes every rank's worst
def world_size() -> int:
    "The number of processes training together (1 when torch.distributed is not initialized)."
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

def is_multiprocess() -> bool: return world_size() > 1

def is_ddp(model) -> bool: return isinstance(model, DDP)

def syncs(model) -> bool:
    """Whether the ranks must agree about `model`'s steps: several processes, and `model` is a DDP (a learner that
    trains a plain model on one rank only, in a multi-process job, stays local: no collective it would hang on)."""
    return is_ddp(model) and is_multiprocess()

def reduce_max_(t:Tensor, model=None) -> Tensor:
    "`t` all-reduced in place with MAX across ranks when `syncs(model)` (else as it is); no host sync of its own."
    if syncs(model): dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t

# ---- what a skip must undo, and its accounting
class BNStatsGuard:
    "Snapshot BatchNorm running statistics before a step's forward pass; put them back when the step is skipped."
    def __init__(self,
        model:nn.Module, # the model whose BatchNorm layers (tracking running stats) are guarded
    ):
        self.bufs = [b for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                     for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]
        self.snaps = [torch.empty_like(b) for b in self.bufs]
        self.armed = True  # a snapshot is due: nothing was accumulated since the last optimizer step

    def snapshot(self):
        "Copy the statistics aside (one fused copy) when a new step starts; micro-batches of an accumulated step keep the first."
        if not self.armed or not self.bufs: return
        torch._foreach_copy_(self.snaps, self.bufs)
        self.armed = False

    def restore(self):
        "Put back the statistics of the snapshot: the skipped step's forward passes leave no trace in them."
        if self.bufs and not self.armed: torch._foreach_copy_(self.bufs, self.snaps)
        self.armed = True

    def arm(self):
        "An optimizer step (or skip) happened: the next training batch takes a new snapshot."
        self.armed = True

def count_skip(n_in_a_row:int, skipped:bool, max_skipped:int, what:str) -> int:
    "Consecutive skipped steps after this one; past `max_skipped` the scalers' loud `LossScaleError`."
    n = n_in_a_row + 1 if skipped else 0
    if n > max_skipped:
        raise LossScaleError(f"Mixed-precision training stopped: {n} steps in a row had inf/NaN gradients "
                             f"and were skipped ({what}). {_HINT}")
    return n

@contextmanager
def lr_find_stops_on(learn,
    on_collapse=None, # `LossScaleError -> exception or None`: where the overflow starts and the remedy (None: applied)
):
    """In `lr_find`, steps that keep overflowing mean the growing lr diverged: end the search (as `stop_div` does), not
    raise. Elsewhere `on_collapse` (the failing step only) gives the error to raise instead, one that says where the
    overflow starts and what to do, or None when it removed the cause: training goes on."""
    from fastai.callback.core import CancelFitException
    from fastai.callback.schedule import LRFinder
    try: yield
    except LossScaleError as e:
        if any(isinstance(cb, LRFinder) for cb in learn.cbs): raise CancelFitException()
        err = e if on_collapse is None else on_collapse(e)
        if err is e: raise
        if err is not None: raise err from None

def warn_all_skipped(skips:list, what:str):
    "At the end of a fit: warn when every optimizer step of it was skipped for inf/NaN gradients (the weights never moved)."
    if skips and all(skips):
        import warnings
        warnings.warn(f"all {len(skips)} optimizer steps of this fit were skipped for inf/NaN gradients ({what}): the "
                      f"weights did not change. Check the data and the loss for NaN/inf, lower the learning rate, or try "
                      f"`learn.to_bf16()` if the forward pass overflows in fp16.", RuntimeWarning, stacklevel=2)

def underflow_flag(stats:Tensor, grads:list, loss:Tensor, min_normal:float=FP16_TINY) -> Tensor:
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
    flushed = (stats[1] == 0) & (loss.detach().as_subclass(Tensor).abs().reshape(()).to(dev) != 0)  # fastai's TensorBase: plain
    return torch.cat([stats, ((2 * small > nonzero) | flushed).to(stats.dtype).reshape(1)])

def read_stats(stats:Tensor, model=None) -> tuple:
    """The step's one host sync (after every rank's worst is taken, under DDP): `(found_inf, max |grad| or None,
    underflow)`; `underflow` (any rank's) is read where `underflow_flag` added it, the calibrating step; else False."""
    s = reduce_max_(stats, model).tolist()
    return s[0] > 0, (s[1] if len(s) > 1 else None), len(s) > 2 and s[2] > 0

def nonfinite_flags(grads:list) -> Tensor|None:
    """Whether each of `grads` (None: no grad) holds an inf/NaN, as a bool tensor on the first one's device: one
    reduction per tensor and no host sync (a skipped step's attribution; read later, by `OverflowLog.read`)."""
    ts = [g for g in grads if g is not None]
    if not ts: return None
    dev = ts[0].device
    finite = [torch.isfinite(g).all().to(dev) if g is not None else torch.ones((), dtype=torch.bool, device=dev) for g in grads]
    return torch.stack(finite).logical_not_()

class OverflowLog:
    """Which parameters had inf/NaN gradients at each skipped step: the last `keep` steps (a long run stays bounded)
    and their `count`. The per-parameter flags stay on the device until `read` (no host sync in the step)."""
    def __init__(self, keep:int=100): self.entries, self.count = deque(maxlen=keep), 0

    def add(self, step:int, scale:float, flags=None, names=()):
        "Step `step` (at `scale`) was skipped; `flags[i]`: param `names[i]` had an inf/NaN gradient."
        self.entries.append([step, scale, flags, names if flags is not None else []]); self.count += 1

    def read(self) -> list:
        "`[{'step', 'scale', 'params'}]`, oldest first: `params` are the names of the params whose grads held inf/NaN."
        for e in self.entries:
            if e[2] is not None: e[2], e[3] = None, [n for n, bad in zip(e[3], e[2].tolist()) if bad]
        return [dict(step=e[0], scale=e[1], params=list(e[3])) for e in self.entries]

    def __len__(self): return len(self.entries)

class StepRecord:
    """Skip accounting for one precision callback: the loss scale and the skip flag of every optimizer step (over all
    its fits; `fit_start` is where the current fit's steps begin), which params overflowed at the skipped ones
    (`overflows`), and the BatchNorm statistics a skipped step must not change (snapshot at each step's first
    micro-batch, restored on a skip). A step that another callback cancels is no step: nothing is recorded
    (`cancelled`). `grad_scale`: the loss scale the grads of the step under way carry (None: none), what a fit that
    ends before its step divides them by (`unscale_left`)."""
    def __init__(self):
        self.scales, self.skips, self.fit_start, self.bn, self.overflows = [], [], 0, None, OverflowLog()
        self.grad_scale = None
    def new_fit(self): self.fit_start, self.grad_scale = len(self.skips), None
    def setup(self, model): self.bn = BNStatsGuard(model)
    def teardown(self): self.bn = None
    def snapshot(self):
        if self.bn is not None: self.bn.snapshot()
    def record(self, scale:float, skipped:bool, found:tuple|None=None):
        """One optimizer step done (or skipped: BatchNorm's statistics go back to the snapshot, and `found`, the
        store's `(flags, names)` of the params whose grads held inf/NaN, is logged); the next one re-arms."""
        if skipped: self.overflows.add(len(self.skips), scale, *(found or ()))
        self.scales.append(scale); self.skips.append(skipped)
        if self.bn is not None:
            if skipped: self.bn.restore()
            self.bn.arm()

    def cancelled(self):
        """Another callback cancelled the step (`CancelStepException`): as in FP32, nothing happened but the forward
        passes, whose BatchNorm statistics stay; no step is recorded. The next training batch takes a new snapshot."""
        if self.bn is not None: self.bn.arm()

    def scaled(self, scale):
        """A backward is about to add grads multiplied by `scale` (the micro-batches of a step share one): a float, or
        a function that reads it (GradScaler's, a host read: only a fit that ends before the step makes it)."""
        self.grad_scale = None if scale == 1. else scale
    def unscaled(self): "The grads carry no loss scale any more (divided by it, or cleared)."; self.grad_scale = None

    def unscale_left(self, grads:list):
        """The fit ends while `grads` carry the loss scale (a `KeyboardInterrupt` after the backward, a fit cancelled
        before its step): divide them by it, which leaves what FP32 would hold, the grads unscaled."""
        gs, scale = [g for g in grads if g is not None], self.grad_scale
        if scale is not None and gs:
            inv = 1. / float(scale() if callable(scale) else scale)
            with torch.no_grad():
                for ts in _by_device(gs).values(): torch._foreach_mul_(ts, inv)
        self.grad_scale = None
    @property
    def this_fit(self) -> list: return self.skips[self.fit_start:]
