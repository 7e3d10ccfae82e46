"""Optimizers from other code (issue: the open world), each trained with plain FP32 fastai and the same code, same seed
and data, and in mixed precision: flat masters refused with any optimizer not known to update each element on its own
(a fastai `Optimizer` with a step callback or a `step` of its own, as well as a torch one); a torch optimizer wrapping
another (timm's `Lookahead` around AdamW), whose state lives in the inner one, trains like FP32 over two fits and
saves; 16-bit optimizer state rounds only the moving averages (`fp16cb.compat.MOVING_AVERAGES`), never a weight copy
such as timm MADGRAD's `x0` anchor."""
from functools import partial
import pytest
import torch
from torch import nn
from fastai.basics import Callback
from fastai.optimizer import Optimizer, OptimWrapper
from fastai.torch_core import trainable_params

from fp16cb.compat import MOVING_AVERAGES
from fp16cb.storage import StateStorage
from fp16cb.weights.optstate import opt_state, opt_states
from conftest import make_learner, quiet_fit, weights

BF16 = torch.bfloat16

def _tanh_mlp():
    "4 -> 8 -> 8 -> 1 with tanh (smooth grads), from seed 0."
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))

def _learner(opt_func, mode=None, **kw):
    "A learner on `_tanh_mlp` (one param group), converted by `mode` ('to_fp16', 'to_bf16'; None: FP32) with `kw`."
    learn = make_learner(model=_tanh_mlp(), opt_func=opt_func, splitter=trainable_params)
    return getattr(learn, mode)(**kw) if mode else learn

def _off(got:list, ref:list, w0:list) -> float:
    "The distance of weights `got` from FP32's `ref`, as a fraction of FP32's movement from `w0`."
    d = lambda a, b: torch.cat([(x.float() - y.float()).flatten() for x, y in zip(a, b)]).norm()
    return float(d(got, ref) / d(ref, w0))

def _timm():
    return pytest.importorskip('timm.optim')

# ---- 7. flat masters and an optimizer not known to be elementwise
def trust_step(p, lr, eps=1e-6, **kwargs):
    "A user's step callback: SGD scaled by the ratio of the param's norm to its grad's (LAMB's trust ratio: per param)."
    p.detach().add_(p.grad, alpha=-lr * float(p.detach().norm() / (p.grad.norm() + eps)))

class NormedSGD(Optimizer):
    "A fastai `Optimizer` with a `step` of its own: each param moves by `lr` along its grad's direction (its grad's norm)."
    def step(self, closure=None):
        for p, pg, state, hyper in self.all_params(with_grad=True):
            p.detach().add_(p.grad / (p.grad.norm() + 1e-6), alpha=-hyper['lr'])

def _unknown_opts() -> dict:
    return {'fastai-callback': (partial(Optimizer, cbs=[trust_step]), 'trust_step'),
            'fastai-own-step': (lambda ps, lr, **kw: NormedSGD(ps, [], lr=lr), 'NormedSGD'),
            'timm-lamb': (lambda: partial(OptimWrapper, opt=_timm().Lamb), 'timm.optim.lamb.Lamb'),
            'timm-nvnovograd': (lambda: partial(OptimWrapper, opt=_timm().NvNovoGrad), 'NvNovoGrad'),
            'timm-adafactor-bv': (lambda: partial(OptimWrapper, opt=_timm().AdafactorBigVision), 'AdafactorBigVision')}

