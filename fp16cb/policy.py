"""Per-layer precision policy: which modules of a 16-bit model stay FP32, and the casts at the edges of each FP32
island. After the op categories of the Google/NVIDIA "Automated Mixed-Precision for TensorFlow" slides (2019): most of
the network runs in 16-bit, numerically touchy layers in FP32; as Keras lets a layer carry its own dtype policy and
NVCaffe lets a layer choose its math (NVIDIA's "Training with mixed precision" slides, 2017), a module can carry its own
choice (`module.fp16cb_dtype = torch.float32`). Casts go only where a kept subtree (an *island*) meets the 16-bit rest:
its floating inputs cast up once, its outputs back once; nothing is cast inside an island."""
from __future__ import annotations
import difflib, fnmatch, re, sys, warnings
from typing import NamedTuple
import torch
from torch import nn
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.weight_norm import WeightNorm
from torch.nn.utils.spectral_norm import SpectralNorm

from .dtypes import user_stacklevel

__all__ = ['CATEGORIES', 'PrecisionPolicy', 'Island', 'Resolved', 'policy_report', 'is_compiled', 'uncompiled',
           'named_modules']

_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm, nn.LocalResponseNorm)
if hasattr(nn, 'RMSNorm'): _NORMS += (nn.RMSNorm,)
_SOFTMAX = (nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.Softmax2d)

# ---- names as on the original model: a `torch.compile` wrapper holds its module under `_orig_mod`
def is_compiled(m) -> bool:
    "Whether `m` is a `torch.compile` wrapper (an `OptimizedModule`: the module it compiles is its `_orig_mod`)."
    ef = sys.modules.get('torch._dynamo.eval_frame')  # loaded as soon as anything is compiled
    return ef is not None and isinstance(m, ef.OptimizedModule)

def uncompiled(m:nn.Module) -> nn.Module:
    "The module a `torch.compile` wrapper compiles (`m` itself when it is not one)."
    while is_compiled(m): m = m._orig_mod
    return m

def _children(name:str, m:nn.Module):
    "`(qualified name, child)` of `m`'s children; a compiled child is its original module."
    for cn, c in m.named_children(): yield (f"{name}.{cn}" if name else cn), uncompiled(c)

def named_modules(model:nn.Module, remove_duplicate:bool=True):
    """`model.named_modules()` with the names of the original modules: those of compiled ones (the model itself, or
    a submodule) without `_orig_mod`, so that `keep_fp32='layer4.*'` means the same on `torch.compile(model)`."""
    seen = set()
    def walk(name, m):
        if remove_duplicate:
            if id(m) in seen: return
            seen.add(id(m))
        yield name, m
        for cn, c in _children(name, m): yield from walk(cn, c)
    yield from walk('', uncompiled(model))

# the tests of the categories, `(name, module, model) -> bool`: module-level functions, so that a policy pickles
def _is_batchnorm(name:str, m:nn.Module, model:nn.Module) -> bool: return isinstance(m, nn.modules.batchnorm._BatchNorm)
def _is_norm(name:str, m:nn.Module, model:nn.Module) -> bool: return isinstance(m, _NORMS)
def _is_embedding(name:str, m:nn.Module, model:nn.Module) -> bool: return isinstance(m, (nn.Embedding, nn.EmbeddingBag))
def _is_softmax(name:str, m:nn.Module, model:nn.Module) -> bool: return isinstance(m, _SOFTMAX)
def _is_classifier(name:str, m:nn.Module, model:nn.Module) -> bool: return name == _last_layer_name(model)

def _last_layer_name(model:nn.Module):
    "The name of the last (in registration order) Linear or Conv layer: the model's final classifier."
    res = None
    for n, m in named_modules(model):
        if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd)): res = n
    return res

