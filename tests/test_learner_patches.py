"""Learner.to_fp16 / to_bf16 / to_fp32 / to_native_fp16 / to_native_fp32: which callbacks, toggling, bad arguments;
fastai's own names and arguments (its `MixedPrecision`, `to_non_native_fp16`, `to_channelslast`, its AMP arguments)."""
import pathlib, re
import pytest
import torch
from fastai.learner import Learner
import fastai.callback.fp16 as fastai_fp16
import fp16cb
from fp16cb import ModelToHalf, MixedPrecision, NativeMixedPrecision
from conftest import make_learner, quiet_fit, Record

def _kinds(learn): return sorted(type(cb).__name__ for cb in learn.precision_callbacks())

def test_patches_are_ours():
    for name in ('to_fp16', 'to_bf16', 'to_fp32', 'to_native_fp16', 'to_native_fp32'):
        assert getattr(Learner, name).__module__ == 'fp16cb.learner', name

def test_every_change_to_learner_is_listed():
    "Each `Learner` attribute fp16cb set is a row of `fp16cb.patches.CHANGES` (none set elsewhere, e.g. by `@patch`)."
    from fp16cb.patches import CHANGES
    def from_us(v): return (getattr(v, '__module__', None) or '').startswith('fp16cb') or getattr(v, '_fp16cb', False)
    ours = {n for n in dir(Learner) if from_us(getattr(Learner, n))}
    listed = {c.name for c in CHANGES if c.cls is Learner}
    assert ours == listed, (ours - listed, listed - ours)
    assert all(getattr(Learner, c.name) is c.value for c in CHANGES if c.cls is Learner)

def test_to_fp16_adds_one_of_each_and_returns_learner():
    learn = make_learner()
    assert learn.to_fp16() is learn
    assert _kinds(learn) == ['MixedPrecision', 'ModelToHalf']
    learn.to_fp16(loss_scale=64., dynamic=False)  # twice: replaced, not added
    assert _kinds(learn) == ['MixedPrecision', 'ModelToHalf']
    assert len([cb for cb in learn.cbs if isinstance(cb, (ModelToHalf, MixedPrecision))]) == 2
    assert learn.mixed_precision.loss_scale == 64.  # the second call's settings
    assert learn.model_to_half.dtype == learn.mixed_precision.dtype == torch.float16

def test_to_bf16_defaults_and_overrides():
    learn = make_learner().to_bf16()
    assert learn.model_to_half.dtype == learn.mixed_precision.dtype == torch.bfloat16
    assert learn.mixed_precision.loss_scale == 1.
    learn.to_bf16(loss_scale=8.)
    assert learn.mixed_precision.loss_scale == 8. and _kinds(learn) == ['MixedPrecision', 'ModelToHalf']
    learn.to_fp16()  # back to fp16 replaces the bf16 ones
    assert learn.model_to_half.dtype == torch.float16 and not learn.mixed_precision.scaler.calibrated  # fp16's dynamic scale

def test_to_fp32_toggle():
    learn = make_learner().to_fp16(max_loss_scale=2.**8)
    dt = Record(after_pred=lambda l: (l.model[0].weight.dtype, l.pred.dtype))
    computes = []
    h = learn.model[0].register_forward_pre_hook(lambda m, a: computes.append(m.weight.dtype))
    quiet_fit(learn, 1, lr=1e-2, cbs=dt)
    h.remove()
    assert dt.log['after_pred'] == [(torch.float32, torch.float32)]*4  # the model keeps its FP32 params
    assert computes == [torch.float16] * 6  # and computes with fp16 copies (4 training, 2 validation batches)
    w = [p.detach().clone() for p in learn.model.parameters()]
    assert learn.to_fp32() is learn and learn.precision_callbacks() == []
    assert all(torch.equal(a, b) for a, b in zip(w, learn.model.parameters()))  # to_fp32 leaves the weights alone
    dt = Record(after_pred=lambda l: (l.model[0].weight.dtype, l.model[0].weight.dtype))
    quiet_fit(learn, 1, lr=1e-2, cbs=dt)
    assert dt.log['after_pred'] == [(torch.float32, torch.float32)]*4
    learn.to_fp16(max_loss_scale=2.**8)
    dt = Record(after_pred=lambda l: (l.model[0].weight.dtype, l.pred.dtype))
    computes = []
    h = learn.model[0].register_forward_pre_hook(lambda m, a: computes.append(m.weight.dtype))
    quiet_fit(learn, 1, lr=1e-2, cbs=dt)
    h.remove()
    assert dt.log['after_pred'] == [(torch.float32, torch.float32)]*4  # the model keeps its FP32 params
    assert computes == [torch.float16] * 6  # and computes with fp16 copies (4 training, 2 validation batches)
    assert learn.model[0].weight.dtype == torch.float32
    learn.to_fp32(); learn.to_fp32()  # idempotent
    assert learn.precision_callbacks() == []

