"""Before the fit: which 16-bit dtypes we train in, how a model is converted (BatchNorm stays FP32), what this CPU
computes natively, and which devices the model and the main job can run on."""
from __future__ import annotations
import contextlib, copy, functools, os, sys, warnings
from typing import NamedTuple
import torch
from torch import nn

__all__ = ['Converted', 'HALF_DTYPES', 'EIGHT_BIT', 'STATE_DTYPES', 'resolve_state_dtype', 'FP16_MAX',
           'FP16_MIN_NORMAL', 'FP16_MIN_SUBNORMAL', 'resolve_dtype',
           'keeps_fp32', 'convert_network', 'convert_network_keeping', 'cpu_has_native', 'has_fast_half_math',
           'range_remedy',
           'warn_slow_half', 'user_stacklevel', 'resolve_device', 'model_device', 'bare_copy', 'cpu_flags',
           'machine_line']

HALF_DTYPES = (torch.float16, torch.bfloat16)
FP16_MAX = 65504.  # the largest finite float16
FP16_MIN_NORMAL = 2.**-14  # the smallest normal float16: under it fp16 keeps a fixed spacing of 2^-24 (subnormals)
FP16_MIN_SUBNORMAL = 2.**-24  # the smallest subnormal float16: anything smaller flushes to zero
_ALIASES = {'fp16': torch.float16, 'float16': torch.float16, 'half': torch.float16,
            'bf16': torch.bfloat16, 'bfloat16': torch.bfloat16}

def resolve_dtype(dtype, allowed=HALF_DTYPES) -> torch.dtype:
    "`dtype` as a `torch.dtype` (accepts 'fp16', 'bf16', ...); `ValueError` if it is not one of `allowed`."
    res = _ALIASES.get(dtype.lower(), None) if isinstance(dtype, str) else dtype
    if res not in allowed:
        names = ', '.join(str(o).replace('torch.', '') for o in allowed)
        raise ValueError(f"unsupported dtype {dtype!r}: expected one of {names} (or 'fp16'/'bf16')")
    return res

# ---- the optimizer's state between steps (`state_dtype`)
EIGHT_BIT = '8bit'  # `state_dtype` of 8-bit state (block-wise codes and scales, `state8`)
# what the state may be stored in (fp16 is refused by `fp16cb.compat`: its range)
STATE_DTYPES = (torch.bfloat16, EIGHT_BIT)
_STATE_ALIASES = {'bf16': torch.bfloat16, 'bfloat16': torch.bfloat16, 'fp16': torch.float16, 'float16': torch.float16,
            'half': torch.float16, 'fp32': torch.float32, 'float32': torch.float32, '8bit': EIGHT_BIT}

def resolve_state_dtype(v) -> torch.dtype|str|None:
    """`state_dtype` as None (FP32 state: None, `torch.float32`, 'fp32'), a 16-bit dtype ('bf16', 'fp16' accepted:
    `fp16cb.compat` refuses fp16 with its reason) or '8bit' (`torch.uint8` too: the codes' dtype); a `ValueError` naming
    the argument for anything else."""
    d = _STATE_ALIASES.get(v.lower(), v) if isinstance(v, str) else EIGHT_BIT if v == torch.uint8 else v
    if d is None or d == torch.float32: return None
    if d not in (torch.bfloat16, torch.float16, EIGHT_BIT):
        raise ValueError(f"`state_dtype` must be torch.bfloat16 (or 'bf16'), '8bit' (or torch.uint8), or None for FP32 "
                         f"optimizer state, got {v!r}")
    return d

def keeps_fp32(module:nn.Module) -> bool:
    "BatchNorm layers (torch's and fastai's `BatchNorm`, which builds them) keep FP32 parameters and statistics."
    return isinstance(module, nn.modules.batchnorm._BatchNorm)

_CONVERTIBLE = (torch.float32, torch.float16, torch.bfloat16)  # float64 (kept on purpose) and complex keep their dtype
def _convertible(t): return t is not None and t.dtype in _CONVERTIBLE

class Converted(NamedTuple):
    "What `convert_network_keeping` converted: where the tensor lives, and its exact value before."
    module: nn.Module
    name: str
    is_param: bool
    original: torch.Tensor


