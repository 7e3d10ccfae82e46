"""Regression tests for issue 11, one focused test per bug (the number in each test's name is the issue's).
Each describes the correct behaviour; see the docstrings for how the bug showed."""
import copy, errno, io, os, re, warnings
from types import SimpleNamespace
import numpy as np
import pytest, torch
from torch import nn
from fastai.basics import Learner, DataLoaders, DataLoader, CrossEntropyLossFlat, load_learner
from fastai.callback.core import Callback, CancelTrainException
from fastai.callback.mixup import MixUp
from fastai.callback.tracker import SaveModelCallback
from fastai.torch_core import trainable_params
from fp16cb import MixedPrecision, NativeMixedPrecision, LogNormalScaler
from fp16cb.monitor import scale_health
from conftest import make_learner, quiet_fit, seed_all, Record
from test_checkpoint import make_learner as datasets_learner  # fastai `Datasets`: `export` can empty them

pytestmark = pytest.mark.filterwarnings("ignore:(fp16|bf16) training on the CPU:RuntimeWarning")

# short fits: fp16's dynamic scale starts lower than 2**24, so that its first steps do not overflow
MODES = {'fp16': ('to_fp16', {'max_loss_scale': 2.**8}), 'bf16': ('to_bf16', {})}

def to_mode(learn, mode, **kwargs):
    "Put `learn` in `mode` ('fp32' leaves it alone): the reference run is the same call without precision callbacks."
    if mode == 'fp32': return learn
    name, kw = MODES[mode]
    return getattr(learn, name)(**{**kw, **kwargs})

def flat_kw(mode, flat): return {} if mode == 'fp32' else {'flat_master': flat}

def weights(learn): return [p.detach().clone() for p in learn.model.parameters()]

# ---- 1: a complex parameter --------------------------------------------------------------------------------------

class WithComplex(nn.Module):
    "A linear model plus a term of a complex parameter `c` (which gets a complex grad)."
    def __init__(self):
        super().__init__()
        self.lin, self.c = nn.Linear(4, 1), nn.Parameter(torch.tensor([1+2j, 3-4j]))
    def forward(self, x): return self.lin(x) + (x[:, :2] * self.c).abs().sum(1, keepdim=True) * .1

def complex_run(mode, flat=False):
    seed_all(); model = WithComplex()
    learn = to_mode(make_learner(model=model, splitter=trainable_params), mode, **flat_kw(mode, flat))
    dtypes = Record(before_batch=lambda l: l.model.c.dtype)
    quiet_fit(learn, 1, lr=1e-1, cbs=dtypes)
    return learn.model.c.detach().clone(), dtypes.log['before_batch']

@pytest.mark.parametrize('flat', [False, True])
@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
def test_1_complex_param_trains_in_its_own_dtype(mode, flat):
    """Was: fp16 keeps the real part only (`[1+2j, 3-4j]` -> `[0.99+0j, 2.99+0j]`: the master is `c.float()`);
    bf16 dies with `NotImplementedError ... 'ComplexFloat'` in the overflow check."""
    c0 = torch.tensor([1+2j, 3-4j])
    ref, _ = complex_run('fp32')
    c, dtypes = complex_run(mode, flat)
    assert set(dtypes) == {torch.complex64} and c.dtype == torch.complex64  # never altered to real, not even mid-fit
    assert (ref.imag - c0.imag).abs().min() > 1e-3  # the reference moves the imaginary part...
    assert torch.allclose(c.imag - c0.imag, ref.imag - c0.imag, rtol=.1, atol=1e-3)  # ...and so does the 16-bit run
    assert torch.allclose(c.real - c0.real, ref.real - c0.real, rtol=.1, atol=1e-3)

# ---- 2: a float64 parameter --------------------------------------------------------------------------------------

