"""The step engine against plain FP32 fastai: an optimizer with per-group state (timm's Adan and LAMB) stepped once per
training step however many lift chunks the store cuts the masters into; a `KeyboardInterrupt` inside a step (a torch
optimizer's sliced step, 16-bit storage's batch of small params) leaves a consistent, saveable optimizer; a channels_last
weight stepped in slices reads its grad in its own element order whatever that grad's strides; `learn.opt.zero_grad()`
from a callback clears the grads the step will use."""
from functools import partial
import pytest
import torch
from torch import nn
from fastai.basics import Callback, SGD, Adam
from fastai.optimizer import OptimWrapper
from fastai.torch_core import trainable_params

from conftest import make_learner, quiet_fit, weights, Record, set_chunk

def _f32(ts): return [t.detach().float().clone() for t in ts]

def _tanh_mlp():
    "4 -> 8 -> 8 -> 1 with tanh (smooth grads: few near-zero ones whose sign 16-bit rounding could flip); from seed 0."
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))

def _mlp():
    "4 -> 8 -> 1 with ReLU (a 32-element first weight, three small params), from seed 0."
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

# ---- 1. optimizers with per-group state: one `step()` per training step
def _timm_opts():
    timm_optim = pytest.importorskip('timm.optim')
    # timm's LAMB applies its trust ratio only to params with weight decay (timm puts biases and norms in a no-decay
    # group): without it the update's size is Adam's, set by the group's step count through the bias correction.
    return {'adan': timm_optim.Adan, 'lamb': partial(timm_optim.Lamb, weight_decay=0.)}

@pytest.mark.parametrize('kw', [dict(), dict(half_storage=True)], ids=['masters', 'half_storage'])
@pytest.mark.parametrize('opt', ['adan', 'lamb'])
def test_group_step_optimizers_step_once_per_step_over_several_chunks(monkeypatch, opt, kw):
    """timm's Adan and LAMB keep a step count per param group (`group['step']`, incremented by each `step()` call, for
    every group) and LAMB clips by the global norm of all the grads of the call. In FP32 fastai (`OptimWrapper`) each
    training step is one `step()` call over every param. With a lift chunk small enough that the store cuts the params
    into 5 chunks, 4 bf16 steps (FP32 masters or 16-bit storage) must move the weights as FP32 does with the same
    optimizer, same seed and data: the distance to FP32's weights under 10% of FP32's movement (bf16 rounding: ~2%).
    A `step()` per chunk counts each training step 5 times (Adan: ~0.4 of the movement off; LAMB: ~0.25)."""
    opt_func = partial(OptimWrapper, opt=_timm_opts()[opt])
    res = []
    for mode in ('fp32', 'bf16'):
        learn = make_learner(model=_tanh_mlp(), opt_func=opt_func, splitter=trainable_params)
        w0 = weights(learn)
        if mode == 'bf16':
            set_chunk(monkeypatch, 16)  # chunks: [32], [8], [64], [8, 8], [1] elements
            learn.to_bf16(**kw)
        quiet_fit(learn, 1, lr=3e-2)
        res.append(_f32(learn.model.parameters()))
    (ref, got), sizes = res, [p.numel() for p in w0]
    assert sum(sizes) > 3 * 16 and max(sizes) > 16  # several chunks, some param bigger than one
    moved = torch.cat([(r - a).flatten() for r, a in zip(ref, w0)]).norm()
    off = torch.cat([(g - r).flatten() for g, r in zip(got, ref)]).norm()
    assert moved > 0.05
    assert off <= 0.1 * moved, f"bf16 ends {off / moved:.3f} of FP32's movement away from FP32's weights"

def test_flat_masters_step_an_optimizer_not_known_to_be_elementwise():
    """`flat_master` lays the model's FP32 params out and the optimizer steps each of them: an optimizer `fp16cb.compat`
    does not know to be elementwise (timm's Adan) trains, with 16-bit state too, as torch's AdamW (known) does; its
    weights move. (Before: flat masters stepped a whole group as one tensor, and such an optimizer was refused.)"""
    timm_optim = pytest.importorskip('timm.optim')
    for opt in (partial(OptimWrapper, opt=timm_optim.Adan), partial(OptimWrapper, opt=torch.optim.AdamW)):
        for kw in ({}, {'state_dtype': torch.bfloat16}):
            learn = make_learner(model=_tanh_mlp(), opt_func=opt, splitter=trainable_params)
            w0 = weights(learn)
            quiet_fit(learn.to_bf16(flat_master=True, **kw), 1)
            assert all(not torch.equal(a, b) for a, b in zip(w0, weights(learn)))

