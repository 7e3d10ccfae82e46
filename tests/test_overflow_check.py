"""Overflow: test_overflow / grad_overflow / OverflowCheck, the skipped step, dynamic scale backoff/growth/cap,
static scaling, and clipping of the unscaled FP32 master grads."""
import pytest
import torch
from torch import nn
import fp16cb.scaling as ov  # `ov.test_overflow`: never bind a `test_*` name that pytest would collect
from fp16cb import grad_overflow
from fp16cb.scaling import OverflowCheck
from fastai.basics import Callback
from conftest import make_learner, quiet_fit, Record, StepSpy, Inject, clones, flat_pgs, count_host_reads, DEVICE

INF, NAN = float('inf'), float('nan')

# ---- the checks ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize('dtype', [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize('bad', [INF, -INF, NAN])
def test_test_overflow(dtype, bad):
    x = torch.randn(3, 4, device=DEVICE).to(dtype)
    assert ov.test_overflow(x) is False
    x[1, 2] = bad
    assert ov.test_overflow(x) is True

def test_test_overflow_large_finite():
    assert not ov.test_overflow(torch.full((2,), 65504., dtype=torch.float16, device=DEVICE))  # fp16 max is finite
    assert ov.test_overflow(torch.full((2,), 65504., dtype=torch.float16, device=DEVICE) * 2)  # ... and overflows when doubled

def _pgs(*grads):
    pgs = []
    for gs in grads:
        pg = []
        for g in gs:
            p = nn.Parameter(torch.zeros_like(g))
            p.grad = g
            pg.append(p)
        pgs.append(pg)
    return pgs

def test_grad_overflow():
    assert grad_overflow(_pgs([torch.randn(3, device=DEVICE)], [torch.randn(2, 2, device=DEVICE).half()])) is False
    for bad in (INF, -INF, NAN):
        g = torch.randn(2, 2, device=DEVICE).half(); g[1, 0] = bad
        assert grad_overflow(_pgs([torch.randn(3, device=DEVICE)], [torch.randn(4, device=DEVICE), g])) is True  # any param of any group
    assert grad_overflow([[nn.Parameter(torch.zeros(2, device=DEVICE))]]) is False  # no gradient at all
    assert grad_overflow([]) is False

def test_overflow_check_unscales_and_finds():
    check = OverflowCheck()
    gs = [torch.ones(3, device=DEVICE) * 8, torch.full((2, 2), 4., device=DEVICE)]
    found = check(gs, 1/4)
    assert found.tolist() == [0.]
    assert torch.equal(gs[0], torch.full((3,), 2., device=DEVICE)) and torch.equal(gs[1], torch.ones(2, 2, device=DEVICE))
    gs = [torch.ones(3, device=DEVICE), torch.tensor([1., INF], device=DEVICE)]
    assert check(gs, 1.)[0] > 0
    res = check([torch.tensor([2., -6.], device=DEVICE), torch.tensor([4.], device=DEVICE)], .5, with_max=True)
    assert res.tolist() == [0., 3.]  # found, max |unscaled grad|
    assert check([torch.tensor([NAN], device=DEVICE)], 1., with_max=True)[0] > 0

@pytest.mark.parametrize('dtype', [torch.float32, torch.float16, torch.bfloat16])
def test_overflow_check_at_scale_one_only_reads(dtype):
    "Nothing to unscale at scale 1: a read-only pass, exact (no false alarm from huge finite grads) for every dtype."
    check, big = OverflowCheck(), torch.finfo(dtype).max
    gs = [torch.tensor([big, big, -big], device=DEVICE).to(dtype), torch.tensor([.5, -6., 2.], device=DEVICE).to(dtype)]
    versions = [g._version for g in gs]
    assert check(gs, 1., with_max=True).tolist() == [0., float(big)]  # a sum of these would overflow
    assert check(gs[1:], 1., with_max=True).tolist() == [0., 6.]  # max |grad| of a negative one
    assert [g._version for g in gs] == versions  # not written
    for bad in (INF, -INF, NAN):
        g = torch.randn(1000, device=DEVICE).to(dtype); g[517] = bad
        assert check([gs[1], g], 1.).tolist() == [1.]
    assert check([torch.zeros(0, dtype=dtype, device=DEVICE)], 1., with_max=True).tolist() == [0., 0.]