def convert_network_keeping(model:nn.Module, dtype:torch.dtype, keep=None) -> dict:
    """Convert `model`'s FP32/fp16/bf16 parameters and buffers to `dtype`, BatchNorm layers excepted, in place.
    `keep`: the ids of the modules that stay FP32 instead of BatchNorm's (a `PrecisionPolicy`'s choice).
    Tensors of any other dtype (float64, complex, integer) keep theirs. Returns `{id(tensor): Converted}` with the
    original tensor of everything converted, so the exact values can be restored later (the originals are kept, not
    copied)."""
    converted, seen = {}, set()
    for module in model.modules():
        if (keeps_fp32(module) if keep is None else id(module) in keep): continue
        for is_param, tensors in ((True, module._parameters), (False, module._buffers)):
            for name, t in tensors.items():
                if not _convertible(t) or t.dtype == dtype or id(t) in seen: continue
                seen.add(id(t))
                converted[id(t)] = Converted(module, name, is_param, t.data if is_param else t)
                if is_param: t.data = t.data.to(dtype)
                else: tensors[name] = t.to(dtype)
        if isinstance(module, nn.RNNBase): module.flatten_parameters()
    return converted

def convert_network(model:nn.Module, dtype:torch.dtype) -> nn.Module:
    """Convert `model`'s FP32/fp16/bf16 parameters and buffers to `dtype`, except BatchNorm layers, which stay FP32
    (float64 and complex tensors keep their dtype). Returns `model`."""
    convert_network_keeping(model, dtype)
    return model

_ONEDNN_PROBES = {torch.bfloat16: '_is_mkldnn_bf16_supported', torch.float16: '_is_mkldnn_fp16_supported'}
# the CPU flags (/proc/cpuinfo: x86's `flags`, Arm's `Features`) of native 16-bit math; AVX512 without them converts
# to FP32 and back around every op, AVX2 alone runs torch's reference kernels: both slower than FP32
_NATIVE_FLAGS = {torch.bfloat16: {'avx512_bf16', 'amx_bf16', 'bf16'},
                 torch.float16: {'avx512_fp16', 'amx_fp16', 'asimdhp'}}

@functools.cache
def cpu_has_native(dtype:torch.dtype) -> bool:
    """Whether this CPU computes `dtype` matmuls natively, faster than FP32: bf16 with AVX512-BF16, AMX-BF16 or Arm's
    BF16, fp16 with AVX512-FP16 or AMX-FP16, where torch's oneDNN uses them too (`ONEDNN_MAX_CPU_ISA` may forbid it).
    Without, torch falls back to slow kernels."""
    if dtype not in _ONEDNN_PROBES: return True  # FP32 (and anything else) needs no 16-bit instructions
    flags = _cpu_flag_set()
    if flags and not flags & _NATIVE_FLAGS[dtype]: return False
    try: return bool(getattr(torch.ops.mkldnn, _ONEDNN_PROBES[dtype])())
    except (AttributeError, RuntimeError): return dtype == torch.bfloat16 and bool(flags)  # a torch without the probe

def range_remedy(device) -> str:
    """What to train in when activations overflow fp16's range, as advice chosen by what `device` runs fast: bf16
    (FP32's range) where it is native, else FP32 (bf16 would be several times slower than FP32 there)."""
    if has_fast_half_math(torch.bfloat16, device): return "bf16 (`learn.to_bf16()`), which has FP32's range"
    return (f"FP32 (`learn.to_fp32()`): bf16 has FP32's range but no native math on this "
            f"{torch.device(device).type}, where it runs slower than FP32")

def has_fast_half_math(dtype:torch.dtype, device) -> bool:
    "Whether `device` computes `dtype` natively (GPUs do; a CPU only with the instructions `cpu_has_native` checks)."
    return torch.device(device).type != 'cpu' or cpu_has_native(dtype)

