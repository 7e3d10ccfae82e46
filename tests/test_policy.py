"Per-layer precision policy (`keep_fp32=`): what stays FP32, the casts at the edges of FP32 islands, tied params, the report."
import re, warnings
from collections import OrderedDict
import pytest
import torch
from torch import nn
from fastai.layers import BatchNorm

from fp16cb.callbacks import ModelToHalf, MixedPrecision
from fp16cb.policy import PrecisionPolicy, CATEGORIES
from conftest import DEVICE, make_learner, quiet_fit, Record

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
        x = torch.randn(5, 4, device=DEVICE)
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
        out = learn.model(torch.randn(5, 4, device=DEVICE))
        assert inner.seen == [torch.float32] and out.dtype == torch.bfloat16 and cb.islands.n_casts == 2
    finally: cb.teardown()
    assert not island._forward_pre_hooks and not island._forward_hooks and not m._forward_hooks

def test_island_output_that_is_the_model_output_stays_fp32():
    "The final classifier kept FP32: the loss sees its exact FP32 logits, not their 16-bit rounding."
    m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    learn, cb = _setup(m, keep_fp32='classifier')
    try:
        x = torch.randn(5, 4, device=DEVICE)
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
        out = m(torch.randint(0, 11, (3, 5), device=DEVICE))
        assert out.dtype == torch.float32  # the tied head is the last island: the logits stay FP32
    finally: cb.teardown()
    assert m.head.weight is m.emb.weight and m.emb.weight.dtype == torch.float32

def test_policy_report_columns_and_delegation():
    learn = make_learner()
    learn.to_bf16(keep_fp32=['classifier'])
    rep = learn.mixed_precision.policy_report()
    assert list(rep.columns) == ['module', 'type', 'storage', 'compute', 'casts', 'fp32_because']
    row = rep.set_index('module')
    # the model keeps its FP32 params and computes with bf16 copies; with 16-bit storage its params are bf16
    assert row.loc['0', 'storage'] == 'float32' and row.loc['0', 'compute'] == 'bfloat16'
    half = make_learner().to_bf16(keep_fp32=['classifier'], half_storage=True).mixed_precision.policy_report()
    assert half.set_index('module').loc['0', 'storage'] == 'bfloat16'
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

def _named(**mods) -> nn.Sequential: return nn.Sequential(OrderedDict(mods))

def _kept_names(policy, model) -> dict:
    res = policy.resolve(model)
    return {res.names[k]: why for k, why in res.kept.items()}

# ---- a to_fp16 / to_bf16 learner pickles (no lambdas in the policy) ---------------------------------------------------
@pytest.mark.parametrize('dump', ['pickle', 'torch.save'])
def test_learner_with_a_policy_pickles(dump):
    import io, pickle
    from fastai.torch_core import trainable_params
    model = _named(layer1=nn.Linear(4, 8), norm=nn.LayerNorm(8), x=nn.ReLU(), ln=nn.LayerNorm(8), head=nn.Linear(8, 1))
    learn = make_learner(model=model, splitter=trainable_params)
    learn.to_fp16(keep_fp32=['norm', 'classifier', 'layer*', 're:x', nn.LayerNorm])
    if dump == 'pickle': new = pickle.loads(pickle.dumps(learn))
    else:
        buf = io.BytesIO(); torch.save(learn, buf); buf.seek(0)
        new = torch.load(buf, weights_only=False)
    kept = _kept_names(learn.model_to_half.policy, learn.model)
    assert kept == _kept_names(new.model_to_half.policy, new.model)
    assert {n for n in kept if n} == {'layer1', 'norm', 'x', 'ln', 'head'}
    assert new.model_to_half.policy.specs == learn.model_to_half.policy.specs
    quiet_fit(new, 1)  # and the copy trains
    assert pickle.loads(pickle.dumps(make_learner(splitter=trainable_params).to_bf16())).mixed_precision.dtype == torch.bfloat16

# ---- keep_fp32 typos and specs that match nothing ---------------------------------------------------------------------
def _encoder_model():
    "encoder (norm1, ff, norm2) -> head: names to match, and to be close to."
    return _named(encoder=_named(norm1=nn.LayerNorm(4), ff=nn.Linear(4, 4), norm2=nn.LayerNorm(4)), head=nn.Linear(4, 1))

@pytest.mark.parametrize('typo,close', [('norms', 'norm'), ('embeddings', 'embedding'), ('Classifier', 'classifier'),
                                        ('encoders', 'encoder'), ('batchnorms', 'batchnorm')])
