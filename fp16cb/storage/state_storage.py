"""16-bit optimizer state (`state_dtype=torch.bfloat16`), one more part of the lift: the optimizer's per-param state is
stored in bfloat16 between steps, brought to FP32 with its param inside the step (`widen`: one fused copy into a
scratch buffer), updated there by the optimizer's own code, and written back rounded stochastically, or to nearest
(`narrow`: one rounding of the whole scratch, one fused copy back). Adam's two moments then cost 4 bytes/param, not 8.

What is stored in 16-bit: the state known to be a moving average, as `fp16cb.compat.MOVING_AVERAGES` names it (fastai's
`grad_avg`, `sqr_avg`; torch's `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`, `momentum_buffer`; timm's), an FP32 tensor
with at least one dim and as many elements as its param: a moment forgets a rounding error as it forgets a grad. Any
other state stays FP32, whatever its shape: a weight copy (timm MADGRAD's `x0` anchor, timm Lookahead's slow weights),
a running sum, a previous grad, a name not declared there; so do step counts, flags and scalars, and the state of a
0-dim param (its moments cannot be told from a 0-dim step count), unless flat masters merged it into its group's flat
master, whose moments are 16-bit. Between fits, in a checkpoint and in the store's FP32 view the state is FP32
(`widen_all`).

`dtype='8bit'`: the same moving averages, those of at least `state8.MIN_NUMEL` elements, stored as 8-bit codes with
block scales (`state8.State8`), dequantized into the scratch by `widen` and quantized back by `narrow`: stochastically
in a step (each value to one of the two codes around it, unbiased), to nearest at a fit's set-up (`narrow_all`)."""
from __future__ import annotations
import operator, weakref
from contextlib import contextmanager, nullcontext
from functools import partial
import torch
from torch import Tensor

from ..compat import MOVING_AVERAGES
from ..distributed import local_shard, as_state_of, is_dtensor
from ..dtypes import EIGHT_BIT
from ..weights.layout import flat_views, with_layout_of, own_storages, spans
from ..weights.optstate import PlainState, opt_state, steps_param_by_param
from ..weights.loop import STORED, chunks
from ..weights.params import AROUND
from . import state8, fused16
from .state8 import State8
from .stored import TorchHooks, as_stored
from .lazy import Stream, lazy_state

__all__ = ['StateStorage', 'round_bf16_stochastic_', 'random16', 'noise16']

_NULL = nullcontext()

def _dither_(x:Tensor, generator=None) -> Tensor:
    """`x` (FP32) in place made a bfloat16 value, chosen stochastically: a random 16-bit integer is added to the 16 bits
    that bfloat16 drops, which are then cleared, so `x` rounds away from zero with probability (its distance from the
    neighbour toward zero) / (the spacing): E[result] = x. inf and NaN stay what they are."""
    bits = x.view(torch.int32)  # sign and magnitude: adding to the low bits moves |x| up, clearing them moves it down
    if x.device.type == 'cpu' and x.is_contiguous(): _add_table_noise_(bits.view(-1), generator)
    else: bits.add_(random16(x.numel(), generator, x.device).view(x.shape)).add_(1 << 15)  # + uniform [0, 2^16)
    bits.bitwise_and_(-65536)  # (a copy reading only the high halves instead is a strided copy: slower on a CPU)
    return x

# On a CPU, torch's generator costs more than the rest of the dither (3 ms of a 17 ms step on 4M moments): the noise
# is read instead from a fixed random permutation of the 2^16 values [0, 2^16), each 65536-element piece of `x` at an
# offset drawn from the rounding's generator. The offset is uniform, so each element's noise is exactly uniform over
# [0, 2^16), and its rounding unbiased; within a piece the values are distinct (their errors cancel rather than add),
# and a step's offsets are independent of another's. One draw per piece: the same stream on resume and on every rank.
PIECE = 1 << 16
_TABLES = {}  # device -> the permutation twice over (int32, 512 KiB), the same in every process

def _noise_table(device) -> Tensor:
    device = torch.device(device)
    t = _TABLES.get(device)
    if t is None:
        perm = torch.randperm(PIECE, generator=torch.Generator().manual_seed(0x5EED), dtype=torch.int32)
        t = _TABLES[device] = perm.repeat(2).to(device)
    return t

