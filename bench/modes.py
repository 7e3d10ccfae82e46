"""The benchmark's modes (how a learner trains: fp32, fastai's AMP, fastai's master-weight algorithm, fp16cb's, and
the limit: a bare bf16 model), its optimizers (fastai's Adam, or torch's fused AdamW through `OptimWrapper`), and the
reference: a plain PyTorch AMP loop; the compiled comparison (`--modes compile`): `to_bf16` with a `torch.compile`d
model and the plain loop with its model compiled, on the backend `pick_compile_backend` chose."""
from __future__ import annotations
from functools import partial, cache
import torch
import torch.nn.functional as F
from fastai.basics import Callback, CancelStepException, Adam
from fastai.optimizer import OptimWrapper
import fastai.callback.fp16 as ffp16

import fp16cb  # noqa: F401 (patches Learner.to_fp16 & co.)
from fp16cb.callbacks import model_device
from fp16cb.dtypes import convert_network
from fp16cb.callbacks import cast_floats

__all__ = ['AutocastCB', 'FastaiAMP', 'KeepsScale', 'FastaiNonNative', 'BareBF16', 'bare_bf16', 'MODES', 'POLICY_MODES', 'OPTS', 'PLAIN', 'run_key',
           'fused_adamw_ok', 'half_dtype', 'PLAIN_COMPILED', 'PLAIN_MODES', 'COMPILED_MODES', 'COMPILE_MODES', 'MODE_SETS',
           'set_compile_backend', 'compile_backend', 'compile_model', 'pick_compile_backend']

def half_dtype(device) -> torch.dtype:
    "The 16-bit dtype of the autocast modes: fp16 on CUDA, bf16 on a CPU."
    return torch.float16 if torch.device(device).type == 'cuda' else torch.bfloat16

class KeepsScale:
    """A fastai AMP callback whose GradScaler's state (the loss scale, its growth count) goes on from one of the
    benchmark's fits to the next. fastai's `MixedPrecision` makes a new GradScaler at 2^16 in every `before_fit`: over
    the benchmark's fits of 3 steps each it skipped 39 of 45 steps of ResNet-50 (H200, 2026-11-26), and its timed steps
    were all skipped ones, without the optimizer. In one long fit its scale settles after the first steps: carried
    over, the benchmark times the steps of that long fit."""
    _scale_state = None
    def before_fit(self):
        super().before_fit()
        if self._scale_state is not None and self.learn.scaler.is_enabled(): self.learn.scaler.load_state_dict(self._scale_state)
    def after_fit(self):
        scaler = getattr(self.learn, 'scaler', None)
        if scaler is not None and scaler.is_enabled(): self._scale_state = scaler.state_dict()
        super().after_fit()

class FastaiAMP(KeepsScale, ffp16.MixedPrecision):
    "fastai's `to_fp16()` callback itself (CUDA), its loss scale carried across the benchmark's fits (`KeepsScale`)."

class _AutocastCB(Callback):
    "fastai's `MixedPrecision` (autocast + GradScaler) on the model's device instead of hard-coded 'cuda'."
    order = 10
    def __init__(self, dtype): self.dtype = dtype
    def before_fit(self):
        dev = model_device(self.learn.model).type
        self.autocast = torch.autocast(dev, dtype=self.dtype)
        self.learn.scaler = torch.amp.GradScaler(dev, enabled=self.dtype == torch.float16)
    def after_fit(self): pass
    def before_batch(self): self.autocast.__enter__()
    def after_pred(self): self.learn.pred = cast_floats(self.learn.pred, torch.float32)
    def after_loss(self): self.autocast.__exit__(None, None, None)
    def before_backward(self): self.learn.loss_grad = self.learn.scaler.scale(self.learn.loss_grad)
    def before_step(self):
        self.skipped = True
        self.learn.scaler.step(self)
        if self.skipped: raise CancelStepException()
    def after_step(self): self.learn.scaler.update()
    @property
    def param_groups(self): return self.learn.opt.param_groups
    def step(self, *args, **kwargs): self.skipped = False

