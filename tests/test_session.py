"""The fit's one owner: `PrecisionSession` sets up and tears down, and what it installs on the optimizer comes off again;
what pauses a fit from a callback (freeze / unfreeze, `copy.deepcopy(learn)`) and a change of precision mid-fit."""
import copy, pickle, re
from functools import partial
import pytest, torch
from fastai.basics import Callback, OptimWrapper, Adam, SGD
from fp16cb.session import session_of, PrecisionSession
from conftest import make_learner, quiet_fit, to_mode, weights

OPTS = {'fastai SGD': partial(SGD, mom=0.9), 'fastai Adam': Adam,
        'OptimWrapper(AdamW)': partial(OptimWrapper, opt=torch.optim.AdamW)}

@pytest.mark.parametrize('opt', list(OPTS))
@pytest.mark.parametrize('kw', [{}, {'flat_master': True}, {'state_dtype': torch.bfloat16}, {'half_storage': True}],
                         ids=['own', 'flat', 'state', 'half'])
def test_optimizer_gets_its_own_step_back(opt, kw):
    """During the fit the optimizer is the same object, of its own class, in every mode: it steps the model's params
    (FP32, laid out flat or not, its state 16-bit or not; or 16-bit for the fit, `half_storage`, lifted to FP32 by
    fastai's step rows); nothing is assigned on the instance. Before, with `half_storage`, its class was a routed
    subclass for the fit."""
    learn = make_learner(opt_func=OPTS[opt]).to_bf16(**kw)
    routed = False
    learn.create_opt()
    opt_obj, cls, seen = learn.opt, type(learn.opt), []
    class Spy(Callback):
        order = 50
        def after_step(self):
            o = self.learn.opt
            seen.append((o is opt_obj, isinstance(o, cls), type(o) is not cls, 'step' in vars(o), 'zero_grad' in vars(o)))
    quiet_fit(learn, 1, cbs=Spy())
    # the user's optimizer steps the model's params as it is
    assert seen and all(s == (True, True, routed, False, False) for s in seen) and learn.opt is opt_obj
    assert type(learn.opt) is cls and 'step' not in vars(learn.opt) and 'zero_grad' not in vars(learn.opt)
    assert '_fp16cb_route' not in vars(learn.opt)
    w = [p.detach().clone() for p in learn.model.parameters()]
    quiet_fit(learn.to_fp32(), 1)  # a plain FP32 fit with the same optimizer trains
    assert any(not torch.equal(a, b) for a, b in zip(w, learn.model.parameters()))

def test_session_is_per_learner_and_never_copied():
    learn = make_learner().to_bf16()
    s = session_of(learn)
    assert session_of(learn) is s and isinstance(pickle.loads(pickle.dumps(s)), PrecisionSession)
    assert pickle.loads(pickle.dumps(s)).active == [] and session_of(copy.deepcopy(learn)) is not s

def test_nested_validate_keeps_the_setup_and_the_fit_tears_down():
    "validate() inside a fit (a callback) keeps the masters; the fit's end tears them down; a lone validate too."
    learn = make_learner().to_bf16()
    seen = []
    class Val(Callback):
        order, busy = 50, False
        def after_epoch(self):
            if self.busy: return  # validate() fires after_epoch itself
            self.busy, m = True, self.learn.mixed_precision.store
            with self.learn.no_bar(): self.learn.validate()
            self.busy = False
            seen.append(self.learn.mixed_precision.store is m and m is not None)
    quiet_fit(learn, 2, cbs=Val())
    assert seen == [True, True] and session_of(learn).active == [] and learn.mixed_precision.store is None
    learn.validate()
    assert session_of(learn).active == [] and all(p.dtype == torch.float32 for p in learn.model.parameters())

