"FP16 master-weight storage (NVIDIA's NVCaffe slides) and FP32 regularization (OpenSeq2Seq's guide)."
from functools import partial
import pytest
import torch
from torch import nn
from fastai.optimizer import SGD, Adam, Optimizer, weight_decay, l2_reg

from fp16cb.callbacks import ModelToHalf, MixedPrecision
from fp16cb.storage import round_stochastic, HalfStorage
from fp16cb.diagnostics import state_bytes
from fp16cb.demos.experiments import make_learner as digits_learner, train
from conftest import make_learner, quiet_fit, Record, weights

def test_stochastic_rounding_is_unbiased_and_exact_on_grid():
    x = torch.full((20000,), 1. + 2.**-12)  # a quarter of an fp16 spacing above 1
    y = round_stochastic(x, torch.float16, torch.Generator().manual_seed(0)).float()
    assert set(y.unique().tolist()) == {1., 1. + 2.**-10}
    assert abs(y.mean().item() - x[0].item()) < 2e-5  # nearest would give exactly 1 (the update lost)
    g = torch.randn(100).to(torch.bfloat16).float()
    assert torch.equal(round_stochastic(g, torch.bfloat16).float(), g)  # representable values are kept as they are

def test_fp16_stochastic_rounding_by_dither_is_unbiased_in_every_range():
    """fp16 from FP32 by the dither of the 13 dropped mantissa bits (normal range) or of 2^-24 steps (under fp16's
    smallest normal): each result one of the two fp16 neighbours of x, representable values kept, inf and NaN kept, and
    the mean of many draws x (under 1% of a spacing off, in each range); the general rule's law, at a quarter of its
    cost."""
    from fp16cb.storage.lifted import round_fp16_stochastic_
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20000, generator=g) * s for s in (1e-7, 1e-5, 6e-5, 1e-3, 1., 3e4)])
    y = round_fp16_stochastic_(x.clone(), g).float()
    near = x.to(torch.float16)
    other = torch.nextafter(near, torch.where(x > near.float(), torch.inf, -torch.inf).to(torch.float16)).float()
    assert ((y == near.float()) | (y == other)).all()
    grid = torch.randn(10000, generator=g).to(torch.float16).float()
    assert torch.equal(round_fp16_stochastic_(grid.clone(), g).float(), grid)
    special = torch.tensor([float('inf'), -float('inf'), float('nan')])
    got = round_fp16_stochastic_(special.clone(), g).float()
    assert got[0] == float('inf') and got[1] == -float('inf') and got[2].isnan()
    for v in (1. + 2.**-12, 3e-6 + 1e-8, -1e-5 - 3e-9, 2.**-14 - 1e-9):
        mean = round_fp16_stochastic_(torch.full((200000,), v), g).double().mean().item()
        h = torch.tensor(v).half()
        spacing = abs(float(torch.nextafter(h, torch.tensor(1e4).half()).double() - h.double()))
        assert abs(mean - v) < .01 * spacing, (v, mean)

def _storage_learner(opt_func, **kw):
    learn = make_learner(opt_func=opt_func, lr=1e-2)
    return learn.to_fp16(half_storage=True, dynamic=False, loss_scale=128., **kw)  # static: no skipped first steps

def test_fp16_stochastic_rounding_on_a_cpu_draws_once_per_piece():
    """On a CPU fp16's dither reads its 13-bit draws from the same fixed permutation as bf16's, at offsets drawn from
    the generator, one per 65536 elements (the generator drawing a number per 4 elements was a third of the rounding):
    the generator moves by exactly those draws, and each element, rounded again and again, averages its own value, in
    the normal range and under fp16's smallest normal."""
    from fp16cb.storage.lifted import round_fp16_stochastic_
    PIECE = 65536
    g, ref = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    round_fp16_stochastic_(torch.full((3 * PIECE + 5,), 1. + 2.**-12), g)
    torch.randint(0, PIECE, (4,), generator=ref)
    assert torch.equal(g.get_state(), ref.get_state())
    for v, spacing in ((1. + 2.**-12, 2.**-10), (3e-6 + 1e-8, 2.**-24)):
        x = torch.full((1000,), v)
        ys = torch.stack([round_fp16_stochastic_(x.clone(), g).float() for _ in range(400)])
        assert (ys.mean(0) - x).abs().max() < 5 * spacing * 0.5 / 20, v  # 5 sigma of 400 roundings at most