# ---- 2. a KeyboardInterrupt inside a torch optimizer's sliced step
class _InterruptStep(Callback):
    """Counts training steps and the inner torch optimizer's `step()` calls within each (a pre-hook on it); raises
    `KeyboardInterrupt` from the call numbered `call` of the training step numbered `step` (1-based)."""
    order = 20
    def __init__(self, step:int, call:int): self.at, self.n, self.calls, self.raised_in = (step, call), 0, 0, None
    def before_step(self): self.n, self.calls = self.n + 1, 0
    def hook(self, opt, args, kwargs):
        self.calls += 1
        if (self.n, self.calls) == self.at:
            self.raised_in = [tuple(p.shape) for g in opt.param_groups for p in g['params'] if p.grad is not None]
            raise KeyboardInterrupt

def test_interrupt_in_a_sliced_torch_step_leaves_a_consistent_optimizer(monkeypatch, tmp_path):
    """FP32 fastai with `OptimWrapper(AdamW)` steps every param in one `step()` call; after a `KeyboardInterrupt` the
    torch optimizer's state is keyed by the model's params and `learn.save` and a further fit work. Here 0.weight (32
    elements) is over the lift chunk (12) and is stepped a slice at a time; the 2nd `step()` call of the 3rd training step
    (the weight's 2nd slice) raises. Then: the state's keys are exactly the model's params (no entry keyed by a slice),
    each with the step count of the 2 completed steps and FP32 moments of its param's shape; `learn.save` works; a
    further fit (4 steps) works and counts from there (6)."""
    set_chunk(monkeypatch, 12)  # the state widened 12 elements at a time
    learn = make_learner(model=_mlp(), opt_func=partial(OptimWrapper, opt=torch.optim.AdamW), splitter=trainable_params)
    learn.path = tmp_path
    learn.to_bf16(state_dtype=torch.bfloat16)  # (FP32 state is stepped whole: no slices)
    learn.create_opt()
    cb = _InterruptStep(step=3, call=2)
    handle = learn.opt.opt.register_step_pre_hook(cb.hook)
    with pytest.raises(KeyboardInterrupt): quiet_fit(learn, 1, lr=1e-2, cbs=cb)
    handle.remove()
    assert cb.raised_in is not None  # today: [(12,)], the 2nd slice of 0.weight
    params = list(learn.model.parameters())
    assert all(p.dtype == torch.float32 for p in params)  # torn down: the FP32 learner again
    def check_state(steps:int):
        state = learn.opt.opt.state
        assert {id(k) for k in state} == {id(p) for p in params}, [tuple(k.shape) for k in state]
        for p in params:
            st = state[p]
            assert float(st['step']) == steps, (tuple(p.shape), float(st['step']))
            for k in ('exp_avg', 'exp_avg_sq'): assert st[k].shape == p.shape and st[k].dtype == torch.float32, (k, st[k].shape)
    check_state(2)
    learn.save('x')
    assert (tmp_path / learn.model_dir / 'x.pth').exists()
    quiet_fit(learn, 1, lr=1e-2)
    check_state(6)
    assert all(torch.isfinite(p).all() for p in learn.model.parameters())

# ---- 3. a KeyboardInterrupt inside 16-bit storage's batch of small params
class _RaisingCb:
    """A fastai optimizer callback that raises `KeyboardInterrupt` at its call numbered `call` of the training step
    numbered `step` (1-based, counted by `_CountSteps`), else runs `cb`. `func`: the function it runs (what tells the
    store whether the optimizer is elementwise, as for a `partial`)."""
    def __init__(self, cb, step:int, call:int):
        self.cb, self.func, self.at, self.n, self.calls, self.raised = cb, getattr(cb, 'func', cb), (step, call), 0, 0, False
    def __call__(self, p, **kwargs):
        self.calls += 1
        if (self.n, self.calls) == self.at: self.raised = True; raise KeyboardInterrupt
        return self.cb(p, **kwargs)