class WithDouble(nn.Module):
    "A linear model plus a float64 offset `d`."
    def __init__(self):
        super().__init__()
        self.lin, self.d = nn.Linear(4, 1), nn.Parameter(torch.tensor([.5], dtype=torch.float64))
    def forward(self, x): return self.lin(x) + self.d.float()

def double_run(mode, flat=False):
    seed_all(); model = WithDouble()
    learn = to_mode(make_learner(model=model, splitter=trainable_params), mode, **flat_kw(mode, flat))
    dtypes = Record(before_batch=lambda l: l.model.d.dtype)
    quiet_fit(learn, 1, lr=1e-1, cbs=dtypes)
    return learn.model.d.detach().clone(), dtypes.log['before_batch']

@pytest.mark.parametrize('flat', [False, True])
@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
def test_2_float64_param_keeps_its_dtype(mode, flat):
    "Was: the float64 param is 16-bit during the fit and comes back float32 (only float32 params are to be converted)."
    ref, _ = double_run('fp32')
    d, dtypes = double_run(mode, flat)
    assert set(dtypes) == {torch.float64} and d.dtype == torch.float64
    assert abs(ref.item() - .5) > 1e-2 and abs(d.item() - ref.item()) < .1 * abs(ref.item() - .5)

# ---- 4: one parameter in two param groups ------------------------------------------------------------------------

def body_in_both(m):
    "Splitter: the first Linear in both groups."
    return [list(m[0].parameters()), list(m[0].parameters()) + list(m[1].parameters()) + list(m[3].parameters())]

@pytest.mark.parametrize('flat', [False, True])
def test_4_param_in_two_groups_is_refused(flat):
    "Was: two masters for one param, and only the last group's update survives (lr [0.1, 0]: fp32 moves it, bf16 not)."
    learn = make_learner(splitter=body_in_both).to_bf16(flat_master=flat)
    with pytest.raises(ValueError, match='group') as e: quiet_fit(learn, 1, lr=[.1, 0.])
    assert re.search(r"0\.(weight|bias)|param\w*\s*#?\d", str(e.value)), str(e.value)  # which parameter

# ---- 5: freeze / unfreeze from a callback during a fit -----------------------------------------------------------

class ToggleAt0(Callback):
    "At the end of epoch 0, `learn.freeze()` or `learn.unfreeze()`; keeps the first Linear's weight of that moment."
    order = 50
    def __init__(self, how): self.how = how
    def after_epoch(self):
        if self.epoch != 0: return
        getattr(self.learn, self.how)()
        self.w = self.learn.model[0].weight.detach().clone()

@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
def test_5_freeze_from_a_callback_takes_effect(mode):
    "Was: the frozen body keeps training in epoch 1 and ends with `requires_grad=True`."
    learn = to_mode(make_learner(), mode)
    cb = ToggleAt0('freeze')
    head = learn.model[3].weight.detach().clone()
    quiet_fit(learn, 2, lr=1e-1, cbs=cb)
    w = learn.model[0].weight
    assert not w.requires_grad
    assert torch.equal(w.detach().to(cb.w.dtype), cb.w)  # not moved since the freeze
    assert not torch.equal(learn.model[3].weight, head)  # the head still trained

@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
def test_5_unfreeze_from_a_callback_takes_effect(mode):
    "Was: the unfrozen body never trains (no master) and ends with `requires_grad=False`."
    learn = make_learner()
    learn.freeze()
    w0 = learn.model[0].weight.detach().clone()
    to_mode(learn, mode)
    cb = ToggleAt0('unfreeze')
    quiet_fit(learn, 2, lr=1e-1, cbs=cb)
    w = learn.model[0].weight
    assert torch.equal(cb.w, w0.to(cb.w.dtype))  # frozen in epoch 0
    assert w.requires_grad and (w.detach() - w0).abs().max() > 1e-2  # trained in epoch 1

# ---- 6: a lower-order callback cancels the training in after_step ------------------------------------------------