def test_a_pause_mid_fit_keeps_the_recorder_consistent(tmp_path):
    "A save in every epoch pauses the setup (`suspended`): the Recorder's columns are taken out once, at the fit's end."
    from fastai.callback.tracker import SaveModelCallback
    learn = make_learner(path=tmp_path).to_fp16(loss_scale=2.**20)
    quiet_fit(learn, 3, cbs=SaveModelCallback(every_epoch=True))
    rec = learn.recorder
    assert 'loss_scale' not in rec.metric_names and len(rec.values) == 3
    assert all(len(row) == len(rec.metric_names) - 2 for row in rec.values)  # no 'epoch', no 'time'

# ---- one lifecycle: teardown in exact reverse, mid-fit save without a pause, steps kept across pauses
from fastai.callback.core import CancelBatchException, CancelFitException
from fp16cb.callbacks import ModelToHalf, MixedPrecision

def _weights(learn): return [p.detach().float().clone() for p in learn.model.parameters()]

def _teardown_order(monkeypatch) -> list:
    order = []
    for cls in (ModelToHalf, MixedPrecision):
        orig = cls.teardown
        def td(self, _orig=orig, _name=cls.__name__): order.append(_name); return _orig(self)
        monkeypatch.setattr(cls, 'teardown', td)
    return order

class _Raise(Callback):
    order = 30
    def after_batch(self): raise KeyboardInterrupt()

@pytest.mark.parametrize('how', ['end', 'exception', 'save', 'freeze'])
def test_teardown_is_the_exact_reverse_of_setup(monkeypatch, how, tmp_path):
    "A fit's end, an exception, a mid-fit pause: MixedPrecision is torn down before ModelToHalf, each once (save: none)."
    order = _teardown_order(monkeypatch)
    learn = make_learner().to_fp16(); learn.path = tmp_path
    class Pause(Callback):
        order = 30
        def after_batch(self):
            if how == 'save': self.learn.save('mid')
            else: self.learn.freeze_to(0)
            raise CancelFitException()
    cbs = {'end': [], 'exception': [_Raise()], 'save': [Pause()], 'freeze': [Pause()]}[how]
    try: quiet_fit(learn, 1, cbs=cbs)
    except KeyboardInterrupt: pass
    pairs = ['MixedPrecision', 'ModelToHalf']
    assert order == pairs * {'end': 1, 'exception': 1, 'save': 1, 'freeze': 2}[how]

def test_mid_fit_save_leaves_the_16bit_model_as_it_is(tmp_path):
    "`learn.save` in a fit reads the store's FP32 view: the 16-bit params keep their storages; the file holds the masters."
    learn = make_learner().to_fp16(); learn.path = tmp_path
    seen = {}
    class SaveMid(Callback):  # not `Save`: fastai would make it `learn.save`
        order = 30
        def after_batch(self):
            if 'ptrs' in seen: return
            ps = list(self.learn.model.parameters())
            seen['ptrs'], seen['dtypes'] = [p.data_ptr() for p in ps], [p.dtype for p in ps]
            seen['masters'] = {n: t.clone() for n, t in ((n, self.learn.mixed_precision.store.fp32_views().get(p)) for n, p in self.learn.model.named_parameters()) if t is not None}
            seen['file'] = self.learn.save('mid')
            seen['after'] = [p.data_ptr() for p in ps], [p.dtype for p in ps]
    quiet_fit(learn, 1, cbs=[SaveMid()])
    assert seen['after'] == (seen['ptrs'], seen['dtypes']) and set(seen['dtypes']) == {torch.float32}
    sd = torch.load(seen['file'], weights_only=False)['model']
    for n, t in seen['masters'].items(): assert sd[n].dtype == torch.float32 and torch.equal(sd[n], t)

