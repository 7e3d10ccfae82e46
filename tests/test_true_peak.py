"""Memory at the step's true peak: the optimizer's 16-bit state (`state_dtype`) is widened to FP32 a slice at a time
wherever its param is stepped a slice at a time (a param bigger than a chunk: fastai's loop, a torch optimizer, 16-bit
storage, the step in the backward), so a big param's step holds one slice of FP32 state, not the param's. The results
are those of the whole param's step (rounded to nearest: bit for bit)."""
from functools import partial
import pytest
import torch
from torch import nn
from fastai.basics import Adam
from fastai.optimizer import OptimWrapper

from conftest import make_learner, quiet_fit, weights, seed_all, set_chunk

CHUNK = 32  # a chunk of this many elements: the model's 8x16 and 16x8 weights are stepped a slice at a time
KW = {'masters': {}, 'half': {'half_storage': True}, 'sib': {'step_in_backward': True},
      'half-sib': {'half_storage': True, 'step_in_backward': True}}
OPTS = {'fastai': Adam, 'torch': partial(OptimWrapper, opt=torch.optim.AdamW)}

def model():
    seed_all(0)  # the same initial weights for every run
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))

def learner(opt_func):
    return make_learner(model=model(), opt_func=opt_func, splitter=lambda m: [list(m.parameters())])

def small_chunks(monkeypatch, n:int):
    "Chunks of `n` elements: a store's lift (`lift_chunk`), and the state widened on the model's own params."
    set_chunk(monkeypatch, n)

def fit(kw, opt, chunk=None, monkeypatch=None):
    if chunk is not None: small_chunks(monkeypatch, chunk)
    learn = learner(OPTS[opt]).to_bf16(state_dtype=torch.bfloat16, stochastic_rounding=False, **KW[kw])
    quiet_fit(learn, 2, lr=1e-2)
    learn.to_fp32()
    return weights(learn)

CELLS = [(k, o) for k in KW for o in OPTS if not (k.endswith('sib') and o == 'torch')]  # sib: fastai optimizers only

@pytest.mark.parametrize('kw,opt', CELLS)
def test_state_widened_a_slice_at_a_time_steps_as_the_whole_param(kw, opt, monkeypatch):
    whole = fit(kw, opt)
    sliced = fit(kw, opt, CHUNK, monkeypatch)
    for a, b in zip(sliced, whole): assert torch.equal(a, b), (a - b).abs().max()

class WidestState:
    "A fastai step callback put first: the largest FP32 storage behind the state tensors a step's update is given."
    def __init__(self): self.widest = 0
    def __call__(self, p, **kw):
        for v in kw.values():
            if isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.dim():
                self.widest = max(self.widest, v.untyped_storage().nbytes() // 4)
    elementwise = True

@pytest.mark.parametrize('kw', list(KW))
def test_a_big_params_step_widens_one_slice_of_its_state(kw, monkeypatch):
    """The FP32 state a big param's update sees lives in a slice-sized scratch (before: the whole param's state widened
    at once, 8 bytes/param above the step's other memory: +321 MiB for one Linear(4096, 4096))."""
    small_chunks(monkeypatch, CHUNK)
    spy = WidestState()
    learn = learner(lambda ps, lr: _with_first(Adam(ps, lr=lr), spy))
    learn.to_bf16(state_dtype=torch.bfloat16, **KW[kw])
    quiet_fit(learn, 2, lr=1e-2)
    assert 0 < spy.widest <= 2 * CHUNK  # a slice's moments (two of at most a chunk each), never a 128-element param's

def _with_first(opt, cb):
    opt.cbs.insert(0, cb)
    return opt
