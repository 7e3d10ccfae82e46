"""The precision-health check of a fit (`MixedPrecision(health_every=...)`): what `learn.precision_check()` finds when
asked, said during a fit that nobody asked about. Every `every` steps, on that step's training batch, a share of the
modules that compute in 16 bits (rotating through the model: all of them every `SHARE` checks) is run again in FP32 on
the same inputs, from a hookless FP32 copy and the same random state. A module whose 16-bit output is over `DIVERGES`
off its FP32 output (a hand-written norm whose `x**2` overflows fp16 gives 0 where FP32 gives the norm) is said once,
with the `keep_fp32` that keeps it FP32. A module that diverges only because one of its modules does is not named:
that one is. No host sync: a check's figures are read at the next check (on a GPU from a non-blocking copy that has
landed by then), or at the epoch's end. Each check is kept in `checks`, the record `plot_precision_health` draws."""
from __future__ import annotations
import math, re, warnings
from collections import deque
import torch
from torch import nn

from ..dtypes import bare_copy, user_stacklevel, ours
from ..policy import named_modules, is_compiled, CATEGORIES
from .casts import cast_floats, _floats, _values, _rebuild

__all__ = ['PrecisionWatch', 'DIVERGES', 'SHARE']

DIVERGES = .2  # as `precision_check`: a module's output this far from FP32's (relative) is named
SHARE = 16  # a check runs 1/SHARE of the watched modules again in FP32
KEEP = 10_000  # the checks kept (the latest): a long fit's record stays bounded
FIRST = 20  # the first SHARE checks come this often: a module that fails from the start is named within ~340 steps
_SKIP = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.Identity, nn.Flatten, nn.modules.dropout._DropoutNd)

def _kept(b):
    "`b` with its tensors copied: what a later in-place op (a `ReLU(inplace=True)` after the module) cannot change."
    if torch.is_tensor(b): return b.detach().clone()
    vals = _values(b)
    return _rebuild(b, [_kept(v) for v in vals]) if vals else b

def _widened(b): return cast_floats(b, torch.float32, keep64=True)  # what the FP32 copy takes

def rel_diff(out16, out32) -> torch.Tensor:
    """`||out16 - out32|| / ||out32||` over the floating tensors of two outputs, on the device (no host read); inf where
    the 16-bit output holds inf/NaN and FP32's does not. Where FP32's own is not finite: 0 (not 16 bits' doing)."""
    a, b = _floats(out16), _floats(out32)
    if not a or len(a) != len(b): return None
    num = sum(((x.float() - y.float()) ** 2).sum() for x, y in zip(a, b))
    den = sum((y.float() ** 2).sum() for y in b)
    fp32_ok = torch.isfinite(den)
    rel = torch.where(torch.isfinite(num), (num / den.clamp_min(1e-30)).sqrt(), torch.full_like(num, math.inf))
    return torch.where(fp32_ok, rel, torch.zeros_like(rel))