@pytest.mark.parametrize('n', [3, 40])  # a few flat buffers (read-only aminmax), or many grads (the fused kernel)
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_overflow_check_at_scale_one_many_tensors(n, dtype):
    "At scale 1, any number of tensors: the same answer (found, max |grad|), values unchanged."
    torch.manual_seed(n)
    gs = [torch.randn(int(torch.randint(1, 300, ())), device=DEVICE).to(dtype) for _ in range(n)]
    ref = [g.clone() for g in gs]
    assert OverflowCheck()(gs, 1., with_max=True).tolist() == [0., max(float(g.float().abs().max()) for g in ref)]
    assert all(torch.equal(g, r) for g, r in zip(gs, ref))
    for bad in (INF, -INF, NAN):
        gs[n // 2][0] = bad
        assert OverflowCheck()(gs, 1.).tolist() == [1.]

@pytest.mark.parametrize('inv_scale', [.5, 0., 1.])
@pytest.mark.parametrize('bad_first', [True, False])
def test_overflow_check_mixed_dtypes(inv_scale, bad_first):
    "An inf in one dtype's tensors is found whatever the other dtypes (bf16 weights + FP32 BatchNorm) hold."
    for bad in (INF, NAN):
        half = torch.tensor([1., bad, 2.], device=DEVICE).to(torch.bfloat16)
        gs = [half, torch.ones(3, device=DEVICE)] if bad_first else [torch.ones(3, device=DEVICE), half]
        gs += [torch.ones(2, dtype=torch.bfloat16, device=DEVICE)] * 20 if inv_scale == 1. else []  # many: the fused kernel at scale 1
        assert OverflowCheck()(gs, inv_scale).tolist() == [1.]
    ok = [torch.tensor([1., -4.], device=DEVICE).to(torch.bfloat16), torch.tensor([2.], device=DEVICE)]
    assert OverflowCheck()(ok, .5, with_max=True).tolist() == [0., 2.]
    assert ok[0].tolist() == [.5, -2.] and ok[1].tolist() == [1.]

def test_overflow_check_by_zero_clears():
    "Unscaling by 0 checks and clears in one pass (`MixedPrecision` at scale 1): finite -> 0, inf/NaN -> NaN."
    g = torch.tensor([3., -2., 0.], device=DEVICE).to(torch.bfloat16)
    assert OverflowCheck()([g], 0.).tolist() == [0.] and not g.any()
    g = torch.tensor([3., INF, -2.], device=DEVICE).to(torch.bfloat16)
    assert OverflowCheck()([g], 0.).tolist() == [1.] and g[[0, 2]].eq(0).all() and g[1].isnan()

# ---- the skipped step during a fit ----------------------------------------------------------------------------

def _overflow_recorder():
    mp = lambda l: l.mixed_precision
    return Record(after_backward=lambda l: (clones(flat_pgs(mp(l).master_pgs)), clones(flat_pgs(mp(l).model_pgs)),
                                            mp(l).loss_scale),
                  after_step=lambda l: (clones(flat_pgs(mp(l).master_pgs)), clones(flat_pgs(mp(l).model_pgs)),
                                        [None if p.grad is None else p.grad.clone() for p in flat_pgs(mp(l).model_pgs)],
                                        mp(l).loss_scale, mp(l).skipped))

@pytest.mark.parametrize('where,value', [('grad', INF), ('grad', NAN), ('loss', INF)])
@pytest.mark.parametrize('flat', [False, True])
def test_overflow_skips_step(where, value, flat):
    learn = make_learner()
    learn.to_fp16(max_loss_scale=2.**8, flat_master=flat)
    rec = _overflow_recorder()
    quiet_fit(learn, 1, lr=1e-2, cbs=[Inject([1], value, where), rec])
    mp_skips = learn.mixed_precision.skips
    assert mp_skips == [False, True, False, False]
    (m_before, p_before, s_before), (m_after, p_after, grads, s_after, _) = rec.log['after_backward'][1], rec.log['after_step'][1]
    assert all(torch.equal(a, b) for a, b in zip(m_before, m_after))  # masters bit-identical
    assert all(torch.equal(a, b) for a, b in zip(p_before, p_after))  # model untouched
    assert all(g is None or not g.any() for g in grads)  # model grads cleared (no inf left for the next step)
    assert s_after == s_before / 2  # divided by div_factor
    # the clean steps around it did move the masters
    for i in (0, 2):
        (mb, _, _), (ma, _, _, _, _) = rec.log['after_backward'][i], rec.log['after_step'][i]
        assert any(not torch.equal(a, b) for a, b in zip(mb, ma))
    assert all(torch.isfinite(p).all() for p in learn.model.parameters())

@pytest.mark.parametrize('flat', [False, True])
def test_overflow_skips_step_at_scale_one(flat):
    "bf16 at scale 1 checks the 16-bit grads (no unscale pass): an inf/NaN still skips the step and leaves no trace."
    learn = make_learner()
    learn.to_bf16(flat_master=flat)
    rec = _overflow_recorder()
    quiet_fit(learn, 1, lr=1e-2, cbs=[Inject([1], NAN), rec])
    assert learn.mixed_precision.skips == [False, True, False, False] and learn.mixed_precision.scales == [1.] * 4
    (m_before, p_before, _), (m_after, p_after, grads, _, _) = rec.log['after_backward'][1], rec.log['after_step'][1]
    assert all(torch.equal(a, b) for a, b in zip(m_before, m_after))
    assert all(torch.equal(a, b) for a, b in zip(p_before, p_after))
    assert all(g is None or not g.any() for g in grads)
    assert all(torch.isfinite(p).all() for p in learn.model.parameters())

def test_overflow_with_adam_leaves_state_untouched():
    from fastai.basics import Adam
    learn = make_learner(opt_func=Adam)
    learn.to_fp16(max_loss_scale=2.**8)
    state = lambda l: [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in l.opt.state[m].items()}
                       for m in flat_pgs(l.mixed_precision.master_pgs)]
    rec = Record(after_backward=state, after_step=state)
    quiet_fit(learn, 1, lr=1e-2, cbs=[Inject([2]), rec])
    for a, b in zip(rec.log['after_backward'][2], rec.log['after_step'][2]):
        assert a['step'] == b['step'] == 2
        assert torch.equal(a['grad_avg'], b['grad_avg']) and torch.equal(a['sqr_avg'], b['sqr_avg'])

