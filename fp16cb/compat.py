"""What combines: the one declaration of which precision modes work with which optimizers and training contexts, and
the semantics every mode keeps. Set-up consults it as each fact becomes known (`check`): the callback's options when
it is made, the optimizer and the callbacks when the fit sets up, the model as the learner calls it (DDP-wrapped) at the
first batch. The README's compatibility table is generated from it (`table`), and the test suite's combination
matrix trains every cell it declares supported against FP32 fastai and expects every refused cell's sentence.

A new mode, optimizer kind or context adds its row here first."""
from __future__ import annotations
import re, sys
from dataclasses import dataclass, field, replace
import torch
from torch.nn.parallel import DistributedDataParallel
import torch.distributed as dist
import fastai.optimizer as fo
from fastai.optimizer import Optimizer, OptimWrapper, _BaseOptimizer
from fastai.callback.training import GradientAccumulation, GradientClip

from .options import options_of, bf16_defaults, Refused
from .distributed import is_fsdp

__all__ = ['SEMANTICS', 'MOVING_AVERAGES', 'NONNEGATIVE',
           'Mode', 'MODES', 'OPTIMIZERS', 'CONTEXTS',
           'Facts', 'Rule', 'RULES', 'Refused', 'OPTIONS', 'FIT', 'BATCH', 'STEP', 'refusal', 'check', 'verdict',
           'table', 'learner_facts', 'optimizer_kind', 'optimizer_name', 'float64_layers', 'ELEMENTWISE_FASTAI',
           'ELEMENTWISE_TORCH', 'known_elementwise']

# what every mode keeps of plain FP32 fastai under the same optimizer and callbacks: it changes dtypes only
SEMANTICS = (
    "A param whose grad is None is not stepped (a fastai optimizer skips params that never had a grad; a torch "
    "optimizer, whose `zero_grad` sets grads to None, those without a grad this step).",
    "A cancelled step changes nothing: no weight, no optimizer state, no loss-scale statistics.",
    "A param that never trained keeps its exact FP32 value.",
    "Nothing loss-scaled or 16-bit outlives the fit (ended, raised or interrupted): the params, their grads and the "
    "optimizer's state are FP32 and unscaled, as FP32 fastai would leave them.",
    "Other code in the fit sees and changes what it would in FP32, dtypes aside: a copy of the model "
    "(`copy.deepcopy(learn.model)`, `learn.model.state_dict()`) holds the FP32 weights (with `half_storage`, the "
    "16-bit weights, which are the weights in that mode); a weight changed in place "
    "(under `torch.no_grad()`) is what the next step starts from; a callback's `before_step` reads the grads unscaled "
    "and may change them; a cancelled step's grads stay until the optimizer's `zero_grad`; a param made trainable "
    "mid-fit trains; `torch.autograd.grad` of the loss, or a backward of its own, gets grads as they are (unscaled), "
    "second order included; "
    "a layer recomputed in the backward (activation checkpointing) computes as in the forward; a module put in the "
    "model mid-fit computes with the rest.",
    "What cannot keep these is refused with a sentence that says what to do instead: at set-up, before any step, "
    "or, for what only a step shows (a step cancelled after `step_in_backward` stepped it), when it happens.",
)

# ---- the axes
@dataclass(frozen=True)
class Mode:
    "A precision mode as a user sets it: the `Learner` method and its keyword arguments."
    name: str
    call: str  # 'to_fp16', 'to_bf16', 'to_native_fp16', 'to_native_bf16'
    kwargs: dict = field(default_factory=dict)
    def __str__(self):
        kw = ', '.join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.call}({kw})"

