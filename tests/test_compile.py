"""A compiled model (`learn.model = torch.compile(model)`) under `to_bf16`/`to_fp16`: no graph break caused by us, no
recompilation after the first epoch (validation, a mid-fit `learn.save`, `SaveModelCallback`, `to_fp32()` and back
included), and the same weights as eager. dynamo's `aot_eager` backend needs no C++ compiler."""
from pathlib import Path
import pytest
import torch
from fastai.callback.tracker import SaveModelCallback

from conftest import make_learner, quiet_fit

dynamo = pytest.importorskip('torch._dynamo')
from torch._dynamo.utils import counters

def _learner(compiled:bool, tmp_path:Path):
    learn = make_learner(splitter=lambda m: [list(m.parameters())])
    if compiled: learn.model = torch.compile(learn.model, backend='aot_eager')
    learn.path = tmp_path
    return learn

def _graphs() -> int: return counters['stats']['unique_graphs']

@pytest.mark.parametrize('meth,kw', [('to_bf16', {}), ('to_fp16', {'half_storage': True})], ids=['bf16', 'fp16-half_storage'])
def test_compiled_model_compiles_once_and_trains_as_eager(meth, kw, tmp_path):
    dynamo.reset(); counters.clear()
    learn = getattr(_learner(True, tmp_path), meth)(**kw)
    quiet_fit(learn, 1)
    first = _graphs()  # a training and a validation graph
    assert first <= 2 and not any('graph_break' in k for k in counters), dict(counters)
    learn.save('mid'); quiet_fit(learn, 1, cbs=SaveModelCallback(fname='best')); learn.validate()
    assert _graphs() == first  # nothing of ours made dynamo compile again
    learn.to_fp32(); quiet_fit(learn, 1)
    fp32_graphs = _graphs()
    getattr(learn, meth)(**kw); quiet_fit(learn, 1)
    assert _graphs() == fp32_graphs  # back in 16-bit: the first graphs serve again
    eager = getattr(_learner(False, tmp_path), meth)(**kw)
    dynamo.reset()
    compiled = getattr(_learner(True, tmp_path), meth)(**kw)
    quiet_fit(eager, 2); quiet_fit(compiled, 2)
    for a, b in zip(eager.model.parameters(), compiled.model.parameters()):
        assert torch.allclose(a, b, rtol=1e-2, atol=1e-3)