@pytest.mark.parametrize('opt', list(_unknown_opts()))
def test_flat_masters_step_an_optimizer_not_known_to_be_elementwise_as_fp32(opt):
    """An optimizer whose step reads a param whole (a trust ratio, a per-tensor norm or second moment, factored
    moments). `flat_master` lays the FP32 params out in one buffer per group, and the optimizer steps each param: it
    trains like FP32, as with the default (2 epochs, bf16: within 2% of FP32's movement). Before: flat masters stepped a
    group as one tensor, where such an optimizer would take the whole group's: a fastai `Optimizer` was refused only
    with LAMB's or LARC's callbacks, and the user's trust-ratio callback trained flat, 0.50 of FP32's movement away from
    FP32's weights; later any optimizer not known to be elementwise was refused."""
    opt_func, name = _unknown_opts()[opt]
    if opt.startswith('timm'): opt_func = opt_func()
    w0 = weights(_learner(opt_func))
    ref = _learner(opt_func)
    quiet_fit(ref, 2, lr=1e-2)
    for kw in ({}, {'flat_master': True}):
        got = _learner(opt_func, 'to_bf16', **kw)
        quiet_fit(got, 2, lr=1e-2)
        assert _off(weights(got), weights(ref), w0) < 0.02, kw

# ---- 8. a torch optimizer wrapping another: timm's Lookahead around AdamW
def _lookahead_adamw(params, **kwargs):
    "timm's `Lookahead` (a slow-weight sync every 3 steps) around torch's AdamW: AdamW's state and the slow weights live in AdamW."
    return _timm().Lookahead(torch.optim.AdamW(params, **kwargs), k=3)

class _StateDtypes(Callback):
    "After each step: the dtypes of every state tensor of the optimizer, by key (all the state dicts it has)."
    order = 90
    def before_fit(self): self.seen = {}
    def after_step(self):
        for st in opt_states(self.learn.opt):
            for d in st.values():
                for k, v in d.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0: self.seen.setdefault(k, set()).add(v.dtype)

@pytest.mark.parametrize('mode,kw,tol', [('to_fp16', {}, .02), ('to_bf16', {}, .02),
                                         ('to_bf16', dict(half_storage=True), .1)], ids=['fp16', 'bf16', 'bf16-half'])
def test_a_torch_optimizer_wrapping_another_keeps_its_state_over_fits_and_saves(mode, kw, tol, tmp_path):
    """timm's `Lookahead(AdamW)` in `OptimWrapper`: the wrapper steps AdamW (its own `step` calls AdamW's) and keeps no
    state of its own: AdamW's moments and step counts, and the slow weights, are in AdamW's state. FP32 fastai keeps them
    across steps and fits. Two fits of 4 steps: the weights within `tol` of FP32's movement from FP32's (masters: 2%,
    bf16 rounding ~0.2%; 16-bit storage: 10%, its weights rounded to bf16 at every step, ~4%), AdamW's state keyed by the
    model's own params with FP32's 8 steps and FP32 slow weights, and `learn.save`/`learn.load` round-trip.
    Before: fp16cb moved only the wrapper's (empty) state: with 16-bit storage AdamW restarted at every step (0.37 off
    after the first fit), with masters at every fit (0.34 off after the second), and `learn.save` raised `KeyError`."""
    ref = _learner(partial(OptimWrapper, opt=_lookahead_adamw))
    w0 = weights(ref)
    fits = []
    for _ in range(2): quiet_fit(ref, 1, lr=1e-2); fits.append(weights(ref))
    learn = _learner(partial(OptimWrapper, opt=_lookahead_adamw), mode, **kw)
    learn.path, probe = tmp_path, _StateDtypes()
    for i in range(2):
        quiet_fit(learn, 1, lr=1e-2, cbs=probe)
        assert _off(weights(learn), fits[i], w0) < tol, f"fit {i + 1}: {_off(weights(learn), fits[i], w0):.3f} off"
    params, base = list(learn.model.parameters()), learn.opt.opt._base_optimizer
    assert {id(k) for k in base.state} == {id(p) for p in params} and not learn.opt.opt.state
    for p in params:
        st = base.state[p]
        assert float(st['step']) == 8 and st['lookahead_slow_buff'].dtype == torch.float32, (float(st['step']), st.keys())
    assert probe.seen['lookahead_slow_buff'] == {torch.float32}  # during the fit too (also with 16-bit storage)
    learn.save('la')
    saved = {id(p): {k: v.clone() for k, v in base.state[p].items()} for p in params}
    w_saved = weights(learn)
    quiet_fit(learn, 1, lr=1e-2)
    learn.load('la')
    base = learn.opt.opt._base_optimizer  # the same AdamW, its state loaded
    assert all(torch.equal(a, b) for a, b in zip(w_saved, weights(learn)))
    for p in learn.model.parameters():
        for k, v in saved[id(p)].items(): assert torch.equal(base.state[p][k].to(v.dtype).cpu(), v.cpu()), k  # ('step': on the CPU before a load)

