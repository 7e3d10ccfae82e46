"""FP32 master weights: the seed API (get_master, to_master_grads, to_model_params, copy_clone), the update they get
during a fit, flat masters, param groups + freeze, and the exact FP32 weights and optimizer state after the fit;
params that are not FP32 (complex, float64) train in their own dtype, one param in two groups is refused, and after a
fit every param owns its storage."""
import io, re
from functools import partial
import pytest
import torch
from torch import nn
from fastai.basics import SGD, Adam
from fastai.optimizer import Optimizer, sgd_step
from fastai.torch_core import trainable_params
from fp16cb import get_master, to_master_grads, to_model_params, copy_clone, convert_network
from conftest import make_learner, quiet_fit, tiny_model, two_groups, Record, StepSpy, clones, flat_pgs, seed_all, DEVICE, to_mode

# Loss scale small enough that this tiny regression never overflows in fp16 (|grad| * 2**8 << 65504).
NO_OVERFLOW = dict(max_loss_scale=2.**8)

def half_opt(flat_frozen=False):
    seed_all(0)
    m = convert_network(tiny_model().to(DEVICE), torch.float16)
    opt = SGD(two_groups(m), lr=0.1)
    if flat_frozen: m[0].bias.requires_grad_(False)
    return m, opt

# ---- seed API -------------------------------------------------------------------------------------------------

def test_get_master_per_group():
    m, opt = half_opt(flat_frozen=True)
    model_pgs, master_pgs = get_master(opt)
    assert len(model_pgs) == len(master_pgs) == 2
    assert [len(pg) for pg in model_pgs] == [3, 2]  # body: Linear weight (bias frozen), BN weight+bias; head: 2
    assert all(p is not m[0].bias for p in model_pgs[0])
    for pg, mg in zip(model_pgs, master_pgs):
        for p, mp in zip(pg, mg):
            assert isinstance(mp, nn.Parameter) and mp.requires_grad and mp.dtype == torch.float32
            assert torch.equal(mp.data, p.data.float())
            assert mp.data_ptr() != p.data_ptr()  # a copy: stepping it must not touch the model

def test_get_master_flat():
    m, opt = half_opt()
    model_pgs, master_pgs = get_master(opt, flat_master=True)
    assert [len(mg) for mg in master_pgs] == [1, 1]  # SGD has no per-param flags: one flat master per group
    for pg, (flat,) in zip(model_pgs, master_pgs):
        assert flat.dim() == 1 and flat.dtype == torch.float32 and flat.numel() == sum(p.numel() for p in pg)
        assert torch.equal(flat.data, torch.cat([p.data.float().reshape(-1) for p in pg]))
        assert flat.grad is not None and flat.grad.shape == flat.shape

@pytest.mark.parametrize('flat', [False, True])
def test_to_master_grads_and_back(flat):
    m, opt = half_opt()
    model_pgs, master_pgs = get_master(opt, flat_master=flat)
    grads = {}
    for i, p in enumerate(flat_pgs(model_pgs)):
        if i == 1: p.grad = None; continue  # a param without gradient
        p.grad = torch.randn_like(p, dtype=torch.float32).to(p.dtype); grads[p] = p.grad.float()
    to_master_grads(model_pgs, master_pgs, flat_master=flat)
    if flat:
        for pg, (flat_m,) in zip(model_pgs, master_pgs):
            expect = torch.cat([grads[p].reshape(-1) if p in grads else torch.zeros(p.numel(), device=DEVICE) for p in pg])
            assert torch.equal(flat_m.grad, expect)  # a missing grad is zero in a flat master
    else:
        for p, mp in zip(flat_pgs(model_pgs), flat_pgs(master_pgs)):
            if p in grads: assert mp.grad.dtype == torch.float32 and torch.equal(mp.grad, grads[p])
            else: assert mp.grad is None
    # step the masters in FP32, copy back: the model gets them rounded once to its own dtype
    with torch.no_grad():
        for mp in flat_pgs(master_pgs): mp.add_(torch.randn_like(mp) * 1e-3)
    to_model_params(model_pgs, master_pgs, flat_master=flat)
    if flat:
        for pg, (flat_m,) in zip(model_pgs, master_pgs):
            o = 0
            for p in pg:
                assert torch.equal(p.data, flat_m.data[o:o+p.numel()].view_as(p).to(p.dtype)); o += p.numel()
    else:
        for p, mp in zip(flat_pgs(model_pgs), flat_pgs(master_pgs)): assert torch.equal(p.data, mp.data.to(p.dtype))