KEEP = '<a layer>'  # `keep_fp32`'s value in the table: the matrix names a real module of its model
MODES = {m.name: m for m in (
    Mode('fp16', 'to_fp16'),
    Mode('fp16-flat', 'to_fp16', dict(flat_master=True)),
    Mode('bf16', 'to_bf16'),
    Mode('bf16-flat', 'to_bf16', dict(flat_master=True)),
    Mode('fp16-half', 'to_fp16', dict(half_storage=True)),
    Mode('bf16-half', 'to_bf16', dict(half_storage=True)),
    Mode('bf16-sib', 'to_bf16', dict(step_in_backward=True)),
    Mode('bf16-half-sib', 'to_bf16', dict(half_storage=True, step_in_backward=True)),
    Mode('bf16-keep', 'to_bf16', dict(keep_fp32=KEEP)),
    Mode('bf16-state', 'to_bf16', dict(state_dtype=torch.bfloat16)),
    Mode('fp16-flat-state', 'to_fp16', dict(flat_master=True, state_dtype=torch.bfloat16)),
    Mode('bf16-half-state', 'to_bf16', dict(half_storage=True, state_dtype=torch.bfloat16)),
    Mode('bf16-half-sib-state', 'to_bf16', dict(half_storage=True, step_in_backward=True, state_dtype=torch.bfloat16)),
    Mode('bf16-state8', 'to_bf16', dict(state_dtype='8bit')),
    Mode('fp16-state8', 'to_fp16', dict(state_dtype='8bit')),
    Mode('bf16-half-state8', 'to_bf16', dict(half_storage=True, state_dtype='8bit')),
    Mode('bf16-half-sib-state8', 'to_bf16', dict(half_storage=True, step_in_backward=True, state_dtype='8bit')),
    Mode('fp16-clip', 'to_fp16', dict(clip=1.)),
    Mode('bf16-check', 'to_bf16', dict(health_every=1)),  # the precision-health check on every step (default: 100th)
    Mode('fp16-lognormal', 'to_fp16', dict(scaler='lognormal')),
    Mode('fp16-static', 'to_fp16', dict(dynamic=False, loss_scale=1024.)),
    Mode('native-fp16', 'to_native_fp16'),
    Mode('native-bf16', 'to_native_bf16'),
)}

OPTIMIZERS = {  # name: (kind, what it is)
    'sgd': ('fastai', "fastai's `SGD` (momentum)"),
    'adam': ('fastai', "fastai's `Adam`"),
    'lookahead': ('lookahead', "fastai's `Lookahead` around a fastai optimizer (`ranger`)"),
    'torch': ('torch', "a torch optimizer in fastai's `OptimWrapper` (`torch.optim.AdamW`)"),
    'fused': ('fused', "torch's fused AdamW (`fused=True`) in `OptimWrapper`"),
}

CONTEXTS = {  # name: what it is
    'plain': "a plain fit",
    'accumulate': "fastai's `GradientAccumulation`",
    'branch': "params used on some steps only (a branch taken on every other batch, from the first: a torch optimizer "
              "sees its grad come and go, a fastai one keeps stepping it with a zeroed grad)",
    'cancel': "a callback that cancels steps (`CancelStepException` in `before_step`)",
    'gradclip': "fastai's `GradientClip`",
    'ddp': "several processes (fastai's `distrib_ctx`, DDP)",
    'fsdp2': "several processes, the model sharded with PyTorch FSDP2 (`fully_shard`, `fp16cb.shard_model`)",
    'compile': "`torch.compile`d model",
    # other code that reads or writes the model's params, their grads, `requires_grad` or the optimizer during the fit:
    # what it sees and changes is what FP32 fastai's would, dtypes aside (`SEMANTICS`)
    'ema': "other code: an EMA of the weights (`deepcopy(learn.model)` in `before_fit`, averaged each batch)",
    'constraint': "other code: a weight constraint in place after each step (`p.clamp_` under `torch.no_grad()`)",
    'unfreeze': "other code: a param made trainable mid-fit with `requires_grad_(True)` (a hand-written unfreeze)",
    'userclip': "other code: a user's own `clip_grad_norm_(learn.model.parameters(), ...)` in `before_step`",
    'skipbatch': "other code: a batch dropped after its backward (`learn.opt.zero_grad()`, `CancelBatchException`)",
    'cancelaccum': "other code: accumulation by cancelled steps (`CancelStepException`, the optimizer's `zero_grad` "
                   "held back)",
    'checkpoint': "other code: activation checkpointing, a layer's forward run again in the backward "
                  "(`torch.utils.checkpoint`, as Hugging Face's `gradient_checkpointing_enable` and timm's)",
    'surgery': "other code: a module put in the model mid-fit (a callback gives it a new head, a copy of the old one "
               "that the optimizer does not hold)",
    'gradpenalty': "other code: a penalty on the loss's grads w.r.t. the params, added to the loss (second order: "
                   "`torch.autograd.grad(..., create_graph=True)`)",
}

