"""The accounting of a precision callback's steps: the scale and skip flag of each optimizer step, the params that
overflowed at the skipped ones, what a skip must undo (BatchNorm's running statistics), the loud end of steps that
keep overflowing."""
from __future__ import annotations
import warnings
from collections import deque
from collections.abc import Sequence
from contextlib import contextmanager
import numpy as np
import torch
from torch import nn

from ..dtypes import range_remedy, user_stacklevel
from .scalers import LossScaleError, _HINT
from .check import _by_device

__all__ = ['BNStatsGuard', 'count_skip', 'lr_find_stops_on', 'warn_all_skipped', 'OverflowLog', 'ScaleHistory',
           'StepRecord', 'settled', 'BURST']

class BNStatsGuard:
    "Snapshot BatchNorm running statistics before a step's forward pass; put them back when the step is skipped."
    def __init__(self,
        model:nn.Module, # the model whose BatchNorm layers (tracking running stats) are guarded
    ):
        self.bufs = [b for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                     for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]
        self.snaps = [torch.empty_like(b) for b in self.bufs]
        self.armed = True  # a snapshot is due: nothing was accumulated since the last optimizer step

    def snapshot(self):
        """Copy the statistics aside (one fused copy) when a new step starts; micro-batches of an accumulated step keep
        the first."""
        if not self.armed or not self.bufs: return
        torch._foreach_copy_(self.snaps, self.bufs)
        self.armed = False

    def restore(self):
        "Put back the statistics of the snapshot: the skipped step's forward passes leave no trace in them."
        if self.bufs and not self.armed: torch._foreach_copy_(self.bufs, self.snaps)
        self.armed = True

    def arm(self):
        "An optimizer step (or skip) happened: the next training batch takes a new snapshot."
        self.armed = True

def count_skip(n_in_a_row:int, skipped:bool, max_skipped:int, what:str) -> int:
    "Consecutive skipped steps after this one; past `max_skipped` the scalers' loud `LossScaleError`."
    n = n_in_a_row + 1 if skipped else 0
    if n > max_skipped:
        raise LossScaleError(f"Mixed-precision training stopped: {n} steps in a row had inf/NaN gradients "
                             f"and were skipped ({what}). {_HINT}")
    return n

@contextmanager
def lr_find_stops_on(learn,
    on_collapse=None, # `LossScaleError -> exception or None`: where the overflow starts and the remedy (None: applied)
):
    """In `lr_find`, steps that keep overflowing mean the growing lr diverged: end the search (as `stop_div` does), not
    raise. Elsewhere `on_collapse` (the failing step only) gives the error to raise instead, one that says where the
    overflow starts and what to do, or None when it removed the cause: training goes on."""
    from fastai.callback.core import CancelFitException
    from fastai.callback.schedule import LRFinder
    try: yield
    except LossScaleError as e:
        if any(isinstance(cb, LRFinder) for cb in learn.cbs): raise CancelFitException()
        err = e if on_collapse is None else on_collapse(e)
        if err is e: raise
        if err is not None: raise err from None

def warn_all_skipped(skips:list, what:str, device='cpu'):
    """At the end of a fit: warn when every optimizer step of it was skipped for inf/NaN gradients (the weights never
    moved); the remedy for an fp16 overflow as `device` runs fast (`range_remedy`)."""
    if skips and all(skips):
        warnings.warn(f"all {len(skips)} optimizer steps of this fit were skipped for inf/NaN gradients ({what}): the "
                      f"weights did not change. Check the data and the loss for NaN/inf, lower the learning rate, or "
                      f"if the forward pass overflows in fp16, train in {range_remedy(device)}.", RuntimeWarning,
                      stacklevel=2)

# a fit whose loss scale has settled and that skips this many of this many steps is told so at once: the most that any
# healthy fp16 fit of `python -m bench.skip_rates` skipped was 3 of 8 (with the scale trying to grow every 20 steps)
BURST = (4, 8)

