"""8-bit optimizer state (`state_dtype='8bit'`), the other storage `StateStorage` knows: each moving average of at least
`MIN_NUMEL` elements stored between steps as 8-bit codes with one FP32 scale per block of `BLOCK` consecutive elements
(block-wise dynamic quantization: Dettmers et al. 2021, "8-bit Optimizers via Block-wise Quantization"), quantized by
torchao's code (`torchao.optim.quant_utils`: its dynamic maps, `quantize_8bit_with_qmap`, `dequant_with_qmap`), the
second moments (`compat.NONNEGATIVE`) on its unsigned map and the others on its signed map, as torchao's `AdamW8bit`
does. Adam's two moments then cost 2 bytes/param (and 4 bytes per 256 of scales), not 8.

Where the codes live: in the optimizer's state dict, under the moment's own key, a `State8`: a uint8 tensor of the
param's shape and layout (the codes), its block scales beside it (`.scale`). Blocks run over the param's memory order,
so a slice of it that starts at a block boundary (a sliced step's: slices are multiples of `BLOCK`) has whole blocks.

One departure from torchao, for exact round trips: a block's scale carries the sign of its largest-magnitude element
(torchao's is its absolute value; for a second moment, never negative, the two are the same). That element is then
coded as the map's +1.0 exactly, whatever its sign (the signed map holds +1.0, not -1.0), so quantizing the dequantized
state gives back the same codes and scales: a checkpoint holds the FP32 state, and a run resumed from it goes on bit for
bit. And one guard, on the unsigned map: a positive second moment is never coded as 0 (torchao rounds a value under
half the map's smallest positive one, 3.25e-7 of its block's largest, to 0), but as that smallest value. A second
moment read as 0 under a first moment that is not divides the update by `eps` alone: the "zero-point problem" of Li et
al. 2023 ("Memory Efficient Optimizers with 4-bit States"); torchao's `AdamW8bit` itself (eps 1e-8) sends the weights
of a small MLP to 50 times their FP32 norm in 8 steps that way.

And one more, for Adam's second moment: in a step the codes are chosen stochastically (`stochastic_rounding`, the
store's generator), each value coded to one of the two map values around it with the probability that makes the code
unbiased. To nearest (torchao's), a moment whose increments are finer than the map's spacing stalls: on a small GPT-2
the second moments read 0.89-0.98 of exact Adam's by step 200, its steps up to 13% too large, and two seeds of six
ended 7.7% and 14.6% above FP32's loss. At a fit's set-up (a checkpoint's FP32 state) the codes are the nearest ones:
the same codes, so a resumed run goes on bit for bit.

The quantizer and the dequantizer are `torch.compile`d at their first use, as torchao's optimizers compile their step
(one fused pass instead of torchao's 8 gathers over int64 codes: on a CPU the quantizer 8x faster, an MLP's step 4x);
eager where compiling fails, with a warning. A step codes a chunk's moving averages together (`quantize_many`,
`dequantize_many`): one call per map over all their blocks, not one or two per tensor; the stochastic code search is
three table lookups and one compare (`_lut`), not a binary search over the map; and the stochastic draws are made
inside the compiled quantizer (`_uniform`), from one draw of the generator a step."""
from __future__ import annotations
import logging, warnings
from contextlib import contextmanager
import torch
from torch import Tensor

from ..compat import NONNEGATIVE
from ..weights.layout import memory_order, dense_strides, span_of

__all__ = ['State8', 'BLOCK', 'MIN_NUMEL', 'COMPILE', 'quantize_', 'dequantize_into', 'quantize_many',
           'dequantize_many', 'empty8', 'flat8', 'part8', 'copy8_', 'signed_for', 'aligned']

BLOCK = 256  # elements per scale (torchao's block size)
MIN_NUMEL = 4096  # a smaller state tensor stays FP32 (as bitsandbytes and torchao do: its scales would cost more)
COMPILE = True  # `torch.compile` torchao's quantizer at its first use (False: eager; a step about 4x slower on a CPU)
_LIB = {}  # torchao's `quant_utils`, its maps per (signed, device), the two functions as run (compiled or not)

class _Hush(logging.Filter):
    "Drops records under ERROR while `depth` > 0 (`_quiet`), and nothing otherwise."
    depth = 0
    def filter(self, record): return self.depth == 0 or record.levelno >= logging.ERROR

_HUSH = _Hush()