def test_copy_clone():
    t16, ti = torch.randn(3, device=DEVICE).half(), torch.arange(3, device=DEVICE)
    d = {'grad_avg': t16, 'step': ti, 'do_wd': False, 'lr': 0.1, 'n': None}
    r = copy_clone(d)
    assert r['grad_avg'].dtype == torch.float32 and torch.equal(r['grad_avg'], t16.float())
    assert r['step'].dtype == torch.long and torch.equal(r['step'], ti) and r['step'].data_ptr() != ti.data_ptr()
    assert r['do_wd'] is False and r['lr'] == 0.1 and r['n'] is None
    r['step'] += 1; assert torch.equal(ti, torch.arange(3, device=DEVICE))  # a clone, not a view
    x = torch.randn(2, device=DEVICE, requires_grad=True)
    assert not copy_clone({'x': x * 2})['x'].requires_grad  # detached
    assert set(r) == set(d)

# ---- the update during a fit ----------------------------------------------------------------------------------

def _step_recorder():
    """At after_backward: the 16-bit model grads; at before_step (after MixedPrecision unscaled, and cleared the 16-bit
    grads): the masters and lr; at after_step: the masters and the model."""
    mp = lambda l: l.mixed_precision
    return Record(
        after_backward=lambda l: clones(p.grad for p in flat_pgs(mp(l).model_pgs)),
        before_step=lambda l: (clones(flat_pgs(mp(l).master_pgs)), mp(l).loss_scale, [h['lr'] for h in l.opt.hypers],
                               [len(pg) for pg in mp(l).master_pgs]),
        after_step=lambda l: (clones(flat_pgs(mp(l).master_pgs)), clones(flat_pgs(mp(l).model_pgs))))

@pytest.mark.parametrize('dtype,wd,one_cycle', [(torch.float16, 0., False), (torch.bfloat16, 0., False),
                                                (torch.float16, .1, False), (torch.float16, .1, True)])
def test_master_update_is_fp32_sgd_of_unscaled_grads(dtype, wd, one_cycle):
    learn = make_learner(wd=wd)
    learn.to_fp16(dtype=dtype, dynamic=False, loss_scale=64.)  # a fixed scale: the grads are 64x the true ones
    rec = _step_recorder()
    wd_of = Record(before_fit=lambda l: [l.opt.state[p].get('do_wd', True) for p in flat_pgs(l.mixed_precision.master_pgs)])
    kw = dict(one_cycle=True, moms=(0., 0., 0.)) if one_cycle else {}  # one cycle: lr (and mom, kept 0) scheduled
    quiet_fit(learn, 1, lr=slice(1e-3, 1e-1), cbs=[rec, wd_of], **kw)  # discriminative lrs: a different lr per group
    do_wd = wd_of.log['before_fit'][0]
    assert do_wd == [True, False, False, False, True, False]  # fastai: no wd on BatchNorm and biases
    assert len(rec.log['before_step']) == 4 == len(rec.log['after_step'])
    all_lrs = set()
    steps = zip(rec.log['after_backward'], rec.log['before_step'], rec.log['after_step'])
    for g16, (before, scale, lrs, sizes), (after, model) in steps:
        assert scale == 64. and lrs[0] < lrs[1]
        all_lrs.add(tuple(lrs))
        lr_of = [lr for lr, n in zip(lrs, sizes) for _ in range(n)]
        for g, m0, m1, p, lr, dwd in zip(g16, before, after, model, lr_of, do_wd):
            assert m0.dtype == m1.dtype == torch.float32
            # FP32 SGD (mom=0; decoupled wd on the FP32 master, where the param's flag allows) of the unscaled
            # grad: the model's FP32 grad arrived unscaled (the 16-bit grad -> FP32 exactly, / 64 exactly)
            m = m0.mul(1 - lr*wd) if wd and dwd else m0
            assert g.dtype == torch.float32 and torch.equal(m1, m.add(g, alpha=-lr))
            assert torch.equal(p, m1.to(p.dtype))  # the model holds the master rounded once
    assert len(all_lrs) == (4 if one_cycle else 1)  # the scheduler's lrs reached the optimizer of the masters

