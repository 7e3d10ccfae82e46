"""`Learner.to_fp16 / to_bf16 / to_fp32 / to_native_fp16 / to_native_fp32` & co., replacing fastai's own patches: the
functions here; `fp16cb.patches` installs them on `Learner`."""
from __future__ import annotations
import difflib, functools, inspect
from torch.amp import GradScaler
import torch
from fastai.learner import Learner
import fastai.callback.fp16 as _fastai_fp16  # loaded first, so that its own patches can never override ours
from fastcore.meta import delegates
from fastcore.docments import docments

from .options import bf16_defaults, AMP_ARGS  # AMP_ARGS: fastai's AMP `to_fp16`'s arguments
from .callbacks import ModelToHalf, MixedPrecision, NativeMixedPrecision

from .session import session_of, FIT_CHECKS

__all__ = ['precision_callbacks', 'AMP_ARGS', 'check_kwargs', 'to_fp16', 'to_bf16', 'to_fp32', 'to_native_fp16',
           'to_native_bf16', 'to_native_fp32', 'to_non_native_fp16', 'to_channelslast']

from .session import FOREIGN, is_ours, family_of

def precision_callbacks(self:Learner) -> list:
    "The mixed-precision callbacks of this learner (ours and fastai's)."
    return [cb for cb in self.cbs if family_of(cb) is not None]

def _set_precision(self:Learner, cbs:list):
    "Replace whatever precision callbacks the learner has with `cbs`, restoring the FP32 model and optimizer first."
    if session_of(self).in_fit:
        raise RuntimeError("the precision of a learner cannot change during a fit (`to_fp16`/`to_bf16`/`to_fp32`/"
                           "`to_native_fp16` was called from a callback or in a fit): set it before `fit`, "
                           "or after it.")
    old = self.precision_callbacks()
    for cb in old:
        if hasattr(cb, 'restore'): cb.restore()
    self.remove_cbs(old)
    if cbs: self.add_cbs(cbs)
    return self


def _args_of(cls) -> list: return [n for n in inspect.signature(cls).parameters if n != 'self']

def check_kwargs(name:str, kwargs:dict, cls, foreign:dict, also:tuple=()):
    """A `TypeError` that names `learn.{name}` for a keyword `cls` does not take: one of `foreign` (`{argument: hint}`)
    says which method takes it; any other lists the valid ones (and the closest)."""
    valid = _args_of(cls) + list(also)
    bad = [k for k in kwargs if k not in valid]
    if not bad: return
    hints = [foreign[k] for k in bad if k in foreign]
    if hints: raise TypeError(f"`learn.{name}()` got {', '.join(map(repr, bad))}: {hints[0]}")
    close = difflib.get_close_matches(bad[0], valid, n=1)
    raise TypeError(f"`learn.{name}()` got an unexpected keyword argument {bad[0]!r}"
                    f"{f' (did you mean {close[0]!r}?)' if close else ''}; it takes: {', '.join(valid)}")

_TO_NATIVE = ("it is an argument of fastai's own `to_fp16` (PyTorch AMP: autocast + GradScaler), which fp16cb replaces "
              "with FP32 master weights and loss scaling (Micikevicius et al. 2018). For autocast + GradScaler, call "
              "`learn.to_native_fp16(init_scale=..., growth_factor=..., backoff_factor=..., growth_interval=...)` "
              "(bf16: `learn.to_native_bf16()`, not `amp_mode`).")
_FP16_FOREIGN = {k: _TO_NATIVE for k in AMP_ARGS}

_HALF_ARGS = ('keep_fp32',)  # `ModelToHalf`'s: which modules stay FP32

