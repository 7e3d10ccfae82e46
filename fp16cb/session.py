"""The one owner of a mixed-precision fit's lifecycle. A `PrecisionSession` per learner sets the precision callbacks up
at the start of a fit (in callback order) and tears them down at its end in exactly the reverse order, once: at the
outermost `after_fit`, or at once when the fit raises (fastai then skips `after_fit`). It knows the nested
`before_fit`/`after_fit` pairs that `validate`/`get_preds` fire inside a fit, and nested `fit`s (a fit run from a
callback of another). Whatever must see the plain FP32 learner in the middle of a fit asks for `suspended()`
(`learn.load`, `freeze`/`unfreeze`, `export`, `copy.deepcopy(learn)`); `learn.save` needs no pause: it reads the FP32
view of the weight store. The callbacks keep their configuration and per-fit state; `setup()` and `teardown()` are
called by the session alone. Also here: the registry of our precision callbacks (`SessionCallback` subclasses, each
with its family and checkpoint key) and the `Learner` methods the lifecycle goes through (`fit`, `remove_cb`,
`freeze_to`, `__deepcopy__`)."""
from __future__ import annotations
import copy, functools, inspect
from contextlib import contextmanager
from fastai.callback.core import Callback
from fastai.learner import Learner
from fastcore.foundation import L
import fastai.callback.fp16 as _fastai_fp16

__all__ = ['PrecisionSession', 'session_of', 'SessionCallback', 'REGISTRY', 'FOREIGN', 'is_ours', 'family_of',
           'check_precision_cbs', 'restore_precision', 'FIT_CHECKS', 'COLLAPSE',
           'fit_in_session', 'remove_cb_restoring', 'freeze_to_fp32', 'deepcopy_fp32']

_KEY = '_fp16cb_session'
REGISTRY = {}  # our precision callback classes: name -> class (each has `family` and `checkpoint_key`)
# `{callback class: f(cb, err)}`: the diagnosis of a loss scale that cannot go lower (`fp16cb.diagnostics.collapse`)
COLLAPSE = {}
FOREIGN = tuple(getattr(_fastai_fp16, n) for n in ('MixedPrecision', 'NonNativeMixedPrecision', 'ModelToHalf')
                if hasattr(_fastai_fp16, n))  # fastai's own precision callbacks

def is_ours(cb) -> bool: return isinstance(cb, SessionCallback)

def family_of(k) -> str|None:
    "Which precision setup a callback (or class) belongs to: ours by their `family`, fastai's by name; None: not one."
    k = k if isinstance(k, type) else type(k)
    if issubclass(k, SessionCallback): return k.family
    if issubclass(k, FOREIGN): return 'fastai AMP' if k.__name__ == 'MixedPrecision' else 'fastai master weights'
    return None