# the named op categories `keep_fp32` takes: name -> (what it is, a test of (name, module, model))
CATEGORIES = {
    'batchnorm': ("BatchNorm layers (the default)", _is_batchnorm),
    'norm': ("LayerNorm, GroupNorm, InstanceNorm, LocalResponseNorm, RMSNorm", _is_norm),
    'embedding': ("nn.Embedding and nn.EmbeddingBag", _is_embedding),
    'classifier': ("the final classifier: the last Linear or Conv layer", _is_classifier),
    'softmax': ("Softmax, LogSoftmax, Softmin modules", _is_softmax),
}
_NATIVE_MIXED = (nn.modules.batchnorm._BatchNorm,)  # torch's kernels take 16-bit inputs with FP32 params: no casts
# a parametrization computes its tensor in FP32, cast to the module's dtype as it leaves: torch's orthogonal maps have
# no 16-bit CPU kernels (cayley, householder) or give NaN in 16 bits (matrix_exp); FP32 is what the user's code computed
PARAMETRIZATION = "a parametrization: computed in FP32, its tensor cast to 16 bits for the module"
# the reparametrizations by forward pre-hook (torch's pruning, the former `weight_norm` and `spectral_norm`) set their
# tensor as a plain attribute of the module, which other code reads after the forward (the next pruning ranks the
# weights by it): kept FP32, the attribute is what FP32 would leave there
HOOKED = "a reparametrization by forward pre-hook (torch's pruning, the former weight_norm, spectral_norm): kept FP32"

_HOOK_KINDS = (BasePruningMethod, WeightNorm, SpectralNorm)

def _hooked(m:nn.Module) -> bool:
    "Whether `m` carries a reparametrization by forward pre-hook (`HOOKED`)."
    return bool(m._forward_pre_hooks) and any(isinstance(h, _HOOK_KINDS) for h in m._forward_pre_hooks.values())

_ATTR = 'fp16cb_dtype'  # the per-module override

class _IsType:
    "Test: the module is a `cls`."
    def __init__(self, cls:type): self.cls = cls
    def __call__(self, name:str, m:nn.Module, model:nn.Module) -> bool: return isinstance(m, self.cls)

class _NameIs:
    "Test: the module's qualified name fully matches `rx` (a regex, or a glob translated to one)."
    def __init__(self, rx:re.Pattern): self.rx = rx
    def __call__(self, name:str, m:nn.Module, model:nn.Module) -> bool: return self.rx.fullmatch(name) is not None

class _Predicate:
    "Test: the user's `fn(name, module)`."
    def __init__(self, fn): self.fn = fn
    def __call__(self, name:str, m:nn.Module, model:nn.Module) -> bool: return bool(self.fn(name, m))

class _Matcher(NamedTuple):
    "One item of `keep_fp32`: its test, how reports name it, and whether it names modules (a glob, a regex, a word)."
    test: object  # (name, module, model) -> bool
    label: str
    spec: object  # as the user gave it
    by_name: bool = False

def _is_word(spec) -> bool:
    "A plain identifier ('norms', 'encoder'): a category or one top-level module, never a pattern."
    return isinstance(spec, str) and spec.isidentifier()

def _regex(spec, pattern:str) -> re.Pattern:
    try: return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"keep_fp32: {spec!r} is not a valid regex ({e}): fix it, or use a glob") from None

_ORIG = re.compile(r'(?:(?<=^)|(?<=\.)|(?<=^re:))_orig_mod\.')  # `torch.compile`'s wrapper in a qualified name

def _matcher(spec) -> _Matcher:
    "The test and the label of one item of `keep_fp32`."
    if isinstance(spec, type) and issubclass(spec, nn.Module): return _Matcher(_IsType(spec), spec.__name__, spec)
    if isinstance(spec, str):
        if spec in CATEGORIES: return _Matcher(CATEGORIES[spec][1], spec, spec)
        name = _ORIG.sub('', spec)  # a compiled model's name as `named_modules()` shows it: the original module's
        if spec.startswith('re:'): return _Matcher(_NameIs(_regex(spec, name[3:])), spec, spec, True)
        return _Matcher(_NameIs(re.compile(fnmatch.translate(name))), f"name {spec!r}", spec, True)
    if isinstance(spec, re.Pattern): return _Matcher(_NameIs(spec), f"re {spec.pattern!r}", spec, True)
    if callable(spec): return _Matcher(_Predicate(spec), getattr(spec, '__name__', 'predicate'), spec)
    raise TypeError(f"keep_fp32: cannot use {spec!r}: expected a module type, a category ({', '.join(CATEGORIES)}), "
                    "a name glob ('encoder.*'), 're:<regex>', a compiled regex or a predicate `(name, module) -> bool`")