# ---- the facts a verdict reads
OPTIONS, FIT, BATCH, STEP = 'options', 'fit', 'batch', 'step'  # when a fact is known: the callback made, the fit set
# up, the first batch (the model as the learner calls it), a step (what a callback did to it: seen when it happens)

@dataclass(frozen=True)
class Facts:
    "What is known of a fit's set-up, filled in as each fact becomes known."
    native: bool = False  # torch autocast + GradScaler (`to_native_*`), not FP32 masters
    dtype: torch.dtype = torch.float16
    half_storage: bool = False
    flat_master: bool = False
    step_in_backward: bool = False
    stochastic_rounding: bool = True  # how 16-bit weights and 16- or 8-bit state are rounded
    clip: bool = False
    unit_scale: bool = False  # the loss scale is 1 and stays 1 (bf16's default)
    scaler_args: tuple = ()  # GradScaler arguments given where no GradScaler runs (native bf16)
    optimizer: str|None = None  # an `OPTIMIZERS` kind, or 'fastai-own-step' (an `Optimizer` with its own `step`)
    optimizer_name: str|None = None  # the optimizer as its user knows it, for the sentences: "torch's `AdamW`"
    accumulate: bool = False
    gradient_clip: float|None = None  # fastai's `GradientClip(max_norm)` among the callbacks
    ddp: bool = False
    fsdp: bool = False  # the model is sharded with FSDP2 (its units' `MixedPrecisionPolicy` computes in 16 bits)
    compiled: bool = False
    float64_layers: tuple = ()  # names of float64 params of torch layers (a 16-bit model may feed them 16-bit inputs)
    float64_model: bool = False  # every floating param of the model is float64 (nothing would be 16-bit)
    float64_input: str|None = None  # a float64 torch layer that a 16-bit input reached (seen when it happens), by name
    cancels_steps: str|None = None  # what a callback raised after the backward to cancel a step, by name
    grads_read: bool = False  # a callback after ours handles `before_step` (it may read or change the grads)
    intermittent: str|None = None  # a param whose grad comes and goes between steps (a branch), by name
    counts_steps: bool = True  # the optimizer keeps a step count per param (Adam's bias correction; not SGD's momentum)
    state_dtype: torch.dtype|str|None = None  # the optimizer's state between steps: a 16-bit dtype, '8bit' (None: FP32)
    sparse_grads: tuple = ()  # names of the modules whose params get sparse grads (`nn.Embedding(sparse=True)`)

    @classmethod
    def of_options(cls, dtype:torch.dtype, scaling, storage, clipping, **kw) -> Facts:
        "The facts `MixedPrecision`'s options tell (`fp16cb.options`: `ScalingOptions`, `StoreOptions`, `ClipOptions`)."
        return cls(dtype=dtype, half_storage=storage.half_storage, flat_master=storage.flat_master,
                   step_in_backward=storage.step_in_backward, state_dtype=storage.state_dtype,
                   stochastic_rounding=storage.stochastic_rounding,
                   clip=clipping.clip is not None, unit_scale=scaling.unit, **kw)

    @classmethod
    def of_cell(cls, mode:str, opt:str='adam', ctx:str='plain') -> Facts:
        "The facts of a combination of `MODES`, `OPTIMIZERS` and `CONTEXTS` (what the matrix and the table read)."
        m, kind = MODES[mode], OPTIMIZERS[opt][0]
        kw, native, bf16 = m.kwargs, m.call.startswith('to_native'), m.call.endswith('bf16')
        dtype = torch.bfloat16 if bf16 else torch.float16
        known = dict(optimizer=kind, optimizer_name=OPTIMIZERS[opt][1], counts_steps=opt != 'sgd',
                     accumulate=ctx == 'accumulate', gradient_clip=1. if ctx == 'gradclip' else None, ddp=ctx == 'ddp',
                     fsdp=ctx == 'fsdp2', compiled=ctx == 'compile', cancels_steps=_CANCELS.get(ctx),
                     grads_read=ctx in ('cancel', 'gradclip', 'userclip', 'cancelaccum'),
                     intermittent='<a branch>' if ctx == 'branch' and kind in ('torch', 'fused') else None)
        if native: return cls(native=True, dtype=dtype, **known)
        return cls.of_options(dtype, *options_of(**(bf16_defaults(kw) if bf16 else kw)), **known)

    def knowing(self, **kw) -> Facts: return replace(self, **kw)