def _slow_half_message(dtype:torch.dtype) -> str:
    cap = torch.backends.cpu.get_cpu_capability()
    if dtype == torch.float16:
        alt = (f"Use `learn.to_bf16()` instead: bf16 is native on this CPU ({cap}), with FP32's range and no loss "
               "scaling." if cpu_has_native(torch.bfloat16) else
               f"`learn.to_bf16()` is not native on this CPU either ({cap}): FP32 is the fastest here.")
        return (f"fp16 training on the CPU is correct but slow: this CPU ({cap}) has no native fp16 math, so torch "
                "runs fp16 matmuls and convolutions on reference kernels. How much slower depends on the model: on an "
                "AMD EPYC with AVX512-BF16 and no fp16 math (torch 2.14, one thread), a training step measured 1.9x "
                "(a small tabular MLP), 8x (a compute-bound MLP), 23x (an LSTM) and over 40x (a resnet18) slower than "
                "FP32; compute-bound layers (matmuls, convolutions, recurrent layers) suffer most. " + alt)
    return (f"bf16 training on the CPU is correct but slower than FP32: this CPU ({cap}) has no native bf16 math "
            "(AVX512, AVX512-BF16 or AMX), and a compute-bound model trains several times slower (4x for a "
            "compute-bound MLP on an AMD EPYC with AVX2 only). 16-bit training here saves activation memory, not time.")

def _pkg_dir(mod) -> str: return os.path.dirname(mod.__file__) + os.sep

def _library_dirs() -> tuple:
    "The folders of the libraries between a user's `learn.fit(...)` and our warning (fastai, fastcore, torch, fp16cb)."
    import fastai, fastcore
    return tuple(_pkg_dir(m) for m in (fastai, fastcore, torch)) + (os.path.dirname(os.path.abspath(__file__)) + os.sep,
                                                                      contextlib.__file__)

def user_stacklevel(skip:tuple|None=None) -> int:
    """`stacklevel` for a `warnings.warn` in the caller of this function that names the first frame outside the
    libraries (the user's `learn.fit(...)` line, not fastai's core.py); 1 if every frame is theirs."""
    skip = _library_dirs() if skip is None else skip
    f, level = sys._getframe(1), 1
    while f is not None and f.f_code.co_filename.startswith(skip): f, level = f.f_back, level + 1
    return level if f is not None else 1

_warned = set()
def warn_slow_half(dtype:torch.dtype, device):
    """Warn once per process and dtype when training in `dtype` on a device without native math for it (at the user's
    line)."""
    if has_fast_half_math(dtype, device) or (dtype, str(device)) in _warned: return
    _warned.add((dtype, str(device)))
    warnings.warn(_slow_half_message(dtype), RuntimeWarning, stacklevel=user_stacklevel())

