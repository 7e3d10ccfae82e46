"""Other code during a fit sees and changes what FP32 fastai would (issue: the open world): callbacks that read or
write the model's grads, params, `requires_grad` or the optimizer. Each case is run with plain FP32 fastai and the same
code, and the mixed-precision run must match it (dtypes aside)."""
import copy, warnings
from functools import partial
import pytest
import torch
from torch import nn
from fastai.basics import Callback, CancelStepException, CancelBatchException, SGD, Adam
from fastai.optimizer import OptimWrapper

from conftest import make_learner, quiet_fit, weights

MODES = {'fp16': ('to_fp16', {'max_loss_scale': 2.**8}), 'bf16': ('to_bf16', {}),
         'bf16-half': ('to_bf16', {'half_storage': True}),
         'fp16-flat': ('to_fp16', {'flat_master': True, 'max_loss_scale': 2.**8}),
         'bf16-sib': ('to_bf16', {'step_in_backward': True})}
OPTS = {'fastai-sgd': partial(SGD, mom=0.), 'torch-sgd': partial(OptimWrapper, opt=torch.optim.SGD)}

def learner(mode, opt='fastai-sgd', **kwargs):
    learn = make_learner(opt_func=OPTS[opt] if isinstance(opt, str) else opt, **kwargs)
    if mode is None: return learn
    name, kw = MODES[mode]
    return getattr(learn, name)(**kw)

class GradNorms(Callback):
    "The norm of all the model's grads, as a callback ordered after the precision callbacks reads them in `before_step`."
    order = 50
    def before_fit(self): self.norms = []
    def before_step(self):
        gs = [p.grad.float().norm() for p in self.learn.model.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack(gs))))

def norms_seen(mode, *cbs, opt='fastai-sgd') -> list:
    probe = GradNorms()
    quiet_fit(learner(mode, opt), 1, cbs=[*cbs, probe])
    return probe.norms

def assert_norms_match(got, ref, rtol=2e-2):
    assert len(got) == len(ref), (got, ref)
    for g, r in zip(got, ref): assert abs(g - r) <= rtol * r, (got, ref)

# -- grads: seen unscaled before the step, kept by a cancelled step, cleared by the optimizer's `zero_grad`
class ClipOwn(Callback):
    "A user's own clipping callback: `clip_grad_norm_` on the model's params in `before_step` (after ours)."
    order = 30
    def before_fit(self): self.seen = []
    def before_step(self): self.seen.append(float(nn.utils.clip_grad_norm_(self.learn.model.parameters(), 1.)))

@pytest.mark.parametrize('mode', ['fp16', 'fp16-flat', 'bf16'])
def test_a_users_clip_callback_sees_and_clips_the_unscaled_grads(mode):
    """FP32: `clip_grad_norm_` reads the true norms (~5) and clips them to 1. Before: with `to_fp16()` it read the
    loss-scaled grads (~1300 at scale 2^8), and clipped those, so that the step used 1/scale of the clipped grads."""
    ref, got = ClipOwn(), ClipOwn()
    ref_after = norms_seen(None, ref)
    got_after = norms_seen(mode, got)
    assert_norms_match(got.seen, ref.seen)
    assert_norms_match(got_after, ref_after)  # what the step then uses: clipped to 1, as in FP32

class SkipAfterBackward(Callback):
    "Drops a bad batch after its backward: `learn.opt.zero_grad()` then `CancelBatchException` (in `event`)."
    order = 30
    def __init__(self, event): setattr(self, event, self._skip)
    def _skip(self):
        if self.train_iter == 1: self.learn.opt.zero_grad(); raise CancelBatchException()

@pytest.mark.parametrize('event', ['after_backward', 'before_step'])
@pytest.mark.parametrize('opt', ['fastai-sgd', 'torch-sgd'])
@pytest.mark.parametrize('mode', ['fp16', 'bf16', 'bf16-half'])
def test_a_batch_dropped_after_its_backward_leaves_no_grad_behind(mode, opt, event):
    "The next step's grads are that batch's own, as in FP32 (none of the dropped batch's loss-scaled grads added)."
    assert_norms_match(norms_seen(mode, SkipAfterBackward(event), opt=opt), norms_seen(None, SkipAfterBackward(event), opt=opt))

