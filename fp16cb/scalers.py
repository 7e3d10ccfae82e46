"""Loss scalers: small strategy objects with explicit state that pick the loss scale step after step."""
from __future__ import annotations
import math

__all__ = ['LossScaler', 'StaticScaler', 'BackoffScaler', 'LossScaleError', 'check_positive', 'make_scaler']

class LossScaleError(FloatingPointError):
    "Training cannot go on: gradients keep overflowing whatever the loss scale."

def check_positive(name, v, strict_min=0., allow_none=False):
    "Raise a `ValueError` that names `name` unless `v` is a number > `strict_min`."
    if v is None and allow_none: return v
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= strict_min:
        raise ValueError(f"`{name}` must be a finite number > {strict_min:g}, got {v!r}")
    return v

_HINT = ("Likely causes: NaN/inf in the inputs, targets or loss; a learning rate that is too high (the weights "
         "diverged); or activations beyond the fp16 range in the forward pass (try `learn.to_bf16()`, which has "
         "FP32's range).")

class LossScaler:
    "Base strategy: `scale` is the current loss scale; `update` is called once per step after the overflow check."
    needs_max_grad = False  # whether `update` wants the largest |unscaled grad| of the step (costs one fused pass)
    _state_names = ('scale', 'skipped_in_a_row', 'n_skipped', 'n_steps')

    def __init__(self,
        scale:float, # initial loss scale
        max_skipped:int=50, # more overflowing steps in a row than this is an error, not training
    ):
        self.scale = float(check_positive('loss_scale', scale))
        self.max_skipped = int(check_positive('max_skipped', max_skipped, strict_min=0))
        self.skipped_in_a_row, self.n_skipped, self.n_steps = 0, 0, 0

    def update(self,
        found_inf:bool, # whether this step's gradients held an inf/NaN (the step is then skipped)
        grad_stats=None, # the statistics the strategy asked for (`needs_max_grad`: largest |unscaled grad|)
    ):
        "Count the step, then let the strategy move `scale`; fail loudly when steps keep overflowing."
        self.n_steps += 1
        if found_inf:
            self.n_skipped += 1; self.skipped_in_a_row += 1
        else: self.skipped_in_a_row = 0
        self._update(found_inf, grad_stats)
        if self.skipped_in_a_row > self.max_skipped:
            self._fail(f"{self.skipped_in_a_row} steps in a row had inf/NaN gradients and were skipped "
                       f"(loss scale now {self.scale:g}).")

    def _update(self, found_inf, grad_stats): pass

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
    "Divide by `factor` on overflow (after `hysteresis` overflows); multiply by it after `wait` clean steps in a row."
    _state_names = LossScaler._state_names + ('clean_in_a_row', 'overflows_left')

    def __init__(self,
        init_scale:float=2.**24, # starting scale (seed 001: `max_loss_scale`)
        factor:float=2., # divide by this on overflow, multiply after `wait` clean steps (`div_factor`)
        wait:int=500, # clean steps in a row before the scale grows (`scale_wait`)
        min_scale:float=1., # the scale never goes under this; needing to is an error
        max_scale:float=2.**24, # the scale never goes above this
        hysteresis:int=1, # the scale drops only after this many overflows (each one still skips its step)
        max_skipped:int=50, # more overflowing steps in a row than this is an error
    ):
        check_positive('div_factor', factor, strict_min=1.)
        if isinstance(wait, bool) or not isinstance(wait, int) or wait < 1:
            raise ValueError(f"`scale_wait` must be an integer >= 1, got {wait!r}")
        check_positive('min_loss_scale', min_scale); check_positive('max_loss_scale', max_scale)
        if min_scale > max_scale: raise ValueError(f"`min_loss_scale` ({min_scale:g}) > `max_loss_scale` ({max_scale:g})")
        if isinstance(hysteresis, bool) or not isinstance(hysteresis, int) or hysteresis < 1:
            raise ValueError(f"`hysteresis` must be an integer >= 1, got {hysteresis!r}")
        super().__init__(min(max(check_positive('loss_scale', init_scale), min_scale), max_scale), max_skipped)
        self.factor, self.wait, self.min_scale, self.max_scale, self.hysteresis = float(factor), wait, float(min_scale), float(max_scale), hysteresis
        self.clean_in_a_row, self.overflows_left = 0, hysteresis

    def _update(self, found_inf, grad_stats):
        if found_inf:
            self.clean_in_a_row = 0
            self.overflows_left -= 1
            if self.overflows_left > 0: return
            self.overflows_left = self.hysteresis
            if self.scale / self.factor < self.min_scale:
                self._fail(f"the loss scale would fall under min_loss_scale={self.min_scale:g}: gradients overflow "
                           f"even at scale {self.scale:g}.")
            self.scale /= self.factor
        else:
            self.clean_in_a_row += 1
            if self.clean_in_a_row >= self.wait:
                self.clean_in_a_row, self.overflows_left = 0, self.hysteresis
                self.scale = min(self.scale * self.factor, self.max_scale)

    def __repr__(self): return f"BackoffScaler(scale={self.scale:g}, factor={self.factor:g}, wait={self.wait})"

def make_scaler(scaler, *, loss_scale, dynamic, max_loss_scale, div_factor, scale_wait, min_loss_scale=1.,
                max_skipped=50) -> LossScaler:
    "A `LossScaler` from `MixedPrecision`'s arguments: `None` keeps seed 001's behaviour, a name or an instance picks."
    if isinstance(scaler, LossScaler): return scaler
    if scaler is None: scaler = 'backoff' if dynamic else 'static'
    if not isinstance(scaler, str): raise ValueError(f"`scaler` must be None, a LossScaler or a name, got {scaler!r}")
    name = scaler.lower()
    if name == 'static': return StaticScaler(loss_scale, max_skipped=max_skipped)
    if name == 'backoff':
        return BackoffScaler(max_loss_scale, div_factor, scale_wait, min_scale=min(min_loss_scale, max_loss_scale),
                             max_scale=max_loss_scale, max_skipped=max_skipped)
    raise ValueError(f"unknown loss scaler {scaler!r}: expected 'backoff', 'static' or a LossScaler instance")