@pytest.mark.parametrize('opt_func', [partial(SGD, mom=0.9), Adam], ids=['sgd_mom', 'adam'])
def test_half_storage_trains_with_one_16bit_copy_and_fp32_state(opt_func):
    learn = _storage_learner(opt_func)
    seen = Record(before_step=lambda l: (l.model[0].weight.dtype, l.mixed_precision.master_pgs),
                  after_step=lambda l: {k: v.dtype for s in l.opt.state.values() for k, v in s.items() if torch.is_tensor(v) and v.dim()})
    start = learn.model[0].weight.detach().clone()
    quiet_fit(learn, 2, cbs=[seen])
    assert seen.log['before_step'][0] == (torch.float16, None)  # the 16-bit weights themselves, no FP32 masters
    assert set(seen.log['after_step'][-1].values()) == {torch.float32}  # momentum / Adam's averages in FP32
    assert learn.recorder.values[-1][0] < learn.recorder.values[0][0] or len(learn.recorder.values) == 1
    assert not torch.equal(learn.model[0].weight, start) and learn.model[0].weight.dtype == torch.float32

def test_half_storage_unscales_in_fp32():
    "Loss-scaled grads whose unscaled values are below fp16's subnormals still move the weights (unscaled in FP32)."
    learn = make_learner(opt_func=partial(SGD, mom=0.), lr=1.)
    learn.loss_func = lambda p, t: ((p - t)**2).mean() * 2.**-30  # raw grads ~1e-9: zero once unscaled in fp16
    learn.to_fp16(half_storage=True, loss_scale=2.**24, dynamic=False, stochastic_rounding=False)
    w0 = learn.model[3].weight.detach().clone()
    quiet_fit(learn, 1, lr=2.**24)
    assert not torch.equal(learn.model[3].weight, w0)

def test_modified_rule_beats_plain_update_and_matches_masters():
    "The experiment at small scale: plain 16-bit update lags; the modified rule lands within 0.5 points of FP32 masters."
    acc = {m: train(digits_learner('storage', m, 0), epochs=2).accuracy for m in ('to_fp16', 'fp16_storage', 'fp16_storage_plain')}
    assert abs(acc['fp16_storage'] - acc['to_fp16']) <= 0.005
    assert acc['fp16_storage_plain'] < acc['to_fp16'] - 0.02

def test_stochastic_rounding_keeps_updates_under_half_a_spacing():
    "Weights near 24 (fp16 spacing 2^-6), Adam steps ~5e-3: round-to-nearest stores nothing, stochastic rounding trains."
    moved = {m: train(digits_learner('vanishing', m, 0), epochs=1).weights_moved for m in ('fp16_storage_rn', 'fp16_storage')}
    assert moved['fp16_storage_rn'] < 0.1 and moved['fp16_storage'] > 0.9

def test_memory_bytes_per_param():
    """The model's own FP32 params (the masters): 4 (weight) + 4 (grad) + 4 (momentum), as FP32; 16-bit storage: 2+2+4."""
    sizes = {}
    for half in (False, True):
        learn = make_learner(model=nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 1)), opt_func=partial(SGD, mom=0.9),
                             splitter=lambda m: [list(m.parameters())])
        learn.to_fp16(half_storage=half, dynamic=False, loss_scale=128.)
        rec = Record(after_step=state_bytes)
        quiet_fit(learn, 1, cbs=[rec])
        sizes[half] = rec.log['after_step'][-1]
    assert sizes[False] == {"weights": 4, "grads": 4, "masters": 0, "optimizer state": 4, "total": 12}
    assert sizes[True]['masters'] == 0 and sizes[True]['weights'] == 2 and sizes[True]['optimizer state'] == 4
    assert sizes[True]["total"] == 8  # half of the 16 bytes/param with FP32 masters

def test_bad_storage_arguments():
    with pytest.raises(ValueError, match='half_storage'): MixedPrecision(half_storage='yes')
    with pytest.raises(ValueError, match='stochastic_rounding'): MixedPrecision(stochastic_rounding=1)

# FP32 regularization (OpenSeq2Seq's guide): decay acts on FP32 values, never on 16-bit weights where it underflows

def _decay_run(mode, wd, true_wd=True, steps=3, wd_bn_bias=False):
    "Tiny weights (~1e-3), zero loss gradient: what `steps` SGD steps with decay leave of the first layer's weights."
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        for p in model.parameters(): p.copy_(torch.linspace(1e-3, 4e-3, p.numel()).reshape(p.shape))
    learn = make_learner(model=model, opt_func=partial(SGD, mom=0.), lr=1e-2, wd=wd, train_bn=False,
                         splitter=lambda m: [list(m.parameters())], wd_bn_bias=wd_bn_bias, n_train=16 * steps)
    learn.true_wd, learn.loss_func = true_wd, lambda p, t: (p * 0.).sum()
    if mode == 'pure16': learn.to_fp32().add_cb(ModelToHalf(torch.bfloat16))  # the optimizer on the 16-bit weights
    elif mode == 'mixed': learn.to_bf16()
    elif mode == 'storage': learn.to_bf16(half_storage=True, stochastic_rounding=False)
    w0 = learn.model[0].weight.detach().clone(); b0 = learn.model[1].bias.detach().clone()
    quiet_fit(learn, 1)
    return (w0 - learn.model[0].weight.detach()).abs().max().item(), (b0 - learn.model[1].bias.detach()).abs().max().item()