class _CountSteps(Callback):
    order = 20
    def __init__(self, r): self.r = r
    def before_step(self): self.r.n, self.r.calls = self.r.n + 1, 0

def test_interrupt_in_a_half_storage_batch_keeps_state_and_weights_together(tmp_path):
    """FP32 fastai's Adam updates each param's state and its weight together, one param after the other: after a
    `KeyboardInterrupt` in the middle of a step, a param whose step count advanced has moved, and one whose count did not
    has not. Under `to_bf16(half_storage=True)` the 4 small bf16 params are stepped together in the scratch
    (`LiftedSteps._step_batch`), one flat tensor per stretch of equal state: the two weights, then the two biases
    (fastai's `wd_bn_bias=False` flags them apart); Adam's first callback raises at its 2nd call of the 3rd training
    step (the weights done, the biases next). Then, for every param, its step count advanced (2 -> 3) exactly when its
    weight changed since that step's `before_step`; the state is FP32 and keyed by the params; save, load and a further
    fit work, and every param's count goes on by the 4 steps of that fit."""
    learn = make_learner(model=_mlp(), opt_func=Adam, splitter=trainable_params)
    learn.path = tmp_path
    learn.to_bf16(half_storage=True)
    learn.create_opt()
    r = learn.opt.cbs[0] = _RaisingCb(learn.opt.cbs[0], step=3, call=2)
    rec = Record(before_step=lambda l: _f32(l.model.parameters()))
    with pytest.raises(KeyboardInterrupt): quiet_fit(learn, 1, lr=1e-2, cbs=[_CountSteps(r), rec])
    learn.opt.cbs[0] = r.cb
    assert r.raised and len(rec.log['before_step']) == 3
    before, params = rec.log['before_step'][-1], list(learn.model.parameters())
    state = learn.opt.state
    assert all(p in state for p in params) and len(state) == len(params)
    counts = [state[p]['step'] for p in params]
    assert counts == [3, 2, 3, 2], counts  # (0.weight, 0.bias, 2.weight, 2.bias)
    moved = [not torch.equal(p.detach().float(), w) for p, w in zip(params, before)]
    assert [c == 3 for c in counts] == moved, f"step counts {counts}, weights moved {moved}"
    assert all(v.dtype == torch.float32 for p in params for v in state[p].values() if torch.is_tensor(v) and v.dim())
    learn.save('x')
    learn.load('x')
    quiet_fit(learn, 1, lr=1e-2)
    assert [learn.opt.state[p]['step'] for p in learn.model.parameters()] == [c + 4 for c in counts]
    assert all(torch.isfinite(p).all() for p in learn.model.parameters())

# ---- 4. a channels_last weight stepped in slices, its grad replaced by a contiguous copy
def _cl_net():
    "A Linear to 2x3x3 images, a 2x2 conv whose 32-element weight is channels_last (memory order O,H,W,I), a Linear head."
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 18), nn.Unflatten(1, (2, 3, 3)), nn.Conv2d(2, 4, 2), nn.Flatten(), nn.ReLU(),
                         nn.Linear(16, 1)).to(memory_format=torch.channels_last)

class _ContiguousGrad(Callback):
    "In `event` (at `order`), the conv weight's grad replaced by a contiguous (NCHW-strided) copy: same values, other strides."
    def __init__(self, event:str, order:int): self.order = order; setattr(self, event, self._swap)
    def _swap(self):
        w = self.learn.model[2].weight
        if w.grad is not None: w.grad = w.grad.contiguous()

_STEP_OPTS = {'adam': Adam, 'adamw': partial(OptimWrapper, opt=torch.optim.AdamW)}