def test_switch_between_ours_and_native():
    learn = make_learner().to_fp16()
    learn.to_native_fp16()
    assert _kinds(learn) == ['NativeMixedPrecision']
    learn.to_bf16()
    assert _kinds(learn) == ['MixedPrecision', 'ModelToHalf']
    assert learn.to_native_fp32() is learn and learn.precision_callbacks() == []

def test_replaces_fastais_own_callbacks():
    learn = make_learner(cbs=[fastai_fp16.MixedPrecision()])
    assert len(learn.precision_callbacks()) == 1
    learn.to_fp16()
    assert _kinds(learn) == ['MixedPrecision', 'ModelToHalf']
    assert not any(isinstance(cb, fastai_fp16.MixedPrecision) for cb in learn.cbs)

@pytest.mark.parametrize('call,kwargs,name', [
    ('to_fp16', dict(loss_scale=0), 'loss_scale'), ('to_fp16', dict(div_factor=1), 'div_factor'),
    ('to_fp16', dict(scale_wait=0), 'scale_wait'), ('to_fp16', dict(clip=-1), 'clip'),
    ('to_fp16', dict(dtype='fp8'), 'dtype'), ('to_bf16', dict(loss_scale=-1), 'loss_scale'),
    ('to_native_fp16', dict(backoff_factor=2.), 'backoff_factor'), ('to_native_fp16', dict(dtype='int8'), 'dtype'),
])
@pytest.mark.parametrize('before', ['to_bf16', 'to_native_fp16', 'to_fp32'])
def test_bad_arguments_keep_existing_callbacks(call, kwargs, name, before):
    learn = getattr(make_learner(), before)()
    cbs = list(learn.precision_callbacks())
    with pytest.raises(ValueError, match=name): getattr(learn, call)(**kwargs)
    after = learn.precision_callbacks()
    assert len(after) == len(cbs) and all(a is b for a, b in zip(after, cbs))

def test_unknown_keyword_rejected():
    learn = make_learner().to_bf16()
    with pytest.raises(TypeError): learn.to_fp16(loss_scael=3)
    assert _kinds(learn) == ['MixedPrecision', 'ModelToHalf'] and learn.mixed_precision.dtype == torch.bfloat16

def test_to_fp32_after_interrupted_fit_restores_fp32():
    "to_fp32 after a fit broken by an exception (fastai skips after_fit) gives back the FP32 masters and the optimizer."
    learn = make_learner().to_fp16(max_loss_scale=2.**8)
    def boom(l):
        if l.iter == 1: raise KeyboardInterrupt('stop')
    masters = Record(after_step=lambda l: {id(p): t.clone() for p, t in l.mixed_precision.store.fp32_views().items()})
    with pytest.raises(KeyboardInterrupt): quiet_fit(learn, 1, lr=1e-2, cbs=[masters, Record(after_step=boom)])
    # (fastai skips after_fit here: the model may still be 16-bit, unless fp16cb restored it on the way out)
    learn.to_fp32()
    last = masters.log['after_step'][-1]
    for p in learn.model.parameters():  # the trained masters, exactly
        assert p.dtype == torch.float32 and torch.equal(p.data, last[id(p)])
    ids = {id(p) for p in learn.model.parameters()}
    assert all(id(p) in ids for pg in learn.opt.param_lists for p in pg)
    quiet_fit(learn, 1, lr=1e-2)  # and it trains in FP32
    assert all(torch.isfinite(p).all() and p.dtype == torch.float32 for p in learn.model.parameters())

@pytest.mark.parametrize('how', ['instance', 'class', 'remove_cbs'])
@pytest.mark.parametrize('which', [ModelToHalf, MixedPrecision])
def test_removing_either_precision_callback_restores_the_fp32_learner(which, how):
    """Before the fix: `learn.remove_cb(MixedPrecision)` left `ModelToHalf`, so the next fit trained a pure 16-bit model
    (no masters, no loss scaling). Removing either callback of a `to_fp16` setup removes both, as `to_fp32()` does."""
    learn = make_learner().to_fp16(max_loss_scale=2.**8)
    quiet_fit(learn, 1, lr=1e-2)
    cb = next(c for c in learn.cbs if isinstance(c, which))
    if how == 'instance': learn.remove_cb(cb)
    elif how == 'class': learn.remove_cb(which)
    else: learn.remove_cbs([cb])
    assert learn.precision_callbacks() == [] and cb.learn is None
    assert not hasattr(learn, 'model_to_half') and not hasattr(learn, 'mixed_precision')
    dt = Record(after_pred=lambda l: {p.dtype for p in l.model.parameters()})
    quiet_fit(learn, 1, lr=1e-2, cbs=dt)
    assert dt.log['after_pred'] == [{torch.float32}]*4  # it trains in FP32
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in learn.model.parameters())

