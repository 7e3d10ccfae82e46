"Per-layer precision policy (`keep_fp32=`): what stays FP32, the casts at the edges of FP32 islands, tied params, the report."
import re
import pytest
import torch
from torch import nn
from fastai.layers import BatchNorm

from fp16cb.callbacks import ModelToHalf, MixedPrecision
from fp16cb.policy import PrecisionPolicy, CATEGORIES
from conftest import make_learner, quiet_fit

class Probe(nn.Module):
    "Records the dtype of what it is given; returns it unchanged."
    def __init__(self): super().__init__(); self.seen = []
    def forward(self, x): self.seen.append(x.dtype); return x

class TinyTransformer(nn.Module):
    "Embedding -> LayerNorm -> Linear -> LayerNorm -> head tied to the embedding (a language-model-like toy)."
    def __init__(self, n_vocab=11, d=8):
        super().__init__()
        self.emb, self.norm1, self.ff, self.norm2 = nn.Embedding(n_vocab, d), nn.LayerNorm(d), nn.Linear(d, d), nn.LayerNorm(d)
        self.head = nn.Linear(d, n_vocab, bias=False)
        self.head.weight = self.emb.weight  # tied
    def forward(self, x): return self.head(self.norm2(self.ff(self.norm1(self.emb(x)))))

def _dtypes(model): return {n: p.dtype for n, p in model.named_parameters()}

def _setup(model, dtype=torch.bfloat16, **kw):
    learn = make_learner(model=model, splitter=lambda m: [list(m.parameters())])
    learn.to_fp32().add_cb(ModelToHalf(dtype, **kw))
    cb = learn.model_to_half
    cb.setup()
    return learn, cb

def test_default_keeps_only_batchnorm_and_adds_no_hooks():
    learn, cb = _setup(nn.Sequential(nn.Linear(4, 8), BatchNorm(8, ndim=1), nn.LayerNorm(8), nn.Linear(8, 1)))
    try:
        assert _dtypes(learn.model) == {'0.weight': torch.bfloat16, '0.bias': torch.bfloat16, '1.weight': torch.float32,
                                        '1.bias': torch.float32, '2.weight': torch.bfloat16, '2.bias': torch.bfloat16,
                                        '3.weight': torch.bfloat16, '3.bias': torch.bfloat16}
        assert cb.islands.handles == []  # BatchNorm takes 16-bit inputs natively: the default costs no cast
    finally: cb.teardown()

@pytest.mark.parametrize('spec,kept', [
    ('norm', {'2'}), (nn.LayerNorm, {'2'}), ('classifier', {'3'}), ('3', {'3'}), ('re:[23]', {'2', '3'}),
    (lambda name, m: isinstance(m, nn.Linear) and m.out_features == 1, {'3'}), (['norm', 'classifier'], {'2', '3'})])
def test_keep_fp32_specs(spec, kept):
    learn, cb = _setup(nn.Sequential(nn.Linear(4, 8), BatchNorm(8, ndim=1), nn.LayerNorm(8), nn.Linear(8, 1)), keep_fp32=spec)
    try:
        fp32 = {n.split('.')[0] for n, d in _dtypes(learn.model).items() if d == torch.float32}
        assert fp32 == kept | {'1'}  # BatchNorm stays FP32 too
        x = torch.randn(5, 4)
        learn.model.train(); assert learn.model(x).dtype == (torch.float32 if '3' in kept else torch.bfloat16)
    finally: cb.teardown()
    assert all(d == torch.float32 for d in _dtypes(learn.model).values())

def test_per_module_override_and_batchnorm_opt_out():
    m = nn.Sequential(nn.Linear(4, 8), BatchNorm(8, ndim=1), nn.Linear(8, 1))
    m[0].fp16cb_dtype = torch.float32  # as a Keras layer carrying its own dtype policy
    learn, cb = _setup(m, keep_fp32=PrecisionPolicy(batchnorm=False))
    try: assert {n: d for n, d in _dtypes(learn.model).items() if n.endswith('weight')} == {
            '0.weight': torch.float32, '1.weight': torch.bfloat16, '2.weight': torch.bfloat16}
    finally: cb.teardown()
    m[0].fp16cb_dtype = torch.bfloat16  # a 16-bit override wins over a spec that would keep it
    learn, cb = _setup(m, keep_fp32=nn.Linear)
    try: assert learn.model[0].weight.dtype == torch.bfloat16 and learn.model[2].weight.dtype == torch.float32
    finally: cb.teardown()