@pytest.mark.filterwarnings('ignore:grad and param do not obey the gradient layout contract')
@pytest.mark.parametrize('event,kw,opt', [
    ('after_backward', dict(), 'adam'),  # passes today: the grad is copied back into the store's buffer (a guard)
    ('before_step', dict(), 'adam'), ('before_step', dict(), 'adamw'),
    ('after_backward', dict(half_storage=True, stochastic_rounding=False), 'adam'),
    ('before_step', dict(half_storage=True, stochastic_rounding=False), 'adam')],
    ids=['after_backward-masters-adam', 'before_step-masters-adam', 'before_step-masters-adamw',
         'after_backward-half-adam', 'before_step-half-adam'])
def test_a_channels_last_weight_steps_in_slices_as_whole_with_a_contiguous_grad(monkeypatch, event, kw, opt):
    """In FP32 fastai a grad's strides change nothing of the step: element (o, i, h, w) of the weight is updated with
    element (o, i, h, w) of the grad. A callback replaces the channels_last conv weight's grad by a contiguous copy
    (`after_backward`, before MixedPrecision's check; or `before_step` after it, order 15). With a lift chunk under the
    weight's 32 elements (16: masters step 16-element slices, 16-bit storage 8-element ones) 4 bf16 steps must give the
    weights of the same run stepping the weight whole (lift chunk 2^22), within 1 bf16 ulp (rounded to nearest: the
    same math). A slice that reads the grad in memory order takes it in NCHW order for a weight in NHWC order: each
    element stepped with another's grad (~0.075 off for a movement of ~0.04)."""
    res = []
    for chunk in (2**22, 16):
        set_chunk(monkeypatch, chunk)
        learn = make_learner(model=_cl_net(), opt_func=_STEP_OPTS[opt], splitter=trainable_params).to_bf16(**kw)
        w = learn.model[2].weight
        assert not w.is_contiguous() and w.is_contiguous(memory_format=torch.channels_last) and w.numel() > 16
        quiet_fit(learn, 1, lr=1e-2, cbs=_ContiguousGrad(event, 0 if event == 'after_backward' else 15))
        res.append(_f32(learn.model.parameters()))
    whole, sliced = res
    torch.testing.assert_close(sliced[2], whole[2], rtol=2**-7, atol=0, msg=lambda m: f"conv weight, sliced vs whole: {m}")
    for a, b in zip(whole, sliced): torch.testing.assert_close(b, a, rtol=2**-7, atol=0)

# ---- 5. `learn.opt.zero_grad()` from a callback
class _ZeroGradCb(Callback):
    "In `after_backward`: `learn.opt.zero_grad()`, as a user's callback might; the model's grads must be cleared by it."
    def after_backward(self):
        self.learn.opt.zero_grad()
        left = [n for n, p in self.learn.model.named_parameters() if p.grad is not None and p.grad.any()]
        assert not left, f"grads left after learn.opt.zero_grad(): {left}"

@pytest.mark.parametrize('meth,kw', [('to_bf16', dict()), ('to_fp16', dict()), ('to_bf16', dict(flat_master=True)),
                                     ('to_bf16', dict(half_storage=True))],  # the last passes today (a guard)
                         ids=['bf16', 'fp16', 'bf16-flat', 'bf16-half_storage'])
def test_opt_zero_grad_in_a_callback_clears_the_grads_the_step_uses(meth, kw):
    """FP32 fastai: `learn.opt.zero_grad()` in `after_backward` zeroes the model's grads, so SGD without momentum or weight
    decay never moves the weights. In mixed precision the call must clear the model's grads too (checked right after it,
    in the callback) and the weights must end where they started (at most the bf16 rounding of the start: 16-bit storage
    keeps only the rounded weights). Today the optimizer holds the FP32 masters, whose grads are None between steps:
    the call clears nothing and each step applies the full grads."""
    ref = make_learner(opt_func=partial(SGD, mom=0.))
    w0 = weights(ref)
    quiet_fit(ref, 1, lr=1e-2, cbs=_ZeroGradCb())
    for a, b in zip(weights(ref), w0): assert torch.equal(a, b)
    learn = getattr(make_learner(opt_func=partial(SGD, mom=0.)), meth)(**kw)
    quiet_fit(learn, 1, lr=1e-2, cbs=_ZeroGradCb())
    for a, b in zip(_f32(learn.model.parameters()), w0): torch.testing.assert_close(a, b, rtol=2**-8, atol=0)