class CancelTrainAfterStep(Callback):
    "Order 5, before MixedPrecision (10): `CancelTrainException` in the `after_step` of the second batch."
    order = 5
    def after_step(self):
        if self.training and self.iter == 1: raise CancelTrainException()

class WeightsAtValidate(Callback):
    order = 90
    def before_validate(self): self.w = weights(self.learn)

@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
def test_6_cancel_train_in_an_earlier_after_step_updates_the_model(mode):
    """Was: our `after_step` is skipped, so the 16-bit model misses the last update and the validation after the cancel
    runs the stale weights (only `after_fit` gives the FP32 model the masters)."""
    finals = []
    for m in ('fp32', mode):
        learn = to_mode(make_learner(), m)
        at_valid = WeightsAtValidate()
        quiet_fit(learn, 1, lr=1e-1, cbs=[CancelTrainAfterStep(), at_valid])
        finals.append(weights(learn))
    # the final weights are the trained masters (those of BatchNorm, FP32 in the model, too: they missed the update)
    for a, b in zip(*finals): assert torch.allclose(a, b, rtol=0., atol=5e-3)
    # the model that validated after the cancel is the masters (= the final FP32 weights) rounded to 16-bit
    for v, f in zip(at_valid.w, finals[1]): assert torch.equal(v, f.to(v.dtype))

# ---- 7: deepcopy of the learner during a fit ---------------------------------------------------------------------

class DeepcopyAt0(Callback):
    "The keep-the-best pattern: `copy.deepcopy(learn)` at the end of epoch 0."
    order = 60
    def after_epoch(self):
        if self.epoch != 0 or hasattr(self, 'best'): return
        self.best = None  # set before the copy: the copy's own DeepcopyAt0 does not copy again
        self.best = copy.deepcopy(self.learn)

@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
def test_7_deepcopy_mid_fit_gives_a_plain_learner(mode):
    "Was: the copy's model stays 16-bit, and its own `fit` trains nothing."
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

# ---- 8: fastai's MixUp -------------------------------------------------------------------------------------------

def classifier(n=64, bs=16):
    "A tiny 2-class classifier on fixed data."
    seed_all()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g); y = (x[:, 0] > 0).long()
    ds = list(zip(x, y))
    dls = DataLoaders(DataLoader(ds[:48], bs=bs), DataLoader(ds[48:], bs=bs), device=torch.device('cpu'))
    return Learner(dls, nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), loss_func=CrossEntropyLossFlat())

@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
def test_8_mixup_trains(mode):
    "Was: `expected dtype c10::BFloat16 for 'weight' but got dtype float` in MixUp's `before_batch` (fp16: c10::Half)."
    learn = to_mode(classifier(), mode)
    w0 = weights(learn)
    quiet_fit(learn, 1, lr=1e-1, cbs=MixUp())
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in learn.model.parameters())
    assert not torch.equal(learn.model[0].weight, w0[0])

# ---- 9: storage of the params after a non-flat fit ---------------------------------------------------------------

def test_9_params_own_their_storage_after_a_fit():
    "Was: after a non-flat fit every param is a view into one shared buffer (saving one bias writes all of them)."
    learn = to_mode(make_learner(), 'bf16')
    quiet_fit(learn, 1, lr=1e-2)
    for n, p in learn.model.named_parameters():
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), n
        assert p.grad is None or p.grad.untyped_storage().nbytes() == p.grad.numel() * p.grad.element_size(), n
    buf = io.BytesIO(); torch.save(learn.model[3].bias, buf)
    assert len(buf.getvalue()) < 2000

# ---- 10: a fit whose every step was skipped ----------------------------------------------------------------------

class NaNLoss(Callback):
    "Every training loss NaN: every step is skipped."
    order = 5
    def after_loss(self):
        if self.training: self.learn.loss_grad = self.learn.loss_grad * float('nan')