_CANCELS = {'cancel': 'CancelStepException', 'cancelaccum': 'CancelStepException', 'skipbatch': 'CancelBatchException'}

# ---- the refusals
@dataclass(frozen=True)
class Rule:
    "A combination that cannot keep the semantics: refused when `applies(facts)`, at `moment`, with `sentence`."
    name: str
    moment: str  # OPTIONS, FIT or BATCH: when the facts it reads are known
    applies: object  # Facts -> bool
    sentence: object  # str, formatted with the facts' fields, or Facts -> str
    reason: str = ''  # the reason in a few words (the compatibility table's footnote)

    def message(self, f:Facts) -> str:
        return self.sentence(f) if callable(self.sentence) else self.sentence.format(**vars(f))

    def said_in(self, text:str, f:Facts) -> bool:
        "Whether `text` says this rule's sentence for `f` (a field known when it happens, a name, may differ)."
        if callable(self.sentence): return self.message(f) in text
        parts = re.split(r'\{\w+\}', self.sentence)
        return re.search('.*'.join(map(re.escape, parts)), text, re.S) is not None

_SIB = "step_in_backward=True cannot be used with "
_SIB_WHY = "it steps each param as soon as the backward has its grad"
_MASTERS = lambda f: not f.native
# the model converted to 16 bits for the fit, a store beside it (else it keeps its FP32 params: `ModelParams`)
_STORE = lambda f: f.half_storage

