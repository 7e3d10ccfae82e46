"""The loss scalers: what picks the loss scale step after step. Static, Backoff (halve on overflow, grow back; the first
step may calibrate the scale from the gradients) and LogNormal (OpenSeq2Seq's statistics-based scaling), and
GradScaler behind the same interface."""
from __future__ import annotations
import math
from statistics import NormalDist
import torch

from ..dtypes import FP16_MAX, FP16_MIN_NORMAL, resolve_dtype
from ..options import (check_positive, check_real, check_int, check_bool, SaidFirst, SEED_LOSS_SCALE,  # noqa: F401
                       CALIBRATE)

__all__ = ['LossScaler', 'StaticScaler', 'BackoffScaler', 'LogNormalScaler', 'LossScaleError', 'make_scaler',
           'GradScalerAdapter', 'SEED_LOSS_SCALE', 'CALIBRATE', 'calibrates', 'FP16_MAX', 'FP16_MIN_NORMAL']

# ---- scalers
class LossScaleError(SaidFirst, FloatingPointError):
    "Training cannot go on: gradients keep overflowing whatever the loss scale (its sentence first: `SaidFirst`)."

def _check_scale_range(min_scale, max_scale) -> tuple:
    "`(min_scale, max_scale)` as floats, both > 0 and min <= max (an error names both: neither is clamped silently)."
    max_scale = check_positive('max_loss_scale', max_scale)
    return check_real('min_loss_scale', min_scale, 0., max_scale, lo_open=True, hi_name='max_loss_scale'), max_scale

_HINT = ("Likely causes: NaN/inf in the inputs, targets or loss; a learning rate that is too high (the weights "
         "diverged); or activations beyond the fp16 range in the forward pass (`learn.precision_check()` names where "
         "they start).")

class LossScaler:
    """Base strategy: `scale` is the current loss scale; `update` is called once per optimizer step after the overflow
    check (a step that another callback cancels is no step: the scaler sees nothing of it, as torch's
    `GradScaler.update` is never called for it)."""
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
        min_normal:float=FP16_MIN_NORMAL, # 16-bit dtype's smallest normal (fp16: 2^-14): calibration's underflow check
    ):
        factor, wait = check_positive('factor', factor, strict_min=1.), check_int('wait', wait, 1)  # their own names
        min_scale, max_scale = _check_scale_range(min_scale, max_scale)
        hysteresis = check_int('hysteresis', hysteresis, 1)
        check_positive('headroom', headroom, strict_min=0.); check_positive('max_value', max_value)
        calibrate, min_normal = check_bool('calibrate', calibrate), check_positive('min_normal', min_normal)
        super().__init__(min(max(check_positive('init_scale', init_scale), min_scale), max_scale), max_skipped)
        self.factor, self.wait, self.min_scale, self.max_scale = factor, wait, min_scale, max_scale
        self.hysteresis = hysteresis
        self.clean_in_a_row, self.overflows_left = 0, hysteresis
        self.calibrated, self.headroom, self.max_value = not calibrate, float(headroom), float(max_value)
        self.min_normal = float(min_normal)

    @property
    def needs_max_grad(self) -> bool:
        "Only the calibrating step needs the largest |grad| (read in the same sync as the overflow flag)."
        return not self.calibrated

    calibrating = property(lambda self: not self.calibrated,
                           doc="Whether the next step sets the scale (until one does).")

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
        """The calibrating step was skipped for underflow: its largest |grad| (0: every one flushed) still sets the
        scale."""
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

    is_dynamic = property(lambda self: True,
                          doc="Backoff scaling moves the scale: down on overflow, up after `wait` clean steps.")
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
    """OpenSeq2Seq's LogNormal automatic loss scaling (its mixed-precision guide): log2 of each step's largest
    |unscaled grad| is modelled as normal with a running mean and variance; the next scale is the largest for which
    the scaled maximum overflows `max_value` with probability `overflow_prob`:
    `log2(scale) = log2(max_value) - (mu + z*sigma)`, `z = Phi^-1(1-overflow_prob)`.

    Overflowing steps enter the statistics as *censored* observations: their maximum is unknown but above the cutoff
    `c = log2(max_value/scale)`, so we add `E[X | X > c]` under the current fit (skipping them would bias the
    estimate low exactly where it matters, in the tail); and the scale is divided by `backoff` at least, so that
    persistent overflow (NaN in the loss) drives it to `min_scale` and to the loud failure. Until the first clean
    step there are no statistics: the scale only backs off. For the first `warmup` observations sigma is taken as at
    least 1 bit, since a spread estimated from a handful of steps is unreliable."""
    needs_max_grad = True
    _state_names = LossScaler._state_names + ('mu', 'var', 'n_obs', 'calibrated')

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
        calibrate:bool=False, # the first step (at `init_scale`, 1) gives the first observation, even if it underflows
        min_normal:float=FP16_MIN_NORMAL, # 16-bit dtype's smallest normal (fp16: 2^-14): calibration's underflow check
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
        self.calibrated, self.min_normal = (not check_bool('calibrate', calibrate),
                                            check_positive('min_normal', min_normal))

    calibrating = property(lambda self: not self.calibrated,
                           doc="Whether the next step is the first observation (run at 1).")

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

    def _underflow(self, max_grad):
        "The calibrating step was skipped for underflow: its largest |grad| is observed still (0: every one flushed)."
        self.calibrated = True
        if max_grad is not None and max_grad > 0 and math.isfinite(max_grad): self.observe(math.log2(max_grad))
        self.scale = self.target() if self.n_obs else self.max_scale

    def _update(self, found_inf, max_grad):
        if not self.calibrated:
            # an overflow at scale 1 (what fp16 cannot hold anyway): skipped, tried again (max_skipped ends it)
            if found_inf:
                self.scale = max(min(self.scale / self.backoff, 1.), self.min_scale)
                return
            if max_grad == 0: return  # an all-zero gradient of a zero loss says nothing: calibrate on a later step
            self.calibrated = True
        if not found_inf:
            if max_grad is None:
                raise ValueError("LogNormalScaler.update needs the largest |unscaled grad| of the step")
            if max_grad > 0 and math.isfinite(max_grad): self.observe(math.log2(max_grad))
            if self.n_obs: self.scale = self.target()
            return
        if self.scale <= self.min_scale:
            self._fail(f"gradients overflow even at min_loss_scale={self.min_scale:g}: the loss scale would fall "
                       f"under it.")
        if self.n_obs:
            cutoff = math.log2(self.max_value / self.scale)
            self.observe(_censored_mean(self.mu, self.sigma, cutoff))
        self.scale = max(min(self.target() if self.n_obs else self.scale, self.scale / self.backoff), self.min_scale)

    is_dynamic = property(lambda self: True, doc="The scale follows the statistics of the gradients.")
    floor = property(lambda self: self.min_scale, doc="`min_scale`.")

    def __repr__(self):
        return (f"LogNormalScaler(scale={self.scale:g}, mu={self.mu:.2f}, sigma={self.sigma:.2f}, "
                f"overflow_prob={self.overflow_prob:g})")

