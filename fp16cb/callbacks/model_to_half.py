"""`ModelToHalf`: the model in 16-bit during a fit (BatchNorm and the `keep_fp32` islands FP32), its exact FP32 values
given back at the end."""
from __future__ import annotations
import warnings
from functools import partial
import torch
from torch import nn
from torch.nn.modules import module as mod

from ..dtypes import resolve_dtype, convert_network_keeping, warn_slow_half, model_device, range_remedy, ours
from ..weights import shared
from ..compat import Facts, check, float64_layers, FIT, STEP
from ..session import SessionCallback
from ..policy import PrecisionPolicy, policy_report, named_modules
from ..distributed import rewrap, is_ddp, is_sharded
from ..fsdp import ShardPolicy
from .casts import cast_floats, _cast_inputs, _floats, IslandHooks, EntryCasts, RangeWatch
from .copies import ComputeCopies

__all__ = ['ModelToHalf']

def _widen(t:torch.Tensor, dtype) -> torch.Tensor: return t.to(dtype)

def _float64_layer(m:nn.Module) -> bool:
    "A torch layer (`torch.nn`: Linear, Conv, LSTM ...) holding float64 params: it cannot take a 16-bit input."
    return (type(m).__module__.startswith('torch.nn.')
            and any(p.dtype == torch.float64 for p in m.parameters(recurse=False)))

def _float64_input(module, args, kwargs, name:str, dtype):
    """A forward pre-hook on a float64 layer: a 16-bit input reaching it is refused (the declaration's sentence), at
    once."""
    if any(t.dtype in (torch.float16, torch.bfloat16) for t in _floats((args, kwargs))):
        check(Facts(dtype=dtype, float64_input=name), STEP)

class TreeWatch:
    """Whether the model's tree changed since the set-up: a module put in one of its modules (a head replaced, a layer
    grown by a callback), or a param or buffer under a new name; in a converted model (`params`), any param put in.
    Registration hooks of the whole process, while a fit is set up (the copies follow a tensor put under a name the
    module has already as it is)."""
    def __init__(self, model:nn.Module, params:bool=False):
        self.ids, self.changed, self.params = {id(m) for m in model.modules()}, False, params
        self.handles = [mod.register_module_module_registration_hook(self._module),
                        mod.register_module_parameter_registration_hook(partial(self._tensor, kind='_parameters')),
                        mod.register_module_buffer_registration_hook(partial(self._tensor, kind='_buffers'))]

    def _module(self, module, name, value):
        if id(module) in self.ids: self.changed = True
    def _tensor(self, module, name, value, kind:str):
        if id(module) in self.ids and (name not in getattr(module, kind) or self.params and kind == '_parameters'):
            self.changed = True

    def remove(self):
        for h in self.handles: h.remove()
        self.handles = []