def test_master_update_keeps_small_steps():
    "An update far below fp16's resolution of the weight accumulates in the FP32 master (problem 1 of the seed)."
    learn = make_learner()
    learn.to_fp16(**NO_OVERFLOW)
    w0 = learn.model[3].weight.detach().clone()
    quiet_fit(learn, 2, lr=1e-6)
    w1 = learn.model[3].weight.detach()
    assert w1.dtype == torch.float32
    changed = (w1 != w0)
    assert changed.any()  # the FP32 masters moved ...
    # ... by 8 steps of lr*|grad| < 3e-6 each: below half an fp16 ulp at |w| >= 0.06 (3e-5), so an fp16 weight
    # stepped in fp16 would never have moved
    assert (w1 - w0).abs().max() < 1e-4

# ---- exact weights and optimizer state after the fit ----------------------------------------------------------

@pytest.mark.parametrize('flat', [False, True])
def test_model_holds_masters_exactly_after_fit(flat):
    learn = make_learner()
    learn.to_fp16(flat_master=flat, **NO_OVERFLOW)
    def masters_by_param(l):
        mp = l.mixed_precision
        views = mp.store.fp32_views()
        return {id(p): (p.dtype, views[p].detach().clone()) for p in flat_pgs(mp.model_pgs)}
    rec = Record(train_only=False, after_train=masters_by_param)
    quiet_fit(learn, 2, lr=1e-2, cbs=rec)
    final = rec.log['after_train'][-1]
    params = dict((id(p), p) for p in learn.model.parameters())
    assert set(final) == set(params)
    not_fp16_exact = 0
    for k, (dt, master) in final.items():
        p = params[k]
        assert p.dtype == torch.float32 and torch.equal(p.data, master)  # bitwise the master
        not_fp16_exact += int(not torch.equal(master.half().float(), master))
    assert not_fp16_exact > 0  # so a model rounded through fp16 would fail this test
    assert all(t.dtype == torch.float32 for t in learn.model.state_dict().values() if t.is_floating_point())

def test_frozen_params_bit_identical_and_freeze_unfreeze():
    learn = make_learner(opt_func=Adam)
    learn.to_fp16(**NO_OVERFLOW)
    learn.freeze()  # body Linear frozen; BatchNorm stays trainable (train_bn)
    w0, b0 = learn.model[0].weight.detach().clone(), learn.model[0].bias.detach().clone()
    head0 = learn.model[3].weight.detach().clone()
    seen = Record(before_step=lambda l: [[(p.dtype, tuple(p.shape)) for p in pg] for pg in l.mixed_precision.model_pgs])
    quiet_fit(learn, 1, lr=1e-2, cbs=seen)
    assert len(seen.log['before_step'][0][0]) == 2  # only the BN weight+bias of the body group train
    assert torch.equal(learn.model[0].weight, w0) and torch.equal(learn.model[0].bias, b0)  # bit-identical
    assert learn.model[0].weight.dtype == torch.float32
    assert not torch.equal(learn.model[3].weight, head0)
    learn.unfreeze()
    rec = Record(before_step=lambda l: ([h['lr'] for h in l.opt.hypers], [len(pg) for pg in l.mixed_precision.master_pgs]))
    quiet_fit(learn, 1, lr=slice(1e-4, 1e-2), cbs=rec)
    lrs, sizes = rec.log['before_step'][0]
    assert sizes == [4, 2] and lrs[0] < lrs[1]
    assert not torch.equal(learn.model[0].weight, w0)  # unfrozen: trained now
    assert learn.model[0].weight.dtype == torch.float32

