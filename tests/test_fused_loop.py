"""fastai's loop on a fit's own FP32 params: runs of consecutive params whose grads are consecutive too step as one
flat tensor each (`fp16cb.weights.drivers.FusedLoop`), with the very update fastai's per-param loop gives, whatever
other code does to the params, their grads or the optimizer's state mid-fit."""
import io
from functools import partial
import pytest
import torch
from torch import nn
import fastai.optimizer
from fastai.basics import Callback, Adam, SGD

from conftest import make_learner, quiet_fit, weights, seed_all
from fp16cb.weights import drivers, optstate

def deep(n:int=6, w:int=16) -> nn.Sequential:
    "Linear layers with biases (fastai leaves biases out of weight decay: two kinds of params, interleaved)."
    layers = [nn.Linear(4, w), nn.ReLU()]
    for _ in range(n): layers += [nn.Linear(w, w), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(w, 1))

def learner(mode:str='bf16', opt=Adam, **kwargs):
    seed_all(42)  # the same initial weights for every learner
    learn = make_learner(deep(), opt_func=partial(opt, wd=0.1) if opt is Adam else opt,
                         splitter=lambda m: [list(m.parameters())], **kwargs)
    return learn.to_bf16() if mode == 'bf16' else learn.to_fp16(max_loss_scale=2.**8) if mode == 'fp16' else learn

@pytest.fixture
def updates(monkeypatch):
    "Counts the optimizer's callback calls (fastai's `_update`, once a call: a param, or a run stepped as one)."
    calls = []
    real = drivers._update
    def counted(state, new):
        calls.append(1)
        return real(state, new)
    monkeypatch.setattr(drivers, '_update', counted)
    monkeypatch.setattr(optstate, '_update', counted)  # fastai's loop over the other params (`fastai_update`)
    monkeypatch.setattr(fastai.optimizer, '_update', counted)  # fastai's own loop
    return calls

@pytest.mark.parametrize('mode', ['bf16', 'fp16'])
def test_runs_step_as_one_with_fastais_update(mode, updates, monkeypatch):
    "Before the fix each param was stepped on its own: 16 params x 4 callbacks x 4 steps calls."
    learn = quiet_fit(learner(mode), 1, lr=1e-2)
    fused, n_fused = weights(learn), len(updates)
    monkeypatch.setattr(drivers.FusedRun, 'step', lambda self, core, hyper: [])  # fastai's loop, param by param
    updates.clear()
    ref = weights(quiet_fit(learner(mode), 1, lr=1e-2))
    assert n_fused * 4 <= len(updates)  # weights as one run, biases as another (not 16 of each)
    assert all(torch.equal(a, b) for a, b in zip(fused, ref))

class Replace(Callback):
    "At the third batch: a param's tensor replaced (`p.data = ...`), and the optimizer's state loaded from a copy."
    order = 60
    def before_batch(self):
        if self.train_iter != 2: return
        p = self.learn.model[4].weight
        p.data = p.data.clone()
        buf = io.BytesIO(); torch.save(self.learn.opt.state_dict(), buf); buf.seek(0)
        self.learn.opt.load_state_dict(torch.load(buf, weights_only=False))

@pytest.mark.parametrize('opt', [Adam, SGD])
def test_a_param_replaced_and_the_state_loaded_mid_fit_train_as_param_by_param(opt, monkeypatch):
    learn = quiet_fit(learner(opt=opt), 2, lr=1e-2, cbs=Replace())
    fused = weights(learn)
    monkeypatch.setattr(drivers.FusedRun, 'step', lambda self, core, hyper: [])
    ref = weights(quiet_fit(learner(opt=opt), 2, lr=1e-2, cbs=Replace()))
    assert all(torch.equal(a, b) for a, b in zip(fused, ref))
    # as close to FP32 fastai's run as 16-bit compute comes without the replacement (the replaced param kept training)
    err = lambda a, b: max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b))
    fp32 = weights(quiet_fit(learner('fp32', opt=opt), 2, lr=1e-2, cbs=Replace()))
    plain = err(weights(quiet_fit(learner(opt=opt), 2, lr=1e-2)), weights(quiet_fit(learner('fp32', opt=opt), 2, lr=1e-2)))
    assert err(fused, fp32) <= 2 * plain + 1e-3

def test_a_fits_params_are_laid_out_and_own_their_memory_after(updates):
    "During the fit a group's weights lie one after the other; after it each param owns its memory (a save writes it)."
    seen = []
    class Look(Callback):
        def before_step(self):
            ws = [m.weight for m in self.learn.model if isinstance(m, nn.Linear)][1:]
            seen.append(all(a.data_ptr() + a.numel() * 4 == b.data_ptr() for a, b in zip(ws, ws[1:])))
    learn = quiet_fit(learner(), 1, lr=1e-2, cbs=Look())
    assert seen and all(seen)
    for p in learn.model.parameters():
        assert p.untyped_storage().nbytes() == p.numel() * 4
        assert p.grad.untyped_storage().nbytes() == p.numel() * 4
    st = learn.opt.state[learn.model[2].weight]['grad_avg']
    assert st.untyped_storage().nbytes() == st.numel() * 4