@pytest.mark.parametrize('true_wd', [True, False])
@pytest.mark.parametrize('wd', [1e-5, 1e-3])
def test_decay_acts_on_fp32_values(wd, true_wd):
    ref = _decay_run('fp32', wd, true_wd)[0]
    assert ref > 0
    assert _decay_run('pure16', wd, true_wd)[0] == 0.  # decay of 1e-7..1e-5 relative: under half a bf16 spacing, lost
    assert _decay_run('mixed', wd, true_wd)[0] == pytest.approx(ref, rel=1e-3)  # on the FP32 masters: as FP32

def test_decay_in_fp16_storage_is_computed_in_fp32():
    "16-bit storage with a decay bigger than half a spacing: computed in FP32 and rounded once, as FP32 then rounded."
    ref = _decay_run('fp32', 1., steps=1)[0]  # lr*wd = 1e-2: over half a bf16 spacing (2^-9 relative)
    got = _decay_run('storage', 1., steps=1)[0]
    assert got > 0 and got == pytest.approx(ref, rel=0.1)

def test_wd_bn_bias_keeps_its_meaning():
    assert _decay_run('mixed', 1e-3, wd_bn_bias=False)[1] == 0.  # BatchNorm and biases not decayed
    assert _decay_run('mixed', 1e-3, wd_bn_bias=True)[1] == pytest.approx(_decay_run('fp32', 1e-3, wd_bn_bias=True)[1], rel=1e-3)

def test_experiment_rows_run_at_tiny_scale():
    "`python -m fp16cb --experiments` has the precision-policy and FP16-storage rows in its one table, and formats them."
    from fp16cb.demos.experiments import EXPERIMENTS, run_experiments
    from fp16cb.demos.cli import format_experiments
    ours = {t for t, _, _ in EXPERIMENTS if t.startswith(('Precision policy', 'FP16 master-weight storage', 'FP16 storage'))}
    assert len(ours) == 4
    res = [r for r in run_experiments(seeds=(0,), epochs=1, log=None) if r[0] in ours]
    text, _ = format_experiments(res)
    assert 'fp16 storage, plain update' in text and 'classifier FP32' in text

def test_half_storage_steps_a_groups_small_params_as_one(monkeypatch):
    """`half_storage` with an elementwise fastai optimizer: the small params lifted together are stepped by fastai's
    callbacks one flat tensor per stretch of equal state (the weights, then the biases, which fastai's `wd_bn_bias=False`
    flags apart), as the default path steps its FP32 params; the weights after three epochs are those of stepping each
    param on its own. Before: each param stepped on its own (on 150 small layers, 1.9x `to_bf16()`'s step)."""
    from fp16cb.weights import drivers
    from fp16cb.storage import lifted
    def run(fuse:bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), *[m for _ in range(6) for m in (nn.ReLU(), nn.Linear(16, 16))],
                              nn.ReLU(), nn.Linear(16, 1))
        learn = make_learner(model=model, opt_func=Adam, lr=1e-3, splitter=lambda m: [list(m.parameters())])
        learn.to_bf16(half_storage=True, stochastic_rounding=False)
        calls = {'alone': 0, 'flat': 0}
        def count(f, k):
            def g(*a, **kw): calls[k] += 1; return f(*a, **kw)
            return g
        with monkeypatch.context() as m:
            m.setattr(lifted, 'fastai_update', count(lifted.fastai_update, 'alone'))
            m.setattr(drivers._Stretch, 'step', count(drivers._Stretch.step, 'flat'))
            if not fuse: m.setattr(lifted._Batch, 'runs', lambda *a: [])
            steps = Record(after_step=lambda l: dict(calls))
            quiet_fit(learn, 3, cbs=[steps])
        log = steps.log['after_step']
        per_step = [{k: b[k] - a[k] for k in a} for a, b in zip(log, log[1:])]
        return weights(learn), per_step
    (fused, calls), (alone, calls_alone) = run(True), run(False)
    assert all(c == {'alone': 0, 'flat': 2} for c in calls), calls  # 8 weights as one, 8 biases as one
    assert all(c == {'alone': 16, 'flat': 0} for c in calls_alone), calls_alone
    assert all(torch.equal(a, b) for a, b in zip(fused, alone))