class PrecisionWatch:
    "The check of one learner's model: which modules, which turn, the hooks of a check step, the figures so far."
    def __init__(self,
        model:nn.Module, # the 16-bit model of the fit
        kept:dict, # `id(module) -> reason` of the modules kept FP32 (`PrecisionPolicy.resolve(...).kept`)
        dtype:torch.dtype, # the 16-bit dtype
        every:int, # steps between checks
        sources=None, # `() -> {tensor the forward computes with: its FP32 source}` (the model keeps FP32 params)
    ):
        self.model, self.dtype, self.every, self.turn, self.sources = model, dtype, every, 0, sources
        # the modules that compute in 16 bits, less torch's containers and parameterless layers (their ops are exact
        # or computed in FP32 inside torch's kernels); a parameterless module of one's own is watched. Not a module
        # holding a dropout layer: on a GPU its FP32 copy draws another mask from the same random state (seen on an
        # H200), so it is watched through its modules
        mods = [(n, m) for n, m in named_modules(model) if n and id(m) not in kept and not isinstance(m, _SKIP)
                and not any(isinstance(d, nn.modules.dropout._DropoutNd) and d.p > 0 for d in m.modules())]
        own = lambda m: not type(m).__module__.startswith('torch.nn.')
        self.mods = [(n, m) for n, m in mods if own(m) or any(True for _ in m.parameters())]
        self.names = [n for n, _ in self.mods]
        self.checks = deque(maxlen=KEEP)  # `{'step', 'module', 'rel_diff'}` of each module checked
        # `half_storage`: `{'step', 'lost', 'updates'}` at each check step, the share of its weight updates that rounded
        # back onto the 16-bit weight they started from (`note_lost`)
        self.lost, self._pending_lost = deque(maxlen=KEEP), []
        self.said, self.flagged, self._pending, self._hooks, self._seen = set(), {}, [], [], {}
        self.unchecked = {}  # name -> why: modules that could not be copied or run alone, left out of the check
        self.active = bool(self.mods) and not any(is_compiled(m) for m in model.modules())

    def due(self, step:int) -> bool:
        "Whether `step` is checked: every `every`th, and in a first round every `FIRST`th (the whole model early on)."
        first = min(FIRST, self.every)
        return self.active and step > 0 and (step % self.every == 0 or (step % first == 0 and step <= first * SHARE))
    armed = property(lambda self: bool(self._hooks), doc="Whether this step's forward is being watched.")

    def arm(self, step:int):
        "A check step: the hooks that keep the inputs and outputs of this turn's modules (and their random state)."
        if not self.mods: return
        k = max(1, math.ceil(len(self.mods) / SHARE))
        start = (self.turn * k) % len(self.mods)
        chosen = (self.mods + self.mods)[start:start + min(k, len(self.mods))]
        self.turn += 1
        self._step, self._seen = step, {}
        for n, m in chosen:
            self._hooks.append(ours(m.register_forward_pre_hook(self._before(n), with_kwargs=True)))
            self._hooks.append(ours(m.register_forward_hook(self._after(n), with_kwargs=True)))

    def _before(self, name):
        def hook(m, args, kwargs):
            seen = self._seen.setdefault(name, {})
            if 'rng' in seen or name in self.unchecked: return  # its first call only
            dev = next((t.device for t in _floats(args) + _floats(kwargs)), torch.device('cpu'))
            cuda = torch.cuda.get_rng_state(dev) if dev.type == 'cuda' else None
            seen['rng'] = (torch.get_rng_state(), dev, cuda)
            seen['args'], seen['kwargs'] = _kept(args), _kept(kwargs)  # as they were before the forward
            # the FP32 copy as the module is before its forward: a module that keeps state (an RNN's hidden state)
            # starts from the same one
            try: seen['shadow'] = bare_copy(m, self.sources() if self.sources is not None else None)
            except Exception as e: self._leave_out(name, e)  # a non-leaf tensor held as an attribute, say
        return hook

    def _leave_out(self, name:str, e:Exception):
        "A module that cannot be copied or run alone: out of the check, with why (`unchecked`)."
        self.unchecked[name] = f"{type(e).__name__}: {e}"[:200]
        self.mods = [(n, m) for n, m in self.mods if n != name]
        if name in self.names: self.names.remove(name)

    def _after(self, name):
        def hook(m, args, kwargs, out):
            seen = self._seen.setdefault(name, {})
            if 'out' not in seen and 'rng' in seen: seen['out'] = _kept(out)  # its first call only
        return hook

    def compare(self):
        "After the check step's forward: each module run again in FP32 on its inputs; the figures stay on the device."
        self.disarm()
        names, rels = [], []
        with torch.no_grad():
            for name, seen in self._seen.items():
                if 'out' not in seen or 'shadow' not in seen: continue
                try: rel = self._fp32_diff(seen)
                except Exception as e: self._leave_out(name, e); continue  # it cannot run alone (state outside it)
                if rel is not None: names.append(name); rels.append(rel)
        self._seen = {}
        if rels: self._pending.append((self._step, names, _landing(torch.stack(rels))))

    def _fp32_diff(self, seen):
        cpu, dev, cuda, shadow = *seen['rng'], seen['shadow']
        now = (torch.get_rng_state(), torch.cuda.get_rng_state(dev) if cuda is not None else None)
        try:
            torch.set_rng_state(cpu)  # the random draws of the 16-bit forward (random ops inside the module)
            if cuda is not None: torch.cuda.set_rng_state(cuda, dev)
            out32 = shadow(*_widened(seen['args']), **_widened(seen['kwargs']))
        finally:
            torch.set_rng_state(now[0])
            if cuda is not None: torch.cuda.set_rng_state(now[1], dev)
        return rel_diff(seen['out'], out32)

    def disarm(self):
        for h in self._hooks: h.remove()
        self._hooks = []

    def note_lost(self, step:int, counts:torch.Tensor):
        "`counts` (`[updates lost, updates]`, on the device) of the check step `step`'s landings, read later (`read`)."
        self._pending_lost.append((step, _landing(counts)))

    def _read_lost(self, final:bool):
        keep = []
        for step, (host, ready) in self._pending_lost:
            if not (final or ready()): keep.append((step, (host, ready))); continue
            lost, n = host.tolist()
            self.lost.append(dict(step=step, lost=lost / n if n else 0., updates=n))
        self._pending_lost = keep

    def read(self, final:bool=False) -> list:
        "The figures that have landed (all of them when `final`): recorded, and what diverges said; the new warnings."
        self._read_lost(final)
        keep, said = [], []
        for step, names, (host, ready) in self._pending:
            if not (final or ready()): keep.append((step, names, (host, ready))); continue
            for n, r in zip(names, host.tolist()):
                self.checks.append(dict(step=step, module=n, rel_diff=r))
                if r > DIVERGES: self.flagged.setdefault(n, (step, r))
        self._pending = keep
        checked = {c['module'] for c in self.checks}
        for n, (step, r) in list(self.flagged.items()):
            if n in self.said: continue
            inner = [c for c in self.names if c.startswith(n + '.')]
            if any(c in self.flagged for c in inner): self.said.add(n); continue  # one of its modules is named
            if all(c in checked for c in inner): said.append(self._warn(n, step, r))
        return said

    def _warn(self, name:str, step:int, rel:float) -> str:
        self.said.add(name)
        m = dict(named_modules(self.model)).get(name)
        off = "holds inf/NaN where FP32's is finite" if math.isinf(rel) else f"is {rel:.0%} off its FP32 output"
        spec = name if name not in CATEGORIES else 're:' + re.escape(name)  # 'norm' alone is the category
        kind = type(m).__name__ if m is not None else 'a module'
        msg = (f"module {name!r} ({kind}) computes in {str(self.dtype)[6:]}, and its output {off} on the "
               f"same inputs (a training batch at step {step}): the fit loses precision there. `keep_fp32=[{spec!r}]` "
               f"keeps it FP32 (`learn.precision_check()` says more). Checked every {self.every} steps; "
               f"`health_every=0` turns the check off.")
        warnings.warn(msg, RuntimeWarning, stacklevel=user_stacklevel())
        return msg

def _landing(t:torch.Tensor) -> tuple:
    "`(host tensor, ready())`: a GPU's figures copied without waiting (read once the copy has landed)."
    if t.device.type != 'cuda': return t, lambda: True
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ev = torch.cuda.Event(); ev.record()
    return host, ev.query