def test_keep_fp32_unknown_word_is_an_error_listing_the_categories(typo, close):
    with pytest.raises(ValueError, match=rf"keep_fp32: {typo!r}.*did you mean {close!r}") as e:
        PrecisionPolicy(typo).resolve(_encoder_model())
    assert all(c in str(e.value) for c in CATEGORIES)
    learn = make_learner(model=_encoder_model(), splitter=lambda m: [list(m.parameters())]).to_bf16()
    cbs = learn.precision_callbacks()
    with pytest.raises(ValueError, match=rf"did you mean {close!r}"): learn.to_fp16(keep_fp32=['norm', typo])
    assert all(a is b for a, b in zip(learn.precision_callbacks(), cbs))  # at the call, the learner as it was

def test_keep_fp32_plain_word_naming_a_module_or_a_nested_one():
    "A plain word that is a module's name is that module; the name of nested modules hints at the glob that finds them."
    assert set(_kept_names(PrecisionPolicy('encoder'), _encoder_model())) >= {'encoder', 'encoder.ff'}
    with pytest.raises(ValueError, match=r"did you mean '\*\.norm1'"): PrecisionPolicy('norm1').resolve(_encoder_model())

@pytest.mark.parametrize('spec,close', [('encoder.norm', 'encoder.norm1'), ('encoder.norm*3', 'encoder.norm1'),
                                        ('re:encoder\\.nrm.', 'encoder.norm1'), ('layer4.*', 'encoder')])
def test_keep_fp32_name_that_matches_nothing_warns_with_the_closest_names(spec, close):
    with pytest.warns(UserWarning, match=rf"keep_fp32: {re.escape(repr(spec))} matches no module.*{re.escape(repr(close))}"):
        kept = _kept_names(PrecisionPolicy(spec), _encoder_model())
    assert set(kept) == set()  # nothing kept (no BatchNorm here)
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # a name that matches warns nothing
        PrecisionPolicy('encoder.norm*', 'norm', nn.LayerNorm).resolve(_encoder_model())

def _unmatched(ws) -> list:
    "The matches-nothing warnings of `ws`."
    return [w for w in ws if 'matches no module' in str(w.message)]

@pytest.fixture
def every_warning(recwarn):
    "`recwarn` showing every warning, a repeat from the same line too (Python's default shows it once)."
    warnings.simplefilter('always')
    return recwarn

def test_keep_fp32_name_that_matches_nothing_warns_once_at_the_call(every_warning, tmp_path):
    """Before the fix: nothing at `to_bf16(...)`, then the same warning at every fit (its set-up). Now once, at the
    call that names the model's modules; the fits (and a pause mid-fit, as `learn.load` makes) say nothing more."""
    learn = make_learner(model=_encoder_model(), splitter=lambda m: [list(m.parameters())], path=tmp_path)
    learn.to_bf16(keep_fp32=['layer4.*', 'norm'])
    assert len(_unmatched(every_warning)) == 1 and every_warning.list[0].filename == __file__  # at the user's line
    every_warning.clear()
    quiet_fit(learn, 1); learn.save('w'); quiet_fit(learn, 1, cbs=Record(after_epoch=lambda l: l.load('w')))
    assert _unmatched(every_warning) == []

def test_keep_fp32_name_that_matches_nothing_warns_once_at_the_first_fit(every_warning):
    "A `ModelToHalf` added by hand knows the model at the fit's set-up: it warns there, at the first fit only."
    learn = make_learner(model=_encoder_model(), splitter=lambda m: [list(m.parameters())])
    learn.add_cbs([ModelToHalf(torch.bfloat16, keep_fp32='encoder.nrm'), MixedPrecision(dtype=torch.bfloat16)])
    assert _unmatched(every_warning) == []
    quiet_fit(learn, 1)
    assert len(_unmatched(every_warning)) == 1
    quiet_fit(learn, 1)
    assert len(_unmatched(every_warning)) == 1

def test_glob_matching_every_child_keeps_the_parent_one_island():
    "keep_fp32='layer4.*' (the README's example): layer4 is kept too, so its blocks form one island, not one each."
    seen = []
    class Keep(nn.Module):
        def forward(self, x): seen.append(x); return x
    m = _named(layer3=nn.Linear(4, 8), layer4=nn.Sequential(nn.Linear(8, 8), Keep(), nn.Linear(8, 8)), head=nn.Linear(8, 1))
    learn, cb = _setup(m, keep_fp32='layer4.*')
    try:
        assert [i.name for i in cb.policy.resolve(m).islands] == ['layer4']
        assert _kept_names(cb.policy, m)['layer4'] == "name 'layer4.*' (all its children)"
        assert len(cb.islands.handles) == 3  # pre-hook + hook of the one island, + the model's output hook
        x = torch.randn(5, 4, device=DEVICE)
        m(x)
        h = m.layer3(x.to(torch.bfloat16)).float()
        assert torch.equal(seen[-1], m.layer4[0](h)) and cb.islands.n_casts == 2  # FP32 between the blocks: not rounded
    finally: cb.teardown()
    assert 'layer4' not in _kept_names(PrecisionPolicy('layer4.0'), m)  # not every child: the parent is 16-bit

