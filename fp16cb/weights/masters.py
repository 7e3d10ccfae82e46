"""FP32 master weights (Micikevicius et al. 2018) beside a 16-bit model, one per param (`ParamMasters`), stepped by the
optimizer with FP32 grads lifted a chunk at a time (`lift`): the store of `step_in_backward`."""
from __future__ import annotations
from functools import partial
import torch
from torch import Tensor
from fastai.optimizer import OptimWrapper

from .layout import memory_order, laid_out_as
from .functional import get_master, _pairs
from .optstate import (move_opt_state, fastai_update, steps_param_by_param, opt_state, elementwise, sliced_update,
                       sliced_torch_step)
from .drivers import fused_runs, flag_ranks
from .lift import Scratch, LiftPlan, Chunk, BufferRun, lift_chunks, storage_runs, to_model_copies, merged
from .store import WeightStore, check_same_kind
from .state_storage import StateStorage
from .writes import WriteWatch

__all__ = ['FP32Masters', 'ParamMasters']

class FP32Masters(WeightStore):
    """FP32 master weights stepped by the optimizer (Micikevicius et al. 2018). The model's params and grads become
    views into one flat buffer per (device, dtype) run of the masters, so that master->model, the overflow check and
    zeroing are one vectorised op per buffer. The masters get FP32 grads only while the optimizer steps them, a chunk of
    at most `chunk_limit` elements at a time (cache-sized on a CPU): copied from the 16-bit grads into one scratch
    buffer, unscaled and clipped there, stepped, and rounded into the model right after, while in the caches (memory at
    the step's peak: 2 bytes/param of 16-bit weights, 2 of 16-bit grads, 4 of masters, the optimizer's state, and one
    chunk). A master bigger than a chunk is stepped a slice at a time where the optimizer is elementwise.
    `ParamMasters`: one FP32 master per param, viewing one FP32 buffer per device, which the optimizer steps.
    A fastai `Optimizer` is stepped once, its loop run a chunk at a time; a torch optimizer (`OptimWrapper`) once per
    chunk, only that chunk's masters having grads (torch skips the others); a fused one that takes `grad_scale` (torch's
    `fused=True` Adam/AdamW/SGD) unscales inside its kernel, as under torch's `GradScaler`."""
    def __init__(self, opt,
        fp32_of=None, # `param -> exact FP32 value` (from `ModelToHalf`); masters are made from these tensors
        names:dict=None, # `{id(param): name}` for error messages
        model=None, # the model (sparse grads)
        in_backward:bool=False, # step each param in the backward (`arm_in_backward`): no 16-bit grad buffer
        state_dtype:torch.dtype=None, # the optimizer's state in this dtype between steps (`StateStorage`; None: FP32)
        stochastic:bool=True, # round the 16-bit state stochastically (False: to nearest)
        generator=None, # the `torch.Generator` of that rounding
        keep=(), # ids of params kept though frozen since (`WeightStore`)
    ):
        super().__init__(opt, names, model, keep)
        self.state_storage = StateStorage(state_dtype, stochastic, generator); self._with_grads = not in_backward
        self.model_pgs, self.master_pgs = get_master(self.core, False, fp32_of=fp32_of, keep=self.keep)
        self.master_params = [m for mg in self.master_pgs for m in mg]
        for m in self.master_params: m.grad = None  # FP32 grads exist only for the chunk being stepped
        self.runs = self._make_runs()
        self.models, self.masters, _ = _pairs(self.model_pgs, self.master_pgs, False, with_grads=False)
        self.opt_pgs = [list(mg) + own for mg, own in zip(self.master_pgs, self.own_pgs)]  # what the optimizer steps
        move_opt_state(opt, self.model_pgs, self.master_pgs, None, self.opt_pgs)
        self.state_storage.narrow_all(opt_state(self.core))
        self._bufs, self._masters = [r.buf for r in self.runs], [r.master for r in self.runs]
        self._grads = merged([r.grad for r in self.runs if r.grad is not None])  # none when stepping in the backward
        self._sliced_ok = elementwise(self.core)  # a master over a chunk is stepped a slice at a time
        # fastai's loop steps runs of consecutive per-param masters as one flat tensor (16-bit state: widened per param)
        self._fuse = self._sliced_ok and steps_param_by_param(self.core) and state_dtype is None
        self.chunks = self._plan_chunks(in_backward)
        # the driver, picked once: fastai's loop (run here, chunk by chunk), or the torch optimizer's own `step`
        self._driver = self._fastai_loop if steps_param_by_param(self.core) else self._torch_step
        self._master_of = {id(p): (m, gi) for gi, (pg, mg) in enumerate(zip(self.model_pgs, self.master_pgs))
                           for p, m in zip(pg, mg)}
        self._master_of.update({id(p): (p, gi) for gi, pg in enumerate(self.own_pgs) for p in pg})
        self._missing, self._trusted = [], False
        self.writes = WriteWatch(self.models, self.masters, self.chunk_limit)  # other code's writes reach the masters
        if in_backward: self.arm_in_backward()

    def _plan_chunks(self, in_backward:bool) -> list:
        """The `Chunk`s one optimizer step takes, in the masters' buffer order: each chunk of at most `chunk_limit`
        elements (fastai's loop; an elementwise torch optimizer, stepped once per chunk), or one chunk of everything (a
        torch optimizer not known to be elementwise, an `Optimizer` with a `step` of its own: stepped once, as FP32
        steps it); whether each is rounded into the model as soon as it is stepped (`_fold_ok`: not when a wrapper such
        as Lookahead, changes the masters after); the lift's scratch and the plans, made
        now."""
        own, sources = {id(p) for p in self.own_params}, self._sources()
        items = self._in_storage_order([(p, gi, None if id(p) in own else sources[id(p)])
                                        for gi, pg in enumerate(self.opt_pgs) for p in pg])
        chunked = steps_param_by_param(self.core) or (isinstance(self.core, OptimWrapper) and self._sliced_ok)
        parts = lift_chunks(items, self.chunk_limit) if chunked else [items] if items else []
        self._fold_ok = chunked and self.opt is self.core
        chunks = [Chunk(c, self._sliceable(c), [(p, gi) for p, gi, src in c if src is None], to_model_copies(c))
                  for c in parts]
        sizes = {}  # the largest chunk of masters per device (a sliced one: a slice): the scratch the lift writes into
        for c in chunks:
            n = self.chunk_limit(c.device) if c.sliced else c.elements()
            if n: sizes[c.device] = max(sizes.get(c.device, 0), n)
        self.scratch = Scratch(sizes)
        for c in chunks:
            if not (in_backward or c.sliced): c.plan = LiftPlan.make(c.items, self.scratch)  # made now, not in step 1
        return chunks

    # -- the interface
    def _grads_to_check(self) -> list:
        if not self.runs and not self.own_params: return []
        for r in self.runs: r.settle()
        self._missing = [p for r in self.runs for p in r.reattach_grads()]  # no grad this step: not to be stepped
        self._trusted = self.grads_final and not self._missing  # every grad is its view, and stays so until the step
        return self._grads + self.own_grads()

    def _step_impl(self, *args, **kwargs):
        self.writes.follow()  # written since the last step (a constraint, a clip of the weights): stepped from there
        held = self._hold(self._missing)
        self._fold = held is None and self._fold_ok  # each chunk rounded into the model as it is stepped (`_land`)
        out = self._through_core(self._driver, *args, **kwargs)
        if held is not None: held()
        if not self._fold: self.master_to_model()
        return out

    def _hold(self, params:list):
        "What puts back, after the step, whatever it changed of `params` (without a grad, they are not to be stepped)."
        return None

    def _fastai_loop(self, step, *args, **kwargs):
        """fastai's driver: its `Optimizer.step` loop, run here a chunk at a time on the masters with FP32 grads (each
        run of consecutive masters with equal state as one flat tensor, the others one at a time); `step` is not
        called."""
        hypers, state = self.core.hypers, self.core.state
        sliced = lambda m, gi, n, lift, land: sliced_update(self.core, m, hypers[gi], n, lift, land, self.state_storage)
        for chunk in self.chunks:
            if self._step_sliced(chunk, sliced): continue
            live = self._lift(chunk)
            with self.state_storage.lifted([p for p, _ in live], state):  # their state in FP32 (16-bit state: widened)
                for p, gi in self._fused(chunk, live): fastai_update(self.core, p, hypers[gi])
            self._land(chunk)

    def _torch_step(self, step, *args, **kwargs):
        """The torch driver: the optimizer's own `step` once per chunk (one chunk of everything unless it is known to be
        elementwise), only that chunk's masters (and own params) with grads: torch skips the others. A fused optimizer
        that takes `grad_scale` unscales in its kernel."""
        inner = getattr(self.core, 'opt', None); fused = self._fused_scale(inner)
        step_once = partial(self._step_with_scale, inner, fused, step, *args, **kwargs)
        own, out, state = {p: p.grad for p in self.own_params}, None, opt_state(self.core)  # torch steps every param
        for p in own: p.grad = None  # with a grad: each own param in one chunk
        try:
            for chunk in self.chunks:
                sliced = lambda m, gi, n, lift, land: sliced_torch_step(inner, m, n, lift, land, step_once,
                                                                        self.state_storage)
                if self._step_sliced(chunk, sliced, unscale=fused is None): continue
                live = self._lift(chunk, own, unscale=fused is None)
                with self.state_storage.lifted([p for p, _ in live], state): out = step_once()
                self._land(chunk)
        finally:
            for p, g in own.items(): p.grad = g
        return out

    @staticmethod
    def _step_with_scale(inner, fused, step, *args, **kwargs):
        "`step(*args)`, with the fused kernel's `(grad_scale, found_inf)` set on `inner` for the call when there are."
        if fused is None: return step(*args, **kwargs)
        inner.grad_scale, inner.found_inf = fused
        try: return step(*args, **kwargs)
        finally: del inner.grad_scale, inner.found_inf

    def _fused(self, chunk:list, live:list) -> list:
        """The chunk's runs of consecutive masters stepped by fastai's callbacks as one flat tensor each (`FusedRun`):
        returns `live` less the params they stepped (those step one at a time, as fastai's loop would)."""
        plan = chunk.lifted
        if not self._fuse or plan is None: return live
        if plan.runs is None: plan.runs = fused_runs(plan.masters, plan.views, plan.gis)
        hypers, done = self.core.hypers, set()
        for run in plan.runs: done.update(map(id, run.step(self.core, hypers[run.gi])))
        return [it for it in live if id(it[0]) not in done] if done else live

    def _step_sliced(self, chunk:list, update, unscale:bool=True) -> bool:
        """A chunk that is one master bigger than the chunk limit, under an elementwise optimizer: stepped a chunk-sized
        slice at a time (`update(master, group, n, lift, land)`: `sliced_update` for fastai's loop, `sliced_torch_step`
        for a torch optimizer), each slice's grad lifted into the scratch, unscaled (unless the fused kernel does it),
        stepped and rounded into the model while in the caches. False: not such a chunk (the caller steps it whole)."""
        if not chunk.sliced: return False
        (m, gi, sources), = chunk; o = sources[0][0]
        if o.grad is None: return True  # no backward reached it: not stepped, as in FP32
        lift = partial(self._lift_slice, memory_order(m), memory_order(laid_out_as(o.grad, m)),
                       self._factor(gi) if unscale else None)
        land = partial(self._land_slice, memory_order(o.buf if isinstance(o, BufferRun) else o))
        update(m, gi, self.chunk_limit(m.device), lift, land)  # 16-bit state widened a slice at a time
        return True

    def _lift_slice(self, master:Tensor, g16:Tensor, f, s:slice) -> Tensor:
        """Slice `s` of a master (`master`, in memory order) with its FP32 grad: the 16-bit grad's slice (`g16`) copied
        into the scratch, unscaled."""
        g = self.scratch(g16.device, s.stop - s.start).copy_(g16[s])
        q = master[s]; q.grad = g if f is None else g.mul_(f)
        return q

    def _land_slice(self, out:Tensor, s:slice, q:Tensor):
        """A stepped slice of a master rounded into the model's param (`out`, in memory order), unless done after the
        step."""
        if self._fold: out[s].copy_(q)

    def _sliceable(self, items:list) -> bool:
        "Whether `items` are one master (fed by one grad) bigger than the chunk limit, under an elementwise optimizer."
        if len(items) != 1 or not self._sliced_ok: return False
        m, _, sources = items[0]
        return sources is not None and len(sources) == 1 and m.numel() > self.chunk_limit(m.device)

    def _fused_scale(self, inner):
        """`(grad_scale, found_inf)` for a torch optimizer whose kernel unscales (`_step_supports_amp_scaling`: torch's
        fused Adam/AdamW/SGD), so the grads are only copied to FP32: one pass less. None where one factor cannot serve
        every group (per-group clipping of several groups), or the optimizer cannot."""
        if inner is None or not getattr(inner, '_step_supports_amp_scaling', False) or not self._masters: return None
        coefs = list({id(c): c for c in self.coefs.values()}.values())
        if len(coefs) > 1 or (coefs and len(self.coefs) < len(self.opt_pgs)): return None
        dev = self._masters[0].device  # the scale below: 1 where the grads are divided already
        scale = torch.full((), self.scale if self.grad_factor != 1. else 1., dtype=torch.float32, device=dev)
        return (scale / coefs[0] if coefs else scale), torch.zeros((), dtype=torch.float32, device=dev)

    def _lift(self, chunk:list, own:dict=None, unscale:bool=True) -> list:
        """Give the masters of `chunk` FP32 grads: its part of the scratch, the 16-bit grads copied in (one fused copy),
        unscaled and clipped (one fused multiply per group); own params' grads unscaled in place (`own`: their grads,
        set aside). Returns `[(param, group)]` of those with a grad."""
        plan = chunk.lifted = self._plan(chunk)
        groups, live = (plan.lift(), list(plan.live)) if plan is not None else ({}, []); extra = {}
        for p, gi in chunk.owns:
            if own is not None: p.grad = own.get(p)
            if p.grad is None: continue
            extra.setdefault(gi, []).append(p.grad); live.append((p, gi))
        if unscale:
            for gi in groups.keys() | extra.keys():
                f = self._factor(gi)
                if f is not None: torch._foreach_mul_(groups.get(gi, []) + extra.get(gi, []), f)
        return live

    def _step_one(self, p):
        "In the backward: `p`'s master gets its grad in FP32, fastai's optimizer steps it, `p` follows (rounded once)."
        m, gi = self._master_of[id(p)]; n = self.chunk_limit(m.device)
        if m is not p and self._sliced_ok and m.numel() > n:  # a slice at a time: its grad, its state in FP32
            lift = lambda s, mm=memory_order(m), g=memory_order(laid_out_as(p.grad, m)): _with_grad(mm[s], g[s].float())
            land = lambda s, q, out=memory_order(p.data): out[s].copy_(q)  # `.data`: not counted as others' write
            return sliced_update(self.core, m, self.core.hypers[gi], n, lift, land, self.state_storage)
        if m is not p: m.grad = p.grad.float()
        with self.state_storage.lifted([m], self.core.state): fastai_update(self.core, m, self.core.hypers[gi])
        if m is not p:
            m.grad = None
            p.data.copy_(m)  # `.data`: the store's own write, not counted as other code's (`WriteWatch`)

    def _plan(self, chunk:list):
        """The chunk's `LiftPlan`: made once and kept while its sources' grads are the same tensors; when a master's
        param has no grad (no backward reached it: an unused head), a plan of the others, kept while the same ones have
        none (None: no master has a grad)."""
        plan = chunk.plan
        if plan is not None and ((self._trusted and not plan.absent) or plan.valid()): return plan  # grads as they are
        chunk.plan = LiftPlan.make(chunk.items, self.scratch) or LiftPlan.make(chunk.items, self.scratch, partial=True)
        return chunk.plan

    def _land(self, chunk:list):
        """The chunk was stepped: its masters' FP32 grads go (the next chunk reuses the scratch) and, unless something
        changes the masters after the step (`_fold`), the masters are rounded into the model's params while in the
        caches (one fused copy per contiguous run)."""
        plan, chunk.lifted = chunk.lifted, None
        if plan is not None: plan.free()
        if self._fold:
            dsts, srcs = chunk.out
            if dsts: torch._foreach_copy_(dsts, srcs)

    def zero_model_grads(self, reattach:bool=True):
        "Zero the model's 16-bit grads (grads someone replaced go back into the flat buffers first, unless just done)."
        if reattach:
            for r in self.runs: r.reattach_grads()
        if self._grads: torch._foreach_zero_(self._grads)
        self.clear_own_grads(); self._trusted = False  # until the next step's `prepare_grads` has looked again

    def check_linked(self):
        "Each run's first param still views the run's buffer (a `.to()` or `.float()` replaces every param's tensor)."
        for r in self.runs:
            if r.linked(): continue
            p = r.params[0]
            check_same_kind(p, r.buf, 'the FP32 masters', self.names.get(id(p), tuple(p.shape)))
            r.relink()
            for c in self.chunks: c.plan = None  # new grad views: the plans are made again at the next lift

    def fp32_views(self) -> dict: return dict(zip(self.models, self.masters))
    def _shared(self) -> list: return self._masters + [p.data for p in self.own_params]

    def _grads_by_param(self) -> tuple:
        "The model's grads (16-bit, loss-scaled, before any clearing), one per param; own params' grads."
        pairs = [(p, p.grad) for p in self.models] + [(p, p.grad) for p in self.own_params]
        return [p for p, _ in pairs], [g for _, g in pairs]
    def _after_broadcast(self): self.master_to_model()
    def follow_writes(self, everything:bool=False): self.writes.follow(everything)

    def backward(self, scale:float=1.):
        super().backward()
        if self.in_backward: self.writes.follow()  # the backward steps the params: from what other code wrote

    def _point_opt(self, to_model:bool, stash:dict=None):
        "Move the optimizer (params, state, Lookahead's slow weights) between the masters and the model's params."
        if to_model: move_opt_state(self.opt, self.master_pgs, self.model_pgs, None, self.old_param_lists, stash)
        else: move_opt_state(self.opt, self.model_pgs, self.master_pgs, None, self.opt_pgs, stash)

    def restore(self):
        self.writes.settle()  # the last step's writes: the FP32 weights the fit ends with
        for r in self.runs: r.release()
        super().restore()  # the scratch let go there
        self._point_opt(to_model=True)
        self.runs, self.chunks, self._bufs, self._grads = [], [], [], []  # 16-bit buffers: gone with the model's views

    # -- helpers
    def master_to_model(self):
        "Copy the master weights into the model params (rounding to 16-bit once), one fused pass."
        if self.runs: torch._foreach_copy_(self._bufs, self._masters)

    def buffers(self) -> list:
        "The flat buffers behind the model's 16-bit params and grads and the FP32 masters (memory accounting)."
        return self._bufs + self._grads + self._masters

    @property
    def model_grads(self) -> list: return self._grads

    def _in_storage_order(self, items:list) -> list:
        "The `(master, group, sources)` items in the order the chunks take them (here: the optimizer's)."
        return items
    def _make_runs(self) -> list: raise NotImplementedError
    def _sources(self) -> dict:
        "`{id(master): [(object whose .grad feeds it, offset in the master)]}`."
        raise NotImplementedError