RULES = (
    Rule('sib-scale', OPTIONS, lambda f: f.step_in_backward and not f.unit_scale,
         _SIB + "a loss scale: use `learn.to_bf16(step_in_backward=True)` (loss scale 1). The scale, and an overflow, "
         f"would have to be known before any param is stepped, and {_SIB_WHY}.",
         reason='step_in_backward steps each param inside the backward: it needs a loss scale of 1, known before the '
                'first param steps.'),
    Rule('sib-clip', OPTIONS, lambda f: f.step_in_backward and f.clip,
         _SIB + "`clip`: drop `clip`, or train without step_in_backward. It steps each param as soon as the backward "
         "has its grad, and clipping needs every grad's norm before any param is stepped.",
         reason="clipping needs every grad's norm before any param is stepped, and step_in_backward steps them during "
                "the backward."),
    Rule('sib-flat', OPTIONS, lambda f: f.step_in_backward and f.flat_master,
         _SIB + f"flat_master=True: use flat_master=False. Flat masters step a param group at once, and {_SIB_WHY}.",
         reason='flat masters step a whole param group at once; step_in_backward steps each param on its own.'),
    Rule('half-flat', OPTIONS, lambda f: f.half_storage and f.flat_master,
         "flat_master=True cannot be used with half_storage=True: drop flat_master, or keep FP32 masters "
         "(half_storage=False) to have them flat. half_storage keeps no FP32 masters, only the 16-bit weights: there "
         "is nothing to flatten, and the option would do nothing.",
         reason='half_storage keeps no FP32 masters: flat_master would have nothing to flatten.'),
    Rule('rounding-unused', OPTIONS, lambda f: not f.native and not f.stochastic_rounding and not f.half_storage
                                                and f.state_dtype is None,
         "stochastic_rounding=False would do nothing here: drop it, or use it with half_storage=True or a 16-bit or "
         "8-bit state_dtype. It chooses how those are rounded; FP32 masters and FP32 optimizer state are never "
         "rounded.",
         reason='stochastic_rounding chooses how 16-bit weights and 16- or 8-bit state are rounded: without them it '
                'would do nothing.'),
    Rule('native-bf16-scaler', OPTIONS, lambda f: f.native and f.dtype == torch.bfloat16 and bool(f.scaler_args),
         lambda f: f"`to_native_bf16` runs no GradScaler, so {', '.join(map(repr, f.scaler_args))} would do nothing: "
                   f"drop {'it' if len(f.scaler_args) == 1 else 'them'}, or use `learn.to_native_fp16(...)` for fp16 "
                   f"with GradScaler. bfloat16 has FP32's range: nothing is loss-scaled.",
         reason='native bf16 runs no GradScaler: its arguments would do nothing.'),
    Rule('state-fp16', OPTIONS, lambda f: f.state_dtype == torch.float16,
         "state_dtype=torch.float16 cannot hold the optimizer's state: use state_dtype=torch.bfloat16 (FP32's range). "
         "Adam's second moment averages squared gradients, which underflow fp16 (1e-4 squared is under its smallest "
         "subnormal, 6e-8): it would read 0, and the update lr*m/(sqrt(v)+eps) be divided by eps alone.",
         reason="fp16 state: Adam's second moment (squares of small gradients) underflows fp16's range; bf16 has "
                "FP32's."),
    Rule('float64-layers', FIT, lambda f: _MASTERS(f) and bool(f.float64_layers) and f.float64_model,
         lambda f: f"the model is float64 (its layers {', '.join(f.float64_layers[:5])}"
                   f"{' ...' if len(f.float64_layers) > 5 else ''}): convert it to FP32 first (`learn.model.float()`, "
                   f"or `model.float()` before making the Learner). A {str(f.dtype)[6:]} model would feed its float64 "
                   f"layers 16-bit inputs, which they cannot take.",
         reason="a float64 model cannot take a 16-bit model's inputs: convert it to FP32 first."),
    Rule('float64-input', STEP, lambda f: _MASTERS(f) and f.float64_input is not None,
         lambda f: f"the model's layer {f.float64_input} is float64 and a {str(f.dtype)[6:]} input reached it, which "
                   f"it cannot take: give it float64 inputs (`self.{f.float64_input.split('.')[-1]}(x.double())` "
                   f"in the forward), or convert it to FP32 (`.float()`) before `learn.to_fp16()`/`to_bf16()`.",
         reason="a float64 layer that a 16-bit input reaches (seen at the first batch): give it float64 inputs or "
                "convert it."),
    Rule('sib-optimizer', FIT, lambda f: f.step_in_backward and f.optimizer not in (None, 'fastai'),
         "step_in_backward=True cannot step {optimizer_name}: use a plain fastai optimizer (`Adam`, `SGD`, ...) or "
         "train without step_in_backward. It steps each param inside the backward with fastai's `Optimizer` loop.",
         reason="step_in_backward runs fastai's `Optimizer` loop itself, one param at a time: a plain fastai optimizer "
                "only."),
    Rule('sib-sparse', FIT, lambda f: f.step_in_backward and bool(f.sparse_grads),
         lambda f: _SIB + "sparse gradients: make the embedding dense (`sparse=False`, the default) or train without "
                   f"step_in_backward. The model's {', '.join(f.sparse_grads[:3])}"
                   f"{' ...' if len(f.sparse_grads) > 3 else ''} get{'s' if len(f.sparse_grads) == 1 else ''} sparse "
                   "gradients (`sparse=True`), which cannot be checked for inf/NaN and stepped inside the backward.",
         reason="sparse gradients (`nn.Embedding(sparse=True)`) cannot be checked and stepped inside the backward."),
    Rule('sib-accumulate', FIT, lambda f: f.step_in_backward and f.accumulate,
         _SIB + "GradientAccumulation: train without step_in_backward. GradientAccumulation sums several backwards' "
         "grads before one step, and step_in_backward steps each param in every backward.",
         reason="gradient accumulation sums several backwards' grads before one step; step_in_backward steps in each "
                "backward."),
    Rule('sib-ddp', FIT, lambda f: f.step_in_backward and f.ddp,
         _SIB + "several processes (DDP): train without step_in_backward. DDP averages the grads after the backward: "
         "each rank would step with its own, and the ranks' weights would drift apart.",
         reason='DDP averages the grads after the backward; step_in_backward would step each rank with its own grads.'),
    Rule('sib-grads-read', FIT, lambda f: f.step_in_backward and f.grads_read,
         _SIB + "a callback that reads or changes the grads in `before_step` (a clip of its own, fastai's "
         "`GradientClip`, a probe): train without step_in_backward, or do that work in `after_backward` of a callback "
         "ordered before fp16cb's. The backward steps the params and drops their grads: that callback would see none.",
         reason="a callback's `before_step` would find no grads: step_in_backward consumed them in the backward."),
    Rule('sib-cancel', STEP, lambda f: f.step_in_backward and bool(f.cancels_steps),
         "step_in_backward=True cannot undo a step a callback cancelled after the backward (`{cancels_steps}`): "
         "train without step_in_backward, or cancel before the backward (`CancelBackwardException` in "
         "`before_backward`). The backward had stepped the params: the weights moved where FP32 fastai's would not.",
         reason="a step cancelled after the backward cannot be undone: step_in_backward stepped it in the backward (an "
                "error when it happens)."),
    Rule('masters-gradclip', FIT, lambda f: _MASTERS(f) and f.gradient_clip is not None and _STORE(f),
         lambda f: f"fastai's GradientClip(max_norm={f.gradient_clip}) cannot be used with "
                   f"`half_storage`: use "
                   f"`learn.{'to_bf16' if f.dtype == torch.bfloat16 else 'to_fp16'}(clip={f.gradient_clip}, "
                   f"clip_global=True)` (the same global L2 norm, of the FP32 master gradients), or the default "
                   f"`to_fp16()`/`to_bf16()`, whose model keeps its FP32 params. In this mode the model's params "
                   f"are 16-bit during the fit, and GradientClip would clip their loss-scaled gradients.",
         reason="with a 16-bit model (`half_storage`) fastai's "
                "`GradientClip` would clip the 16-bit, loss-scaled grads: use `to_fp16(clip=..., clip_global=True)`."),
)
_FSDP = "a model sharded with PyTorch FSDP2"
RULES += (
    Rule('fsdp-native', FIT, lambda f: f.native and f.fsdp,
         "`to_native_fp16`/`to_native_bf16` cannot be used with " + _FSDP + ": use `learn.to_bf16()` or "
         "`learn.to_fp16()`, which set FSDP2's own mixed precision (16-bit all-gathers, FP32 reductions) and a loss "
         "scale whose skips agree on every rank. Autocast would cast the FP32 params FSDP2 all-gathers, each forward.",
         reason="FSDP2 computes in 16 bits through its `MixedPrecisionPolicy`, which `to_bf16`/`to_fp16` set."),
    Rule('fsdp-ddp', FIT, lambda f: f.ddp and f.fsdp,
         "fastai's `distrib_ctx()` (`DistributedTrainer`) cannot train " + _FSDP + ": it would wrap the sharded model "
         "in DistributedDataParallel. Fit with `cbs=fp16cb.DistributedData()` instead: each rank takes its part of "
         "every batch, as under `distrib_ctx()`, and the model stays as FSDP2 sharded it.",
         reason="fastai's `distrib_ctx()` wraps the model in DDP: use `fp16cb.DistributedData()` for the data."),
    Rule('fsdp-half', FIT, lambda f: not f.native and f.half_storage and f.fsdp,
         "half_storage=True cannot be used with " + _FSDP + ": drop half_storage. FSDP2 keeps the sharded params "
         "FP32 and all-gathers them in 16 bits; each rank holds 1/world of them already, and there is no 16-bit copy "
         "to save.",
         reason="FSDP2 keeps its shards FP32 and casts them as it all-gathers: no 16-bit copy to drop."),
    Rule('fsdp-sib', FIT, lambda f: not f.native and f.step_in_backward and f.fsdp,
         _SIB + _FSDP + ": train without step_in_backward. FSDP2 reduce-scatters each unit's grads across the ranks "
         "after its backward, and " + _SIB_WHY + ".",
         reason="FSDP2 reduces each unit's grads across ranks after its backward; step_in_backward would step before."),
    Rule('fsdp-flat', FIT, lambda f: not f.native and f.flat_master and f.fsdp,
         "flat_master=True would do nothing on " + _FSDP + ": drop it. FSDP2 keeps each unit's shards in one flat "
         "buffer already, and its params are the masters.",
         reason="FSDP2 keeps each unit's shards in one flat buffer already."),
)
_ORDER = {OPTIONS: 0, FIT: 1, BATCH: 2, STEP: 3}