def _fp32_vs_fp16_freeze_run(fp16):
    learn = make_learner(opt_func=Adam)
    if fp16: learn.to_fp16(**NO_OVERFLOW)
    learn.freeze(); quiet_fit(learn, 1, lr=1e-2)
    learn.unfreeze(); quiet_fit(learn, 1, lr=slice(1e-3, 1e-2))
    return learn

def test_freeze_unfreeze_matches_fp32_run():
    a, b = _fp32_vs_fp16_freeze_run(False), _fp32_vs_fp16_freeze_run(True)
    # 8 Adam steps of lr <= 1e-2 from the same init: fp16's 11-bit mantissa perturbs each grad by ~5e-4 relative,
    # Adam normalises them, so each weight ends within ~1e-4 of the FP32 run (measured <= 1e-4); 2e-3 leaves room.
    # Skipped: the bias of the Linear before the BatchNorm. BN removes it, its true grad is 0, and Adam turns the
    # rounding noise of a zero grad into full-size steps in either direction, in FP32 as much as in fp16.
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        if n != '0.bias': torch.testing.assert_close(q, p, atol=2e-3, rtol=0)
    assert not torch.equal(a.model[3].weight, b.model[3].weight)  # they did train in different precisions

def test_optimizer_back_on_model_params_with_state():
    learn = make_learner(opt_func=Adam)
    learn.to_fp16(**NO_OVERFLOW)
    quiet_fit(learn, 1, lr=1e-2)
    params = list(learn.model.parameters())
    in_opt, expect = [p for pg in learn.opt.param_lists for p in pg], flat_pgs(two_groups(learn.model))
    assert len(in_opt) == len(expect) and all(p is q for p, q in zip(in_opt, expect))  # the very same objects
    ids = {id(p) for p in params}
    assert all(id(p) in ids for pg in learn.opt.param_lists for p in pg)
    assert all(id(k) in ids for k in learn.opt.state)  # no master left in the state
    for p in params:
        st = learn.opt.state[p]
        assert st['grad_avg'].shape == p.shape and st['grad_avg'].dtype == torch.float32
        assert st['sqr_avg'].shape == p.shape and st['step'] == 4
    # state carries over into the next fit (Adam's step count goes on) and back again
    quiet_fit(learn, 1, lr=1e-2)
    assert all(learn.opt.state[p]['step'] == 8 for p in learn.model.parameters())
    bn_w = learn.model[1].weight
    assert learn.opt.state[bn_w]['do_wd'] is False and learn.opt.state[bn_w]['force_train'] is True

# ---- flat masters ---------------------------------------------------------------------------------------------

def _run(flat, opt_func, precision=True, wd=None, n_epoch=2):
    learn = make_learner(opt_func=opt_func, **({} if wd is None else {'wd': wd}))
    if precision: learn.to_fp16(flat_master=flat, **NO_OVERFLOW)
    quiet_fit(learn, n_epoch, lr=1e-2)
    return learn

def test_flat_master_same_training_as_per_param_sgd():
    a, b = _run(False, partial(SGD, mom=0.9)), _run(True, partial(SGD, mom=0.9))
    # the same elementwise FP32 ops on the same values: equal up to float rounding of the fused/unfused kernels
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(b.opt.state[q]['grad_avg'], a.opt.state[p]['grad_avg'], rtol=1e-6, atol=1e-7)