def _keep_parents(model:nn.Module, hits:dict, label:str):
    """Add to `hits` the modules whose children (two or more) a name spec all keeps: `'layer4.*'` keeps `layer4` too,
    so that its blocks are one FP32 island (their activations stay FP32 between them), not one island each."""
    def covered(m) -> bool:
        kids = [covered(uncompiled(c)) for c in m.children()]  # all of them, first: nested parents are kept too
        if id(m) in hits: return True
        if len(kids) >= 2 and all(kids): hits[id(m)] = f"{label} (all its children)"
        return id(m) in hits
    covered(model)

def _closest(word:str, names:list, n:int=3) -> list:
    "The names closest to `word` (difflib), and the glob `*.word` if nested modules are named `word`."
    nested = [f"*.{word}"] if any(o.endswith(f".{word}") for o in names) else []
    return nested + [o for o in difflib.get_close_matches(word, names, n=n, cutoff=.6) if o not in nested]

def _categories() -> str: return '; '.join(f"{k!r}: {doc}" for k, (doc, _) in CATEGORIES.items())

class Island(NamedTuple):
    "A subtree that computes in another dtype than its parent: its floating inputs cast on entry, its outputs back."
    name: str
    module: nn.Module
    fp32: bool = True  # an FP32 island in the 16-bit model (False: a 16-bit module inside a kept subtree)

class Resolved(NamedTuple):
    "What a policy gives on one model: the modules kept FP32 and why, and the islands (with casts at their edges)."
    kept: dict  # id(module) -> reason
    islands: list  # `Island`s: the kept modules whose parent is 16-bit, and the 16-bit ones whose parent is kept
    names: dict  # id(module) -> qualified name