class AccumulateByCancelling(Callback):
    "Gradient accumulation by cancelling every other step and holding the optimizer's `zero_grad` back for it."
    order = 30
    def before_step(self):
        if self.train_iter % 2 == 0:
            self.learn.opt.__dict__['zero_grad'] = lambda: None
            raise CancelStepException()
    def after_batch(self): self.learn.opt.__dict__.pop('zero_grad', None)

@pytest.mark.parametrize('opt', ['fastai-sgd', 'torch-sgd'])
@pytest.mark.parametrize('mode', ['fp16', 'bf16', 'bf16-half', 'fp16-flat'])
def test_accumulation_by_cancelled_steps_adds_the_micro_batches(mode, opt):
    """FP32 keeps a cancelled step's grads until `zero_grad`: the step after holds two batches' grads. Before: the
    store cleared them at the cancelled step (norms 5.3 and 3.9 where FP32 shows 9.4 and 7.8), 4.6e-2 off after a fit."""
    ref = norms_seen(None, AccumulateByCancelling(), opt=opt)
    assert_norms_match(norms_seen(mode, AccumulateByCancelling(), opt=opt), ref)
    learn, fp32 = learner(mode, opt), learner(None, opt)
    for l in (learn, fp32): quiet_fit(l, 2, cbs=AccumulateByCancelling())
    learn.to_fp32()
    for a, b in zip(weights(learn), weights(fp32)): assert (a - b).abs().max() < 2e-2

# -- trainability: a param made trainable mid-fit trains, one frozen mid-fit is stepped as FP32 steps it
class UnfreezeHead(Callback):
    "The head frozen for the first batches, then made trainable with `requires_grad_(True)` (a hand-written unfreeze)."
    def __init__(self, event='before_batch', order=0, at=2): self.at, self.order = at, order; setattr(self, event, self._go)
    def _go(self):
        if self.training and self.train_iter == self.at:
            for p in self.learn.model[3].parameters(): p.requires_grad_(True)

def head_moves(mode, cb, opt='fastai-sgd', n_epoch=1) -> list:
    learn = learner(mode, opt)
    for p in learn.model[3].parameters(): p.requires_grad_(False)  # frozen when the fit sets up
    w0 = [p.detach().float().clone() for p in learn.model[3].parameters()]
    quiet_fit(learn, n_epoch, cbs=cb)
    if mode is not None: learn.to_fp32()
    return [float((p.detach() - w).abs().max()) for p, w in zip(learn.model[3].parameters(), w0)], weights(learn)

@pytest.mark.parametrize('when', [('before_batch', 0), ('before_batch', 30), ('after_backward', 30)], ids=['early', 'late', 'backward'])
@pytest.mark.parametrize('opt', ['fastai-sgd', 'torch-sgd'])
@pytest.mark.parametrize('mode', ['fp16', 'bf16', 'bf16-half', 'fp16-flat'])
def test_a_param_made_trainable_mid_fit_trains(mode, opt, when):
    """FP32: the head, unfrozen at the third batch, moves ~1e-2. Before: the store, made at the set-up without the
    frozen head, never stepped it (moved 0.0)."""
    ref_moved, ref = head_moves(None, UnfreezeHead(*when), opt)
    moved, got = head_moves(mode, UnfreezeHead(*when), opt)
    assert min(ref_moved) > 1e-3
    for m, r in zip(moved, ref_moved): assert abs(m - r) <= .1 * r, (moved, ref_moved)
    for a, b in zip(got, ref): assert (a - b).abs().max() < 2e-2

class SwitchHalves(Callback):
    "fastai's GAN trainer's way: every batch one half of the model trainable, the other frozen (`requires_grad_`)."
    def before_batch(self):
        if not self.training: return
        body_on = self.train_iter % 2 == 0
        for i, m in enumerate(self.learn.model):
            for p in m.parameters(): p.requires_grad_(body_on == (i < 3))