@pytest.mark.parametrize('action', ['save', 'freeze', 'load'])
def test_a_pause_in_before_step_keeps_the_step_s_grads(action, tmp_path):
    "save/freeze/load from a `before_step` after ours: the step still applies this batch's gradients."
    ref = make_learner().to_fp16(); ref.path = tmp_path
    quiet_fit(ref, 1)
    learn = make_learner().to_fp16(); learn.path = tmp_path
    class Pause(Callback):
        order = 20
        def before_step(self):
            if action == 'save': self.learn.save('p')
            elif action == 'freeze': self.learn.freeze_to(0)
            else: self.learn.save('p'); self.learn.load('p')
    quiet_fit(learn, 1, cbs=[Pause()])
    for a, b in zip(_weights(ref), _weights(learn)): assert torch.equal(a, b)

class _Accumulate(Callback):
    "Gradient accumulation ordered after MixedPrecision: every other batch is a micro-batch whose step is cancelled."
    order = 20
    def before_fit(self): self.n = 0
    def before_step(self):
        self.n += 1
        if self.n % 2: raise CancelBatchException()

def test_accumulation_after_us_keeps_one_scale_per_step():
    "The scale does not change between the micro-batches of an accumulated step: the first update is FP32's."
    upd = {}
    for meth in ('to_fp32', 'to_fp16'):
        learn = getattr(make_learner(), meth)()
        w0 = _weights(learn)
        class Stop(Callback):
            order = 30
            def after_step(self): raise CancelFitException()
        quiet_fit(learn, 1, cbs=[_Accumulate(), Stop()])
        upd[meth] = [b - a for a, b in zip(w0, _weights(learn))]
    for a, b in zip(upd['to_fp32'], upd['to_fp16']):
        assert torch.allclose(a, b, rtol=0.02, atol=1e-4), (a, b)
    learn = make_learner().to_fp16()
    quiet_fit(learn, 1, cbs=[_Accumulate()])
    assert len(learn.mixed_precision.skips) == 2  # optimizer steps, not micro-batches

def test_a_zero_gradient_first_batch_does_not_calibrate():
    "A masked first batch (zero loss, zero grads) leaves the scale uncalibrated; the next batch calibrates it, no skip."
    class MaskFirst(Callback):
        order = 5
        def before_fit(self): self.n = 0
        def after_loss(self):
            if self.training and self.n == 0: self.learn.loss_grad = self.learn.loss_grad * 0
            self.n += self.training
    learn = make_learner().to_fp16()
    quiet_fit(learn, 2, cbs=[MaskFirst()])
    mp = learn.mixed_precision
    assert mp.scaler.calibrated and not any(mp.skips) and mp.scales[:2] == [1., 1.] and mp.scales[2] > 1.

def test_a_nested_fit_that_raises_leaves_the_outer_fit_going():
    "A `learn.fit` run from a callback raises and the callback catches it: the outer fit's setup is untouched."
    learn = make_learner().to_fp16()
    class Inner(Callback):
        order = 30
        def after_epoch(self):
            if getattr(self, 'done', False): return
            self.done = True
            try: self.learn.fit(1, cbs=[_Raise()])
            except KeyboardInterrupt: pass
    quiet_fit(learn, 2, cbs=[Inner()])
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())
    assert len(learn.mixed_precision.skips) >= 8

# ---- freeze / unfreeze from a callback during a fit -----------------------------------------------------------

class ToggleAt0(Callback):
    "At the end of epoch 0, `learn.freeze()` or `learn.unfreeze()`; keeps the first Linear's weight of that moment."
    order = 50
    def __init__(self, how): self.how = how
    def after_epoch(self):
        if self.epoch != 0: return
        getattr(self.learn, self.how)()
        self.w = self.learn.model[0].weight.detach().clone()

@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
def test_freeze_from_a_callback_takes_effect(mode):
    "Before the fix: the frozen body kept training in epoch 1 and ended with `requires_grad=True`."
    learn = to_mode(make_learner(), mode)
    cb = ToggleAt0('freeze')
    head = learn.model[3].weight.detach().clone()
    quiet_fit(learn, 2, lr=1e-1, cbs=cb)
    w = learn.model[0].weight
    assert not w.requires_grad
    assert torch.equal(w.detach().to(cb.w.dtype), cb.w)  # not moved since the freeze
    assert not torch.equal(learn.model[3].weight, head)  # the head still trained