def _shows(
    also=None, # a callback whose `_HALF_ARGS` the method passes on (`ModelToHalf`: `keep_fp32`), shown last
    **defaults, # the method's own defaults, shown instead of the delegated callback's
):
    """Decorator, after fastcore's `delegates`: the signature shows `defaults` (this method's own), then the arguments
    of `also` (a callback) that it passes on (`keep_fp32`), so that `help(learn.to_bf16)` shows what a call does."""
    def _f(f):
        sig = inspect.signature(f)
        ps = [p.replace(default=defaults[p.name]) if p.name in defaults else p for p in sig.parameters.values()]
        if also is not None:
            ps += [p.replace(kind=p.KEYWORD_ONLY) for n, p in inspect.signature(also).parameters.items()
                   if n in _HALF_ARGS]
        f.__signature__ = sig.replace(parameters=ps)
        return f
    return _f

def _arguments(*sources):
    """Decorator, outermost: the docstring ends with a NumPy-style 'Parameters' section, which `help()` prints and
    fastcore's `docments` (so fastai's `doc`) reads: each keyword of the method's signature with its default and the
    comment it has where it is declared, in `sources` (the callbacks it is passed on to; the first that has it)."""
    def _f(f):
        docs = {}
        for src in reversed(sources): docs.update({k: v for k, v in docments(src).items() if v})
        lines = [f"{n} : default {p.default!r}\n    {docs.get(n, '')}"
                 for n, p in inspect.signature(f).parameters.items() if n != 'self']
        if lines: f.__doc__ = inspect.cleandoc(f.__doc__) + "\n\nParameters\n----------\n" + '\n'.join(lines)
        return f
    return _f

def _no_dtype(
    name:str, # the method given `dtype`: 'to_bf16'
    other:str, # the method that takes it: 'to_fp16'
    kwargs:dict, # the call's keyword arguments
):
    "A `TypeError` for `dtype` given to a method whose name says its dtype (`to_bf16`), naming the one that takes it."
    if 'dtype' in kwargs:
        raise TypeError(f"`learn.{name}()` trains in bfloat16 and takes no `dtype`: for another dtype, "
                        f"call `learn.{other}(dtype=...)`")

@_arguments(MixedPrecision, ModelToHalf)
@_shows(ModelToHalf)
@delegates(MixedPrecision)
def to_fp16(self:Learner, **kwargs):
    """Train in mixed precision: fp16 compute (BatchNorm FP32), the model's FP32 params the masters, dynamic loss scale.
    `loss_scale='calibrate'` (and fastai's default 512, which means the same): the first step runs at scale 1 and its
    largest gradient sets the scale (a step whose gradients underflowed at scale 1 is skipped, counted in `n_skipped`);
    a number is the dynamic scale's start, or with `dynamic=False` the fixed scale."""
    check_kwargs('to_fp16', kwargs, MixedPrecision, _FP16_FOREIGN, also=_HALF_ARGS)
    kwargs = dict(kwargs)
    dtype, keep_fp32 = kwargs.pop('dtype', torch.float16), kwargs.pop('keep_fp32', None)  # keep_fp32: `ModelToHalf`'s
    half = ModelToHalf(dtype, keep_fp32=keep_fp32)
    # a typo, a float64 model fail here, not in fit
    if getattr(self, 'model', None) is not None: half.check_model(self.model)
    return self._set_precision([half, MixedPrecision(dtype=dtype, **kwargs)])

@_arguments(MixedPrecision, ModelToHalf)
@_shows(ModelToHalf, dynamic=False, loss_scale=1.)
@delegates(MixedPrecision, but=['dtype'])
def to_bf16(self:Learner, **kwargs):
    "Train in mixed precision with bfloat16: FP32 master weights; no loss scaling unless asked (bf16 has FP32's range)."
    _no_dtype('to_bf16', 'to_fp16', kwargs)
    check_kwargs('to_bf16', kwargs, MixedPrecision, _FP16_FOREIGN, also=_HALF_ARGS)
    return self.to_fp16(dtype=torch.bfloat16, **bf16_defaults(kwargs))

def to_fp32(self:Learner):
    "Back to plain FP32 training: removes the precision callbacks; the model holds the exact FP32 master weights."
    return self._set_precision([])

_NATIVE_FOREIGN = {k: ("it is an argument of `learn.to_fp16()` (FP32 master weights, loss scaling); "
                        "`to_native_fp16` takes GradScaler's arguments.") for k in _args_of(MixedPrecision)}