def test_natural_overflow_at_default_scale_backs_off():
    "With seed 001's start (2**24, now explicit) the first fp16 grads overflow; the scale halves until they fit."
    learn = make_learner(n_train=256)
    learn.to_fp16(loss_scale=2.**24)
    quiet_fit(learn, 1, lr=1e-2)
    mp = learn.mixed_precision
    assert mp.scales[0] == 2.**24 and mp.skips[0]
    assert not mp.skips[-1] and mp.scales[-1] < 2.**24
    for s0, s1, skip in zip(mp.scales, mp.scales[1:], mp.skips):
        assert s1 == (s0 / 2 if skip else s0)  # halved on each overflow, never grown (scale_wait=500)

# ---- dynamic growth, cap, static --------------------------------------------------------------------------------

@pytest.mark.parametrize('factor', [2., 4.])
def test_growth_after_scale_wait_and_cap(factor):
    learn = make_learner(n_train=160)  # 10 steps
    learn.to_fp16(loss_scale=2.**8, max_loss_scale=2.**8, div_factor=factor, scale_wait=2)
    quiet_fit(learn, 1, lr=1e-3, cbs=Inject([0, 1]))
    mp = learn.mixed_precision
    top = 2.**8
    assert mp.skips == [True, True] + [False]*8
    # two overflows: top/f, top/f**2; two clean steps: * f; two more: * f (back to top); then capped at top
    assert mp.scales == [top, top/factor, top/factor**2, top/factor**2, top/factor, top/factor, top, top, top, top]
    assert mp.loss_scale == top