def test_bad_specs_raise_clear_errors():
    with pytest.raises(TypeError, match='keep_fp32: cannot use 3'): ModelToHalf(keep_fp32=3)
    m = nn.Sequential(nn.Linear(2, 2)); m[0].fp16cb_dtype = 'fp64'
    with pytest.raises(ValueError, match='0.fp16cb_dtype'): PrecisionPolicy().resolve(m)

def test_one_cast_in_and_out_per_island_none_inside():
    "An FP32 island gets one cast of its input and one of its output; the modules inside see FP32 and get no hooks."
    inner = Probe()
    island = nn.Sequential(nn.LayerNorm(8), inner, nn.Linear(8, 8), nn.LayerNorm(8))
    m = nn.Sequential(nn.Linear(4, 8), island, nn.Linear(8, 1))
    learn, cb = _setup(m, keep_fp32=['1'])
    try:
        assert len(cb.islands.handles) == 3  # pre-hook + hook of the island, + the model's output hook
        assert all(not sub._forward_pre_hooks and not sub._forward_hooks for sub in island.modules() if sub is not island)
        out = learn.model(torch.randn(5, 4))
        assert inner.seen == [torch.float32] and out.dtype == torch.bfloat16 and cb.islands.n_casts == 2
    finally: cb.teardown()
    assert not island._forward_pre_hooks and not island._forward_hooks and not m._forward_hooks

def test_island_output_that_is_the_model_output_stays_fp32():
    "The final classifier kept FP32: the loss sees its exact FP32 logits, not their 16-bit rounding."
    m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    learn, cb = _setup(m, keep_fp32='classifier')
    try:
        x = torch.randn(5, 4)
        out = learn.model(x)
        h = m[0](x.to(torch.bfloat16))  # what the classifier is given
        assert out.dtype == torch.float32 and torch.equal(out, m[1].forward(h.float()))  # no hooks: the plain FP32 op
    finally: cb.teardown()

def test_tied_params_stay_one_fp32_tensor():
    "An embedding kept FP32 and a head tied to it: the head is kept too, the weight stays one tensor, and it trains."
    m = TinyTransformer()
    learn, cb = _setup(m, keep_fp32='embedding')
    try:
        assert m.head.weight is m.emb.weight and m.emb.weight.dtype == torch.float32
        rep = cb.policy_report()
        assert rep.set_index('module').loc['head', 'fp32_because'] == 'tied to emb'
        assert m.ff.weight.dtype == torch.bfloat16 and m.norm1.weight.dtype == torch.bfloat16
        out = m(torch.randint(0, 11, (3, 5)))
        assert out.dtype == torch.float32  # the tied head is the last island: the logits stay FP32
    finally: cb.teardown()
    assert m.head.weight is m.emb.weight and m.emb.weight.dtype == torch.float32

def test_policy_report_columns_and_delegation():
    learn = make_learner()
    learn.to_bf16(keep_fp32=['classifier'])
    rep = learn.mixed_precision.policy_report()
    assert list(rep.columns) == ['module', 'type', 'storage', 'compute', 'casts', 'fp32_because']
    row = rep.set_index('module')
    assert row.loc['0', 'storage'] == 'bfloat16' and row.loc['0', 'compute'] == 'bfloat16'
    assert row.loc['1', 'storage'] == 'float32' and row.loc['1', 'compute'] == 'float32 (16-bit in/out)'
    assert row.loc['3', 'casts'].startswith('in: -> float32') and row.loc['3', 'fp32_because'] == 'classifier'
    assert set(CATEGORIES) >= {'batchnorm', 'norm', 'embedding', 'classifier', 'softmax'}
    quiet_fit(learn, 1)  # and it trains, the model FP32 again after
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())

def test_keep_fp32_through_to_fp16_trains_and_restores_exactly():
    learn = make_learner()
    learn.to_fp16(keep_fp32='classifier')
    assert learn.model_to_half.policy.specs == ('batchnorm', 'classifier')
    quiet_fit(learn, 1)
    assert learn.recorder.values and all(p.dtype == torch.float32 for p in learn.model.parameters())
