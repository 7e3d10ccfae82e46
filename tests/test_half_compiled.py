"""`half_storage` with fastai's Adam on a CPU: its 16-bit params lifted to FP32 a batch at a time, each stretch of them
stepped by one compiled pass (`fp16cb.storage.fused16.lifted_adam`) instead of fastai's callbacks one pass each; a
param bigger than a slice a slice at a time, and a param stepped in the backward, the same way. The rounding back to 16 bits, the loss scale, the clip and
the state's storage are what they were; rounding to nearest keeps fastai's eager step, bit for bit."""
import pytest
import torch
from torch import nn
from fastai.basics import Adam, Callback

from fp16cb.callbacks import MixedPrecision
from fp16cb.storage import fused16
from fp16cb.weights import loop
from fp16cb.weights.optstate import opt_state
from conftest import make_learner, quiet_fit, assert_apart_less_than_moved

BF16 = torch.bfloat16

def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 32), nn.LayerNorm(32), *[nn.Linear(32, 32) for _ in range(4)], nn.Linear(32, 1))

def _fit(compiled:bool, monkeypatch, meth='to_bf16', epochs=2, cbs=None, one_cycle=False, **kw):
    """A fit of `_model` with `half_storage` and fastai's Adam on a CPU, the compiled steps on or off; returns the
    learner and the size of each call of the lifted params' compiled step."""
    monkeypatch.setitem(fused16.COMPILE, 'cpu', compiled)
    sizes, compiled_fn = [], fused16._compiled
    def counted(dev, fn=fused16._adam16):
        f = compiled_fn(dev, fn)
        if f is None or fn is not fused16._adam32: return f
        return lambda *a: sizes.append(a[0].numel()) or f(*a)
    monkeypatch.setattr(fused16, '_compiled', counted)
    learn = make_learner(model=_model(), opt_func=Adam, device='cpu', splitter=lambda m: [list(m.parameters())],
                         cbs=cbs)
    getattr(learn, meth)(half_storage=True, **kw)
    quiet_fit(learn, epochs, lr=1e-2, one_cycle=one_cycle)
    return learn, sizes

@pytest.mark.parametrize('meth,kw', [('to_bf16', {}), ('to_fp16', {'max_loss_scale': 2.**8}),
                                     ('to_bf16', {'state_dtype': BF16}), ('to_bf16', {'step_in_backward': True})],
                         ids=['bf16', 'fp16', 'bf16_state16', 'bf16_sib'])
def test_half_storage_adam_steps_each_stretch_in_one_compiled_pass(monkeypatch, meth, kw):
    """Each step after the first (8 steps) steps its stretches of lifted params (the weights, then the biases and the
    LayerNorm, which fastai's `wd_bn_bias=False` flags apart) by the compiled pass, fp16's loss scale divided out before
    it, a bf16 state widened around it; stepped in the backward, each param by it. The fit lands where the usual step's does: the two differ by FP32 roundings the
    compiler fuses and by the 16-bit roundings they lead to, far less than the fit moves the weights. Before: fastai's
    callbacks, one pass each over the scratch (on 150 small layers, 1.4x `to_bf16()`'s step)."""
    fused, sizes = _fit(True, monkeypatch, meth, **kw)
    usual, none = _fit(False, monkeypatch, meth, **kw)
    assert len(sizes) >= 2 * 7 and not none, sizes
    assert_apart_less_than_moved(fused.model, usual.model, _model())
    for a, b in zip(opt_state(fused.opt).values(), opt_state(usual.opt).values()):
        assert a['step'] == b['step'] and a['grad_avg'].dtype == torch.float32