def test_cap_never_exceeded_without_overflow():
    learn = make_learner()
    learn.to_fp16(loss_scale=2.**6, max_loss_scale=2.**6, scale_wait=1)
    quiet_fit(learn, 1, lr=1e-3)
    mp = learn.mixed_precision
    assert mp.scales == [2.**6]*4 and mp.loss_scale == 2.**6

@pytest.mark.parametrize('scale', [1., 512., 1000.])
def test_static_scale_stays(scale):
    learn = make_learner()
    learn.to_fp16(dynamic=False, loss_scale=scale, scale_wait=1)
    rec = Record(before_backward=lambda l: (l.loss_grad.item(), l.loss.item()))
    quiet_fit(learn, 1, lr=1e-2, cbs=[Inject([1]), rec])
    mp = learn.mixed_precision
    assert mp.scales == [scale]*4 and mp.loss_scale == scale
    assert mp.skips == [False, True, False, False]  # an overflowing step is still skipped
    for lg, l in rec.log['before_backward']: assert lg == pytest.approx(l * scale, rel=1e-6)

# ---- clipping --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('clip_global', [False, True])
@pytest.mark.parametrize('clip', [1e-3, 0.1, 1e3])
def test_clip_unscaled_master_grads(clip, clip_global, per_param_steps):
    "Each param group's norm (seed 001), or with `clip_global` the norm over all groups, as fastai's `GradientClip`."
    learn = make_learner()
    learn.to_fp16(dynamic=False, loss_scale=128., clip=clip, clip_global=clip_global)
    mp = lambda l: l.mixed_precision
    # (read in `after_backward`: a callback that handles `before_step` after ours sees the grads unscaled, in 16 bits)
    rec = Record(after_backward=lambda l: [[p.grad.clone() for p in pg] for pg in mp(l).model_pgs])
    rec_where = Record(after_backward=lambda l: {id(m): (gi, i) for gi, mg in enumerate(mp(l).master_pgs) for i, m in enumerate(mg)})
    spy = StepSpy()  # the master grads as the optimizer steps with them (in the masters' buffer order)
    quiet_fit(learn, 1, lr=1e-2, cbs=[rec, rec_where, spy])
    where = rec_where.log['after_backward'][0]  # each master's (group, place in it)
    stepped = [[[g for _, g in sorted(((where[id(p)], g) for p, g in step if where[id(p)][0] == gi), key=lambda o: o[0])]
                 for gi in range(2)] for step in spy.steps]
    assert len(stepped) == 4 and len(stepped[0]) == 2  # 4 steps, 2 param groups
    for g16, gm in zip(rec.log['after_backward'], stepped):
        if clip_global: g16, gm = [[g for pg in g16 for g in pg]], [[g for pg in gm for g in pg]]
        for pg16, pgm in zip(g16, gm):
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in pgm]))
            assert norm <= clip * (1 + 1e-5)
            # the FP32 reference: unscale the 16-bit grads in FP32, clip the (group's or global) norm to `clip`
            ref = [nn.Parameter(torch.zeros_like(g, dtype=torch.float32)) for g in pg16]
            for r, g in zip(ref, pg16): r.grad = g.float().clone()  # (the grads arrive FP32 and unscaled)
            total = nn.utils.clip_grad_norm_(ref, clip)
            for r, g in zip(ref, pgm): torch.testing.assert_close(g, r.grad, rtol=1e-6, atol=1e-9)
            if total > clip: assert norm.item() == pytest.approx(clip, rel=1e-4)  # clipping was active here (.item(): a CUDA norm too)
    if clip == 1e-3:  # grads of this regression are ~0.1-10: the small clip must have acted on every step
        assert all(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in pg])) > 1e-3
                   for g16 in rec.log['after_backward'] for pg in g16)

# ---- one host synchronisation per step ---------------------------------------------------------------------------

@pytest.mark.parametrize('kwargs', [dict(), dict(clip=1.), dict(flat_master=True, clip=.1), dict(dynamic=False),
                                    dict(scaler='lognormal'), dict(dtype=torch.bfloat16, loss_scale=1., dynamic=False)])