def test_flat_master_lays_out_the_params_per_flag():
    """`flat_master` lays each group's FP32 params out in one buffer, those of one set of optimizer flags together
    (fastai marks BN and bias params `do_wd=False`): each set steps as one flat tensor, and the state stays per param,
    equal to the per-param run's and near FP32's."""
    learn = make_learner(opt_func=Adam, wd=0.5)
    learn.to_fp16(flat_master=True, **NO_OVERFLOW)
    def spans(l):
        res = []
        for pg in l.opt.param_lists:
            ps = sorted([p for p in pg if p.requires_grad], key=lambda p: p.data_ptr())
            res.append(([p.untyped_storage().data_ptr() for p in ps], [l.opt.state[p].get('do_wd', True) for p in ps],
                        [(p.data_ptr(), p.numel() * p.element_size()) for p in ps]))
        return res
    rec = Record(before_step=spans)
    quiet_fit(learn, 2, lr=1e-2, cbs=rec)
    for storages, wds, addr in rec.log['before_step'][0]:
        assert len(set(storages)) == 1  # one buffer per group
        assert all(a + n == b for (a, n), (b, _) in zip(addr, addr[1:]))  # one after the other
        assert len([w for w, v in zip(wds, wds[1:]) if w != v]) == 1  # those of one flag together: two spans
    body, head = rec.log['before_step'][0]
    assert sorted(body[1]) == [False, False, False, True] and sorted(head[1]) == [False, True]
    ref = _run(False, Adam, wd=0.5)
    fp32 = _run(False, Adam, precision=False, wd=0.5)
    for (n, p), q, r in zip(ref.model.named_parameters(), learn.model.parameters(), fp32.model.parameters()):
        assert q.dtype == torch.float32
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)  # flat == per-param (same FP32 update math)
        for k in ('grad_avg', 'sqr_avg'):  # state split back per param, shaped like it
            assert learn.opt.state[q][k].shape == q.shape
            torch.testing.assert_close(learn.opt.state[q][k], ref.opt.state[p][k], rtol=1e-5, atol=1e-7)
        assert learn.opt.state[q].get('do_wd', True) == ref.opt.state[p].get('do_wd', True)
        assert learn.opt.state[q]['step'] == ref.opt.state[p]['step'] == 8
        # and against FP32 training (tolerance and the skipped BN-cancelled bias: see test_freeze_unfreeze_matches_fp32_run)
        if n != '0.bias': torch.testing.assert_close(q, r, atol=2e-3, rtol=0)
    # wrongly shared flags would decay the biases by wd*lr per step (0.5%): the per-param run would then differ
    assert len(learn.opt.state) == len(list(learn.model.parameters()))

def _freeze_run(flat):
    learn = make_learner(opt_func=Adam, wd=.1)
    learn.to_fp16(flat_master=flat, **NO_OVERFLOW)
    learn.freeze(); quiet_fit(learn, 1, lr=1e-2)
    learn.unfreeze(); quiet_fit(learn, 1, lr=slice(1e-3, 1e-2))
    return learn

def test_flat_master_freeze_unfreeze_matches_per_param():
    "Flat masters through freeze -> fit -> unfreeze -> fit (discriminative lrs) train like per-param masters."
    a, b = _freeze_run(False), _freeze_run(True)
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert q.dtype == torch.float32
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
        sa, sb = a.opt.state[p], b.opt.state[q]
        assert set(sa) == set(sb) and sa['step'] == sb['step']
        for k in ('grad_avg', 'sqr_avg'): torch.testing.assert_close(sb[k], sa[k], rtol=1e-5, atol=1e-7)
    # fastai's freeze_to clears the optimizer state: every param's Adam step count restarted at unfreeze
    assert all(b.opt.state[p]['step'] == 4 for p in b.model.parameters())

@pytest.mark.parametrize('flat', [False, True])
def test_optim_wrapper_torch_state_follows_the_params(flat):
    "With a torch optimizer (`OptimWrapper`), its own state too must go to the masters and come back."
    from fastai.optimizer import OptimWrapper
    def run(precision):
        learn = make_learner(opt_func=partial(OptimWrapper, opt=torch.optim.AdamW))
        if precision: learn.to_fp16(flat_master=flat, **NO_OVERFLOW)
        quiet_fit(learn, 1, lr=1e-2)
        return learn
    learn, ref = run(True), run(False)
    st = learn.opt.opt.state
    ids = {id(p) for p in learn.model.parameters()}
    assert len(st) == 6 and all(id(k) in ids for k in st)  # keyed by the model's params, no master left behind
    for p, q in zip(learn.model.parameters(), ref.model.parameters()):
        assert float(st[p]['step']) == 4 and st[p]['exp_avg'].shape == p.shape and st[p]['exp_avg'].dtype == torch.float32
        # same tolerance as test_freeze_unfreeze_matches_fp32_run (4 AdamW steps of lr 1e-2 on fp16 grads)
        torch.testing.assert_close(st[p]['exp_avg_sq'], ref.opt.opt.state[q]['exp_avg_sq'], rtol=2e-2, atol=1e-6)
    quiet_fit(learn, 1, lr=1e-2)
    assert len(st) == 6 and all(float(st[p]['step']) == 8 for p in learn.model.parameters())  # state went on