class ModelToHalf(SessionCallback):
    """Run the model in 16-bit during a fit (BatchNorm stays FP32); predictions come out FP32. Floating inputs are cast
    to 16-bit as they enter the model (a forward pre-hook): `learn.xb` stays as the data gave it, so callbacks that
    transform it (fastai's `MixUp`) work on FP32 inputs."""
    order = -50  # before every other callback: the model is 16-bit when they see it
    def __init__(self,
        dtype=torch.float16, # the 16-bit dtype: `torch.float16` or `torch.bfloat16` (or 'fp16' / 'bf16')
        keep_fp32=None, # what stays FP32 besides BatchNorm: a `PrecisionPolicy` or its spec(s) (see `fp16cb.policy`)
    ):
        self.dtype, self.policy = resolve_dtype(dtype), PrecisionPolicy.make(keep_fp32)
        self.originals, self.masters, self._hook, self.islands, self._trained = None, {}, None, None, False
        self.copies = None  # the 16-bit copies the forward computes with, the model keeping its FP32 params
        self.watch = None  # whether the model's tree changed mid-fit (`TreeWatch`)
        self.sharded = None  # FSDP2: the units' `MixedPrecisionPolicy` set for the fit (`fsdp.ShardPolicy`)

    def check_model(self, model:nn.Module):
        """`model`, when it is first known (`to_fp16()`, else the fit's set-up): float64 layers are refused (the
        declaration of what combines); in `keep_fp32` a typo raises, a name that matches no module warns, once (not
        again at each fit)."""
        floating = [p for p in model.parameters() if p.is_floating_point()]
        check(Facts(dtype=self.dtype, float64_layers=float64_layers(model),
                    float64_model=bool(floating) and all(p.dtype == torch.float64 for p in floating)), FIT)
        self.policy.check(model)
        warned = self.__dict__.setdefault('_warned', set())  # the names warned of already
        warned.update(self.policy.warn_unmatched(model, skip=warned))

    @property
    def converted(self) -> bool:
        "Whether the model's params are in 16-bit now (set up by the session for a fit, until its end)."
        return self.originals is not None

    @property
    def computing(self) -> bool:
        "Whether the model computes in 16-bit now: its params converted, or copies of them made for each forward."
        return self.converted or self.copies is not None or self.sharded is not None

    def _uses_copies(self) -> bool:
        "Whether this fit keeps the model's FP32 params and computes with copies (the learner's `MixedPrecision` says)."
        return any(getattr(cb, 'keeps_fp32_params', False) for cb in self.learn.cbs)

    def setup(self):
        # on the data's device first (fastai's TrainEvalCallback moves it there only later, at order -10): the exact
        # FP32 originals, and so the masters made from them, must live where the model trains
        model, device = self.learn.model, getattr(self.learn.dls, 'device', None)
        if device is not None: model.to(device)
        warn_slow_half(self.dtype, model_device(model))
        self.check_model(model)  # before the model is converted
        res = self.policy.resolve(model, warn=False)
        if is_sharded(model): return self._shard_policy(model, res)
        if self._uses_copies(): self.copies = ComputeCopies(model, res.kept, self.dtype)
        else: self.originals = convert_network_keeping(model, self.dtype, keep=set(res.kept))
        self.islands = IslandHooks(model, res.islands, self.dtype)  # no hooks by default: BatchNorm takes 16-bit inputs
        in_dtype = torch.float32 if id(model) in res.kept else self.dtype
        # a DDP of a converted model (its grads change dtype) is wrapped again, before the hook: the hook goes on the
        # model the learner calls
        self.rewrapped = self.copies is None and self._rewrap_ddp()
        self._range = RangeWatch() if in_dtype == torch.float16 else None  # fp16: eval inputs beyond its range
        # a `validate`/`get_preds` changes no param: its teardown gives the originals back as they are
        self._trained = False
        # refused if a 16-bit input reaches one
        self._float64 = [ours(m.register_forward_pre_hook(partial(_float64_input, name=n, dtype=self.dtype),
                                                          with_kwargs=True))
                         for n, m in named_modules(model) if _float64_layer(m)]
        self._hook = ours(self.learn.model.register_forward_pre_hook(_cast_inputs(in_dtype, self._range),
                                                                     with_kwargs=True, prepend=True))
        # calls from outside its forward, kept weights
        self.entries = EntryCasts(self.learn.model, res, self.dtype, self.copies)
        self.watch = TreeWatch(model, self.converted)  # (last: what the set-up itself registered is not a change)

    def _shard_policy(self, model, res):
        """A model sharded with FSDP2: its units' policies compute in 16 bits (the kept ones in FP32), all-gathering
        16-bit params and reducing FP32 grads; the sharded FP32 params stay the model's, and the optimizer's."""
        if not self._uses_copies(): check(Facts(dtype=self.dtype, half_storage=True, fsdp=True), FIT)
        self.sharded = ShardPolicy(model, res.kept, self.dtype, res.names)
        self._trained, self.rewrapped = False, False
        self._hook = self._float64 = self._range = self.entries = None

    def before_fit(self):
        self._changes = 0  # the set-ups again of this fit (`_follow`)
        super().before_fit()

    def before_batch(self):
        if self.watch is not None and self.watch.changed: self._follow()
        if self.copies is not None: self.copies.recompute(False)  # (a batch cancelled before its backward's end)
        if self.training: self._trained = True  # from now on a param's value may differ from its original
        if getattr(self, 'entries', None) is not None: self.entries.reset()  # a forward that raised left its count
        if self.copies is not None: self.copies.reset()

    def after_backward(self):
        if self.copies is not None: self.copies.recompute(False)

    def _follow(self):
        "A module was put in the model since the set-up (or a tensor under a new name): set up again, with it."
        if self.converted: self._widen_new()
        with self.session.suspended(): pass
        self._changes = getattr(self, '_changes', 0) + 1
        if self._changes == 5:
            warnings.warn("fp16cb: the model changed 5 times in this fit (a module put in it, or a param or buffer "
                          "registered under a new name): each time the fit sets up again at the next batch, which "
                          "costs about a fit's start. If code of yours registers one at every batch, register it once "
                          "before the fit (or keep it as a plain attribute).", RuntimeWarning, stacklevel=2)

    def _widen_new(self):
        """The 16-bit tensors put in the converted model since its set-up (a copy of one of its modules: 16-bit, as the
        model is) made FP32, as the teardown makes the others: the set-up again converts and records them alike."""
        for m in self.learn.model.modules():
            for kind in ('_parameters', '_buffers'):
                for n, t in getattr(m, kind).items():
                    if t is None or t.dtype != self.dtype or id(t) in self.originals: continue
                    if kind == '_buffers': m._buffers[n] = t.float(); continue
                    t.grad = None  # (a grad of the 16-bit copy: not this FP32 param's)
                    t.data = t.data.float()

    def after_validate(self):
        """The copies kept for the validation go. Eval inputs that became inf in fp16 (finite in FP32): the loss and
        predictions show nan where FP32's do not, said once."""
        if self.copies is not None: self.copies.drop_cache()
        watch = getattr(self, '_range', None)
        if watch is None or not watch.found() or self.__dict__.get('_range_warned'): return
        self._range_warned = True
        warnings.warn("the validation (or inference) inputs hold values beyond fp16's range (|x| > 65504): cast to "
                      "fp16 as they enter the model, they become inf, and the loss and predictions read nan where FP32 "
                      "gives large finite values. Check the data's normalization (a feature constant in the training "
                      f"split, divided by its std + 1e-7, reaches ~1e7), or train in "
                      f"{range_remedy(model_device(self.learn.model))}.",
                      RuntimeWarning, stacklevel=2)

    def teardown(self):
        "The mirror of `setup`: hooks off, the exact FP32 values back in the model, DDP wrapped again."
        if self._hook is not None: self._hook.remove()
        for h in getattr(self, '_float64', None) or (): h.remove()
        if self.sharded is not None: self.sharded.restore()
        self.sharded = None
        self._float64 = []
        if self.islands is not None: self.islands.remove()
        if getattr(self, 'entries', None) is not None: self.entries.remove()
        if self.copies is not None: self.copies.remove()
        if self.watch is not None: self.watch.remove()
        self._hook = self.islands = self.entries = self.copies = self.watch = None
        was_converted = self.converted
        self._restore_model()
        if was_converted and getattr(self, 'rewrapped', False) and is_ddp(self.learn.model):
            if not self.session.failing: self._rewrap_ddp()
            else:  # a re-wrap is a collective, which the ranks that did not fail would never join: unwrap instead
                self.learn.model = self.learn.model.module
                self.session.notes.append("fp16cb: this rank's fit failed, so its model was not wrapped in a new "
                    "DistributedDataParallel (a collective the other ranks would never join): `learn.model` is the "
                    "plain FP32 module now; wrap it again before training on.")
        self.rewrapped = False

    def _rewrap_ddp(self) -> bool:
        "A model that is already a `DistributedDataParallel` changed dtype under it: wrap it again (every rank does)."
        if not is_ddp(self.learn.model): return False
        self.learn.model = rewrap(self.learn.model)
        return True

    def policy_report(self,
        model:nn.Module=None, # the model to report on (default: the learner's)
        leaves:bool=False, # only the modules without children (and the FP32 islands)
    ):
        "Each module's storage and compute dtype during a fit and the casts inserted at its edges (a DataFrame)."
        model = model if model is not None else self.learn.model
        stored16 = getattr(self, 'learn', None) is None or not self._uses_copies()
        return policy_report(model, self.policy, self.dtype, leaves=leaves, stored16=stored16)

    def after_pred(self):
        if self.copies is not None:
            self.copies.reset()  # the params back, even if the forward's hook did not run
            # to the backward's end: activation checkpointing runs forwards again in it, and in other code's before it
            if self.training: self.copies.recompute(True)
        if self.computing: self.learn.pred = cast_floats(self.learn.pred, torch.float32)

    def keep_too(self, names:list):
        "Keep the modules `names` FP32 too, now: in a fit, the session pauses and sets up again with the new policy."
        self.policy = self.policy.adding(names)
        if self.computing:
            with self.session.suspended(): pass

    def fp32_of(self, p) -> torch.Tensor:
        "The exact FP32 value `p` had when it was converted (`p.data` for what was not; its master once linked)."
        rec = self.originals.get(id(p)) if self.converted else None
        return p.data if rec is None else rec.original

    def forget_originals(self, params:list):
        """`params` were trained in 16-bit (16-bit storage, no masters): their FP32 originals are stale and no longer
        kept (4 bytes/param); their dtype and shape stay (a meta tensor), the model gets their 16-bit values back
        widened."""
        for p in params:
            rec = self.originals.get(id(p)) if self.converted else None
            if rec is not None and not rec.original.is_meta:
                self.originals[id(p)] = rec._replace(original=rec.original.to('meta'))

    def fp32_value(self, cur:torch.Tensor, rec, widen=None) -> torch.Tensor:
        """The exact FP32 value of the converted tensor `cur` now: its master, its original if unchanged, else widened
        (`widen(cur, dtype)`: how, default `cur.to(dtype)`; a checkpoint's makes it as the file is written)."""
        master = self.masters.get(id(cur)) if rec.is_param else None
        if master is not None: return master
        widen = widen or _widen
        if rec.original.is_meta: return widen(cur, rec.original.dtype)  # trained in 16-bit, original forgotten
        if rec.is_param and not self._trained: return rec.original  # no training batch since the set-up (inference)
        if cur.dtype != rec.original.dtype and torch.equal(cur, rec.original.to(cur.dtype)): return rec.original
        return widen(cur, rec.original.dtype)  # trained in 16-bit without master: nothing better than its value

    def fp32_tensors(self, widen=None) -> dict:
        """`{id(tensor): exact FP32 value}` of every converted param and buffer as it lies in the model now (a tensor
        held in two places, a tied head, is one), the model left as it is (`widen`: see `fp32_value`)."""
        return {id(cur): self.fp32_value(cur, rec, widen) for rec, _, _, cur in self._places()}

    def _places(self) -> list:
        """`(record, module, name, tensor)` of each converted tensor where it lies now: in its place, or a param put
        under another name since (torch's pruning makes a module's `weight` its `weight_orig`)."""
        res, here = [], None
        for key, rec in (self.originals or {}).items():
            cur = (rec.module._parameters if rec.is_param else rec.module._buffers).get(rec.name)
            if rec.is_param and (cur is None or id(cur) != key):
                if here is None: here = {id(t): (m, n) for m in self.learn.model.modules()
                                         for n, t in m._parameters.items() if t is not None}
                if key in here: res.append((rec, *here[key], here[key][0]._parameters[here[key][1]]))
            elif cur is not None: res.append((rec, rec.module, rec.name, cur))
        return res

    def _restore_model(self):
        """Give the model back its exact FP32 values: the masters for trained params (their memory, not a copy: each
        param a tensor of its own over its master's part of the masters' buffer), the originals for the rest."""
        if not self.converted: return
        for rec, m, n, cur in self._places():
            new = shared(self.fp32_value(cur, rec), cur)  # in the layout the model has now (channels_last), its own
            if rec.is_param:
                # no 16-bit grad on an FP32 param
                if cur.grad is not None and cur.grad.dtype != new.dtype: cur.grad = None
                cur.data = new
            else: m._buffers[n] = new
        for m in self.learn.model.modules():
            if isinstance(m, nn.RNNBase): m.flatten_parameters()
        self.originals, self.masters = None, {}