# ---- devices
def resolve_device(
    s, # a device name: 'cpu', 'cuda', 'cuda:1', 'mps', ...
    types=('cpu', 'cuda', 'mps'), # the device types the caller supports
    expected:str='cpu, cuda, cuda:N or mps', # how to name them in the error
) -> torch.device:
    "`s` as a `torch.device` that exists on this machine; a `ValueError` that says what is wrong otherwise."
    try: d = torch.device(s)
    except (RuntimeError, ValueError, TypeError): raise ValueError(f"not a torch device: {s!r} (expected {expected})")
    if d.type not in types: raise ValueError(f"unsupported device type: {s!r} (expected {expected})")
    if d.type == 'cuda' and not torch.cuda.is_available():
        raise ValueError(f"{s!r}: CUDA is not available on this machine (try --device cpu)")
    if d.type == 'cuda' and d.index is not None and d.index >= torch.cuda.device_count():
        raise ValueError(f"{s!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if d.type == 'mps' and not (hasattr(torch.backends, 'mps') and torch.backends.mps.is_available()):
        raise ValueError(f"{s!r}: MPS is not available on this machine")
    return d

def model_device(model) -> torch.device:
    "The device of `model`'s first parameter (or buffer); CPU for a model without any."
    for t in model.parameters(): return t.device
    for t in model.buffers(): return t.device
    return torch.device('cpu')

_HOOK_DICTS = ('_forward_hooks', '_forward_hooks_with_kwargs', '_forward_hooks_always_called', '_forward_pre_hooks',
               '_forward_pre_hooks_with_kwargs', '_backward_hooks', '_backward_pre_hooks', '__deepcopy__',
               '_state_dict_hooks')
_HALF = (torch.float16, torch.bfloat16)
OUR_HOOKS = set()  # ids of the hooks fp16cb put on the user's modules (`ours`), which their deep copies leave behind

def ours(handle):
    "`handle` (a `RemovableHandle`) is of a hook of ours: a deep copy of its module does not take it."
    OUR_HOOKS.add(handle.id)
    return handle

def deepcopy_module(self:nn.Module, memo:dict) -> nn.Module:
    """`copy.deepcopy` of a module, as Python's default makes it, without the hooks of ours (`OUR_HOOKS`): a copy
    taken mid-fit (an EMA, keep-the-best) is the plain FP32 model FP32 fastai would give, with the user's own hooks."""
    saved = {}
    for k in _HOOK_DICTS[:-2]:
        d = self.__dict__.get(k)
        if d and any(i in OUR_HOOKS for i in d):
            saved[k] = d
            self.__dict__[k] = type(d)((i, f) for i, f in d.items() if i not in OUR_HOOKS)
    try: return copy._reconstruct(self, memo, *self.__reduce_ex__(4))
    finally: self.__dict__.update(saved)

def bare_copy(
    model:nn.Module, # the model to copy (a 16-bit one mid-fit: its copy is widened to FP32)
    fp32_of:dict|None=None, # `{param: exact FP32 value}` (the FP32 masters) for the copy's params
) -> nn.Module:
    """A deep copy of `model` without its hooks (ours cast to 16-bit) and without grads, its fp16/bf16 params and
    buffers in FP32 (float64 and complex as they are): the FP32 model of that moment."""
    # and `__deepcopy__`
    saved = [(m, {k: m.__dict__[k] for k in _HOOK_DICTS if k in m.__dict__}) for m in model.modules()]
    # the exact FP32 values in place of what the model holds (mid-forward: the copies it computes with, which are not
    # leaves and do not deep-copy)
    memo = {id(p): (nn.Parameter(v.detach().float().clone(), requires_grad=p.requires_grad or v.requires_grad)
                    if isinstance(p, nn.Parameter) or isinstance(v, nn.Parameter) else v.detach().clone())
            for p, v in (fp32_of or {}).items()}
    try:
        for m, hooks in saved:
            for k, v in hooks.items():
                if k == '__deepcopy__': del m.__dict__[k]  # a fit's FP32 copy (`MixedPrecision`): this is it
                else: m.__dict__[k] = type(v)()
        res = copy.deepcopy(model, memo)
    finally:
        for m, hooks in saved: m.__dict__.update(hooks)
    res._apply(lambda t: t.float() if t.dtype in _HALF else t)  # RNNs re-flatten their weights
    with torch.no_grad():
        for p, v in (fp32_of or {}).items():
            c = memo.get(id(p))
            if c is not None and c.shape == v.shape: c.data = v.detach().float().clone()
    return res

# ---- the machine, as timings are labelled with it (the benchmark's results, the notebooks' stored outputs)
_FLAGS = ('avx2', 'avx512f', 'avx512_vnni', 'avx512_bf16', 'avx512_fp16', 'amx_tile', 'amx_bf16', 'amx_fp16')

def _cpuinfo() -> dict:
    try:
        with open('/proc/cpuinfo') as f: lines = [l.split(':', 1) for l in f if ':' in l]
    except OSError: return {}  # not Linux: no flags to show
    return {k.strip(): v.strip() for k, v in lines}

def _cpu_flag_set() -> set:
    "This CPU's flags (x86) or features (Arm), as /proc/cpuinfo lists them; empty where it is not to be read."
    info = _cpuinfo()
    return set(info.get('flags', info.get('Features', '')).split())

def cpu_flags() -> str:
    "The CPU flags that decide 16-bit speed, as `lscpu` lists them: 'flags avx2 avx512f ...; no avx512_fp16, ...'."
    have = _cpu_flag_set()
    if not have: return 'flags unknown'
    return f"flags {' '.join(f for f in _FLAGS if f in have)}; " + ', '.join(f"no {f}" for f in _FLAGS if f not in have)

def machine_line() -> str:
    "'This machine: <CPU>, <n> cores (<flags>), torch <v>, <n> thread(s); executed <date> UTC': whose timings follow."
    import datetime, platform
    name = _cpuinfo().get('model name') or platform.processor() or platform.machine()
    now = datetime.datetime.now(datetime.timezone.utc)
    return (f"This machine: {name}, {os.cpu_count()} cores ({cpu_flags()}), torch {torch.__version__.split('+')[0]}, "
            f"{torch.get_num_threads()} thread(s); executed {now:%Y-%m-%d %H:%M} UTC")