@pytest.mark.parametrize('call', ['to_fp16', 'to_bf16', 'to_native_fp16'])
def test_10_fit_with_every_step_skipped_warns(call):
    "Was: no error and no warning (the skip warning counted the leading skips as the dynamic scale's calibration)."
    learn = getattr(make_learner(), call)(max_skipped=100)
    w0 = weights(learn)
    with pytest.warns(RuntimeWarning, match='skipped'): quiet_fit(learn, 1, lr=1e-2, cbs=NaNLoss())
    for a, b in zip(weights(learn), w0): assert torch.equal(a, b)

# ---- 11: to_bf16 from a callback during an fp32 fit --------------------------------------------------------------

class ToBF16At(Callback):
    "`learn.to_bf16()` after the first training batch of an FP32 fit."
    def after_batch(self):
        if self.training and self.epoch == 0 and self.iter == 0: self.learn.to_bf16()

def test_11_to_bf16_during_a_fit_is_clean():
    "Was: `AttributeError: 'NoneType' object has no attribute 'grads_to_master'` in MixedPrecision's `before_step`."
    learn = make_learner()
    w0 = weights(learn)
    try: quiet_fit(learn, 2, lr=1e-2, cbs=ToBF16At())
    except Exception as e:  # a clear refusal is fine: it says that a fit is running
        assert not isinstance(e, AttributeError) and isinstance(e, (RuntimeError, ValueError)), repr(e)
        assert re.search(r'\bfit\b', str(e)), str(e)
    else: assert not torch.equal(learn.model[0].weight, w0[0])  # or it takes effect: the fit trained
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in learn.model.parameters())

# ---- 12: the floor warning for LogNormalScaler -------------------------------------------------------------------

def test_12_floor_warning_for_lognormal_scaler():
    "Was: `health` took a scaler without a `wait` attribute for a static one: LogNormalScaler never got the warning."
    cb = SimpleNamespace(scales=[1.] * 50, skips=[False] * 50, loss_scaler=LogNormalScaler(init_scale=1., min_scale=1.))
    with pytest.warns(RuntimeWarning, match='sits at its floor'): scale_health(cb)

# ---- 13: bad arguments at construction ---------------------------------------------------------------------------

def _make(how, **kwargs):
    if how == 'MixedPrecision': return MixedPrecision(**kwargs)
    if how == 'NativeMixedPrecision': return NativeMixedPrecision(**kwargs)
    return getattr(make_learner(), how)(**kwargs)

def _names(*names): return ''.join(f'(?=.*{n})' for n in names)  # a regex: every name, in any order

BAD = [
    ('MixedPrecision', dict(dynamic='False'), 'dynamic'), ('to_fp16', dict(dynamic='False'), 'dynamic'),
    ('MixedPrecision', dict(flat_master='yes'), 'flat_master'), ('to_bf16', dict(flat_master='yes'), 'flat_master'),
    ('MixedPrecision', dict(clip_global=1), 'clip_global'), ('NativeMixedPrecision', dict(enabled='no'), 'enabled'),
    ('to_native_fp16', dict(enabled=None), 'enabled'),
    ('MixedPrecision', dict(loss_scale=10**400), 'loss_scale'), ('to_bf16', dict(loss_scale=10**400), 'loss_scale'),
    ('MixedPrecision', dict(max_loss_scale=10**400), 'max_loss_scale'),
    ('MixedPrecision', dict(min_loss_scale='x'), 'min_loss_scale'),
    ('MixedPrecision', dict(max_skipped=.5), 'max_skipped'), ('to_bf16', dict(max_skipped=.5), 'max_skipped'),
    ('NativeMixedPrecision', dict(max_skipped=.5), 'max_skipped'),
    ('to_bf16', dict(scale_wait=0), 'scale_wait'), ('to_bf16', dict(div_factor=.5), 'div_factor'),
    ('to_bf16', dict(min_loss_scale=-1.), 'min_loss_scale'),
    ('MixedPrecision', dict(dynamic=False, scale_wait=1.5), 'scale_wait'),
    ('MixedPrecision', dict(dynamic=False, div_factor=1.), 'div_factor'),
    ('MixedPrecision', dict(scaler='static', min_loss_scale=0.), 'min_loss_scale'),
    ('MixedPrecision', dict(min_loss_scale=float('inf')), 'min_loss_scale'),
    ('MixedPrecision', dict(min_loss_scale=2.**10, max_loss_scale=2.**5), _names('min_loss_scale', 'max_loss_scale')),
    ('to_fp16', dict(scaler='lognormal', min_loss_scale=2.**10, max_loss_scale=2.**5),
     _names('min_loss_scale', 'max_loss_scale')),
    ('NativeMixedPrecision', dict(init_scale=1e308), 'init_scale'),
    ('to_native_fp16', dict(init_scale=10**400), 'init_scale'),
    ('NativeMixedPrecision', dict(growth_interval=10**19), 'growth_interval'),
    ('NativeMixedPrecision', dict(growth_interval=2**31), 'growth_interval'),
]