# ---- a module's own fp16cb_dtype wins inside a kept subtree too ----------------------------------------------------
def test_module_override_inside_a_kept_subtree():
    "keep_fp32='encoder' with encoder.proj.fp16cb_dtype = bf16: proj runs in 16-bit, its input cast down, its output up."
    probe = Probe()
    enc = _named(pre=nn.Linear(8, 8), proj=nn.Linear(8, 8), after=probe, norm=nn.LayerNorm(8))
    m = _named(inp=nn.Linear(4, 8), encoder=enc, head=nn.Linear(8, 1))
    enc.proj.fp16cb_dtype = torch.bfloat16
    enc.norm.fp16cb_dtype = torch.float32  # an FP32 override inside the kept subtree changes nothing
    learn, cb = _setup(m, keep_fp32='encoder')
    try:
        assert _dtypes(m) == {'inp.weight': torch.bfloat16, 'inp.bias': torch.bfloat16,
                              'encoder.pre.weight': torch.float32, 'encoder.pre.bias': torch.float32,
                              'encoder.proj.weight': torch.bfloat16, 'encoder.proj.bias': torch.bfloat16,
                              'encoder.norm.weight': torch.float32, 'encoder.norm.bias': torch.float32,
                              'head.weight': torch.bfloat16, 'head.bias': torch.bfloat16}
        out = m(torch.randn(5, 4, device=DEVICE))  # an FP32 input to the bf16 proj would fail: the island casts it down
        assert probe.seen == [torch.float32] and out.dtype == torch.bfloat16
        assert cb.islands.n_casts == 4  # encoder: in and out; proj: in and out
        row = cb.policy_report().set_index('module').loc['encoder.proj']
        assert (row['storage'], row['compute'], row['casts'], row['fp32_because']) == (
            'bfloat16', 'bfloat16', 'in: -> bfloat16, out: -> float32', '-')
    finally: cb.teardown()
    assert all(d == torch.float32 for d in _dtypes(m).values())
    m.encoder.proj.fp16cb_dtype = torch.float32  # FP32 inside a 16-bit region still keeps it
    assert set(_kept_names(PrecisionPolicy(), m)) == {'encoder.proj', 'encoder.norm'}

# ---- a compiled model: names as on the original one -------------------------------------------------------------------
def _layered():
    return _named(layer3=nn.Linear(4, 8), layer4=_named(a=nn.Linear(8, 8), norm=nn.LayerNorm(8), b=nn.Linear(8, 8)),
                  head=nn.Linear(8, 1))

@pytest.mark.parametrize('spec', ['layer4.*', 'layer4', 'layer4.norm', 'head', 'classifier', 're:layer4\\.[ab]', 'norm'])
@pytest.mark.parametrize('compiled', ['model', 'submodule'])
def test_keep_fp32_names_on_a_compiled_model(spec, compiled):
    """Before the fix: the modules of `torch.compile(model)` sit under `_orig_mod`, so `keep_fp32='layer4.*'` matched
    nothing (a warning) and a plain word was an error. Names resolve as on the original model, the report shows them."""
    m = _layered()
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # it matches on the original model
        expected = _kept_names(PrecisionPolicy(spec), m)
        rows = ModelToHalf(keep_fp32=spec).policy_report(m).drop(columns='type')
        if compiled == 'model': m = torch.compile(m, backend='aot_eager')
        else: m.layer4 = torch.compile(m.layer4, backend='aot_eager')
        assert _kept_names(PrecisionPolicy(spec), m) == expected
        assert ModelToHalf(keep_fp32=spec).policy_report(m).drop(columns='type').equals(rows)

def test_keep_fp32_on_a_compiled_model_through_a_learner():
    "`learn.model = torch.compile(model)`, then `to_bf16(keep_fp32='1')`: module '1' stays FP32 during the fit."
    m = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        learn, cb = _setup(torch.compile(m, backend='aot_eager'), keep_fp32='1')
    try:
        assert {n: d for n, d in _dtypes(m).items()} == {'0.weight': torch.bfloat16, '0.bias': torch.bfloat16,
            '1.weight': torch.float32, '1.bias': torch.float32, '2.weight': torch.bfloat16, '2.bias': torch.bfloat16}
        assert len(cb.islands.handles) == 3  # the island's two casts, and the model's output hook
    finally: cb.teardown()
    assert all(d == torch.float32 for d in _dtypes(m).values())