def settled(skips:list, scales:list, dynamic:bool) -> list:
    """The skip flags of a fit's steps once its loss scale has settled: all of a static scale's; a dynamic one's from
    its first applied step, or from its first at scale 1 or under (an overflow there is the model's own)."""
    if not dynamic: return list(skips)
    return list(skips[next((i for i, (k, s) in enumerate(zip(skips, scales)) if not k or s <= 1), len(skips)):])

def _where(params:list) -> str:
    "The params named in an overflow log entry, and their modules."
    mods = list(dict.fromkeys(n.rsplit('.', 1)[0] if '.' in n else '(the model)' for n in params))
    more = lambda xs: ', '.join(map(repr, xs[:5])) + (f" and {len(xs) - 5} more" if len(xs) > 5 else '')
    return f"in the grads of {more(params)} (modules {more(mods)})" if params else "(no param named)"

def warn_skips(record, dtype, dynamic:bool, device='cpu') -> str|None:
    """After a skipped step: say at once what no healthy fit shows (once a fit each), naming the params whose grads
    held inf/NaN (a host read of the overflow log, on this step only): a bf16 step skipped (bf16 has FP32's range), or
    `BURST` skips among the last settled steps. The warning's kind ('bf16', 'burst'), or None."""
    fit, (n, w) = record.this_fit, BURST
    recent = sum(settled(fit, record.scales[record.fit_start:], dynamic)[-w:]) if dtype != torch.bfloat16 else 0
    kind = ('bf16' if sum(fit) == 1 else None) if dtype == torch.bfloat16 else 'burst' if recent >= n else None
    if kind is None or kind in record.said: return None
    record.said.add(kind)
    where = _where(record.overflows.read()[-1]['params'])
    fix = "(`learn.precision_check()` names where it starts; `keep_fp32=[...]` keeps that module FP32)"
    if kind == 'bf16':
        msg = (f"a bf16 step was skipped for inf/NaN gradients {where}: the weights did not move. bfloat16 has FP32's "
               f"range, so no healthy fit overflows in it: the data or the loss hold NaN/inf, or a module fails in 16 "
               f"bits {fix}.")
    else:
        msg = (f"{recent} of the last {w} "
               f"optimizer steps were skipped for inf/NaN gradients once the loss scale had settled, the last "
               f"{where}: the weights did not move on those steps, and no healthy fp16 fit skips so often. The data "
               f"or the loss hold NaN/inf, or a module overflows in fp16 {fix}; or train in {range_remedy(device)}.")
    warnings.warn(msg + " Said once a fit; `overflows` on the callback lists every skipped step.", RuntimeWarning,
                  stacklevel=user_stacklevel())
    return kind

class OverflowLog:
    """Which parameters had inf/NaN gradients at each skipped step: the last `keep` steps (a long run stays bounded)
    and their `count`. The per-parameter flags stay on the device until `read` (no host sync in the step)."""
    def __init__(self, keep:int=100): self.entries, self.count = deque(maxlen=keep), 0

    def add(self, step:int, scale:float, flags=None, names=()):
        "Step `step` (at `scale`) was skipped; `flags[i]`: param `names[i]` had an inf/NaN gradient."
        self.entries.append([step, scale, flags, names if flags is not None else []]); self.count += 1

    def read(self) -> list:
        "`[{'step', 'scale', 'params'}]`, oldest first: `params` are the names of the params whose grads held inf/NaN."
        for e in self.entries:
            if e[2] is not None: e[2], e[3] = None, [n for n, bad in zip(e[3], e[2].tolist()) if bad]
        return [dict(step=e[0], scale=e[1], params=list(e[3])) for e in self.entries]

    def __len__(self): return len(self.entries)

