"""A compiled model (`learn.model = torch.compile(model)`) under `to_bf16`/`to_fp16`, with FP32 masters (flat or not,
dynamic loss scale) and with 16-bit storage: no graph break caused by us, no recompilation after the first epoch
(validation, a save in the middle of a fit, `SaveModelCallback`, `to_fp32()` and back included), and the same weights
and loss scales as eager; `keep_fp32` islands trace into the model's graphs (`fullgraph=True` too). dynamo's
`aot_eager` backend needs no C++ compiler."""
from pathlib import Path
import pytest
import torch
from torch import nn
from fastai.callback.tracker import SaveModelCallback

from conftest import DEVICE, make_learner, quiet_fit, weights

dynamo = pytest.importorskip('torch._dynamo')
from torch._dynamo.utils import counters

# id: (method, arguments); the FP32-master cases are the ones most users run
CASES = {
    'bf16':              ('to_bf16', {}),
    'bf16-flat':         ('to_bf16', {'flat_master': True}),
    'fp16':              ('to_fp16', {}),  # FP32 masters, dynamic loss scale (calibrated from the first step)
    'fp16-overflow':     ('to_fp16', {'loss_scale': 2.**16}),  # the dynamic scale starts too high: 2 skipped steps
    'fp16-half_storage': ('to_fp16', {'half_storage': True}),
}

def _learner(compiled:bool, tmp_path:Path):
    learn = make_learner(splitter=lambda m: [list(m.parameters())])
    if compiled: learn.model = torch.compile(learn.model, backend='aot_eager')
    learn.path = tmp_path
    return learn

def _graphs() -> int: return counters['stats']['unique_graphs']
def _breaks() -> dict: return {k: dict(v) for k, v in counters.items() if 'graph_break' in k and v}

def _no_recompile(): return dynamo.config.patch(error_on_recompile=True)  # a recompile raises, naming the failed guard

@pytest.mark.parametrize('case', list(CASES))
def test_compiled_model_compiles_once_and_trains_as_eager(case, tmp_path):
    meth, kw = CASES[case]
    dynamo.reset(); counters.clear()
    learn = getattr(_learner(True, tmp_path), meth)(**kw)
    quiet_fit(learn, 1)
    first = _graphs()  # a training and a validation graph
    assert 1 <= first <= 2 and not _breaks(), dict(counters)
    with _no_recompile():  # saved between fits, then mid-fit (after epoch 0, training goes on) and loaded at its end
        learn.save('mid'); quiet_fit(learn, 2, cbs=SaveModelCallback(fname='best')); learn.validate()
    assert (tmp_path/'models'/'mid.pth').exists() and (tmp_path/'models'/'best.pth').exists()
    assert _graphs() == first and not _breaks()  # nothing of ours made dynamo compile again
    learn.to_fp32(); quiet_fit(learn, 1)
    fp32_graphs = _graphs()  # FP32 weights: new graphs, legitimately
    getattr(learn, meth)(**kw)
    with _no_recompile(): quiet_fit(learn, 1)
    assert _graphs() == fp32_graphs and not _breaks()  # back in 16-bit: the first graphs serve again

    eager = getattr(_learner(False, tmp_path), meth)(**kw)
    init = weights(eager)
    dynamo.reset()
    compiled = getattr(_learner(True, tmp_path), meth)(**kw)
    quiet_fit(eager, 2); quiet_fit(compiled, 2)
    moved = max((a - b).abs().max().item() for a, b in zip(weights(eager), init))
    assert moved > 1e-2, moved  # the weights trained well past the tolerance below: the comparison means something
    for a, b in zip(eager.model.parameters(), compiled.model.parameters()):
        assert a.dtype == b.dtype == torch.float32 and torch.allclose(a, b, rtol=1e-2, atol=1e-3)
    mp, mpc = eager.mixed_precision, compiled.mixed_precision
    assert mpc.scales == mp.scales and mpc.skips == mp.skips and len(mp.skips) == 8  # same loss scales, same skips
    if case == 'fp16': assert mp.scales[-1] > 1 and not any(mp.skips)  # calibrated from the first step
    if case == 'fp16-overflow': assert any(mp.skips) and not all(mp.skips) and mp.scales[-1] < 2.**16

@pytest.mark.parametrize('fullgraph', [True, False])
def test_fp32_islands_compile_into_the_models_graphs(fullgraph, tmp_path):
    """`keep_fp32` islands on a compiled model: their casts trace into the model's graphs, even with `fullgraph=True`.
    Before the fix: the island hooks kept a dict keyed by `id()` of the islands' outputs (to give the model's FP32
    output back), which dynamo cannot trace: `fullgraph=True` failed at the first fit, and without it the model split
    into more graphs and a hook recompiled. The FP32 output of the classifier kept FP32 is still given back exactly."""
    dynamo.reset(); counters.clear()
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    learn = make_learner(model=model, splitter=lambda m: [list(m.parameters())])
    learn.model, learn.path = torch.compile(learn.model, backend='aot_eager', fullgraph=fullgraph), tmp_path
    learn.to_bf16(keep_fp32=['norm', 'classifier'])  # an island inside the model, and one whose output is the model's
    quiet_fit(learn, 1)
    first = _graphs()  # a training and a validation graph
    assert 1 <= first <= 2 and not _breaks(), dict(counters)
    with _no_recompile(): quiet_fit(learn, 2); learn.validate()
    assert _graphs() == first and not _breaks()
    cb = learn.model_to_half
    cb.setup()  # the 16-bit model of a fit, its island hooks on
    try:
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the model keeps its FP32 params
        learn.model.eval()
        x = torch.randn(5, 4, device=DEVICE)  # where the model is
        with torch.no_grad():  # compiled, and eager (the same hooks: bf16 copies, the islands' casts)
            out = learn.model(x)
            with torch.compiler.set_stance('force_eager'): eager = learn.model(x)
        assert out.dtype == torch.float32 and torch.equal(out, eager)  # the classifier's FP32 output, as eager gives it
        assert not torch.equal(out, out.to(torch.bfloat16).float())  # not its 16-bit rounding
    finally: cb.teardown()