@contextmanager
def _quiet():
    """Within: torch's warnings of no concern here unlogged: torchao's import registers an Enum that torch says needs no
    registering, and compiling on a machine without CUDA says it found no CUDA runtime. A filter on those two loggers,
    added once, not their levels: `Logger.setLevel` clears every logger's cache (a quarter of a millisecond a call, on
    every quantizer call of a step)."""
    if _HUSH.depth == 0:
        for n in ('torch.utils._pytree', 'torch.utils.cpp_extension'):
            g = logging.getLogger(n)
            if _HUSH not in g.filters: g.addFilter(_HUSH)
    _HUSH.depth += 1
    try: yield
    finally: _HUSH.depth -= 1

def _qu():
    "torchao's `quant_utils`, imported at the first use of 8-bit state (torchao's import takes seconds)."
    if 'qu' not in _LIB:
        with _quiet(): from torchao.optim import quant_utils
        _LIB['qu'] = quant_utils
    return _LIB['qu']

def _qmap(signed:bool, device) -> Tensor:
    "torchao's dynamic map (256 FP32 values, sorted), signed or unsigned, on `device` (made once)."
    key = (signed, torch.device(device))
    if key not in _LIB:
        _LIB[key] = torch.tensor(_qu().create_dynamic_map(signed=signed), dtype=torch.float32, device=device)
    return _LIB[key]

def _scales(x:Tensor) -> Tensor:
    "Each row's scale: its largest-magnitude element, with that element's sign, at least 1e-12 in magnitude."
    hi, lo = x.amax(-1), x.amin(-1)
    return torch.where(hi >= -lo, hi.clamp(min=1e-12), lo.clamp(max=-1e-12))

def _quantize_rows(x:Tensor, qmap:Tensor) -> tuple:
    """`(codes, scales)` of `x` (FP32, one block a row): each row divided by its scale (its largest-magnitude element,
    with that element's sign, at least 1e-12 in magnitude as torchao's), then coded to the nearest value of `qmap`;
    on the unsigned map (`qmap[0] == 0`) a positive value is never coded 0, but at least as its least positive one."""
    s = _scales(x)
    codes = _qu().quantize_8bit_with_qmap(x / s.view(-1, 1), qmap)
    return torch.where((codes == 0) & (x > 0) & (qmap[0] == 0), 1, codes), s

def _key16(y:Tensor) -> Tensor:
    "The top 16 bits of FP32 `y`, made to order as the values do (the sign flips a negative's other bits), from 0."
    b = y.view(torch.int32)
    return ((b ^ ((b >> 31) & 0x7FFFFFFF)) >> 16) + 32768

def _lut(signed:bool, device) -> tuple:
    """`(starts, pairs)`, the code search's two tables (int64, each entry two FP32 values' bits or an index and one):
    `starts`, by the top 16 bits of a value (`_key16`, 512 KiB a map), the index of the first map value not under the
    smallest float with those bits and that value, the one compare left (`_upper`); `pairs`, by an index `i` of the map,
    its values `i - 1` and `i`, the two a value between them may be coded to. Three gathers a value in place of a binary
    search over 256 (`torch.bucketize`: about 30 ns a value on a CPU, most of a step)."""
    key = ('lut', signed, torch.device(device))
    if key not in _LIB:
        qmap = _qmap(signed, device)
        k = ((torch.arange(65536, dtype=torch.int64, device=device) - 32768) << 16).to(torch.int32)
        edge = (k ^ ((k >> 31) & 0x7FFFFFFF)).view(torch.float32).nan_to_num(nan=float('inf'))
        # (a value the quantizer sees is in [-1, 1]: its start is at most the index of the map's 1.0, 255)
        start = torch.bucketize(edge, qmap).clamp_(max=255)
        assert int(torch.bincount(_key16(qmap.contiguous()), minlength=65536).max()) == 1  # one compare is enough
        bits = qmap.view(torch.int32).long()
        _LIB[key] = (start | (bits[start] << 32),
                     (torch.cat([bits[:1], bits[:-1]]) & 0xFFFFFFFF) | (bits << 32))
    return _LIB[key]

def _upper(y:Tensor, starts:Tensor) -> Tensor:
    "The index of the first map value not under each of `y` (`torch.bucketize(y, qmap)`), from `_lut`'s `starts`."
    e = starts[_key16(y)]
    return (e & 0xFF).int() + ((e >> 32).int().view(torch.float32) < y).int()