def refusal(f:Facts, moment:str=STEP) -> Rule|None:
    "The first rule that refuses `f`, among those whose facts are known at `moment` (STEP: all of them)."
    return next((r for r in RULES if _ORDER[r.moment] <= _ORDER[moment] and r.applies(f)), None)

def check(f:Facts, moment:str):
    "Raise the `Refused` of the first rule that refuses `f` at `moment` (set-up calls this as each fact is known)."
    r = refusal(f, moment)
    if r is not None: raise Refused(r.message(f), r.name)

def verdict(mode:str, opt:str, ctx:str) -> str|None:
    "None when the combination is supported; else the sentence its refusal says."
    f = Facts.of_cell(mode, opt, ctx)
    r = refusal(f)
    return None if r is None else r.message(f)

# ---- which optimizer state a 16-bit or 8-bit `state_dtype` may round: the moving averages, known by name
# A moving average (a moment, a momentum) forgets each rounding error at its decay's pace, as it forgets each grad's
# noise; other state does not: a weight copy (timm MADGRAD's `x0` anchor, Lookahead's slow weights, torch ASGD's `ax`),
# a running sum (Adagrad's `sum`, MADGRAD's `s` and `grad_sum_sq`), a previous grad (Adan's `neg_pre_grad`, Rprop's
# `prev`) or a per-element step size would keep it, or grow it, for the rest of the fit. Only the names below are
# rounded; any other state stays FP32. A new optimizer's moving averages are added here (`storage.state_storage` reads
# it).
MOVING_AVERAGES = frozenset({
    'grad_avg', 'sqr_avg',  # fastai: `average_grad` (and momentum), `average_sqr_grad`
    'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'momentum_buffer', 'square_avg', 'exp_inf', 'acc_delta',  # torch.optim
    'exp_avg_diff', 'exp_avg_var', 'max_exp_avg_var', 'exp_hessian_diag_sq',  # timm: Adan, AdaBelief, AdaHessian
    'momentum'})  # timm: SGDP's momentum buffer