class _CountingSGD(Optimizer):
    "A fastai optimizer whose own `zero_grad` does more than zeroing: it must be left in charge."
    calls = 0
    def zero_grad(self):
        type(self).calls += 1
        super().zero_grad()

@pytest.mark.parametrize('flat', [False, True])
def test_masters_are_the_params_and_every_element_steps_once(flat):
    """The masters are the model's FP32 params, laid out flat or not: their FP32 grads are FP32 fastai's, from the
    backward to `zero_grad`, and the optimizer steps every element once; fastai's own `zero_grad` stays (nothing of ours
    to zero), also after a fit interrupted mid-step; an optimizer with its own `zero_grad` keeps it."""
    learn = make_learner()
    learn.to_fp16(flat_master=flat, max_loss_scale=2.**8)
    rec = Record(before_batch=lambda l: [p.grad for p, *_ in l.opt.all_params()],
                 before_step=lambda l: [p.grad for p, *_ in l.opt.all_params()],
                 after_epoch=lambda l: 'zero_grad' in vars(l.opt))
    rec.order = 5  # before ours: a `before_step` after ours would see the grads unscaled for it (another path)
    spy = StepSpy(lambda p: (p.dtype, p.grad.dtype, p.grad.data_ptr()))
    quiet_fit(learn, 1, lr=1e-2, cbs=[rec, spy])
    assert len(spy.steps) == 4 and all(dt == gdt == torch.float32 for step in spy.steps for _, (dt, gdt, _) in step)
    n = len(list(learn.model.parameters()))
    assert all(len({id(p) for p, _ in step}) == len(step) for step in spy.steps)  # each master stepped once per step
    # the model's own FP32 params and grads (laid out flat or not), as FP32 fastai: grads from the backward to `zero_grad`
    assert all(g is None or not g.any() for gs in rec.log['before_batch'] for g in gs)  # fastai's zero_grad zeroes
    assert all(g.dtype == torch.float32 for gs in rec.log['before_step'] for g in gs)
    # every element stepped once: fastai's loop steps runs of consecutive params as one flat tensor (`FusedLoop`); laid
    # out flat, a few runs per group
    assert sum(p.numel() for p, _ in spy.steps[0]) == sum(p.numel() for p in learn.model.parameters())
    assert (2 <= len(spy.steps[0]) < n) if flat else len(spy.steps[0]) <= n
    assert rec.log['after_epoch'] == [False] and 'zero_grad' not in vars(learn.opt)
    boom = Record(after_step=lambda l: 1 / 0)  # a fit interrupted mid-step gives the optimizer its zero_grad back too
    with pytest.raises(ZeroDivisionError): quiet_fit(learn, 1, lr=1e-2, cbs=boom)
    assert 'zero_grad' not in vars(learn.opt) and learn.model[0].weight.dtype == torch.float32
    _CountingSGD.calls = 0
    learn2 = make_learner(opt_func=lambda ps, lr: _CountingSGD(ps, [sgd_step], lr=lr))
    learn2.to_fp16(flat_master=flat, max_loss_scale=2.**8)
    quiet_fit(learn2, 1, lr=1e-2)
    assert _CountingSGD.calls == 4 and 'zero_grad' not in vars(learn2.opt)

# ---- params that are not FP32: complex and float64 train in their own dtype, outside the masters ----------------

def flat_kw(mode, flat): return {} if mode == 'fp32' else {'flat_master': flat}

class WithComplex(nn.Module):
    "A linear model plus a term of a complex parameter `c` (which gets a complex grad)."
    def __init__(self):
        super().__init__()
        self.lin, self.c = nn.Linear(4, 1), nn.Parameter(torch.tensor([1+2j, 3-4j]))
    def forward(self, x): return self.lin(x) + (x[:, :2] * self.c).abs().sum(1, keepdim=True) * .1