@pytest.mark.parametrize('opt', ['fastai-sgd', 'torch-sgd'])
@pytest.mark.parametrize('mode', ['fp16', 'bf16', 'bf16-half'])
def test_halves_switched_every_batch_train_as_in_fp32(mode, opt):
    "Each half trains on its batches as in FP32 (a frozen half with a grad left is stepped as FP32's optimizer steps it)."
    ref, fp32 = learner(None, opt), learner(mode, opt)
    learn = fp32
    quiet_fit(ref, 2, cbs=SwitchHalves()); quiet_fit(learn, 2, cbs=SwitchHalves())
    learn.to_fp32()
    w0 = weights(learner(None, opt))
    assert all((b - w).abs().max() > 1e-3 for i, (b, w) in enumerate(zip(weights(ref), w0)) if i != 1)  # (1: a bias before BatchNorm)
    for a, b in zip(weights(learn), weights(ref)): assert (a - b).abs().max() < 2e-2

# -- writes: an in-place change to a weight reaches what the optimizer steps
class ClampWeights(Callback):
    "A weight constraint in place after every step (WGAN's clipping, a max-norm): `with torch.no_grad(): p.clamp_()`."
    order = 30
    def __init__(self, event='after_step', c=.05): self.c = c; setattr(self, event, self._clamp)
    def _clamp(self):
        if not self.training: return
        with torch.no_grad():
            for p in self.learn.model.parameters(): p.clamp_(-self.c, self.c)

def max_abs_weight(learn) -> float: return max(float(p.detach().abs().max()) for p in learn.model.parameters())

@pytest.mark.parametrize('event', ['after_step', 'before_batch'])
@pytest.mark.parametrize('mode', ['fp16', 'bf16', 'bf16-half', 'fp16-flat'])
def test_weights_constrained_in_place_by_a_callback_stay_constrained(mode, event):
    """FP32: every weight within +-0.05 at the end, and each step starts from the clamped weights. Before: the masters
    were stepped unclamped and copied back over the model (max |w| 0.49)."""
    ref, learn = learner(None, 'fastai-sgd'), learner(mode, 'fastai-sgd')
    for l in (ref, learn): quiet_fit(l, 2, cbs=ClampWeights(event))
    learn.to_fp32()
    if event == 'after_step':  # (before the batch: the last step is not clamped after)
        assert max_abs_weight(ref) <= .05 + 1e-7
        assert max_abs_weight(learn) <= .05 * (1 + 2**-8)  # 0.05 in 16 bits
    for a, b in zip(weights(learn), weights(ref)): assert (a - b).abs().max() < 1e-2

class ClampThroughData(ClampWeights):
    def _clamp(self):
        if not self.training: return
        for p in self.learn.model.parameters(): p.data.clamp_(-self.c, self.c)

@pytest.mark.parametrize('mode', ['bf16', 'fp16-flat', 'bf16-sib'])
def test_a_write_through_data_after_the_last_step_is_kept(mode):
    """torch does not count a write through `.data`. The model's own FP32 params (the default, and `flat_master`'s
    layout of them, stepped in the backward too): the write is the truth, kept as in FP32, nothing to say. (Masters
    beside a 16-bit model, which no mode keeps now, found it at the fit's end and said that steps missed it.)"""
    learn = learner(mode)
    with warnings.catch_warnings():
        warnings.filterwarnings('error', message=".*through `.data`")
        quiet_fit(learn, 1, cbs=ClampThroughData())
    learn.to_fp32()
    assert max_abs_weight(learn) <= .05 * (1 + 2**-8)

# -- reads: a copy or an average of the weights gets FP32 values
class EMA(Callback):
    "fastxtend's `EMACallback` in short: `deepcopy(learn.model)` in `before_fit`, `ema = d*ema + (1-d)*w` each batch."
    order = 30
    def __init__(self, decay=.9998): self.decay = decay
    def before_fit(self): self.ema = copy.deepcopy(self.learn.model)
    def after_batch(self):
        if not self.training: return
        with torch.no_grad():
            for e, w in zip(self.ema.parameters(), self.learn.model.parameters()): e.lerp_(w.to(e.dtype), 1 - self.decay)