# The moving averages never negative (second moments: averages of squares, their maxima): 8-bit state codes them on
# torchao's unsigned map (its 256 values all >= 0, twice as fine), the others on its signed map.
NONNEGATIVE = frozenset({'sqr_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'square_avg', 'exp_inf', 'acc_delta', 'exp_avg_var',
                         'max_exp_avg_var', 'exp_hessian_diag_sq'})



def table() -> str:
    """The compatibility table (markdown): a column per optimizer kind and context, a row per set of modes that the
    declaration treats alike (every mode of `MODES` in one row); refusals by rule, their notes below."""
    cols = [(o, 'plain') for o in OPTIMIZERS if o not in ('sgd',)] + [('adam', c) for c in CONTEXTS if c != 'plain']
    heads = [OPTIMIZERS[o][0] if c == 'plain' else c for o, c in cols]
    seen, rows = {}, {}
    for name, m in MODES.items():
        cells = tuple('yes' if r is None else f"no ({seen.setdefault(r.name, len(seen) + 1)})"
                      for o, c in cols for r in [refusal(Facts.of_cell(name, o, c))])
        rows.setdefault(cells, []).append(f"`{m}`")
    lines = ['| modes | ' + ' | '.join(heads) + ' |', '|---|' + '---|' * len(cols)]
    lines += [f"| {', '.join(ms)} | " + ' | '.join(cells) + ' |' for cells, ms in rows.items()] + ['']
    for rule_name, i in seen.items():
        lines.append(f"({i}) {next(r for r in RULES if r.name == rule_name).reason}  ")
    return '\n'.join(lines)

# ---- the facts of a live learner
def optimizer_name(opt) -> str:
    "`opt` as its user knows it: torch's `AdamW` (in `OptimWrapper`), fastai's `Lookahead`, timm's `Lamb`, `my.Opt`."
    core = opt.opt if isinstance(opt, OptimWrapper) else opt
    cls = type(core).__dict__.get('_fp16cb_base', type(core))  # its own class (a fit's routed subclass: the one below)
    name, top = _named(cls), cls.__module__.split('.')[0]
    return (f"{top}'s `{cls.__name__}`" if top in ('torch', 'fastai', 'timm') else name) + (
        ' (fused=True)' if getattr(core, 'defaults', {}).get('fused') else '')

def optimizer_kind(opt) -> str:
    "`opt`'s kind among `OPTIMIZERS`' ('fastai', 'lookahead', 'torch', 'fused'), or 'fastai-own-step'."
    if isinstance(opt, OptimWrapper): return 'fused' if opt.opt.defaults.get('fused') else 'torch'
    if isinstance(getattr(opt, 'opt', None), _BaseOptimizer): return 'lookahead'
    # read at set-up, before the fit's routing
    return 'fastai' if getattr(type(opt), 'step', None) is Optimizer.step else 'fastai-own-step'