def hash32(idx:Tensor, key:Tensor) -> Tensor:
    """A bijective integer hash (Wellons' `lowbias32`) of each of `idx` (int32) XOR `key` (int32, drawn uniform over
    all 2^32 values): each element's 32 bits then exactly uniform (a bijection of a uniform key), and independent from
    one key to the next. Random draws computed where they are used, inside a compiled graph, with no tensor of draws
    (8-bit state's stochastic choice, bf16 state's dither in `fused16`)."""
    h = idx ^ key
    h = (h ^ ((h >> 16) & 0xFFFF)) * 0x7FEB352D  # (int32 products wrap: the hash's arithmetic modulo 2^32)
    h = (h ^ ((h >> 15) & 0x1FFFF)) * -0x7B935975
    return h ^ ((h >> 16) & 0xFFFF)

def _uniform(shape, key:Tensor) -> Tensor:
    "Uniform draws in [0, 1) (24 bits each), one per element of `shape`: `hash32` of each element's index."
    h = hash32(torch.arange(shape[0] * shape[1], dtype=torch.int32, device=key.device).view(shape), key)
    return ((h >> 8) & 0xFFFFFF).float() * 2.0 ** -24

def _quantize_rows_stochastic(x:Tensor, qmap:Tensor, key:Tensor, starts:Tensor, pairs:Tensor) -> tuple:
    """`_quantize_rows`, each value coded to one of the two `qmap` values around it, the upper with probability its
    distance from the lower over their spacing (`_uniform(x.shape, key)`): unbiased, so that a moving average whose
    increments are finer than the map's spacing still moves on average (to nearest, it would stall)."""
    s = _scales(x)
    y = x / s.view(-1, 1)
    up = _upper(y, starts).clamp(1, qmap.numel() - 1)
    ab = pairs[up]
    a, b = (ab & 0xFFFFFFFF).int().view(torch.float32), (ab >> 32).int().view(torch.float32)
    codes = torch.where(_uniform(x.shape, key) < ((y - a) / (b - a)).clamp(0, 1), up, up - 1)
    # (the guard on int32 codes, before the one conversion to uint8: in uint8, three times the kernel's time)
    return torch.where((codes == 0) & (x > 0) & (qmap[0] == 0), 1, codes).to(torch.uint8), s

def _seed(generator, device) -> Tensor:
    "One draw of `generator`: an int32 key uniform over all 2^32 values, on `device` (no host sync on a GPU)."
    return torch.randint(-2**31, 2**31, (1,), generator=generator, device=device).int()

def _dequantize_rows(codes:Tensor, qmap:Tensor, scale:Tensor) -> Tensor:
    "FP32 values of `codes` (uint8, one block a row) with their rows' `scale`: torchao's `dequant_with_qmap`."
    return _qu().dequant_with_qmap(codes, qmap, scale)

def _fn(name:str, eager):
    "`eager`, `torch.compile`d (dynamic shapes) while `COMPILE` is on (at the first call; eager if compiling fails)."
    def run(*args):
        global COMPILE
        if not COMPILE: return eager(*args)
        f = _LIB.get(name)
        if f is None:  # (every index in range by construction: no bounds check per gather, 7% of the quantizer)
            f = _LIB[name] = torch.compile(eager, dynamic=True, options={'assert_indirect_indexing': False})
        if f is eager: return eager(*args)
        try:
            with _quiet(): return f(*args)
        except Exception as e:  # no C++ compiler, no triton: torchao's code eagerly (the same values, slower)
            COMPILE = False
            warnings.warn(f"8-bit optimizer state: torch.compile of torchao's quantizer failed ({type(e).__name__}: "
                          f"{str(e)[:200]}); quantizing eagerly (slower). `fp16cb.storage.state8.COMPILE = False` "
                          "skips the attempt.")
            return eager(*args)
    return run

_quantize, _dequantize = _fn('quantize', _quantize_rows), _fn('dequantize', _dequantize_rows)
_quantize_stochastic = _fn('quantize_stochastic', _quantize_rows_stochastic)

def _piece(device) -> int:
    """Elements quantized in one call: bounded, so that the eager quantizer's temporaries (int64 codes: about 25 bytes
    per element) stay small; the compiled one makes none, and long calls cost fewer launches."""
    return 2**16 if torch.device(device).type == 'cpu' and not COMPILE else 2**22