# ---- 9. 16-bit state: only the moving averages
def test_half_state_rounds_only_the_declared_moving_averages():
    "A state tensor the size of its param is stored in bf16 only when its name is a declared moving average."
    p = torch.zeros(6)
    state = {p: {'exp_avg': torch.full((6,), 1. + 2.**-12), 'x0': torch.full((6,), 1. + 2.**-12),
                 'lookahead_slow_buff': torch.ones(6), 'step': torch.tensor(3.)}}
    StateStorage(BF16, stochastic=False).narrow_all(state)
    assert state[p]['exp_avg'].dtype == BF16 and {'exp_avg', 'exp_avg_sq', 'grad_avg', 'sqr_avg', 'momentum_buffer'} <= MOVING_AVERAGES
    assert state[p]['x0'].dtype == torch.float32 and state[p]['x0'][0].item() == 1. + 2.**-12  # exact
    assert state[p]['lookahead_slow_buff'].dtype == torch.float32 and state[p]['step'].dtype == torch.float32

@pytest.mark.parametrize('kw', [{}, dict(half_storage=True)], ids=['masters', 'half_storage'])
def test_16bit_state_keeps_a_weight_copy_in_fp32(kw):
    """timm's MADGRAD keeps an FP32 copy of the weights in its state (`x0`, the anchor of its dual averaging: each step
    sets the weights from it) and two running sums (`s`, `grad_sum_sq`); none is a moving average. With
    `state_dtype=torch.bfloat16` they stay FP32 during the fit, and the weights end as close to FP32's (same code, seed,
    data; lr 1e-3, 4 steps) as with FP32 state: no more than 1.5x as far. Torch's AdamW beside it: its moments are
    bf16 between steps (the rule still stores them in 16 bits).
    Before: every state tensor the size of its param was rounded, `x0` included: with masters the weights ended 0.047
    of FP32's movement away, 24x as far as with FP32 state (0.002)."""
    madgrad = partial(OptimWrapper, opt=_timm().MADGRAD)
    ref = _learner(madgrad)
    w0 = weights(ref)
    quiet_fit(ref, 1, lr=1e-3)
    off = {}
    for sd in (None, BF16):
        learn, probe = _learner(madgrad, 'to_bf16', state_dtype=sd, **kw), _StateDtypes()
        quiet_fit(learn, 1, lr=1e-3, cbs=probe)
        off[sd] = _off(weights(learn), weights(ref), w0)
    assert probe.seen['x0'] == probe.seen['s'] == probe.seen['grad_sum_sq'] == {torch.float32}, probe.seen
    assert off[BF16] <= 1.5 * off[None] + 1e-4, off
    adamw, probe = _learner(partial(OptimWrapper, opt=torch.optim.AdamW), 'to_bf16', state_dtype=BF16, **kw), _StateDtypes()
    quiet_fit(adamw, 1, lr=1e-3, cbs=probe)
    assert probe.seen['exp_avg'] == probe.seen['exp_avg_sq'] == {BF16}, probe.seen
    assert all(v.dtype == torch.float32 for d in opt_state(adamw.opt).values() for v in d.values()
               if isinstance(v, torch.Tensor))  # FP32 again after the fit