# ---- which optimizers update each element from that element alone (the step engine's one source for it)
# An elementwise optimizer steps a param cut in parts (flat masters cut at the lift's chunk, a slice at a time, a run of
# params as one flat tensor) exactly as it steps it whole, so fp16cb may step it a bounded chunk at a time. It is KNOWN
# to be elementwise, never guessed: a fastai `Optimizer` whose step callbacks are all in `ELEMENTWISE_FASTAI`; an
# `OptimWrapper` around an optimizer whose class (exactly: a subclass may change the step) is in `ELEMENTWISE_TORCH`.
# Any other optimizer (timm's Adan or Lamb, torch's Adafactor or LBFGS, your own) is stepped whole: its `step` runs
# once per training step over all its params, with every FP32 master grad lifted at once (fastai's memory, not a
# chunk's). Not LAMB's, LARC's norms.
ELEMENTWISE_FASTAI = {fo.sgd_step, fo.weight_decay, fo.l2_reg, fo.average_grad, fo.average_sqr_grad, fo.momentum_step,
                      fo.step_stat, fo.adam_step, fo.radam_step, fo.qhadam_step, fo.rms_prop_step}
ELEMENTWISE_TORCH = tuple(getattr(torch.optim, k) for k in ('SGD', 'Adam', 'AdamW', 'RMSprop', 'Adagrad', 'Adamax',
                                                            'NAdam', 'RAdam', 'Adadelta', 'Rprop', 'ASGD')
                          if hasattr(torch.optim, k))

def known_elementwise(core) -> bool:
    """Whether the innermost optimizer `core` (a fastai `Optimizer` or an `OptimWrapper`) is known to be elementwise
    (above)."""
    if isinstance(core, OptimWrapper): return type(getattr(core, 'opt', None)) in ELEMENTWISE_TORCH
    return bool(getattr(core, 'cbs', None)) and all(_elementwise(getattr(cb, 'func', cb)) for cb in core.cbs)

# yours: `f.elementwise = True`
def _elementwise(f) -> bool: return f in ELEMENTWISE_FASTAI or getattr(f, 'elementwise', False) is True

_named = lambda o: f"`{getattr(o, '__module__', '?')}.{getattr(o, '__qualname__', type(o).__name__)}`"

def float64_layers(model) -> tuple:
    "Names of the float64 params held by torch's own layers (`torch.nn` modules: a Linear, a Conv, an LSTM ...)."
    return tuple(f"{mn}.{pn}" if mn else pn for mn, m in model.named_modules()
                 if type(m).__module__.startswith('torch.nn.')
                 for pn, p in m.named_parameters(recurse=False) if p.dtype == torch.float64)

def _distributed(learn) -> bool:
    """Whether the fit runs in several processes: fastai's `DistributedTrainer` among the callbacks, or a DDP model.
    `fastai.distributed` not imported: no `DistributedTrainer` can be there (importing it would load Accelerate)."""
    trainer = getattr(sys.modules.get('fastai.distributed'), 'DistributedTrainer', None)
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return isinstance(learn.model, DistributedDataParallel) or (several and trainer is not None
                                                                and any(isinstance(cb, trainer) for cb in learn.cbs))

def learner_facts(learn, f:Facts) -> Facts:
    """`f` with what `learn` tells at its fit's set-up (or first batch): its optimizer, callbacks and model. (Its
    float64 layers are `ModelToHalf.check_model`'s to read: they matter only to a model converted to 16-bit.)"""
    model = learn.model
    sparse = tuple(n or 'model' for n, m in model.named_modules() if getattr(m, 'sparse', False) is True
                   and any(p.requires_grad for p in m.parameters(recurse=False)))
    return f.knowing(optimizer=optimizer_kind(learn.opt) if learn.opt is not None else None, sparse_grads=sparse,
                     optimizer_name=optimizer_name(learn.opt) if learn.opt is not None else None,
                     accumulate=any(isinstance(cb, GradientAccumulation) for cb in learn.cbs),
                     gradient_clip=next((cb.max_norm for cb in learn.cbs if isinstance(cb, GradientClip)), None),
                     ddp=f.ddp or _distributed(learn), fsdp=is_fsdp(model), compiled=hasattr(model, '_orig_mod'))