@pytest.mark.parametrize('how,kwargs,name', BAD)
def test_13_bad_arguments_rejected_at_construction(how, kwargs, name):
    """Was: truthy non-bools taken as True; `10**400` an OverflowError; `'x'` a bare "'<' not supported"; 0.5 skipped
    steps truncated to 0; scale_wait/div_factor/min_loss_scale unchecked under bf16 or `dynamic=False`; min_loss_scale
    inf or above max_loss_scale clamped silently; GradScaler's limits found only at fit time."""
    with pytest.raises((ValueError, TypeError), match=name): _make(how, **kwargs)

GOOD = [
    ('MixedPrecision', dict(loss_scale=np.float32(8.), dynamic=False), lambda cb: cb.loss_scale, 8.),
    ('MixedPrecision', dict(clip=np.float64(1.)), lambda cb: cb.clip, 1.),
    ('MixedPrecision', dict(scale_wait=np.int64(10)), lambda cb: cb.scaler.wait, 10),
    ('MixedPrecision', dict(max_loss_scale=np.float32(2.**10), min_loss_scale=np.int64(2)),
     lambda cb: cb.scaler.min_scale, 2.),
    ('MixedPrecision', dict(max_skipped=np.int64(5)), lambda cb: cb.scaler.max_skipped, 5),
    ('MixedPrecision', dict(div_factor=np.float32(4.)), lambda cb: cb.scaler.factor, 4.),
    ('MixedPrecision', dict(flat_master=np.bool_(True)), lambda cb: cb.flat_master, True),
    ('NativeMixedPrecision', dict(init_scale=np.float32(2.**10)), lambda cb: cb.init_scale, 2.**10),
    ('NativeMixedPrecision', dict(growth_interval=np.int64(10)), lambda cb: cb.growth_interval, 10),
    ('NativeMixedPrecision', dict(enabled=np.bool_(False)), lambda cb: cb.enabled, False),
]

@pytest.mark.parametrize('how,kwargs,get,expected', GOOD)
def test_13_numpy_scalars_accepted_as_python_numbers(how, kwargs, get, expected):
    "Was: `np.float32(8.)`, `np.int64(10)` refused (not `int`/`float`) although they are valid numbers."
    v = get(_make(how, **kwargs))
    assert v == expected and type(v) is type(expected)

def test_13_numpy_arguments_train():
    learn = make_learner().to_native_fp16(init_scale=np.float32(2.**8), growth_interval=np.int64(10))
    quiet_fit(learn, 1, lr=1e-2)
    learn.to_fp16(max_loss_scale=np.float32(2.**8), scale_wait=np.int64(2), clip=np.float32(1.))
    quiet_fit(learn, 1, lr=1e-2)
    assert all(torch.isfinite(p).all() for p in learn.model.parameters())

# ---- 3: atomic save and export -----------------------------------------------------------------------------------