class PrecisionPolicy:
    """What stays FP32 in a 16-bit model: BatchNorm (unless `batchnorm=False`) and whatever `specs` match, each with its
    whole subtree. A spec is a module type, a category name of `CATEGORIES`, a glob on the module's qualified name
    ('encoder.*.norm1'; a glob that matches every child of a module keeps that module too), 're:<regex>', a compiled
    regex, or a predicate `(name, module) -> bool`. A plain word that is neither a category nor a module's name is an
    error (a typo: 'norms'); a name that matches no module warns. A module's own `fp16cb_dtype` attribute wins over
    the specs, inside a kept subtree too: `torch.float32` keeps it, a 16-bit dtype converts it (and its subtree)."""
    def __init__(self, *specs,
        batchnorm:bool=True, # keep BatchNorm layers FP32 (as fastai and Micikevicius et al. 2018 do)
    ):
        if len(specs) == 1 and isinstance(specs[0], (list, tuple, set)): specs = tuple(specs[0])
        self.specs = (('batchnorm',) if batchnorm else ()) + tuple(s for s in specs if s != 'batchnorm')
        self.matchers = [_matcher(s) for s in self.specs]

    @classmethod
    def make(cls, keep_fp32=None) -> PrecisionPolicy:
        "A policy from `keep_fp32`: None (BatchNorm only), a policy, one spec, or a list of specs (added to BatchNorm)."
        if isinstance(keep_fp32, PrecisionPolicy): return keep_fp32
        if keep_fp32 is None: return cls()
        return cls(*(keep_fp32 if isinstance(keep_fp32, (list, tuple, set)) else [keep_fp32]))

    def __repr__(self): return f"PrecisionPolicy(keep_fp32={list(self.specs)})"

    def adding(self, names) -> PrecisionPolicy:
        "This policy keeping the modules `names` (qualified names, matched exactly) FP32 too: a new policy."
        # a module's name that is also a category's ('norm') is given as a regex: the category would keep other modules
        new = [n if (_is_word(n) or re.fullmatch(r'[\w.]+', n)) and n not in CATEGORIES else 're:' + re.escape(n)
               for n in names]
        new = [n for n in new if n not in self.specs]
        if not new: return self
        return type(self)(*[s for s in self.specs if s != 'batchnorm'], *new, batchnorm='batchnorm' in self.specs)

    def user_specs(self) -> list:
        "The specs given besides the default BatchNorm one."
        return [s for s in self.specs if s != 'batchnorm']

    def check(self, model:nn.Module):
        "`ValueError` for a plain word of `keep_fp32` that is neither a category nor a module of `model` (a typo)."
        names = [n for n, _ in named_modules(model) if n]
        for mt in self.matchers:
            if not (mt.by_name and _is_word(mt.spec)) or mt.spec in names: continue
            close = _closest(mt.spec, list(CATEGORIES) + names)
            hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ''
            raise ValueError(f"keep_fp32: {mt.spec!r} is neither a category nor the name of a module of the "
                             f"model{hint}. The categories: {_categories()}. A module is named by its qualified name "
                             "('encoder.0.norm1'), a glob ('encoder.*.norm1') or 're:<regex>'.")

    def _warn_unmatched(self, spec, names:list):
        text = spec.pattern if isinstance(spec, re.Pattern) else spec[3:] if spec.startswith('re:') else spec
        close = _closest(text, names)
        top = [n for n in names if '.' not in n]
        seen = f"closest module names: {', '.join(map(repr, close))}" if close else \
               f"the model's top-level modules: {', '.join(map(repr, top[:10]))}{' ...' if len(top) > 10 else ''}"
        warnings.warn(f"keep_fp32: {spec!r} matches no module of the model, so it keeps nothing FP32 ({seen}); "
                      "fix the name, or see `policy_report()` for the names", UserWarning, stacklevel=user_stacklevel())

    def warn_unmatched(self,
        model:nn.Module, # the model the names are matched against
        skip=(), # the specs not to warn of (warned of already)
    ) -> list:
        "Warn of each name spec (glob, regex) that matches no module of `model`; the specs warned of."
        named, res = list(named_modules(model)), []
        for mt in self.matchers:
            if not mt.by_name or mt.spec in skip or any(mt.test(n, m, model) for n, m in named): continue
            self._warn_unmatched(mt.spec, [n for n, _ in named if n])
            res.append(mt.spec)
        return res

    def _spec_reasons(self, model:nn.Module) -> dict:
        "`{id(module): label}` of the modules a spec keeps by itself (the first that does)."
        named, res = list(named_modules(model)), {}
        for mt in self.matchers:
            hits = {id(m): mt.label for n, m in named if mt.test(n, m, model)}
            if mt.by_name: _keep_parents(model, hits, mt.label)
            for k, v in hits.items(): res.setdefault(k, v)
        return res

    @staticmethod
    def _override(name:str, m:nn.Module):
        "The module's own `fp16cb_dtype` (None: it has none)."
        dt = getattr(m, _ATTR, None)
        if dt is not None and dt not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"{name or 'the model'}.{_ATTR} = {dt!r}: expected torch.float32, torch.float16 or "
                             "torch.bfloat16")
        return dt

    def resolve(self,
        model:nn.Module, # the model (compiled or not)
        warn:bool=True, # warn of the names that match no module (False: the caller did, once)
    ) -> Resolved:
        """The modules of `model` kept FP32 (whole subtrees, less those that carry a 16-bit `fp16cb_dtype`; and any
        module holding a tensor tied to a kept one). A compiled model (or submodule) is resolved as its original module,
        with the same names; its wrapper is kept with it."""
        wrapped, model = model, uncompiled(model)
        self.check(model)
        if warn: self.warn_unmatched(model)
        names = {id(m): n for n, m in named_modules(model, remove_duplicate=False)}
        by_spec, kept = self._spec_reasons(model), {}
        def visit(name, m, inherited):
            dt = self._override(name, m)
            own = (PARAMETRIZATION if isinstance(m, nn.utils.parametrize.ParametrizationList) else
                   HOOKED if _hooked(m) else by_spec.get(id(m)))
            reason = ((inherited or own) if dt is None else
                      (f"{_ATTR}=float32" if dt == torch.float32 else None))
            if reason is not None: kept[id(m)] = reason
            for cn, c in _children(name, m): visit(cn, c, f"inside {name or 'the model'}" if reason else None)
        visit('', model, None)
        self._pull_tied(model, kept, names)
        for w in wrapped.modules():  # the compiled wrappers: named and kept as the modules they compile
            if is_compiled(w):
                names[id(w)] = names.get(id(uncompiled(w)), '')
                if id(uncompiled(w)) in kept: kept[id(w)] = kept[id(uncompiled(w))]
        return Resolved(kept, self._islands(model, kept), names)

    def _pull_tied(self, model, kept:dict, names:dict):
        "A converted module that shares a tensor with a kept one is kept too (tied params stay one FP32 tensor)."
        changed = True
        while changed:
            changed = False
            owners = {}
            for n, m in named_modules(model, remove_duplicate=False):
                for t in list(m._parameters.values()) + list(m._buffers.values()):
                    if t is not None: owners.setdefault(id(t), []).append((n, m))
            for mods in owners.values():
                held = [n for n, m in mods if id(m) in kept]
                if not held: continue
                for n, m in mods:
                    if id(m) not in kept:
                        for sub in m.modules(): kept.setdefault(id(sub), f"tied to {held[0]}")
                        changed = True

    def _islands(self, model, kept:dict) -> list:
        """Kept modules whose parent is 16-bit (the root if the whole model is kept), except native mixed kernels; and
        16-bit modules whose parent is kept."""
        res = []
        def visit(name, m, parent_kept):
            fp32 = id(m) in kept
            if fp32 != parent_kept and not (fp32 and _native_leaf(m)): res.append(Island(name, m, fp32))
            for cn, c in _children(name, m): visit(cn, c, fp32)
        visit('', model, False)
        return res