class AutocastCB(KeepsScale, _AutocastCB):
    "fastai's AMP pattern on any device (`_AutocastCB`), its loss scale carried across the benchmark's fits (`KeepsScale`)."

def _move_torch_state(opt, old_pgs, new_pgs):
    "A torch optimizer's own state (`OptimWrapper`), re-keyed from `old_pgs` to `new_pgs` (fastai moves only its own)."
    if not isinstance(opt, OptimWrapper): return
    st = opt.opt.state
    for pg1, pg2 in zip(old_pgs, new_pgs):
        for p1, p2 in zip(pg1, pg2):
            if p1 in st: st[p2] = st.pop(p1)

class FastaiNonNative(ffp16.NonNativeMixedPrecision):
    """fastai's master-weight algorithm with its CUDA assert lifted (fp16 only: fastai's `ModelToHalf` casts to fp16);
    with `OptimWrapper`, torch's optimizer state follows the masters too (fastai's `_copy_state` moves only fastai's:
    torch's would restart every fit and the old masters' state would pile up, 8 bytes/param per fit)."""
    def before_fit(self):
        if self.learn.opt is None: self.learn.create_opt()
        self.model_pgs, self.master_pgs = ffp16.get_master(self.opt, self.flat_master)
        self.old_pgs = self.opt.param_lists
        ffp16._copy_state(self.learn.opt, self.model_pgs, self.master_pgs)
        if not self.flat_master: _move_torch_state(self.learn.opt, self.model_pgs, self.master_pgs)
        if self.dynamic: self.count = 0
    def after_fit(self):
        if hasattr(self, 'master_pgs') and not self.flat_master:
            _move_torch_state(self.learn.opt, self.master_pgs, self.model_pgs)
        super().after_fit()

class BareBF16(Callback):
    "The bare bf16 model's one callback: its prediction back to FP32 for the loss (as every other mode's)."
    order = 10
    def after_pred(self): self.learn.pred = cast_floats(self.learn.pred, torch.float32)

def _cast_inputs_bf16(module, args, kwargs): return cast_floats(args, torch.bfloat16), cast_floats(kwargs, torch.bfloat16)

def bare_bf16(learn, device=None):
    """The limit of a bf16 fastai loop: the model converted to bf16 once and for good (BatchNorm stays FP32, as
    `fp16cb.dtypes.convert_network` does), floating inputs cast to bf16 as they enter it (a forward pre-hook, as fp16cb's
    `ModelToHalf`), the prediction cast back to FP32 for the loss (`BareBF16`), and the optimizer (created at the fit,
    after the conversion) stepping the bf16 params directly: no FP32 masters, no loss scale, no fp16cb callback."""
    if learn.opt is not None: raise ValueError("bare_bf16: the optimizer must be created after the conversion")
    convert_network(learn.model, torch.bfloat16)
    learn.model.register_forward_pre_hook(_cast_inputs_bf16, with_kwargs=True, prepend=True)
    return learn.add_cb(BareBF16())

def _fastai_amp(learn, device):
    "fastai's own `to_fp16()`: its `MixedPrecision` callback itself on CUDA; elsewhere the same on the model's device (bf16)."
    if torch.device(device).type == 'cuda': return learn.add_cb(FastaiAMP())
    return learn.add_cb(AutocastCB(half_dtype(device)))

# ------------------------------------------------------------------------------------------------ torch.compile
_BACKEND = {'name': None}  # the backend of the compiled modes in this run (`run_bench` sets it)

def set_compile_backend(name:str|None): _BACKEND['name'] = name
def compile_backend() -> str|None: return _BACKEND['name']

def compile_model(model):
    "`torch.compile(model)` on this run's backend (what a user writes: `learn.model = torch.compile(learn.model)`)."
    if compile_backend() is None: raise RuntimeError("no compile backend chosen (`set_compile_backend`)")
    return torch.compile(model, backend=compile_backend())

def _probe(x): return (x * 2).sin().sum()