def _add_table_noise_(bits:Tensor, generator=None, op=Tensor.add_):
    """The 1-d int32 `bits` plus noise uniform over [0, 2^16), from `_noise_table` at offsets drawn from `generator`
    (`op=Tensor.copy_`: the noise itself)."""
    n, table = bits.numel(), _noise_table(bits.device)
    offs = torch.randint(0, PIECE, (-(-n // PIECE),), generator=generator).tolist()  # (a CPU's: no device sync)
    for i, off in enumerate(offs):
        piece = bits[i * PIECE:(i + 1) * PIECE]
        op(piece, table[off:off + piece.numel()])
    return bits

def noise16(like:Tensor, generator=None) -> Tensor:
    """Random integers uniform over [0, 2^16), int32, one per element of `like`: from `_noise_table` on a CPU, else
    torch's generator (`random16`)."""
    if like.device.type == 'cpu':
        out = torch.empty(like.shape, dtype=torch.int32)
        return _add_table_noise_(out.view(-1), generator, Tensor.copy_).view(like.shape)
    return random16(like.numel(), generator, like.device).view(like.shape).to(torch.int32).bitwise_and_(0xFFFF)

def random16(n:int, generator=None, device=None) -> Tensor:
    """`n` uniform random 16-bit integers (int16, every bit random), drawn four to one 64-bit number over int64's whole
    range: a quarter of the generator's work of a draw each (on a CPU, torch's generator is the dither's main cost)."""
    k = (n + 3) // 4
    return (torch.empty(k, dtype=torch.int64, device=device).random_(-2**63, 2**63 - 1, generator=generator)
            .view(torch.int16)[:n])

def round_bf16_stochastic_(x:Tensor, generator=None) -> Tensor:
    "`x` (FP32, overwritten) rounded to bfloat16 stochastically (unbiased: E[round(x)] = x); inf and NaN kept."
    return _dither_(x, generator).to(torch.bfloat16)  # exact: the dropped bits are 0

def _is(k, v, p, dtype) -> bool:
    """Whether the state entry `k: v` of param `p` is one `StateStorage` stores: a moving average
    (`MOVING_AVERAGES`), in `dtype` ('8bit': a `State8`, of this rank's shard when `p` is sharded), with at least one
    dim and `p`'s element count."""
    kind = isinstance(v, State8) if dtype == EIGHT_BIT else isinstance(v, Tensor) and v.dtype == dtype
    return (k in MOVING_AVERAGES and isinstance(v, Tensor) and kind and v.dim() > 0 and isinstance(p, Tensor)
            and v.numel() == (local_shard(p) if isinstance(v, State8) else p).numel())

def _key_major(entries:list) -> list:
    """`entries` (`(state dict, key, tensor)`, param by param) ordered key by key, the params in their order within a
    key: a run of consecutive params then finds each key's widened state consecutive too, and steps it as one flat
    tensor where it lies (`weights.drivers._Stretch`), no copy."""
    order = {}
    for _, k, _ in entries: order.setdefault(k, len(order))
    return sorted(entries, key=lambda e: order[e[1]])

# FSDP2's sharded params (DTensors): their state is stored as this rank's shard (bf16: a DTensor of it; 8-bit: the
# codes of the shard), widened and rounded on the local tensors, and given to the optimizer as DTensors again
class _Group:
    """A plan's entries on one device: `(state dict, key, stored tensor)` each, key-major; their local tensors (`lows`,
    this rank's shards), how many elements they hold, and the DTensor param each belongs to (None: no sharded one)."""
    def __init__(self, entries:list, owners:list):
        self.entries, self.lows = entries, [local_shard(v) for _, _, v in entries]
        self.device, self.numel = self.lows[0].device, sum(t.numel() for t in self.lows)
        self.owners = owners if any(o is not None for o in owners) else None
        self._runs = None  # (`spans` of `lows`, their offsets in a scratch), found at the first copy

    def runs(self) -> list:
        """`(first, end, span of the lows, their part of a scratch)` of each run of `lows` that lies one after the other
        in memory (as `_fresh` makes them: `spans`), found once."""
        if self._runs is None:
            offs = [0]
            for t in self.lows: offs.append(offs[-1] + t.numel())
            self._runs = [(i, j, span, slice(offs[i], offs[j])) for i, j, span in spans(self.lows)]
        return self._runs

    def copy(self, scratch:Tensor, views:list, back:bool=False):
        """The 16-bit `lows` into their FP32 `views` in `scratch` (`back`: the other way, rounded to nearest: exact
        from a dithered scratch), one copy a run (`runs`), a fused one for what lies elsewhere."""
        dsts, srcs = [], []
        for i, j, span, part in self.runs():
            if span is None: dsts += views[i:j]; srcs += self.lows[i:j]
            elif back: span.copy_(scratch[part])
            else: scratch[part].copy_(span)
        if dsts: torch._foreach_copy_(*((srcs, dsts) if back else (dsts, srcs)))

class _Widened:
    """What `widen` did for a `_Group`: the scratch its entries' FP32 views live in, and how many entries the params'
    state dicts held (a step that adds one is seen by `narrow`)."""
    def __init__(self, group:_Group, scratch, views, nkeys:int):
        self.group, self.entries, self.scratch, self.views, self.nkeys = group, group.entries, scratch, views, nkeys

class _Plan:
    """What one `widen` of some params found in their state dicts: the stored entries in groups by device, and whose
    they are. Kept from step to step, and used again while the dicts hold exactly those tensors and no more entries
    (`holds`): a plain identity check instead of asking each entry what it is, and each group's tensors known."""
    def __init__(self, ds:list, entries:list, owner:dict):
        self.ds, self.entries, self.nkeys = ds, entries, _nkeys(ds)
        self.groups = [_Group([e for e in entries if e[2].device == dev],
                              [owner.get(id(e[0])) for e in entries if e[2].device == dev])
                       for dev in dict.fromkeys(v.device for _, _, v in entries)]
    def holds(self, ds:list) -> bool:
        return (len(ds) == len(self.ds) and all(map(operator.is_, ds, self.ds)) and _nkeys(ds) == self.nkeys
                and all(d.get(k) is t for d, k, t in self.entries))

def _nkeys(ds:list) -> int: return sum(len(d) for d in ds if d)

def _updated_in_place(widened:dict, params:list, state:dict) -> bool:
    """Whether the step left every widened entry the FP32 view `widen` gave it (updated in place) and added no entry:
    then what `narrow` writes back is exactly `widened`'s entries."""
    ws = list(widened.values())
    return (all(d.get(k) is v for w in ws for (d, k, _), v in zip(w.entries, w.views))
            and _nkeys([state.get(p) for p in params]) == ws[0].nkeys)

class StateStorage(PlainState):
    """The optimizer's per-param state stored in `dtype` between steps (None: FP32, nothing done), widened to FP32 for
    the step and rounded back (`stochastic`, with `generator`; else to nearest). The state dicts are the optimizer's
    own (`{param: {key: value}}`); entries are replaced in place, so whoever holds a dict sees the current entries."""
    def __init__(self,
        dtype:torch.dtype|str=None, # `torch.bfloat16`, '8bit', or None: FP32 state, every method does nothing
        stochastic:bool=True, # round updated 16-bit or 8-bit state stochastically (False: to nearest)
        generator=None, # a `torch.Generator` for the stochastic rounding (on the params' device)
    ):
        self.dtype, self.stochastic, self.generator = dtype, stochastic, generator
        self._plans = {}  # (the params' ids) -> the `_Plan` of their last `widen`

    def lifted(self, params:list, state:dict):
        "Within: `params`' state in FP32 (`widen`); on exit, even on an error, written back to 16-bit (`narrow`)."
        return _NULL if self.dtype is None else self._lifted(params, state)

    @contextmanager
    def _lifted(self, params, state):
        w = self.widen(params, state)
        try: yield
        finally: self.narrow(params, state, w)

    def widen(self, params:list, state:dict) -> dict|None:
        """The 16-bit entries of `params`' states replaced by FP32 views of one scratch buffer per device (one fused
        copy each): returns `{device: _Widened}`, what `narrow` writes back into."""
        if self.dtype is None: return None
        plan, res = self._plan(params, state), {}
        for g in plan.groups:
            scratch = torch.empty(g.numel, dtype=torch.float32, device=g.device)
            views = flat_views(scratch, g.lows)  # each laid out as its tensor (channels_last stays)
            if self.dtype == EIGHT_BIT: state8.dequantize_many(views, g.lows)
            else: g.copy(scratch, views)
            if g.owners is None:
                for (d, k, _), v in zip(g.entries, views): d[k] = v
            else:
                for (d, k, _), v, p in zip(g.entries, views, g.owners): d[k] = as_state_of(v, p)
            res[g.device] = _Widened(g, scratch, views, plan.nkeys)
        return res

    def _plan(self, params:list, state:dict) -> _Plan:
        """The `_Plan` of `params`: the last one, while it holds; else made anew (each entry asked). A plan
        goes as soon as one of its params does (params lifted for one step: their plan would never be used again)."""
        key, ds = tuple(map(id, params)), [state.get(p) for p in params]
        plan = self._plans.get(key)
        if plan is None or not plan.holds(ds):
            # (whose DTensor a sharded param's state is: the model's own params, kept alive by it)
            owner = {id(d): p for p, d in zip(params, ds) if d and is_dtensor(p)}
            entries = _key_major([(d, k, v) for p, d in zip(params, ds) if d for k, v in d.items()
                                  if _is(k, v, p, self.dtype)])
            plan = self._plans[key] = _Plan(ds, entries, owner)
            drop = lambda _, me=weakref.ref(self), key=key: me() is not None and me()._plans.pop(key, None)
            plan.refs = [weakref.ref(p, drop) for p in params]
        return plan

    def fused_step(self, core, run, hyper:dict) -> bool:
        """Step the `FusedRun` `run` of fastai optimizer `core` in one compiled pass, its state where it lies
        (`fused16`: fastai's Adam, bf16 state, a CPU): True when it was, else nothing was done."""
        return fused16.adam_run(self, core, run, hyper)

    def fused_param(self, core, p, hyper:dict) -> bool:
        "`fused_step` for the one param `p` (one too big for a run, or stepped in the backward)."
        return fused16.adam_param(self, core, p, hyper)

    def stores(self, k, v, p, numel:int|None=None) -> bool:
        """Whether the FP32 state entry `k: v` of `p` is one this stores in 16-bit or 8-bit between steps (8-bit: when
        the param, of `numel` elements if `p` is a slice of it, has at least `state8.MIN_NUMEL`)."""
        return self.dtype is not None and _is(k, v, p, torch.float32) and self._big(numel or p.numel())

    def _big(self, numel:int) -> bool: return self.dtype != EIGHT_BIT or numel >= state8.MIN_NUMEL

    def zeros_like(self, p, k:str) -> Tensor:
        "A stored state tensor for the moving average `k` of `p`, all zeros (16-bit, or 8-bit codes and scales)."
        if self.dtype == EIGHT_BIT: return state8.empty8(local_shard(p.detach()), state8.signed_for(k), zero=True)
        return torch.zeros_like(p.detach(), dtype=self.dtype)

    # a param's state cut in slices (`weights.optstate.sliced_update`): 8-bit codes sliced with their blocks' scales
    def relaid(self, v:Tensor, p) -> Tensor:
        "`v` laid out as `p` (8-bit codes: quantized again in `p`'s layout, their blocks running in memory order)."
        if not isinstance(v, State8): return with_layout_of(v, p)
        return state8.quantize_(state8.empty8(p.detach(), v.signed), with_layout_of(v.dequantize(), p))
    def flat(self, v:Tensor) -> Tensor: return state8.flat8(v) if isinstance(v, State8) else super().flat(v)
    def part(self, v:Tensor, s:slice) -> Tensor: return state8.part8(v, s) if isinstance(v, State8) else v[s]
    def put_(self, dst:Tensor, src:Tensor):
        "`src` into `dst` (8-bit: its codes and scales, or an FP32 `src` quantized: a torch optimizer's first step)."
        if not isinstance(dst, State8): dst.copy_(src)
        elif isinstance(src, State8): state8.copy8_(dst, src)
        else: state8.quantize_(dst, src)
    def aligned(self, n:int) -> int: return state8.aligned(n) if self.dtype == EIGHT_BIT else n

    def narrow(self, params:list, state:dict, widened:dict|None=None, stochastic:bool|None=None, numel:int|None=None):
        """Every FP32 entry of `params`' states written back in 16-bit (into the tensor `widened` took it from, when
        there is one: views of it stay valid), rounded stochastically unless `stochastic=False` (default: `self`'s).
        8-bit: quantized (stochastically too), an entry `widened` took from 8-bit codes into them, another one only if
        its param (of `numel` elements, when `params` are slices of it) has at least `state8.MIN_NUMEL`."""
        if self.dtype is None: return
        widened = widened or {}
        stochastic = self.stochastic if stochastic is None else stochastic
        if widened and _updated_in_place(widened, params, state):
            for w in widened.values(): self._back_in_place(w, stochastic)  # (the usual step: no entry asked anything)
            return
        old = {(id(d), k): t for w in widened.values() for d, k, t in w.entries}
        pairs = [(d, k, v) for p in params if (d := state.get(p)) for k, v in d.items() if _is(k, v, p, torch.float32)
                 and ((id(d), k) in old or self._big(numel or p.numel()))]
        if self.dtype == EIGHT_BIT:  # (each map's rows in the params' order: the usual step's draws, and codes)
            return self._quantize_back(pairs, old, stochastic)
        pairs = _key_major(pairs)  # as `widen` laid the scratch out: rounded in place there
        for dev in dict.fromkeys(v.device for _, _, v in pairs):
            self._round_back([it for it in pairs if it[2].device == dev], old, widened.get(dev), stochastic)

    def _back_in_place(self, w:_Widened, stochastic:bool):
        """`w`'s scratch, which the step updated in place, written back into the tensors it was widened from (rounded
        in one pass over the scratch and one fused copy; or quantized), and those put back in the state dicts."""
        gen = self.generator if stochastic else None
        if self.dtype == EIGHT_BIT: state8.quantize_many(w.group.lows, w.views, gen)
        else:
            if stochastic: _dither_(w.scratch, gen)  # then the copies to bf16 are exact (else: to nearest)
            w.group.copy(w.scratch, w.views, back=True)
        for d, k, t in w.entries: d[k] = t

    def _round_back(self, pairs:list, old:dict, widened, stochastic:bool):
        """All `pairs`' values rounded in one pass over a flat FP32 buffer (the scratch itself, when they are its views
        in order: the usual case), then one fused copy back to 16-bit."""
        srcs = [local_shard(v) for _, _, v in pairs]
        if (widened is not None and len(srcs) == len(widened.views)
                and all(map(lambda a, b: a is b, srcs, widened.views))):
            flat = widened.scratch  # the step updated the views in place (the usual case): round the scratch itself
        else:
            flat = torch.empty(sum(v.numel() for v in srcs), dtype=torch.float32, device=srcs[0].device)
            torch._foreach_copy_(flat_views(flat, srcs), srcs)
            srcs = flat_views(flat, srcs)
        dsts = []
        for d, k, v in pairs:
            t = old.get((id(d), k))
            dsts.append(t if t is not None and t.shape == v.shape and t.stride() == v.stride() else None)
        dsts = _fresh([v for _, _, v in pairs], dsts, self.dtype)
        if stochastic: _dither_(flat, self.generator)  # then the copies below to bf16 are exact (else: to nearest)
        torch._foreach_copy_([local_shard(t) for t in dsts], srcs)  # (views of `flat`, rounded)
        for (d, k, _), t in zip(pairs, dsts): d[k] = t

    def _quantize_back(self, pairs:list, old:dict, stochastic:bool):
        """Each of `pairs`' FP32 values quantized into the 8-bit tensor it was widened from (else into a new one),
        stochastically with `self.generator` (else to nearest)."""
        dsts, pairs = [], [(d, k, local_shard(v)) for d, k, v in pairs]
        for d, k, v in pairs:
            t = old.get((id(d), k))
            dsts.append(t if t is not None and t.shape == v.shape and t.stride() == v.stride()
                        else state8.empty8(v, state8.signed_for(k)))
        for dev in dict.fromkeys(v.device for _, _, v in pairs):
            mine = [i for i, (_, _, v) in enumerate(pairs) if v.device == dev]
            state8.quantize_many([dsts[i] for i in mine], [pairs[i][2] for i in mine],
                                 self.generator if stochastic else None)
        for (d, k, _), t in zip(pairs, dsts): d[k] = t

    def narrow_all(self, state:dict):
        """The whole state in 16-bit, rounded to nearest (the set-up of a fit; after the FP32 view): no random draw, so
        a fit resumed from a checkpoint draws what the uninterrupted one does, and state widened from 16-bit is
        exact."""
        # (in memory order: a run of consecutive params then finds its state consecutive too, `_fresh`)
        self.narrow(sorted(state, key=_address), state, stochastic=False)

    def widen_into(self, p, k, v, out:Tensor) -> Tensor:
        """`out` = the FP32 value of the entry `k: v` of `p` that this storage stores (what `widen_all` makes of it),
        written straight into `out` (dense, `v`'s layout): no FP32 tensor of its own (a checkpoint's stream)."""
        if not _is(k, v, p, self.dtype): raise RuntimeError(
            f"the optimizer state {k!r} of a param of shape {tuple(v.shape)} is {type(v).__name__} in {v.dtype}, "
            f"which this state storage ({self.dtype}) does not widen")
        return state8.dequantize_into(out, v) if isinstance(v, State8) else out.copy_(v)

    def widen_all(self, state:dict):
        "The whole state in FP32, in tensors of its own (the end of a fit; the FP32 view: checkpoints, `opt_view`)."
        if self.dtype is None: return
        self._plans.clear()  # (they hold the 16-bit tensors, which go one by one below)
        for p, d in state.items():
            for k in list(d):  # each 16-bit tensor let go as soon as its FP32 one is made (not a param's at once)
                if not _is(k, d[k], p, self.dtype): continue
                d[k] = as_state_of(d[k].dequantize(), p) if isinstance(d[k], State8) else d[k].float()

    def attach(self, learn, core):
        """The state of fastai optimizer `core` (of `learn`) stored narrow from now until the returned function is
        called: fastai's loop widens it a run at a time (`STORED`), a torch optimizer's step hooks all of it
        (`TorchHooks`), and fastai's `Learner._step` all of it around any other optimizer's step (`AROUND`)."""
        self.narrow_all(opt_state(core))
        if steps_param_by_param(core):
            STORED[core] = self
            return lambda: STORED.pop(core, None)
        if isinstance(getattr(core, 'opt', None), torch.optim.Optimizer): return TorchHooks(core, self).remove
        AROUND[learn] = partial(_widened_step, self, opt_state(core))
        return lambda: AROUND.pop(learn, None)

    def fp32_state_dict(self, opt, stream:Stream=None) -> dict:
        "`opt.state_dict()` as an FP32 learner's: each tensor alone, the stored state widened by `stream` as written."
        if self.dtype is None: return own_storages(opt.state_dict())
        with as_stored(): sd = opt.state_dict()
        return lazy_state(sd, opt_state(opt), self, stream or Stream(eager=True))

def _address(p) -> tuple:
    "Where the param `p` lies: its device and address (a DTensor: of this rank's shard)."
    t = local_shard(p) if isinstance(p, Tensor) else None
    return (str(t.device), t.data_ptr()) if t is not None else ('', 0)

def _fresh(like:list, dsts:list, dtype) -> list:
    """`dsts` with each None made an empty tensor shaped and strided as its tensor of `like`, in `dtype`: views one
    after the other into a buffer per state chunk (`chunks`), so that a later widening copies a run of them at once,
    and a buffer outlives its first view going by little (a DTensor's: a tensor of its own)."""
    res, new = list(dsts), []
    for i, t in enumerate(dsts):
        if t is not None: continue
        if is_dtensor(like[i]): res[i] = torch.empty_like(like[i], dtype=dtype)
        else: new.append(i)
    for part in chunks(new, key=lambda i: like[i]):
        ts = [like[i] for i in part]
        buf = torch.empty(sum(t.numel() for t in ts), dtype=dtype, device=ts[0].device)
        for i, v in zip(part, flat_views(buf, ts)): res[i] = v
    return res

def _widened_step(storage, state:dict, step):
    "`step()` with all of `state` widened to FP32 around it (an optimizer with a `step` of its own)."
    with storage.lifted(list(state), state): return step()