def _states(ps:list, **kinds) -> list:
    "Adam-like states of `ps` (moments shaped like each, a step count), with the entries of `kinds` (`{i: {k: v}}`)."
    res = [{'grad_avg': torch.zeros_like(p), 'sqr_avg': torch.zeros_like(p), 'step': 3} for p in ps]
    for i, extra in kinds.get('extra', {}).items(): res[i].update(extra)
    return res

@pytest.mark.parametrize('case', ['alike', 'a step apart', 'keys in another order', 'a flag of its own',
                                  'a tensor step count', 'a moment of another shape', '0-d moments', 'empty', 'floats'])
def test_the_states_signatures_read_together_are_each_ones_own(case):
    "The run's stretches (params of equal signatures) are the same whether the states are read together or one by one."
    ps = [torch.randn(3, 3), torch.randn(4), torch.randn(2, 2), torch.randn(4)]
    sts = {'alike': _states(ps), 'a step apart': _states(ps, extra={1: {'step': 4}}),
           'keys in another order': _states(ps)[:1] + [dict(reversed(list(s.items()))) for s in _states(ps)[1:]],
           'a flag of its own': _states(ps, extra={0: {'do_wd': False}}),
           'a tensor step count': _states(ps, extra={2: {'step': torch.tensor(3)}}),
           'a moment of another shape': _states(ps, extra={3: {'grad_avg': torch.zeros(2, 2)}}),
           '0-d moments': [{'m': torch.zeros(())} for _ in ps], 'empty': [{} for _ in ps],
           'floats': [{'x': 1.5}, {'x': 1.5}, {'x': 2.}, {'x': 1.5}]}[case]
    alone, together = [drivers._signature(s, p) for s, p in zip(sts, ps)], drivers._signatures(sts, ps)
    assert together == alone
    assert [[a == b for b in together] for a in together] == [[a == b for b in alone] for a in alone]

class ZeroOps:
    "Counts the aten ops of each `opt.zero_grad()` (fastai's own: a `zero_` per param; `detach_` is not one)."
    def __init__(self, monkeypatch):
        from torch.utils._python_dispatch import TorchDispatchMode
        self.calls, real = [], fastai.optimizer.Optimizer.zero_grad
        counts = self.calls
        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counts[-1] += 1
                return func(*args, **(kwargs or {}))
        def counted(opt):
            counts.append(0)
            with Count(): real(opt)
        monkeypatch.setattr(fastai.optimizer.Optimizer, 'zero_grad', counted)

@pytest.mark.parametrize('mode', ['bf16', 'fp16'])
def test_zero_grad_clears_the_runs_grads_a_run_at_a_time(mode, monkeypatch):
    """fastai's `zero_grad` zeroes each grad in place, an op a param (16 here); a fit's laid-out grads are zeroed a
    run at a time (weights as one run, biases as another), with the very training of fastai's own loop."""
    ops = ZeroOps(monkeypatch)
    fused = weights(quiet_fit(learner(mode), 1, lr=1e-2))
    assert ops.calls and max(ops.calls) <= 4, ops.calls
    monkeypatch.setattr(drivers.FusedLoop, 'zero_grad', lambda self, core: False)  # fastai's loop, param by param
    ops.calls.clear()
    ref = weights(quiet_fit(learner(mode), 1, lr=1e-2))
    assert min(ops.calls) >= 16
    assert all(torch.equal(a, b) for a, b in zip(fused, ref))

class Regrad(Callback):
    """After each step, other code gives a param a grad of its own (`how`): a new tensor, one in a graph (as a backward
    with `create_graph` leaves), or a view (which fastai's `zero_grad` refuses: `Can't detach views in-place`). Notes,
    after fastai's `zero_grad`, whether every grad is zero, detached, and where it was."""
    order = 60
    def __init__(self, how): self.how, self.seen = how, []
    def after_step(self):
        p = self.learn.model[2].weight
        if self.how == 'new': p.grad = p.grad.clone() + 1
        elif self.how == 'graph': p.grad = torch.ones_like(p, requires_grad=True) * 2
        else: p.grad = torch.ones(2 * p.numel())[:p.numel()].view_as(p)
        self.ids = [id(q.grad) for q in self.learn.model.parameters()]
    def after_batch(self):
        gs = [q.grad for q in self.learn.model.parameters()]
        self.seen.append((all(not g.any() for g in gs), any(g.requires_grad for g in gs),
                          list(map(id, gs)) == self.ids))

@pytest.mark.parametrize('how', ['new', 'graph', 'view'])
@pytest.mark.parametrize('mode', ['fp32', 'bf16', 'fp16'])
def test_zero_grad_clears_grads_other_code_gave_as_fastai_does(mode, how):
    cb = Regrad(how)
    if how == 'view':
        with pytest.raises(RuntimeError, match="Can't detach views in-place"): quiet_fit(learner(mode), 1, cbs=cb)
        return
    quiet_fit(learner(mode), 1, lr=1e-2, cbs=cb)
    assert cb.seen and all(s == (True, False, True) for s in cb.seen), cb.seen
