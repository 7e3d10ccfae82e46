"""The one owner of a mixed-precision fit's lifecycle. A `PrecisionSession` per learner sets the precision callbacks up
at the start of a fit and tears them down at its end (also when the fit raises, when fastai skips `after_fit`). It
also knows the nested `before_fit`/`after_fit` pairs that `validate`/`get_preds` fire inside a fit. Whatever must see
the plain FP32 learner in the middle of a fit asks it for `suspended()`: `learn.save`/`load`, `freeze`/`unfreeze`,
`export` and `copy.deepcopy(learn)`. The callbacks keep their own configuration and per-fit state, and never set
themselves up or down on their own: `setup()` and `teardown()` are called by the session alone."""
from __future__ import annotations
from contextlib import contextmanager

__all__ = ['PrecisionSession', 'session_of']

_KEY = '_fp16cb_session'

class PrecisionSession:
    "Which precision callbacks of a learner are set up for its current fit, and how deep in nested fits we are."
    def __init__(self, learn=None):
        self.learn = learn
        self.active = []  # set-up callbacks, in setup order (their teardown goes in reverse)
        self.depth = {}  # id(callback) -> open before_fit/after_fit pairs (1 + the nested validate/get_preds)
        self.fitting = 0  # `Learner.fit` calls under way (nested fits, e.g. lr_find inside a callback, count too)
        self.suspending = False  # within `suspended()`: the teardowns are a pause, not the end of the fit

    def __reduce__(self):
        "A copied or pickled learner gets an empty session: a fit's state belongs to that fit, not to a copy."
        return (PrecisionSession, ())

    @property
    def in_fit(self) -> bool: return self.fitting > 0

    def is_active(self, cb) -> bool: return any(c is cb for c in self.active)

    def begin(self, cb):
        "From `cb.before_fit`: set `cb` up, unless this is the nested `before_fit` of a `validate`/`get_preds` in a fit."
        if self.is_active(cb):
            if self.in_fit:
                self.depth[id(cb)] += 1
                return
            self._teardown(cb)  # outside `fit` nothing nests: a setup left by events fired without their after_fit
        cb.setup()
        self.active.append(cb); self.depth[id(cb)] = 1

    def end(self, cb):
        "From `cb.after_fit`: tear `cb` down when its outermost `before_fit` is closed."
        if not self.is_active(cb): return
        self.depth[id(cb)] -= 1
        if self.depth[id(cb)] <= 0: self._teardown(cb)

    def _teardown(self, cb):
        self.active = [c for c in self.active if c is not cb]
        self.depth.pop(id(cb), None)
        cb.teardown()

    def teardown_all(self):
        "Put the learner back in its between-fits state: every active callback torn down, in reverse setup order."
        for cb in reversed(list(self.active)): self._teardown(cb)

    def drop(self, cb):
        "Tear `cb` down now if it is set up (it is being removed from the learner)."
        if self.is_active(cb): self._teardown(cb)

    @contextmanager
    def suspended(self):
        """Within: the plain FP32 learner (exact FP32 masters in the model, the optimizer on the model's own params with
        their state). On exit the fit's setup comes back, made again from those FP32 values (nothing rounded twice)."""
        cbs, depth, outer = list(self.active), dict(self.depth), self.suspending
        self.suspending = True
        try:
            for cb in reversed(cbs): cb.teardown()
        except BaseException:
            self.suspending = outer
            raise
        self.active, self.depth = [], {}
        try: yield self.learn
        finally:
            for cb in cbs: cb.setup()
            self.active, self.depth, self.suspending = cbs, depth, outer

    @contextmanager
    def fit(self):
        "Around `Learner.fit`: any exception leaves the learner torn down at once (fastai then skips `after_fit`)."
        outer = not self.in_fit
        if outer: self.teardown_all()  # whatever a fit that ended without `after_fit` (and without us) left behind
        self.fitting += 1
        try: yield
        except BaseException:
            self.teardown_all()
            raise
        finally: self.fitting -= 1

def session_of(learn) -> PrecisionSession:
    "The learner's `PrecisionSession` (made on first use; a copied learner gets its own)."
    s = learn.__dict__.get(_KEY)
    if s is None or s.learn is not learn:
        s = PrecisionSession(learn)
        learn.__dict__[_KEY] = s
    return s