def failing_save(real_save):
    "A `torch.save` that writes the first half of the real file, then fails as a full disk does."
    def save(obj, f, *args, **kwargs):
        buf = io.BytesIO(); real_save(obj, buf, *args, **kwargs)
        data = buf.getvalue()[:len(buf.getvalue()) // 2]
        if isinstance(f, (str, os.PathLike)):
            with open(f, 'wb') as fh: fh.write(data)
        else: f.write(data)
        raise OSError(errno.ENOSPC, 'No space left on device')
    return save

def files(d): return sorted(os.listdir(d))

def test_3_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    "Was: `learn.save` truncates the old file first, so a save that fails part-way destroys the previous checkpoint."
    learn = make_learner(path=tmp_path).to_bf16()
    quiet_fit(learn, 1, lr=1e-2)
    fname = learn.save('ck')
    saved, w = fname.read_bytes(), weights(learn)
    quiet_fit(learn, 1, lr=1e-2)
    monkeypatch.setattr(torch, 'save', failing_save(torch.save))
    with pytest.raises(OSError): learn.save('ck')
    monkeypatch.undo()
    assert fname.read_bytes() == saved and files(fname.parent) == ['ck.pth']  # intact, and no temporary file left
    learn.load('ck')
    for a, b in zip(weights(learn), w): assert torch.equal(a, b)

def test_3_failed_save_of_save_model_callback_keeps_the_previous_file(tmp_path, monkeypatch):
    "`SaveModelCallback` saves with `learn.save`: a failed save in a later fit keeps the best model of the earlier one."
    learn = make_learner(path=tmp_path).to_fp16(max_loss_scale=2.**8)
    quiet_fit(learn, 1, lr=1e-2, cbs=SaveModelCallback(fname='best'))
    fname = tmp_path/'models'/'best.pth'
    saved = fname.read_bytes()
    monkeypatch.setattr(torch, 'save', failing_save(torch.save))
    with pytest.raises(OSError): quiet_fit(learn, 1, lr=1e-2, cbs=SaveModelCallback(fname='best'))  # a new best: saved
    monkeypatch.undo()
    assert fname.read_bytes() == saved and files(fname.parent) == ['best.pth']

def test_3_failed_export_keeps_the_previous_export(tmp_path, monkeypatch):
    "Was: `learn.export` overwrites in place, so an export that fails part-way destroys the previous one."
    learn = datasets_learner(path=tmp_path).to_bf16()
    quiet_fit(learn, 1, lr=1e-2)
    learn.export('exp.pkl')
    fname = tmp_path/'exp.pkl'
    saved, dls, w = fname.read_bytes(), learn.dls, weights(learn)
    monkeypatch.setattr(torch, 'save', failing_save(torch.save))
    with pytest.raises(OSError): learn.export('exp.pkl')
    monkeypatch.undo()
    assert fname.read_bytes() == saved and files(tmp_path) == ['exp.pkl']
    assert learn.dls is dls and learn.opt is not None  # the learner keeps its data and optimizer
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        new = load_learner(fname)
    for a, b in zip(weights(new), w): assert torch.equal(a, b)

def test_3_atomic_write_replaces_only_on_success(tmp_path):
    from fp16cb.atomic import atomic_write
    fname = tmp_path/'f.bin'
    with atomic_write(fname) as f: f.write(b'old')
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(fname) as f:
            f.write(b'new, half written'); raise KeyboardInterrupt()
    assert fname.read_bytes() == b'old' and files(tmp_path) == ['f.bin']
    with atomic_write(fname) as f: f.write(b'new')
    assert fname.read_bytes() == b'new' and files(tmp_path) == ['f.bin']
    assert fname.stat().st_mode & 0o777 == 0o666 & ~_umask()  # permissions of a file made with `open`, not 0o600

def _umask():
    m = os.umask(0); os.umask(m)
    return m