def test_removing_a_precision_callback_mid_fit_goes_on_in_fp32():
    "A callback removing `MixedPrecision` after the first epoch: the rest of the fit trains the FP32 model."
    learn = make_learner().to_fp16(max_loss_scale=2.**8)
    def drop(l):
        if l.epoch == 0: l.remove_cb(MixedPrecision)
    dt = Record(after_pred=lambda l: l.mixed_precision.loss_scale if hasattr(l, 'mixed_precision') else None,
                after_epoch=drop)
    computes = []
    h = learn.model[0].register_forward_pre_hook(lambda m, a: computes.append(m.weight.dtype))
    quiet_fit(learn, 2, lr=1e-2, cbs=dt)
    h.remove()
    assert None not in dt.log['after_pred'][:4] and dt.log['after_pred'][4:] == [None]*4
    assert computes == [torch.float16] * 6 + [torch.float32] * 6  # train, valid: fp16 copies, then FP32
    assert learn.precision_callbacks() == [] and all(p.dtype == torch.float32 for p in learn.model.parameters())

def test_signatures_show_the_callback_arguments():
    import inspect
    for name, args in [('to_fp16', ['loss_scale', 'flat_master', 'dynamic', 'max_loss_scale', 'div_factor', 'scale_wait', 'clip']),
                       ('to_bf16', ['loss_scale', 'clip']),
                       ('to_native_fp16', ['init_scale', 'growth_factor', 'backoff_factor', 'growth_interval', 'enabled'])]:
        params = inspect.signature(getattr(Learner, name)).parameters
        assert all(a in params for a in args), (name, list(params))

# ---- fastai's MixedPrecision and ours: each refuses the other's arguments, naming the right class --------------

def test_fastai_mixed_precision_refuses_our_arguments_naming_ours():
    """fastai's class is not changed (its `__init__` keeps the arguments for GradScaler): the fit refuses them before
    it starts, naming ours, where GradScaler would raise a bare `TypeError` at the first event."""
    for kw, msg in (({'loss_scale': 512, 'flat_master': True}, r"from fp16cb import MixedPrecision, ModelToHalf"),
                    ({'growth': 2.}, "GradScaler's arguments")):
        learn = make_learner(cbs=fastai_fp16.MixedPrecision(**kw))  # the README's line under fastai's star import
        w0 = [p.detach().clone() for p in learn.model.parameters()]
        with pytest.raises(TypeError, match=msg): quiet_fit(learn, 1)
        assert all(torch.equal(a, p) for a, p in zip(w0, learn.model.parameters()))  # before any step
    assert fastai_fp16.MixedPrecision(amp_mode='fp16', init_scale=8.).kwargs == {'init_scale': 8.}  # fastai's own use

def test_our_callbacks_refuse_fastais_arguments_naming_theirs():
    with pytest.raises(TypeError, match=r"NativeMixedPrecision\(init_scale=...\)"): MixedPrecision(init_scale=2.**16)
    with pytest.raises(TypeError, match="fastai.callback.fp16"): MixedPrecision(amp_mode='bf16')
    with pytest.raises(TypeError, match="to_native_bf16"): NativeMixedPrecision(amp_mode='bf16')

def test_readme_imports_give_our_classes():
    "The README's imports, fastai's star import first: `MixedPrecision` and `ModelToHalf` are fp16cb's, not fastai's."
    readme = (pathlib.Path(__file__).parents[1]/'README.md').read_text()
    quick = readme[readme.index('## API'):readme.index('## What importing')]
    ns = {}
    exec('\n'.join(l for l in re.findall(r'^(from .*import .*|import .*)$', quick, re.M)), ns)
    assert ns['MixedPrecision'] is fp16cb.MixedPrecision and ns['ModelToHalf'] is fp16cb.ModelToHalf

# ---- fastai 2.8's to_fp16 arguments, to_non_native_fp16, unknown keywords --------------------------------------

@pytest.mark.parametrize('kw', ['init_scale', 'growth_factor', 'backoff_factor', 'growth_interval', 'enabled', 'amp_mode'])
def test_to_fp16_with_fastais_amp_arguments_points_to_native(kw):
    learn = make_learner()
    with pytest.raises(TypeError, match=r"`learn.to_fp16\(\)` got '" + kw + r"'.*learn.to_native_fp16\("):
        learn.to_fp16(**{kw: 2})
    assert learn.precision_callbacks() == []