def _with_grad(q:Tensor, g:Tensor) -> Tensor:
    q.grad = g
    return q

class ParamMasters(FP32Masters):
    "One FP32 master per param (per-param optimizer state and steps), their data in one buffer per device."
    def _make_runs(self):
        "The masters' buffer ordered by dtype, param group and optimizer flags (`do_wd`...): the fastai driver's runs."
        models, state = [p for pg in self.model_pgs for p in pg], opt_state(self.core)
        gis = [gi for gi, pg in enumerate(self.model_pgs) for _ in pg]
        ranks = flag_ranks(models, state)  # by where each set first appears: a resumed fit orders masters alike
        return storage_runs(models, self.master_params, self._with_grads, per_step=self.none_after_step,
                            key=lambda i: (gis[i], ranks[i]))

    def _in_storage_order(self, items:list) -> list:
        """Masters in the order of their buffer (each chunk a stretch of it: one copy in, one out, long fused runs), own
        params after them; elementwise or not, an optimizer's step does not depend on the order of its params."""
        pos = lambda m: (str(m.device), m.untyped_storage().data_ptr(), m.storage_offset())
        return sorted(items, key=lambda it: (it[2] is None, pos(it[0]) if it[2] is not None else ("", 0, 0)))
    def _sources(self) -> dict:
        "Each master is fed by its param's grad (a param without grad leaves its master without one, as in FP32)."
        return {id(m): [(p, 0)] for p, m in zip((p for pg in self.model_pgs for p in pg), self.master_params)}