_NATIVE_FOREIGN['amp_mode'] = "fastai's `amp_mode` is `dtype` here: `learn.to_native_bf16()` for bf16."

@_arguments(NativeMixedPrecision)
@delegates(NativeMixedPrecision)
def to_native_fp16(self:Learner, **kwargs):
    "Train with PyTorch's autocast + GradScaler (fp16 by default; `dtype=torch.bfloat16` for bf16)."
    check_kwargs('to_native_fp16', kwargs, NativeMixedPrecision, _NATIVE_FOREIGN)
    return self._set_precision([NativeMixedPrecision(**kwargs)])

@_arguments(NativeMixedPrecision)
@delegates(NativeMixedPrecision, but=['dtype'])
def to_native_bf16(self:Learner, **kwargs):
    "Train with PyTorch's autocast in bfloat16 (no loss scaling)."
    _no_dtype('to_native_bf16', 'to_native_fp16', kwargs)
    check_kwargs('to_native_bf16', kwargs, NativeMixedPrecision, _NATIVE_FOREIGN)
    return self.to_native_fp16(dtype=torch.bfloat16, **kwargs)

def to_native_fp32(self:Learner):
    "Back to plain FP32 training (removes any precision callback)."
    return self._set_precision([])

def to_non_native_fp16(self:Learner, **kwargs):
    """fastai's non-native fp16 (its `ModelToHalf` + `NonNativeMixedPrecision`), replacing any precision callbacks (ours
    too)."""
    return self._set_precision([_fastai_fp16.ModelToHalf(), _fastai_fp16.NonNativeMixedPrecision(**kwargs)])

import fastai.callback.channelslast  # noqa: F401 (Learner.to_channelslast)
_fastai_to_channelslast = getattr(Learner.to_channelslast, '_fastai', Learner.to_channelslast)  # not ours if reloaded

@delegates(_fastai_to_channelslast)
def to_channelslast(self:Learner, use_amp:bool=True, **kwargs):
    "fastai's `to_channelslast`; the precision set with `to_fp16`/`to_bf16`/`to_native_fp16` is kept (no AMP on top)."
    if any(is_ours(cb) for cb in self.cbs): use_amp = False
    return _fastai_to_channelslast(self, use_amp=use_amp, **kwargs)
to_channelslast._fastai = _fastai_to_channelslast

# ---- fastai and fp16cb both have a `MixedPrecision`: arguments given to the wrong class name the right one

_OURS = [n for n in inspect.signature(MixedPrecision).parameters if n != 'self']
_SCALER = [n for n in inspect.signature(GradScaler).parameters if n != 'device']  # what fastai's AMP callback passes on

def _check_fastai_amp(kwargs):
    ours = [k for k in kwargs if k in _OURS and k not in _SCALER]
    if ours:
        raise TypeError(f"{', '.join(map(repr, ours))}: arguments of fp16cb's `MixedPrecision`, given to fastai's "
                        f"(`fastai.callback.fp16.MixedPrecision`, PyTorch AMP, which `from fastai.vision.all import *` "
                        f"exports). Import ours after fastai's star import: `from fp16cb import MixedPrecision, "
                        f"ModelToHalf`, or call `learn.to_fp16({ours[0]}=...)`.")
    bad = [k for k in kwargs if k not in _SCALER and k != 'amp_mode']
    if bad:
        raise TypeError(f"fastai's `MixedPrecision` (PyTorch AMP) got {bad[0]!r}; it takes `amp_mode` and GradScaler's "
                        f"arguments: {', '.join(_SCALER)}")

def refuse_fastai_amp_args(cbs):
    """fastai's `MixedPrecision` (PyTorch AMP) given fp16cb's arguments, or ones it does not take: refused when the fit
    starts (fastai keeps them for its GradScaler, which would raise a bare `TypeError` at the fit's first event)."""
    for cb in cbs:
        if type(cb) is _fastai_fp16.MixedPrecision: _check_fastai_amp(getattr(cb, 'kwargs', {}))
FIT_CHECKS.append(refuse_fastai_amp_args)