class PrecisionSession:
    "Which precision callbacks of a learner are set up for its current fit, and how deep in nested fits we are."
    def __init__(self, learn=None):
        self.learn = learn
        self.active = []  # set-up callbacks, in setup order (their teardown goes in reverse)
        self.depth = 0  # open before_fit/after_fit pairs of the set-up callbacks (1 + nested validate/get_preds)
        self.fitting = 0  # `Learner.fit` calls under way (nested fits count too)
        self.suspending = False  # within `suspended()`: the teardowns are a pause, not the end of the fit
        self.failing = False  # the fit raised: teardowns do nothing collective (the other ranks are not there)
        self.notes = []  # what the teardown of a failed fit did that the user should know, added to their exception

    def __reduce__(self):
        "A copied or pickled learner gets an empty session: a fit's state belongs to that fit, not to a copy."
        return (PrecisionSession, ())

    @property
    def in_fit(self) -> bool: return self.fitting > 0

    def is_active(self, cb) -> bool: return any(c is cb for c in self.active)

    def begin(self, cb):
        """From `cb.before_fit`: set `cb` up, unless this is the nested `before_fit` of a `validate`/`get_preds` in a
        fit."""
        if self.is_active(cb):
            if self.in_fit:
                if cb is self.active[0]: self.depth += 1
                return
            self.teardown_all()  # outside `fit` nothing nests: a setup left by events fired without their after_fit
        if not self.active: self.depth = 1
        cb.setup()
        self.active.append(cb)

    def end(self, cb):
        "From `cb.after_fit`: when the outermost `before_fit` closes, tear everything down, in reverse setup order."
        if not self.active or cb is not self.active[0]: return
        self.depth -= 1
        if self.depth <= 0: self.teardown_all()

    def teardown_all(self):
        "Put the learner back in its between-fits state: every active callback torn down once, in reverse setup order."
        cbs, self.active, self.depth = self.active, [], 0
        err = None
        for cb in reversed(cbs):
            try: cb.teardown()
            except BaseException as e: err = err or e  # the others are still torn down
        if err is not None: raise err

    def drop(self, cb):
        "Tear the setup down now if `cb` is part of it (`cb` is being removed from the learner)."
        if self.is_active(cb): self.teardown_all()

    @contextmanager
    def suspended(self):
        """Within: the plain FP32 learner (exact FP32 masters in the model, the optimizer on the model's own params with
        their state). On exit the fit's setup comes back, made again from those FP32 values (nothing rounded twice),
        with the gradients accumulated so far (a step in progress keeps them)."""
        cbs, depth, outer = list(self.active), self.depth, self.suspending
        if not cbs:
            yield self.learn; return
        grads = [(p, p.grad) for p in self.learn.model.parameters() if p.grad is not None]
        self.suspending = True
        try: self.teardown_all()
        except BaseException:
            self.suspending = outer
            raise
        try: yield self.learn
        finally:
            for cb in cbs: cb.setup()
            self.active, self.depth, self.suspending = cbs, depth, outer
            for p, g in grads:  # the 16-bit model again: its grads as they were (the next step reads them)
                if g.dtype == p.dtype and g.shape == p.shape: p.grad = g
            for cb in cbs: cb.resume()

    @contextmanager
    def fit(self):
        """Around `Learner.fit`: any exception leaves the learner torn down at once (fastai then skips `after_fit`). A
        fit run inside another (from a callback) nests like a `validate`: when it raises, the outer fit's setup
        stays."""
        outer, depth = not self.in_fit, self.depth
        if outer: self.teardown_all()  # whatever a fit that ended without `after_fit` (and without us) left behind
        self.fitting += 1
        try: yield
        except BaseException as e:
            if outer: self._teardown_failed(e)
            else: self.depth = depth  # the nested fit's open before_fit pairs are closed: the outer fit goes on
            raise
        finally: self.fitting -= 1

    def _teardown_failed(self, e:BaseException):
        """Tear down after the fit raised `e`, with nothing collective; what it changed is noted on `e` (the user's
        error stays on top)."""
        self.failing, self.notes = True, []
        try: self.teardown_all()
        finally:
            self.failing = False
            for n in self.notes:
                if hasattr(e, 'add_note'): e.add_note(n)
            self.notes = []

def session_of(learn) -> PrecisionSession:
    "The learner's `PrecisionSession` (made on first use; a copied learner gets its own)."
    s = learn.__dict__.get(_KEY)
    if s is None or s.learn is not learn:
        s = PrecisionSession(learn)
        learn.__dict__[_KEY] = s
    return s

class SessionCallback(Callback):
    """A precision callback of ours: the learner's `PrecisionSession` calls its `setup`/`teardown` (once per fit, not
    per event). Subclasses register themselves with their `family` (one setup per fit) and `checkpoint_key` (where
    `learn.save` keeps their `state_dict`, None: nothing to keep)."""
    family, checkpoint_key = 'fp16cb', None
    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        REGISTRY[cls.__name__] = cls
    # our own state, set without fastai's check for a learner attribute of that name (`Callback.__setattr__`): a user's
    # callback `MaxGrad` is `learn.max_grad`, and `MixedPrecision`'s `self.max_grad` warned at every step that it
    # shadows it. Nothing a callback of ours sets is meant to be the learner's (and a step enters no room for it).
    __setattr__ = object.__setattr__
    @property
    def session(self): return session_of(self.learn)
    def before_fit(self): self.session.begin(self)
    def after_fit(self): self.session.end(self)
    def setup(self): pass
    def teardown(self): pass
    def resume(self): "After a `suspended()` pause: the setup is back, with the model's grads as they were."
    def _collapse(self, err:Exception):
        """The loss scale cannot go lower (the failing step only): the error to raise, or None when the cause was
        removed. The diagnosis registered for this class in `COLLAPSE` (where the overflow starts, the remedy,
        `on_collapse`), else `err` itself."""
        f = next((COLLAPSE[k] for k in type(self).__mro__ if k in COLLAPSE), None)
        return err if f is None else f(self, err)
    def restore(self):
        "Tear this callback's setup down now (the learner is FP32 again as far as this callback is concerned)."
        learn = self.__dict__.get('learn')
        if learn is not None: session_of(learn).drop(self)
        else: self.teardown()