@cache
def _inductor_error(device_type:str) -> str|None:
    "None when inductor compiles and runs a small function on this device type (a C++ compiler on a CPU); else why not."
    try: torch.compile(_probe, backend='inductor', fullgraph=True)(torch.randn(8, device=device_type)).item()
    except Exception as e: return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    return None

def pick_compile_backend(requested:str, device) -> tuple:
    """`(backend, why)` for the compiled modes: 'auto' is inductor where it compiles (a working C++ compiler on a CPU,
    triton on CUDA), else aot_eager (dynamo + AOTAutograd, no code generation: no compiler needed); 'inductor' where
    it does not compile is a `ValueError`."""
    if requested not in ('auto', 'inductor', 'aot_eager'):
        raise ValueError(f"unknown compile backend {requested!r} (expected auto, inductor or aot_eager)")
    if requested == 'aot_eager': return 'aot_eager', 'asked for'
    dev = torch.device(device).type
    err = _inductor_error(dev)
    if err is None: return 'inductor', 'a C++ compiler works' if dev == 'cpu' else f'inductor compiles on {dev}'
    if requested == 'inductor': raise ValueError(f"the inductor backend does not compile here ({err})")
    return 'aot_eager', f"inductor does not compile here ({err})"

def _compiled_bf16(learn, device):
    learn.model = compile_model(learn.model)
    return learn.to_bf16()

# name: (description, learner setup(learn, device)); `PLAIN`/`PLAIN_COMPILED` are no learner: the plain PyTorch loop
# of `plain.PlainAMP`, eager or with its model compiled
PLAIN, PLAIN_COMPILED = 'torch-amp', 'torch-amp-compile'
PLAIN_MODES = (PLAIN, PLAIN_COMPILED)
MODES = {
    'fp32':      ('plain FP32', lambda l, d: l),
    'autocast':  ("fastai's own to_fp16() (AMP: autocast + GradScaler, its loss scale carried across the benchmark's fits; "
                  "on a CPU the same callback with bf16 autocast)",
                  _fastai_amp),
    'fastai':    ("fastai's original master-weight algorithm: ModelToHalf + NonNativeMixedPrecision (fp16, FP32 masters, "
                  "dynamic scale)", lambda l, d: l.add_cbs([ffp16.ModelToHalf(), FastaiNonNative()])),
    'bf16':      ('fp16cb learn.to_bf16()', lambda l, d: l.to_bf16()),
    'bf16-flat': ('fp16cb learn.to_bf16(flat_master=True)', lambda l, d: l.to_bf16(flat_master=True)),
    'bare-bf16': ('the limit of a bf16 fastai loop: the model bf16 for good (BatchNorm FP32), inputs cast to bf16, the '
                  'prediction back to FP32, the optimizer stepping the bf16 params (no masters, no fp16cb)', bare_bf16),
    'fp16':      ('fp16cb learn.to_fp16()', lambda l, d: l.to_fp16()),
    'fp16-flat': ('fp16cb learn.to_fp16(flat_master=True)', lambda l, d: l.to_fp16(flat_master=True)),
    'native':    ('fp16cb learn.to_native_fp16() (dtype=bf16 on CPU)', lambda l, d: l.to_native_fp16(dtype=half_dtype(d))),
    # the precision policy's opt-ins (not in the default sets: `--modes bf16,bf16-norm,...` measures their cost)
    'bf16-half': ('fp16cb learn.to_bf16(half_storage=True): 16-bit weights, no FP32 masters', lambda l, d: l.to_bf16(half_storage=True)),
    'bf16-sib':  ('fp16cb learn.to_bf16(step_in_backward=True): each param stepped in the backward',
                  lambda l, d: l.to_bf16(step_in_backward=True)),
    'bf16-half-sib': ('fp16cb learn.to_bf16(half_storage=True, step_in_backward=True)',
                      lambda l, d: l.to_bf16(half_storage=True, step_in_backward=True)),
    'bf16-norm': ('fp16cb learn.to_bf16(keep_fp32=\'norm\'): LayerNorm/GroupNorm/InstanceNorm stay FP32',
                  lambda l, d: l.to_bf16(keep_fp32='norm')),
    'bf16-cls':  ('fp16cb learn.to_bf16(keep_fp32=\'classifier\'): the last Linear/Conv stays FP32',
                  lambda l, d: l.to_bf16(keep_fp32='classifier')),
    'bf16-emb':  ('fp16cb learn.to_bf16(keep_fp32=\'embedding\'): embeddings stay FP32', lambda l, d: l.to_bf16(keep_fp32='embedding')),
    'fp16-norm': ('fp16cb learn.to_fp16(keep_fp32=\'norm\')', lambda l, d: l.to_fp16(keep_fp32='norm')),
    'fp16-cls':  ('fp16cb learn.to_fp16(keep_fp32=\'classifier\')', lambda l, d: l.to_fp16(keep_fp32='classifier')),
    # the precision-health check on every step (by default every 100th, never in the benchmark's short fits): what a
    # check step costs, side by side with 'bf16'/'fp16' (`--modes health`); `python -m bench.health_cost` amortizes it
    'bf16-check': ('fp16cb learn.to_bf16(health_every=1): the in-fit precision-health check on every step',
                   lambda l, d: l.to_bf16(health_every=1)),
    'fp16-check': ('fp16cb learn.to_fp16(health_every=1): the in-fit precision-health check on every step',
                   lambda l, d: l.to_fp16(health_every=1)),
    PLAIN:       ('reference: a plain PyTorch loop, autocast + GradScaler + fused AdamW, no fastai (bf16 on CPU)', None),
    # the compiled comparison (opt-in: `--modes compile` or `--compile`); the first (compiling) epoch is in the warm-up
    'bf16-compile': ('fp16cb learn.to_bf16() with learn.model = torch.compile(learn.model) (backend: --compile-backend)',
                     _compiled_bf16),
    PLAIN_COMPILED: (f'the plain loop of {PLAIN} with its model torch.compile\'d (the same backend)', None),
}
COMPILED_MODES = ('bf16-compile', PLAIN_COMPILED)
COMPILE_MODES = ('bf16', 'bf16-compile', PLAIN, PLAIN_COMPILED)  # to_bf16 and the plain loop, eager and compiled
MEMORY_MODES = ('fp32', 'bf16', 'bf16-half', 'bf16-sib', 'bf16-half-sib')  # the modes that trade speed for memory
HEALTH_MODES = ('bf16', 'bf16-check', 'fp16', 'fp16-check')  # the precision-health check: off (in 3-step fits) and on
MODE_SETS = {'compile': COMPILE_MODES, 'memory': MEMORY_MODES, 'health': HEALTH_MODES}