def own_dtype_run(model_cls, attr:str, mode, flat=False):
    "Train `model_cls()` in `mode`: the final value of its param `attr`, and that param's dtype at each batch."
    seed_all(); model = model_cls()
    learn = to_mode(make_learner(model=model, splitter=trainable_params), mode, **flat_kw(mode, flat))
    dtypes = Record(before_batch=lambda l: getattr(l.model, attr).dtype)
    quiet_fit(learn, 1, lr=1e-1, cbs=dtypes)
    return getattr(learn.model, attr).detach().clone(), dtypes.log['before_batch']

def complex_run(mode, flat=False): return own_dtype_run(WithComplex, 'c', mode, flat)

@pytest.mark.parametrize('flat', [False, True])
@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
def test_complex_param_trains_in_its_own_dtype(mode, flat):
    """Before the fix: fp16 kept the real part only (`[1+2j, 3-4j]` -> `[0.99+0j, 2.99+0j]`: the master was
    `c.float()`); bf16 died with `NotImplementedError ... 'ComplexFloat'` in the overflow check."""
    c0 = torch.tensor([1+2j, 3-4j], device=DEVICE)  # WithComplex's initial `c`, where the runs train it
    ref, _ = complex_run('fp32')
    c, dtypes = complex_run(mode, flat)
    assert set(dtypes) == {torch.complex64} and c.dtype == torch.complex64  # never altered to real, not even mid-fit
    assert c.device == ref.device == c0.device  # and it stays on the model's device
    assert (ref.imag - c0.imag).abs().min() > 1e-3  # the reference moves the imaginary part...
    assert torch.allclose(c.imag - c0.imag, ref.imag - c0.imag, rtol=.1, atol=1e-3)  # ...and so does the 16-bit run
    assert torch.allclose(c.real - c0.real, ref.real - c0.real, rtol=.1, atol=1e-3)

class WithDouble(nn.Module):
    "A linear model plus a float64 offset `d`."
    def __init__(self):
        super().__init__()
        self.lin, self.d = nn.Linear(4, 1), nn.Parameter(torch.tensor([.5], dtype=torch.float64))
    def forward(self, x): return self.lin(x) + self.d.float()

def double_run(mode, flat=False): return own_dtype_run(WithDouble, 'd', mode, flat)

@pytest.mark.parametrize('flat', [False, True])
@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
def test_float64_param_keeps_its_dtype(mode, flat):
    "Before the fix: the float64 param was 16-bit during the fit and came back float32 (only float32 params convert)."
    ref, _ = double_run('fp32')
    d, dtypes = double_run(mode, flat)
    assert set(dtypes) == {torch.float64} and d.dtype == torch.float64
    assert abs(ref.item() - .5) > 1e-2 and abs(d.item() - ref.item()) < .1 * abs(ref.item() - .5)

# ---- one parameter in two param groups ------------------------------------------------------------------------

def body_in_both(m):
    "Splitter: the first Linear in both groups."
    return [list(m[0].parameters()), list(m[0].parameters()) + list(m[1].parameters()) + list(m[3].parameters())]

@pytest.mark.parametrize('flat', [False, True])
def test_param_in_two_groups_is_refused(flat):
    """Before the fix: two masters for one param, and only the last group's update survived (lr [0.1, 0]: fp32 moves
    it, bf16 did not)."""
    learn = make_learner(splitter=body_in_both).to_bf16(flat_master=flat)
    with pytest.raises(ValueError, match='group') as e: quiet_fit(learn, 1, lr=[.1, 0.])
    assert re.search(r"0\.(weight|bias)|param\w*\s*#?\d", str(e.value)), str(e.value)  # which parameter

# ---- storage of the params after a non-flat fit ---------------------------------------------------------------

def test_params_own_their_storage_after_a_fit():
    "Before the fix: after a non-flat fit every param was a view into one shared buffer (saving one bias wrote all)."
    learn = to_mode(make_learner(), 'bf16')
    quiet_fit(learn, 1, lr=1e-2)
    for n, p in learn.model.named_parameters():
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), n
        assert p.grad is None or p.grad.untyped_storage().nbytes() == p.grad.numel() * p.grad.element_size(), n
    buf = io.BytesIO(); torch.save(learn.model[3].bias, buf)
    assert len(buf.getvalue()) < 2000