# ---- the Learner methods the lifecycle goes through
def _unwrapped(f):
    "`f` without the wrapper this module put around it (a reloaded module must not wrap twice; others' wrappers stay)."
    return f.__wrapped__ if getattr(f, '_fp16cb', False) else f

def restore_precision(self:Learner):
    "Put the learner back in its between-fits state: exact FP32 model, optimizer on the model's params, no autocast."
    session_of(self).teardown_all()
    return self

# `f(cbs)` called with a fit's callbacks before it starts (`learner` adds fastai AMP's arguments' check)
FIT_CHECKS = []

def check_precision_cbs(cbs):
    "Raise a `ValueError` unless `cbs` (callbacks or their classes) hold at most one precision setup."
    kinds = [c if isinstance(c, type) else type(c) for c in cbs]
    kinds = [k for k in kinds if family_of(k) is not None]
    if len(set(kinds)) < len(kinds) or len({family_of(k) for k in kinds}) > 1:
        raise ValueError(f"two precision setups would be stacked in this fit ({', '.join(k.__name__ for k in kinds)}): "
                         f"set the precision once with `learn.to_fp16()`, `to_bf16()`, `to_native_fp16()` or "
                         f"`to_fp32()` (the last call wins) and do not pass precision callbacks to `fit(cbs=...)` "
                         f"as well.")

_fit = _unwrapped(Learner.fit)
_fit_sig = inspect.signature(_fit)

@functools.wraps(_fit)
def fit_in_session(self, *args, **kwargs):
    cbs = list(self.cbs) + list(L(_fit_sig.bind(self, *args, **kwargs).arguments.get('cbs')))
    check_precision_cbs(cbs)
    for check in FIT_CHECKS: check(cbs)
    with session_of(self).fit(): return _fit(self, *args, **kwargs)
fit_in_session._fp16cb = True

_remove_cb = _unwrapped(Learner.remove_cb)

def _family(learn, cb) -> list:
    "`cb` and the other callbacks of `learn` in its precision setup (`ModelToHalf` with `MixedPrecision`), `cb` first."
    return [cb] + [c for c in learn.cbs if c is not cb and is_ours(c) and c.family == cb.family]

@functools.wraps(_remove_cb)
def remove_cb_restoring(self, cb):
    # removing a precision callback of ours (by class too: fastai removes each instance through here) removes its whole
    # setup, the FP32 learner restored first, as `to_fp32()` does: `ModelToHalf` alone would train a pure 16-bit model.
    # A precision callback given to `fit(cbs=...)` is removed when an exception leaves the fit: restored first too
    if isinstance(cb, type) or not is_ours(cb): return _remove_cb(self, cb)
    if not any(c is cb for c in self.cbs): return self  # removed with its setup already (fastai's `hasattr` would see
    # the model's attribute of that name through `Learner.__getattr__`: DDP has a `mixed_precision`)
    for c in _family(self, cb):
        if getattr(c, 'learn', None) is self: session_of(self).drop(c)
        _remove_cb(self, c)
    return self
remove_cb_restoring._fp16cb = True

_freeze_to = _unwrapped(Learner.freeze_to)

@functools.wraps(_freeze_to)
def freeze_to_fp32(self, n):
    # mid-fit (a callback unfreezing after an epoch): freeze the model's own params, then make the masters again
    with session_of(self).suspended(): return _freeze_to(self, n)
freeze_to_fp32._fp16cb = True

def deepcopy_fp32(self, memo):
    """`copy.deepcopy(learn)` (keep-the-best in a callback): mid-fit, the copy is taken of the plain FP32 learner, so it
    is a learner between fits, with the exact FP32 weights of that moment, that fits and predicts on its own."""
    with session_of(self).suspended():
        res = self.__class__.__new__(self.__class__)
        memo[id(self)] = res
        res.__setstate__(copy.deepcopy(self.__getstate__(), memo))  # fastai's: all but the lock, a new lock
    return res