def test_unknown_keyword_names_the_method_and_the_valid_ones():
    learn = make_learner()
    with pytest.raises(TypeError, match=r"`learn.to_fp16\(\)` got .*'loss_scael' \(did you mean 'loss_scale'\?\); it takes: loss_scale, flat_master"):
        learn.to_fp16(loss_scael=3)
    with pytest.raises(TypeError, match=r"`learn.to_bf16\(\)` got"): learn.to_bf16(bogus=1)
    with pytest.raises(TypeError, match=r"`learn.to_native_fp16\(\)` got 'loss_scale': .*`learn.to_fp16\(\)`"):
        learn.to_native_fp16(loss_scale=8)

def test_fastais_to_non_native_fp16_replaces_ours():
    learn = make_learner().to_fp16()
    learn.to_non_native_fp16()
    assert sorted(type(cb).__module__ for cb in learn.precision_callbacks()) == ['fastai.callback.fp16']*2
    learn.to_fp16()
    assert not any(isinstance(cb, fastai_fp16.NonNativeMixedPrecision) for cb in learn.cbs)

def test_to_channelslast_keeps_our_precision():
    learn = make_learner().to_native_fp16()
    learn.to_channelslast()
    assert [type(cb).__name__ for cb in learn.precision_callbacks()] == ['NativeMixedPrecision']

def test_signatures_show_each_methods_own_defaults_and_keep_fp32():
    "help(learn.to_bf16) shows bf16's defaults, not fp16's; both show keep_fp32; the calls behave as before."
    import inspect
    fp16, bf16 = (inspect.signature(getattr(Learner, n)).parameters for n in ('to_fp16', 'to_bf16'))
    assert fp16['dynamic'].default is True and fp16['loss_scale'].default == 512 and fp16['dtype'].default == torch.float16
    assert bf16['dynamic'].default is False and bf16['loss_scale'].default == 1. and 'dtype' not in bf16
    assert 'keep_fp32' in fp16 and 'keep_fp32' in bf16 and fp16['keep_fp32'].default is None
    assert all(p.kind == p.KEYWORD_ONLY for n, p in list(fp16.items()) + list(bf16.items()) if n != 'self')
    assert 'dtype' not in inspect.signature(Learner.to_native_bf16).parameters
    learn = make_learner().to_bf16(keep_fp32='classifier')
    mp = learn.mixed_precision
    assert mp.loss_scale == 1. and mp.dtype == torch.bfloat16 and learn.model_to_half.policy.specs == ('batchnorm', 'classifier')
    learn.to_bf16(dynamic=True)  # dynamic bf16: calibrated from the first step, as fp16 (no loss_scale forced to 1)
    assert not learn.mixed_precision.scaler.calibrated and learn.mixed_precision.dtype == torch.bfloat16
    with pytest.raises(TypeError, match=r"to_bf16.*dtype.*to_fp16\(dtype="): learn.to_bf16(dtype=torch.float16)

@pytest.mark.parametrize('name', ['to_fp16', 'to_bf16', 'to_native_fp16', 'to_native_bf16', 'to_fp32', 'to_native_fp32'])
def test_help_and_doc_describe_every_argument(name):
    """A fastai user reads `help(learn.to_bf16)` or `doc(learn.to_bf16)` before the README: before the fix `to_bf16`'s
    was one line and `to_fp16`'s covered `loss_scale` only. Each keyword of the signature has its line, default and
    description in what `help()` prints, and fastcore's `docments` (what fastai's `doc` shows) has it too."""
    import inspect, pydoc
    from fastcore.docments import docments
    meth = getattr(make_learner(), name)
    text = pydoc.render_doc(meth, renderer=pydoc.plaintext)
    lines = [l.strip() for l in text.splitlines()]
    kws = [n for n in inspect.signature(meth).parameters if n != 'self']
    if name in ('to_fp32', 'to_native_fp32'): assert kws == [] and 'FP32' in text
    if name == 'to_bf16': assert {'state_dtype', 'half_storage', 'step_in_backward', 'keep_fp32', 'clip', 'clip_global',
                                  'on_collapse'} <= set(kws)
    docs = docments(getattr(Learner, name))
    for kw in kws:
        at = [i for i, l in enumerate(lines) if l.startswith(f"{kw} : default ")]
        assert len(at) == 1, (name, kw)
        assert len(lines[at[0] + 1]) > 10 and not lines[at[0] + 1].startswith(tuple(f"{k} :" for k in kws)), (name, kw)
        assert docs[kw] and len(docs[kw]) > 10, (name, kw)