class State8(Tensor):
    """One moving average in 8 bits: this tensor holds the codes (uint8, its param's shape and layout), `scale` one FP32
    scale per `BLOCK` elements in memory order, `signed` which of torchao's maps codes it. Torch's functions see the
    codes (a plain uint8 tensor comes out of any of them); `dequantize()` gives the FP32 values."""
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def make(codes:Tensor, scale:Tensor, signed:bool) -> State8:
        "The `State8` over `codes` (its storage shared: writing one writes the other) with `scale`."
        t = Tensor._make_subclass(State8, codes)
        t.scale, t.signed = scale, signed
        return t

    def dequantize(self) -> Tensor:
        "The FP32 values, in a tensor of their own laid out as the codes."
        out = torch.empty_strided(self.shape, dense_strides(self), dtype=torch.float32, device=self.device)
        return dequantize_into(out, self)

    def __deepcopy__(self, memo):
        codes = torch.empty_strided(self.shape, dense_strides(self), dtype=torch.uint8, device=self.device)
        return State8.make(codes.copy_(self), self.scale.clone(), self.signed)

    def __reduce_ex__(self, proto):
        codes = memory_order(self).clone().as_strided(self.shape, dense_strides(self))
        return State8.make, (codes, self.scale, self.signed)

    def __repr__(self, **kw):
        return (f"State8(shape={tuple(self.shape)}, blocks={self.scale.numel()} of {BLOCK}, "
                f"{'signed' if self.signed else 'unsigned'}, device={self.device})")

def signed_for(key:str) -> bool:
    "Whether the moving average named `key` takes torchao's signed map (all but the second moments, `NONNEGATIVE`)."
    return key not in NONNEGATIVE

def aligned(n:int) -> int:
    "A slice size of `n` elements or fewer, in whole blocks (at least one)."
    return max(BLOCK, n - n % BLOCK)