def test_a_big_params_slices_take_the_compiled_pass(monkeypatch):
    """A param bigger than a slice (half a chunk: here the chunk made so small that every param of 32 or more elements
    is one) is lifted a slice at a time, each slice stepped by the compiled pass with its slice of the state, and lands
    where the usual step's slices do."""
    monkeypatch.setitem(loop.STATE_CHUNK, 'cpu', 64)
    fused, sizes = _fit(True, monkeypatch)
    usual, _ = _fit(False, monkeypatch)
    assert set(sizes) == {32} and len(sizes) == 7 * 140, len(sizes)  # 140 slices of 32 each step, but the first
    assert_apart_less_than_moved(fused.model, usual.model, _model())

def test_rounding_to_nearest_keeps_fastais_eager_step_bit_for_bit(monkeypatch):
    """`stochastic_rounding=False`: the 16-bit weights are fastai's FP32 step rounded to nearest, which an FP32 rounding
    of the compiled pass could flip: the usual step, the same weights as with the compiled steps off."""
    fused, sizes = _fit(True, monkeypatch, stochastic_rounding=False)
    usual, _ = _fit(False, monkeypatch, stochastic_rounding=False)
    assert not sizes
    assert all(torch.equal(a, b) for a, b in zip(fused.model.parameters(), usual.model.parameters()))

def test_a_state_holding_more_than_adams_takes_the_usual_step(monkeypatch):
    "A key other code puts in the state (`dampening=False`, which fastai passes to its callbacks): the usual step."
    class Undamped(Callback):
        order = MixedPrecision.order + 1
        def after_step(self):
            for st in opt_state(self.learn.opt).values(): st['dampening'] = False
    fused, sizes = _fit(True, monkeypatch, cbs=[Undamped()])
    usual, _ = _fit(False, monkeypatch, cbs=[Undamped()])
    assert not sizes
    assert_apart_less_than_moved(fused.model, usual.model, _model())

def test_the_compiled_lifted_step_is_fastais_arithmetic():
    """One compiled pass against fastai's own callbacks on FP32 weights and state: bit for bit but where the compiler
    fused what eager rounds twice (an FP32 rounding there)."""
    from fastai.optimizer import Adam as FastaiAdam
    torch.manual_seed(0)
    n = 50_000
    p, g = torch.randn(n), torch.randn(n) * 1e-2
    m, v = torch.randn(n) * 1e-2, torch.rand(n) * 1e-4
    hyper, step = dict(lr=3e-3, mom=0.9, sqr_mom=0.99, eps=1e-5, wd=0.01), 6
    ref = nn.Parameter(p.clone())
    ref.grad = g.clone()
    opt = FastaiAdam([ref], **hyper)
    opt.state[ref] = {'grad_avg': m.clone(), 'sqr_avg': v.clone(), 'step': step}
    opt.step()
    kernel = fused16.lifted_adam(opt, True, 'cpu')
    got, gm, gv = p.clone(), m.clone(), v.clone()
    new = kernel(got, g, {'grad_avg': gm, 'sqr_avg': gv}, {'step': step}, {**hyper, 'decouple_wd': True})
    assert new['step'] == step + 1 == opt.state[ref]['step'] and new['grad_avg'] is gm
    for x, y in ((got, ref.data), (gm, opt.state[ref]['grad_avg']), (gv, opt.state[ref]['sqr_avg'])):
        assert (x == y).float().mean().item() > 0.75 and torch.allclose(x, y, rtol=1e-6, atol=1e-9)
    assert fused16.lifted_adam(opt, False, 'cpu') is None  # rounding to nearest: the eager step

def test_the_compiled_lifted_step_compiles_once(monkeypatch):
    """One graph for stretches and slices of every size and every step of a one-cycle fit (the scalars in a tensor,
    each stretch's memory in tensors of their own)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    torch._dynamo.reset()
    monkeypatch.setattr(fused16, '_FN', {})
    monkeypatch.setitem(loop.STATE_CHUNK, 'cpu', 256)  # (slices of 128, stretches of smaller params)
    _, sizes = _fit(True, monkeypatch, epochs=3, one_cycle=True)
    assert len(set(sizes)) > 2, sizes
    assert len(_debug_get_cache_entry_list(fused16._adam32.__code__)) == 1