POLICY_MODES = ('bf16-norm', 'bf16-cls', 'bf16-emb', 'fp16-norm', 'fp16-cls')  # opt-in: `--modes` names them

# name: (description, fastai `opt_func`)
OPTS = {
    'adam':  ("fastai's default Adam", Adam),
    'fused': ('OptimWrapper(torch.optim.AdamW(fused=True))', partial(OptimWrapper, opt=partial(torch.optim.AdamW, fused=True))),
}

def run_key(mode:str, opt:str) -> str:
    "The name of a mode trained with an optimizer in the results: `fp16` (fastai's Adam), `fp16+fused`."
    return mode if opt == 'adam' or mode in PLAIN_MODES else f"{mode}+{opt}"

def fused_adamw_ok(device) -> str|None:
    "None when torch's fused AdamW steps on `device`; else why not."
    p = torch.zeros(2, device=device, requires_grad=True)
    p.grad = torch.ones_like(p)
    try: torch.optim.AdamW([p], fused=True).step()
    except (RuntimeError, TypeError, ValueError) as e: return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return None

def plain_loss(pred, y) -> torch.Tensor:
    "The loss of the plain loop: cross-entropy in FP32 over the last dim (as fastai's `CrossEntropyLossFlat` after AMP)."
    return F.cross_entropy(pred.float().reshape(-1, pred.shape[-1]), y.reshape(-1))