def empty8(like:Tensor, signed:bool, zero:bool=False) -> State8:
    "An 8-bit state tensor of `like`'s shape and layout (`zero`: every element the map's code of 0, every scale 1)."
    codes = torch.empty_strided(like.shape, dense_strides(like), dtype=torch.uint8, device=like.device)
    scale = torch.empty(-(-like.numel() // BLOCK), dtype=torch.float32, device=like.device)
    if zero:
        codes.fill_(int(torch.searchsorted(_qmap(signed, like.device), 0.)))
        scale.fill_(1.)
    return State8.make(codes, scale, signed)

def flat8(v:State8) -> State8:
    "`v` as a 1-d `State8` in memory order (the same codes and scales)."
    return State8.make(memory_order(v), v.scale, v.signed)

def part8(v:State8, s:slice) -> State8:
    "Elements `s` of the 1-d `v` (`s.start` at a block boundary) with their blocks' scales: views of `v`'s."
    assert s.start % BLOCK == 0, f"8-bit state sliced at {s.start}, inside a block of {BLOCK}"
    return State8.make(v[s], v.scale[s.start // BLOCK:-(-s.stop // BLOCK)], v.signed)

def copy8_(dst:State8, src:State8) -> State8:
    "`src`'s codes and scales into `dst` (the same shape, a whole number of blocks or the same tail)."
    Tensor.copy_(dst, src)
    dst.scale.copy_(src.scale)
    return dst

def quantize_(dst:State8, src:Tensor) -> State8:
    "FP32 `src` (dense, `dst`'s layout) quantized to nearest into `dst`'s codes and scales (`quantize_many` of one)."
    return quantize_many([dst], [src])[0]

def dequantize_into(dst:Tensor, src:State8) -> Tensor:
    "`src`'s FP32 values written into `dst` (dense FP32, `src`'s layout), block by block in memory order."
    c, x, scale = memory_order(src), memory_order(dst), src.scale
    qmap, n, step = _qmap(src.signed, src.device), src.numel(), _piece(src.device)
    full = n - n % BLOCK
    for o in range(0, full, step):
        e = min(o + step, full)
        x[o:e].copy_(_dequantize(c[o:e].view(-1, BLOCK), qmap, scale[o // BLOCK:e // BLOCK]).view(-1))
    if full < n:
        pad = c.new_zeros(1, BLOCK)
        pad[0, :n - full] = c[full:]
        x[full:].copy_(_dequantize(pad, qmap, scale[-1:]).view(-1)[:n - full])
    return dst

# ---- many tensors at once: one call over all their blocks (a chunk of a step's state), not one or two per tensor
def _rows_each(ts:list) -> list: return [-(-t.numel() // BLOCK) for t in ts]

def _rows(ts:list) -> tuple:
    "`(offsets in elements, total rows)`: each of `ts` from a block boundary, in order, its last block padded."
    offs, r = [], 0
    for k in _rows_each(ts): offs.append(r * BLOCK); r += k
    return offs, r

def _pieces(rows:int, device) -> list:
    "Row ranges of at most `_piece(device)` elements each, covering `rows` rows."
    step = max(1, _piece(device) // BLOCK)
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]

def _gather(ts:list, dtype, zero_pads:bool=False) -> tuple:
    """`(rows of blocks, offsets)`: `ts` copied one after the other into a buffer of whole blocks (one fused copy), each
    from a block boundary; `zero_pads`: the rest of each one's last block zero (it changes no scale)."""
    offs, rows = _rows(ts)
    buf = torch.empty(rows * BLOCK, dtype=dtype, device=ts[0].device)
    if zero_pads:
        pads = [buf[o + t.numel():o + -(-t.numel() // BLOCK) * BLOCK] for o, t in zip(offs, ts) if t.numel() % BLOCK]
        if pads: torch._foreach_zero_(pads)
    torch._foreach_copy_([buf[o:o + t.numel()] for o, t in zip(offs, ts)], [memory_order(t) for t in ts])
    return buf.view(rows, BLOCK), offs

def _scatter(dsts:list, rows:Tensor, offs:list):
    "Each of `dsts` (dense) given its elements of `rows` back (`_gather`'s offsets), in one fused copy."
    flat = rows.view(-1)
    torch._foreach_copy_([memory_order(t) for t in dsts], [flat[o:o + t.numel()] for o, t in zip(offs, dsts)])

def _aligned_span(ts:list):
    "`ts` as rows of blocks where they lie (`span_of`), when each is a whole number of blocks: no gather, no scatter."
    span = span_of(ts) if all(t.numel() % BLOCK == 0 for t in ts) else None
    return None if span is None else span.view(-1, BLOCK)

def dequantize_many(dsts:list, srcs:list) -> list:
    """`dequantize_into` of each pair of `dsts` (dense FP32) and `srcs` (`State8`s of one device): the codes of all of
    them gathered into rows of blocks, dequantized by one call per map and piece, scattered back."""
    for signed in (True, False):
        idx = [i for i, t in enumerate(srcs) if t.signed == signed]
        if not idx: continue
        ss = [srcs[i] for i in idx]
        codes, offs = _gather(ss, torch.uint8)
        scale, qmap = torch.cat([t.scale for t in ss]), _qmap(signed, codes.device)
        mine = [dsts[i] for i in idx]
        out = _aligned_span(mine)  # (the widened state of whole blocks, one tensor after the other: written in place)
        into = out is None
        if into: out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
        for a, b in _pieces(len(codes), codes.device): out[a:b] = _dequantize(codes[a:b], qmap, scale[a:b])
        if into: _scatter(mine, out, offs)
    return dsts

def quantize_many(dsts:list, srcs:list, generator=None) -> list:
    """`quantize_` of each pair of `dsts` (`State8`s of one device) and `srcs` (dense FP32): the values gathered into
    rows of blocks (the last block of each zero-padded), quantized by one call per map and piece, codes and scales
    scattered back. Stochastically: one draw of `generator` for the call, the key of every value's own draw
    (`_uniform`, inside the compiled quantizer), so the codes are the same whenever the generator is."""
    if not sum(_rows_each(srcs)): return dsts
    seed = None if generator is None else _seed(generator, srcs[0].device)
    for signed in (True, False):
        idx = [i for i, t in enumerate(dsts) if t.signed == signed]
        if not idx: continue
        vs = [srcs[i] for i in idx]
        rs = _aligned_span(vs)  # read where they lie; else gathered, each last block zero-padded
        rs, my_offs = (rs, _rows(vs)[0]) if rs is not None else _gather(vs, torch.float32, zero_pads=True)
        dev = rs.device
        codes = torch.empty(rs.shape, dtype=torch.uint8, device=dev)
        scale = torch.empty(len(rs), dtype=torch.float32, device=dev)
        qmap = _qmap(signed, dev)
        for a, b in _pieces(len(rs), dev):  # (each map and piece its own key: the seed XOR a constant of them)
            codes[a:b], scale[a:b] = (_quantize(rs[a:b], qmap) if seed is None else _quantize_stochastic(
                rs[a:b], qmap, seed ^ (a * 0x9E3779B1 + signed) % 2**31, *_lut(signed, dev)))
        ts = [dsts[i] for i in idx]
        _scatter(ts, codes, my_offs)
        torch._foreach_copy_([t.scale for t in ts], list(scale.split([t.scale.numel() for t in ts])))
    return dsts
