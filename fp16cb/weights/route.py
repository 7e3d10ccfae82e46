"""The visible optimizer: who runs `learn.opt.step()` during a mixed-precision fit.

`learn.opt` stays the learner's own optimizer object during the fit (`learn.opt is opt`, `isinstance` as before, every
attribute read or written on it: `hypers`, `param_groups`, `state`, `state_dict`, `set_hyper` ...), but its class is,
for the fit, a subclass made for it (`Routed[...]`) whose `step` and `zero_grad` go through the weight store:
- `step()`: the store steps what the optimizer holds (the FP32 masters, or the lifted 16-bit params) and the model
  follows; fastai's `Lookahead` runs its own `step`, whose call of the wrapped optimizer's `step` is the store's;
- `zero_grad()`: clears the model's grads, as FP32 fastai's clears them (a callback's `learn.opt.zero_grad()` included),
  then runs the optimizer's own `zero_grad` on what it holds.
At the end of the fit (or an error, an interrupt: the session tears down) the object gets its own class back. Nothing
is assigned on the instance, so `vars(opt)` is what the user made."""
from __future__ import annotations
from types import MethodType

__all__ = ['Route', 'own_class']

def own_class(opt) -> type:
    "`opt`'s own class (during a fit its class is the routed subclass made for it)."
    return type(opt).__dict__.get('_fp16cb_base', type(opt))

class _Outer:
    "What the routed class adds: `step` and `zero_grad` go through the route (`opt._fp16cb_route`)."
    def step(self, *args, **kwargs): return self.__dict__['_fp16cb_route'].step(*args, **kwargs)
    def zero_grad(self, *args, **kwargs): return self.__dict__['_fp16cb_route'].zero_grad(*args, **kwargs)

class _Inner:
    "The optimizer inside a wrapper (`Lookahead`): its `step`, called by the wrapper's, is the store's chunked step."
    def step(self, *args, **kwargs): return self.__dict__['_fp16cb_route'].inner_step(*args, **kwargs)

_CLASSES = {}

def _routed(cls, mixin):
    """The subclass of `cls` whose `step` (and `zero_grad`) `mixin` routes, made once per class. Class attributes
    written through it (`type(self).calls += 1` in the optimizer's own code) land on `cls`, as they would without the
    fit."""
    k = (cls, mixin)
    if k not in _CLASSES:
        class Meta(type(cls)):
            def __setattr__(c, name, v): setattr(c.__dict__['_fp16cb_base'], name, v)
            def __delattr__(c, name): delattr(c.__dict__['_fp16cb_base'], name)
        _CLASSES[k] = Meta(f"Routed[{cls.__name__}]", (mixin, cls), {
            '__module__': __name__, '_fp16cb_base': cls,
            '__doc__': f"{cls.__name__}, stepped through fp16cb's weight store for a fit."})
    return _CLASSES[k]

class Route:
    "Routes `opt`'s `step` and `zero_grad` (and, inside a wrapper, `core`'s `step`) to `store` until `remove`."
    def __init__(self, opt, core, store):
        self.opt, self.core, self.store, self._inner = opt, core, store, None
        for o, mixin in ((opt, _Outer),) + (((core, _Inner),) if core is not opt else ()):
            o.__class__ = _routed(getattr(type(o), '_fp16cb_base', type(o)), mixin)
            o.__dict__['_fp16cb_route'] = self

    def own(self, o, name:str):
        "`o`'s own method `name` (its class's before the fit; one the user set on the instance wins, as it did)."
        f, base = o.__dict__.get(name), type(o)._fp16cb_base
        if f is not None: return f
        m = getattr(base, name, None)
        return MethodType(m, o) if m is not None else base.__getattr__(o, name)  # delegated (`OptimWrapper`: torch's)

    def step(self, *args, **kwargs): return self.store._step(*args, **kwargs)

    def zero_grad(self, *args, **kwargs):
        self.store.zero_grad()
        return self.own(self.opt, 'zero_grad')(*args, **kwargs)

    def through(self, core_step, *args, **kwargs):
        """Step the optimizer once, `core_step(step, *args)` doing the innermost optimizer's part (`step`: its own):
        through a wrapper (`Lookahead`), the wrapper's own `step` runs once and calls the wrapped optimizer's, which is
        this."""
        own = self.own(self.core, 'step')
        if self.opt is self.core: return core_step(own, *args, **kwargs)
        self._inner = lambda *a, **k: core_step(own, *a, **k)
        try: return self.own(self.opt, 'step')(*args, **kwargs)
        finally: self._inner = None

    def inner_step(self, *args, **kwargs):
        "The wrapped optimizer's `step`: the store's part inside the wrapper's step, or its own outside it."
        if self._inner is not None: return self._inner(*args, **kwargs)
        return self.own(self.core, 'step')(*args, **kwargs)

    def remove(self):
        "Each object its own class back (idempotent)."
        for o in dict.fromkeys((self.opt, self.core)):
            base = getattr(type(o), '_fp16cb_base', None)
            if base is not None: o.__class__ = base
            o.__dict__.pop('_fp16cb_route', None)