@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
def test_unfreeze_from_a_callback_takes_effect(mode):
    "Before the fix: the unfrozen body never trained (no master) and ended with `requires_grad=False`."
    learn = make_learner()
    learn.freeze()
    w0 = learn.model[0].weight.detach().clone()
    to_mode(learn, mode)
    cb = ToggleAt0('unfreeze')
    quiet_fit(learn, 2, lr=1e-1, cbs=cb)
    w = learn.model[0].weight
    assert torch.equal(cb.w, w0.to(cb.w.dtype))  # frozen in epoch 0
    assert w.requires_grad and (w.detach() - w0).abs().max() > 1e-2  # trained in epoch 1

# ---- deepcopy of the learner during a fit ---------------------------------------------------------------------

class DeepcopyAt0(Callback):
    "The keep-the-best pattern: `copy.deepcopy(learn)` at the end of epoch 0."
    order = 60
    def after_epoch(self):
        if self.epoch != 0 or hasattr(self, 'best'): return
        self.best = None  # set before the copy: the copy's own DeepcopyAt0 does not copy again
        self.best = copy.deepcopy(self.learn)

@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
def test_deepcopy_mid_fit_gives_a_plain_learner(mode):
    "Before the fix: the copy's model stayed 16-bit, and its own `fit` trained nothing."
    one = to_mode(make_learner(), mode); quiet_fit(one, 1, lr=1e-1)  # the weights at the end of epoch 0
    two = to_mode(make_learner(), mode); quiet_fit(two, 2, lr=1e-1)  # the run without deepcopy
    learn, cb = to_mode(make_learner(), mode), DeepcopyAt0()
    quiet_fit(learn, 2, lr=1e-1, cbs=cb)
    for a, b in zip(weights(learn), weights(two)): assert torch.equal(a, b)  # the original fit is unaffected
    best = cb.best
    assert all(p.dtype == torch.float32 for p in best.model.parameters())
    for a, b in zip(weights(best), weights(one)): assert torch.equal(a, b)  # the FP32 weights at copy time
    before = weights(best)
    quiet_fit(best, 1, lr=1e-1)
    assert all(p.dtype == torch.float32 for p in best.model.parameters())
    assert not torch.equal(best.model[0].weight, before[0])  # the copy trains

# ---- to_bf16 from a callback during an fp32 fit ---------------------------------------------------------------

class ToBF16At(Callback):
    "`learn.to_bf16()` after the first training batch of an FP32 fit."
    def after_batch(self):
        if self.training and self.epoch == 0 and self.iter == 0: self.learn.to_bf16()

def test_to_bf16_during_a_fit_is_clean():
    """Before the fix: `AttributeError: 'NoneType' object has no attribute 'grads_to_master'` in MixedPrecision's
    `before_step`."""
    learn = make_learner()
    w0 = weights(learn)
    try: quiet_fit(learn, 2, lr=1e-2, cbs=ToBF16At())
    except Exception as e:  # a clear refusal is fine: it says that a fit is running
        assert not isinstance(e, AttributeError) and isinstance(e, (RuntimeError, ValueError)), repr(e)
        assert re.search(r'\bfit\b', str(e)), str(e)
    else: assert not torch.equal(learn.model[0].weight, w0[0])  # or it takes effect: the fit trained
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in learn.model.parameters())

def test_a_fit_that_raises_warns_nothing_more_in_its_teardown():
    "A fit stopped by `LossScaleError` says why in the error: its teardown adds no all-steps-skipped warning."
    import warnings
    from fp16cb import LossScaleError
    learn = make_learner().to_fp16(max_skipped=3)
    learn.loss_func = lambda p, t: ((p - t) ** 2).mean() * float('nan')
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        with pytest.raises(LossScaleError): quiet_fit(learn, 1)
    assert not [o for o in w if 'optimizer steps of this fit were skipped' in str(o.message)]
