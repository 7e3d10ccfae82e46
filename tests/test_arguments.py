"""Arguments of the precision callbacks and of `Learner.to_fp16` & co.: bad values are refused at construction with the
argument's name (not at fit time, not clamped or truncated silently), and numpy scalars are taken as the numbers they
are."""
import numpy as np
import pytest, torch
from fp16cb import MixedPrecision, NativeMixedPrecision
from conftest import make_learner, quiet_fit

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
    ('MixedPrecision', dict(on_collapse='promote'), 'on_collapse'), ('to_fp16', dict(on_collapse=True), 'on_collapse'),
    ('to_bf16', dict(on_collapse=None), 'on_collapse'),
]

@pytest.mark.parametrize('how,kwargs,name', BAD)
def test_bad_arguments_rejected_at_construction(how, kwargs, name):
    """Before the fix: truthy non-bools taken as True; `10**400` an OverflowError; `'x'` a bare "'<' not supported";
    0.5 skipped steps truncated to 0; scale_wait/div_factor/min_loss_scale unchecked under bf16 or `dynamic=False`;
    min_loss_scale inf or above max_loss_scale clamped silently; GradScaler's limits found only at fit time."""
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
def test_numpy_scalars_accepted_as_python_numbers(how, kwargs, get, expected):
    "Before the fix: `np.float32(8.)`, `np.int64(10)` were refused (not `int`/`float`) although they are valid numbers."
    v = get(_make(how, **kwargs))
    assert v == expected and type(v) is type(expected)

def test_numpy_arguments_train():
    learn = make_learner().to_native_fp16(init_scale=np.float32(2.**8), growth_interval=np.int64(10))
    quiet_fit(learn, 1, lr=1e-2)
    learn.to_fp16(max_loss_scale=np.float32(2.**8), scale_wait=np.int64(2), clip=np.float32(1.))
    quiet_fit(learn, 1, lr=1e-2)
    assert all(torch.isfinite(p).all() for p in learn.model.parameters())