def _native_leaf(m:nn.Module) -> bool:
    "A kept module that takes 16-bit inputs as they are (BatchNorm: torch's kernels mix them with FP32 params)."
    return isinstance(m, _NATIVE_MIXED) and not any(True for _ in m.children())

def _dtype_name(dt) -> str: return str(dt).replace('torch.', '')

def _storage(m:nn.Module, dtype:torch.dtype, kept:bool) -> str:
    "The dtype(s) of `m`'s own params during a fit ('-' for none)."
    dts = {t.dtype for t in m.parameters(recurse=False)}
    if not dts: return '-'
    conv = {torch.float32, torch.float16, torch.bfloat16}
    return '/'.join(sorted({_dtype_name(d if kept or d not in conv else dtype) for d in dts}))

def policy_report(model:nn.Module, policy:PrecisionPolicy, dtype:torch.dtype, leaves:bool=False,
                  stored16:bool=True):
    """Each module of `model` (`leaves`: the modules without children, and the islands) with its storage dtype (its own
    params, during a fit: `stored16`, 16-bit where it computes in 16 bits; else as they are, the model keeping its
    FP32 params), compute dtype, the casts inserted at its edges and why it is FP32: a pandas DataFrame."""
    import pandas as pd
    res, model = policy.resolve(model), uncompiled(model)
    islands, rows, seen = {id(i.module): i for i in res.islands}, [], set()
    def visit(name, m, parent_kept):
        if id(m) in seen: return
        seen.add(id(m))
        kept, island = id(m) in res.kept, islands.get(id(m))
        if not (leaves and any(True for _ in m.children()) and island is None):
            native = kept and not parent_kept and island is None  # a BatchNorm leaf of a 16-bit parent: no cast
            compute = (f"float32 (16-bit in/out)" if native else 'float32') if kept else _dtype_name(dtype)
            rows.append(dict(module=name or '(model)', type=type(m).__name__,
                             storage=_storage(m, dtype, kept or not stored16),
                             compute=compute, casts=_casts(island, dtype) if m is not model else '-',
                             fp32_because=res.kept.get(id(m), '-')))
        for cn, c in _children(name, m): visit(cn, c, kept)
    visit('', model, False)
    return pd.DataFrame(rows, columns=['module', 'type', 'storage', 'compute', 'casts', 'fp32_because'])

def _casts(island:Island|None, dtype:torch.dtype) -> str:
    "The casts at the edges of `island` ('-': none)."
    if island is None: return '-'
    inside, outside = ('float32', _dtype_name(dtype)) if island.fp32 else (_dtype_name(dtype), 'float32')
    return f"in: -> {inside}, out: -> {outside}"