class GradScalerAdapter:
    """torch's `GradScaler` behind the `LossScaler` interface (`scale`, `is_dynamic`, `floor`, `state_dict`), so that
    health checks and diagnostics read `NativeMixedPrecision` as they read `MixedPrecision`. GradScaler updates
    itself."""
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


def calibrates(loss_scale) -> bool:
    "Whether `loss_scale` asks a dynamic scale to calibrate on the first step: `CALIBRATE`, or fastai's default 512."
    return loss_scale == CALIBRATE or loss_scale == SEED_LOSS_SCALE

def _max_value(dtype) -> float: return FP16_MAX if dtype is None else torch.finfo(resolve_dtype(dtype)).max
def _min_normal(dtype) -> float: return FP16_MIN_NORMAL if dtype is None else torch.finfo(resolve_dtype(dtype)).tiny

def make_scaler(scaler, *, loss_scale, dynamic, max_loss_scale, div_factor, scale_wait, min_loss_scale=1.,
                max_skipped=50, dtype=None) -> LossScaler:
    """A `LossScaler` from `MixedPrecision`'s arguments: `None` keeps fastai v2's original behaviour (but for the start:
    with `dynamic` and the default `loss_scale`, the first step calibrates the scale), a name or an instance picks.
    `dtype`: the model's 16-bit dtype, whose largest finite value 'lognormal' keeps the gradients under (fp16's if
    None)."""
    if isinstance(scaler, LossScaler): return scaler
    if scaler is None: scaler = 'backoff' if dynamic else 'static'
    if not isinstance(scaler, str): raise ValueError(f"`scaler` must be None, a LossScaler or a name, got {scaler!r}")
    name = scaler.lower()
    if name == 'static':
        if loss_scale == CALIBRATE: raise ValueError("loss_scale='calibrate' sets a dynamic scale from the first step: "
                                                     "use dynamic=True, or give a static scale as a number")
        return StaticScaler(loss_scale, max_skipped=max_skipped)
    if name == 'backoff':  # `loss_scale` other than fastai's default 512: the start; else the first step calibrates it
        calibrate = calibrates(loss_scale)
        return BackoffScaler(1. if calibrate else loss_scale, div_factor, scale_wait, min_scale=min_loss_scale,
                             max_scale=max_loss_scale, max_skipped=max_skipped, calibrate=calibrate,
                             max_value=_max_value(dtype), min_normal=_min_normal(dtype))
    if name == 'lognormal':  # the default `loss_scale`: the first step calibrates (at 1); any other: the start
        calibrate = calibrates(loss_scale)
        return LogNormalScaler(min(max(1. if calibrate else loss_scale, min_loss_scale), max_loss_scale),
                               min_scale=min_loss_scale, max_scale=max_loss_scale, max_skipped=max_skipped,
                               max_value=_max_value(dtype), calibrate=calibrate, min_normal=_min_normal(dtype))
    raise ValueError(f"unknown loss scaler {scaler!r}: expected 'backoff', 'lognormal', 'static' or a LossScaler "
                     "instance")