@pytest.mark.parametrize('mode', ['fp16', 'bf16', 'fp16-flat'])
def test_an_ema_callback_averages_fp32_weights(mode):
    """The EMA's copy is a plain FP32 model (no fp16cb hook), every weight of it moves at decay 0.9998, and it ends
    near FP32's EMA. Before: it averaged a bf16 copy, where 0.0002 of a difference rounds away (3% of it moved)."""
    ref, got = EMA(), EMA()
    ref_learn = learner(None)
    r0 = [p.detach().float().clone() for p in ref_learn.model.parameters()]
    quiet_fit(ref_learn, 2, cbs=ref)
    ref_moved = torch.cat([(e.detach() != w).flatten() for e, w in zip(ref.ema.parameters(), r0)]).float().mean()
    learn = learner(mode)
    w0 = [p.detach().float().clone() for p in learn.model.parameters()]
    quiet_fit(learn, 2, cbs=got)
    assert all(p.dtype == torch.float32 for p in got.ema.parameters())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in got.ema.modules())
    moved = torch.cat([(e.detach() != w).flatten() for e, w in zip(got.ema.parameters(), w0)]).float().mean()
    # every weight FP32's EMA moves (a bias before BatchNorm has no FP32 grad: it does not move, in FP32 nor in the
    # default mode; 16-bit storage gives it rounding noise)
    assert moved >= ref_moved > .85
    for a, b in zip(got.ema.parameters(), ref.ema.parameters()): assert (a - b).abs().max() < 1e-3

def test_half_storage_shows_other_code_its_16bit_weights(tmp_path):
    """`half_storage`: the 16-bit params are the weights during the fit, and what other code sees is that truth, as a
    bf16 model's: `deepcopy(learn.model)` and `learn.model.state_dict()` mid-fit hold the bf16 weights of that moment
    (an EMA of them averages bf16 weights); `learn.save` still writes them widened to FP32, exactly, for any learner.
    Before: the model carried a `__deepcopy__` and a state-dict hook of fp16cb's that gave FP32 values."""
    seen = {}
    class Peek(Callback):
        order = 30
        def after_step(self):
            if seen: return
            seen['copy'] = copy.deepcopy(self.learn.model)
            seen['sd'] = {k: v.clone() for k, v in self.learn.model.state_dict().items()}
            seen['w'] = {n: p.detach().clone() for n, p in self.learn.model.named_parameters()}
            self.learn.path = tmp_path
            self.learn.save('mid')
    learn = learner('bf16-half')
    quiet_fit(learn, 1, cbs=Peek())
    for n, p in seen['copy'].named_parameters():
        assert p.dtype == seen['w'][n].dtype and torch.equal(p, seen['w'][n]), n
        assert torch.equal(seen['sd'][n], seen['w'][n]), n
    assert '__deepcopy__' not in vars(learn.model) and not learn.model._state_dict_hooks
    saved = torch.load(tmp_path/'models'/'mid.pth', weights_only=False)['model']
    for n, w in seen['w'].items(): assert saved[n].dtype == torch.float32 and torch.equal(saved[n], w.float()), n

class KeepBest(Callback):
    "A keep-the-best callback: `deepcopy(learn.model.state_dict())` after each epoch."
    order = 30
    def after_epoch(self): self.best = copy.deepcopy(self.learn.model.state_dict())

@pytest.mark.parametrize('mode', ['fp16', 'bf16', 'fp16-flat'])
def test_a_state_dict_taken_mid_fit_holds_the_exact_fp32_weights(mode):
    "What a keep-the-best callback keeps is the FP32 weights of that moment, bit for bit (before: their 16-bit rounding)."
    learn, kb = learner(mode), KeepBest()
    quiet_fit(learn, 1, cbs=kb)
    learn.to_fp32()
    for k, v in learn.model.state_dict().items():
        assert kb.best[k].dtype == v.dtype and torch.equal(kb.best[k], v), k

def test_grads_unscaled_for_a_later_callback_keep_the_steps_loss_scale():
    "The loss-scale record still holds the step's scale (not 1: the dynamic scale would read as stuck at its floor)."
    learn, probe = learner('fp16'), GradNorms()
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)  # no "sits at its floor" warning
        quiet_fit(learn, 2, cbs=probe)
    scales = learn.mixed_precision.scales
    assert scales[0] == 1. and all(s > 1. for s in scales[1:]), scales  # calibrated at the first step, then scaled