def test_one_host_sync_per_step(monkeypatch, kwargs):
    """MixedPrecision's step work reads one value back from the device per step, whatever the number of params, and
    makes no tensor of host data (a blocking copy on CUDA). At scale 1 on a CPU the check sums bf16 grads (one cheap
    pass): a step whose sums are not finite (the injected inf) reads the exact check's verdict too. Before: the largest
    |grad| was unscaled by a tensor made of a Python list, a second sync per step on CUDA where a scaler reads it (the
    lognormal one every step, the calibrating step of the dynamic one): seen on an H100 by `test_cuda`."""
    from fp16cb import MixedPrecision
    calls = count_host_reads(monkeypatch, MixedPrecision)
    learn = make_learner().to_fp16(max_loss_scale=2.**8, **kwargs)
    quiet_fit(learn, 1, lr=1e-2, cbs=Inject([2]))
    monkeypatch.undo()
    assert len(learn.mixed_precision.skips) == 4
    bf16 = kwargs.get('dtype') == torch.bfloat16
    summed = bf16 and DEVICE.type == 'cpu'
    said = bf16  # a bf16 fit's first skip, never normal, is said at once naming its params: one read more, that step
    assert calls == ['tolist'] * (4 + summed + said), calls  # one per step (the skipped one included), 6 params, 2 groups

def test_summed_check_is_exact():
    """The CPU check that sums the grads (scale 1) says 'overflow' only for an inf/NaN: finite bf16 grads whose sum
    overflows the dtype are confirmed finite by the exact check (and the step is taken); an inf is found either way."""
    from fp16cb.scaling import OverflowCheck
    big = torch.full((4,), 3e38, dtype=torch.bfloat16)  # finite, sums past bf16's range
    check = OverflowCheck()
    assert check([big], 1.).item() == 1. and check.approx  # the sum's verdict: to be confirmed
    assert check.exact([big]).item() == 0.
    assert check.exact([torch.tensor([1., float('-inf')]).bfloat16()]).item() == 1.
    from fp16cb import MixedPrecision
    from fastai.callback.core import Callback
    class Huge(Callback):
        order = 5  # before MixedPrecision's before_step: one grad's finite values sum past the range
        def before_step(self):
            p = next(q for q in self.learn.model.parameters() if q.grad is not None and q.grad.numel() >= 4)
            if self.iter == 1: p.grad.view(-1)[:4] = 3e38
    learn = make_learner().to_bf16()
    quiet_fit(learn, 1, lr=1e-9, cbs=Huge())
    assert learn.mixed_precision.skips == [False] * len(learn.mixed_precision.skips)

# ---- property: the fused check agrees with a plain one -----------------------------------------------------------

from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

_floats = st.floats(allow_nan=True, allow_infinity=True, width=32)

@settings(max_examples=40, deadline=None)
@given(st.lists(arrays('float32', st.integers(1, 6), elements=_floats), min_size=1, max_size=12),
       st.integers(-4, 12))
def test_overflow_check_matches_reference(arrs, log2_scale):
    grads = [torch.from_numpy(a.copy()).to(DEVICE) for a in arrs]
    expect_found = any(ov.test_overflow(g) for g in grads)
    assert grad_overflow([[_p(g)] for g in grads]) == expect_found
    inv = 2.**-log2_scale
    ref = [g * inv for g in grads]
    found = OverflowCheck()(grads, inv, with_max=True).tolist()
    assert (found[0] > 0) == expect_found
    if not expect_found:  # unscaled in place, exactly (a power of 2), and the max |grad| of the unscaled grads
        assert all(torch.equal(g, r) for g, r in zip(grads, ref))
        assert found[1] == max(float(r.abs().max()) for r in ref)

def _p(g):
    p = nn.Parameter(torch.zeros_like(g)); p.grad = g
    return p

def test_overflow_later_in_the_run_still_backs_off_and_grows():
    learn = make_learner(n_train=160).to_fp16(scale_wait=3)
    quiet_fit(learn, 1, lr=1e-3, cbs=Inject([4]))
    sc, sk = learn.mixed_precision.scales, learn.mixed_precision.skips
    assert sk == [False]*4 + [True] + [False]*5 and sc[0] == 1.
    assert sc[5] == sc[4] / 2 and sc[8] == sc[4]  # halved on the overflow, grown back after 3 clean steps