class ScaleHistory(Sequence):
    """The loss scale and the skip flag of every optimizer step of one precision setup (the callback a `to_fp16()` call
    made: its fits, whose scale goes on from one to the next), also `learn.loss_scale_history` from that setup's first
    fit on: it stays on the learner after `to_fp32()` has removed the callbacks, as fastai's `Recorder` keeps its values
    after the fit, until a new setup (`to_fp16()` again, `to_bf16()`...) fits. `fp16cb.plot_loss_scale(learn)` draws
    it. As a sequence it is the loss scales, one per step (`h[-1]`, `list(h)`, `plt.plot(h)`); `.skips` says which
    steps were skipped. Plain lists: a learner holding it copies, pickles and exports as before."""
    def __init__(self, label:str=''): self.label, self.scales, self.skips = label, [], []
    @property
    def n_skipped(self) -> int: return sum(self.skips)
    def __len__(self): return len(self.scales)
    def __getitem__(self, i): return self.scales[i]  # a slice gives a list of scales
    def __iter__(self): return iter(self.scales)
    def __array__(self, dtype=None, copy=None): return np.asarray(self.scales, dtype=dtype)
    def __repr__(self): return f"{type(self).__name__}({self.label}: {len(self)} steps, {self.n_skipped} skipped)"

class StepRecord:
    """Skip accounting for one precision callback: the loss scale and the skip flag of every optimizer step (over all
    its fits; `fit_start` is where the current fit's steps begin), which params overflowed at the skipped ones
    (`overflows`), and the BatchNorm statistics a skipped step must not change (snapshot at each step's first
    micro-batch, restored on a skip). A step that another callback cancels is no step: nothing is recorded
    (`cancelled`). `grad_scale`: the loss scale the grads of the step under way carry (None: none), what a fit that
    ends before its step divides them by (`unscale_left`)."""
    def __init__(self, label:str=''):
        self.history, self.fit_start, self.bn, self.overflows = ScaleHistory(label), 0, None, OverflowLog()
        self.grad_scale, self.said = None, set()
        self.causes = {}  # step -> why it was skipped: 'inf/NaN', or 'underflow' (a calibrating step's gradients)
    scales = property(lambda self: self.history.scales)
    skips = property(lambda self: self.history.skips)
    def new_fit(self, learn=None):
        "A fit starts: its steps are those recorded from now on; `learn.loss_scale_history` is this record's history."
        self.fit_start, self.grad_scale, self.said = len(self.skips), None, set()
        if learn is not None: learn.loss_scale_history = self.history
    def setup(self, model): self.bn = BNStatsGuard(model)
    def teardown(self): self.bn = None
    def snapshot(self):
        if self.bn is not None: self.bn.snapshot()
    def record(self, scale:float, skipped:bool, found:tuple|None=None, cause:str='inf/NaN'):
        """One optimizer step done (or skipped, for `cause`: BatchNorm's statistics go back to the snapshot, and
        `found`, the store's `(flags, names)` of the params whose grads held inf/NaN, is logged); the next one
        re-arms."""
        if skipped:
            self.overflows.add(len(self.skips), scale, *(found or ()))
            self.causes[len(self.skips)] = cause
        self.scales.append(scale); self.skips.append(skipped)
        if self.bn is not None:
            if skipped: self.bn.restore()
            self.bn.arm()

    def cancelled(self):
        """Another callback cancelled the step (`CancelStepException`): as in FP32, nothing happened but the forward
        passes, whose BatchNorm statistics stay; no step is recorded. The next training batch takes a new snapshot."""
        if self.bn is not None: self.bn.arm()

    def scaled(self, scale):
        """A backward is about to add grads multiplied by `scale` (the micro-batches of a step share one): a float, or
        a function that reads it (GradScaler's, a host read: only a fit that ends before the step makes it)."""
        self.grad_scale = None if scale == 1. else scale
    def unscaled(self): "The grads carry no loss scale any more (divided by it, or cleared)."; self.grad_scale = None

    def unscale_left(self, grads:list):
        """The fit ends while `grads` carry the loss scale (a `KeyboardInterrupt` after the backward, a fit cancelled
        before its step): divide them by it, which leaves what FP32 would hold, the grads unscaled."""
        gs, scale = [g for g in grads if g is not None], self.grad_scale
        if scale is not None and gs:
            inv = 1. / float(scale() if callable(scale) else scale)
            with torch.no_grad():
                for ts in _by_device(gs).values(): torch._foreach_mul_(ts, inv)
        self.grad_scale = None
    @property
    def this_fit(self) -> list: return self.skips[self.fit_start:]

