"""Issue 37 ("open world"), the casts: model outputs of any container type (a Hugging Face `ModelOutput` read as
`out.logits`), fastai's GAN (its loss calls the critic and the generator outside the model's forward) and AWD-LSTM with
its embedding kept FP32 (`EmbeddingDropout` reads the kept weight without calling the embedding). Each fit is compared
with plain FP32 fastai on the same data and init."""
import math, warnings
from collections import OrderedDict, defaultdict, namedtuple
from dataclasses import dataclass, field, fields, is_dataclass
from functools import partial
from typing import Optional
import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from fastai.basics import Learner, DataLoaders, DataLoader, SGD, Adam, CrossEntropyLossFlat, Callback
from fastai.callback.rnn import ModelResetter, RNNCallback, RNNRegularizer
from fastai.text.models import AWD_LSTM, get_language_model
from fastai.vision.gan import GANLearner, basic_generator, basic_critic

from fp16cb import cast_floats
from fp16cb.callbacks import ModelToHalf
from fp16cb.callbacks.casts import EntryCasts
from conftest import DEVICE, HALF_MODES, make_learner, quiet_fit, seed_all, to_mode, Record, GradOfLoss

# ---- a faithful stand-in of transformers.utils.ModelOutput: the container rules, each field case alone (a real GPT-2
# trains in every mode in tests/test_hugging_face.py)
class ModelOutput(OrderedDict):
    "As transformers' own: an OrderedDict whose (dataclass) fields that are not None are also its keys, kept in sync."
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.__class__ != ModelOutput and not is_dataclass(self): raise TypeError("must be a @dataclass")

    def __post_init__(self):
        class_fields = fields(self)
        if not all(f.default is None for f in class_fields[1:]): raise ValueError("more than one required field")
        first = getattr(self, class_fields[0].name)
        if all(getattr(self, f.name) is None for f in class_fields[1:]) and not isinstance(first, torch.Tensor):
            try: it = iter(first.items() if isinstance(first, dict) else first)
            except TypeError: it = None
            if it is None:
                if first is not None: self[class_fields[0].name] = first
                return
            for i, el in enumerate(it):  # built from `(key, value)` pairs
                if not isinstance(el, (list, tuple)) or len(el) != 2 or not isinstance(el[0], str):
                    if i != 0: raise ValueError(f"Cannot set key/value for {el}")
                    self[class_fields[0].name] = first
                    break
                setattr(self, el[0], el[1])
                if el[1] is not None: self[el[0]] = el[1]
        else:
            for f in class_fields:
                v = getattr(self, f.name)
                if v is not None: self[f.name] = v

    def __delitem__(self, *args, **kwargs): raise Exception(f"You cannot use ``__delitem__`` on a {type(self)}")
    def setdefault(self, *args, **kwargs): raise Exception(f"You cannot use ``setdefault`` on a {type(self).__name__}")
    def pop(self, *args, **kwargs): raise Exception(f"You cannot use ``pop`` on a {type(self).__name__}")
    def update(self, *args, **kwargs): raise Exception(f"You cannot use ``update`` on a {type(self).__name__}")
    def __getitem__(self, k): return dict(self.items())[k] if isinstance(k, str) else self.to_tuple()[k]

    def __setattr__(self, name, value):
        if name in self.keys() and value is not None: super().__setitem__(name, value)
        super().__setattr__(name, value)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __reduce__(self):
        if not is_dataclass(self): return super().__reduce__()
        fn, _args, *rest = super().__reduce__()
        return (fn, tuple(getattr(self, f.name) for f in fields(self)), *rest)

    def to_tuple(self): return tuple(self[k] for k in self.keys())

@dataclass
class BaseModelOutput(ModelOutput):
    last_hidden_state: Optional[torch.Tensor] = None
    hidden_states: Optional[tuple] = None

@dataclass
class CausalLMOutput(ModelOutput):
    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    hidden_states: Optional[tuple] = None

@dataclass
class Plain:
    x: torch.Tensor
    name: str = 'plain'
    extra: list = field(default_factory=list)

@dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    step: int = 3

Pair = namedtuple('Pair', 'a b')

class ReadOnly(dict):
    "A dict subclass that cannot be rebuilt (no item can be set): the fallback."
    def __setitem__(self, k, v): raise TypeError("read-only")

def _f32(*shape): return torch.randn(*shape)
BF = torch.bfloat16

# ---- 10. containers keep their type
def test_cast_floats_keeps_a_model_output_its_fields_and_attributes():
    out = CausalLMOutput(logits=_f32(2, 3), hidden_states=(_f32(2), torch.arange(3)))
    res = cast_floats(out, BF)
    assert type(res) is CausalLMOutput and list(res.keys()) == ['logits', 'hidden_states'] and res.loss is None
    assert res.logits.dtype == BF and res['logits'] is res.logits and res[0] is res.logits  # keys, attributes in sync
    hs = res.hidden_states
    assert type(hs) is tuple and hs[0].dtype == BF and hs[1].dtype == torch.int64
    assert out.logits.dtype == torch.float32 and out['logits'].dtype == torch.float32  # the original untouched

def test_cast_floats_keeps_dataclasses_namedtuples_and_nested_mixes():
    b = {'p': Plain(_f32(2), extra=[1]), 'f': Frozen(_f32(2)), 'n': Pair(_f32(1), 'txt'),
         'o': OrderedDict(a=[_f32(1), (_f32(1),)]), 'd': defaultdict(list, a=_f32(1)),
         'm': BaseModelOutput(last_hidden_state=_f32(2), hidden_states=[Pair(_f32(1), None)])}
    res = cast_floats(b, BF)
    assert type(res) is dict
    assert [type(v) for v in res.values()] == [Plain, Frozen, Pair, OrderedDict, defaultdict, BaseModelOutput]
    assert res['p'].x.dtype == BF and res['p'].name == 'plain' and res['p'].extra == [1]
    assert res['f'].x.dtype == BF and res['f'].step == 3 and res['n'].a.dtype == BF and res['n'].b == 'txt'
    assert res['o']['a'][0].dtype == BF and type(res['o']['a'][1]) is tuple and res['o']['a'][1][0].dtype == BF
    assert res['d'].default_factory is list and res['d']['a'].dtype == BF
    m = res['m']
    assert m.last_hidden_state.dtype == BF and type(m.hidden_states[0]) is Pair and m.hidden_states[0].a.dtype == BF
    back = cast_floats(res, torch.float32)
    assert type(back['m']) is BaseModelOutput and back['m'].last_hidden_state.dtype == torch.float32

def test_cast_floats_gives_back_what_needs_no_cast_and_falls_back_with_a_warning():
    out = CausalLMOutput(logits=_f32(2))
    assert cast_floats(out, torch.float32) is out  # nothing cast: the very object
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        res = cast_floats(ReadOnly(a=_f32(1)), BF)
    assert type(res) is dict and res['a'].dtype == BF
    assert any("cannot rebuild a ReadOnly" in str(o.message) and "plain dict" in str(o.message) for o in w)

class Body(nn.Module):
    "A transformer body, as a Hugging Face one returns it: a `BaseModelOutput`."
    def __init__(self): super().__init__(); self.lin, self.norm = nn.Linear(4, 8), nn.LayerNorm(8)
    def forward(self, x):
        h = self.norm(self.lin(x))
        return BaseModelOutput(last_hidden_state=h, hidden_states=(x, h))

class TinyHF(nn.Module):
    "A `...ForCausalLM`-like model: its body's output read by attribute, its own a `CausalLMOutput`."
    def __init__(self): super().__init__(); self.transformer, self.head = Body(), nn.Linear(8, 1)
    def forward(self, x):
        out = self.transformer(x)
        return CausalLMOutput(logits=self.head(out.last_hidden_state), hidden_states=out.hidden_states)

def _hf_fit(meth:str=None, **kw):
    "The losses of a fit of `TinyHF` whose loss reads `out.logits`, and the types of its predictions."
    seed_all(0)
    learn = make_learner(model=TinyHF(), splitter=lambda m: [list(m.parameters())])
    learn.loss_func = lambda out, y: F.mse_loss(out.logits, y)
    if meth is not None: getattr(learn, meth)(**kw)
    rec = Record(after_pred=lambda l: (type(l.pred), l.pred['logits'].dtype))  # the loss reads `.logits`
    quiet_fit(learn, cbs=rec)
    return [float(o) for o in learn.recorder.losses], set(rec.log['after_pred'])

@pytest.mark.parametrize('meth,kw', [('to_fp16', {'max_loss_scale': 2.**8}), ('to_bf16', {}), ('to_native_bf16', {}),
                                     ('to_bf16', {'keep_fp32': 'transformer'}),
                                     ('to_fp16', {'keep_fp32': 'transformer', 'max_loss_scale': 2.**8})])
def test_a_loss_reading_out_logits_trains_in_each_mode(meth, kw):
    "Before: `AttributeError: 'dict' object has no attribute 'logits'` (`last_hidden_state` inside, with keep_fp32)."
    ref, _ = _hf_fit()
    losses, preds = _hf_fit(meth, **kw)
    assert preds == {(CausalLMOutput, torch.float32)}
    assert all(math.isfinite(o) for o in losses) and losses == pytest.approx(ref, rel=.05)

# ---- 11. fastai's GAN: its loss calls the critic and the generator itself
def _gan(clip=None, n=48, bs=8):
    "A tiny WGAN on noise -> image pairs (the critic's batches swap them: GANTrainer)."
    seed_all(0)
    g = torch.Generator().manual_seed(0)
    items = [(torch.randn(8, generator=g), torch.rand(3, 16, 16, generator=g) * 2 - 1) for _ in range(n)]
    dls = DataLoaders(DataLoader(items, bs=bs), DataLoader(items[:bs * 2], bs=bs), device=DEVICE)
    gen, crit = basic_generator(16, 3, in_sz=8, n_features=8), basic_critic(16, 3, n_features=8)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # fastai's own "shadowing an attribute" warnings
        return GANLearner.wgan(dls, gen, crit, opt_func=partial(SGD, mom=0.), lr=1e-2, clip=clip)

def _gan_fit(mode:str, clip=None):
    learn = to_mode(_gan(clip), mode)
    rec = Record(after_loss=lambda l: (l.gan_trainer.gen_mode, l.loss.dtype))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        quiet_fit(learn, cbs=rec)
    return [float(o) for o in learn.recorder.losses], rec.log['after_loss']

@pytest.mark.parametrize('mode', list(HALF_MODES))
def test_wgan_trains_with_the_loss_calling_critic_and_generator(mode):
    "Before: `RuntimeError: Input type (torch.FloatTensor) and weight type (...) should be the same` (GANLoss.critic)."
    ref, _ = _gan_fit('fp32')
    losses, seen = _gan_fit(mode)
    assert {g for g, _ in seen} == {False, True}  # both the critic's and the generator's batches ran
    assert {dt for _, dt in seen} == {torch.float32}  # the loss reads FP32 outputs, as from the model's forward
    assert all(math.isfinite(o) for o in losses) and losses == pytest.approx(ref, abs=.01)
    clipped, _ = _gan_fit(mode, clip=.01)  # WGAN's own default
    assert all(math.isfinite(o) for o in clipped)

class Caller(nn.Module):
    "A layer that calls a sibling module of the model's (held, not registered) on its output."
    def __init__(self, other:nn.Module): super().__init__(); self.lin, self.other = nn.Linear(4, 4), [other]
    def forward(self, x): return self.other[0](self.lin(x))

class Twins(nn.Module):
    "Two halves, `a` calling `b`: the critic and the generator of a GAN, each called by the loss."
    def __init__(self): super().__init__(); self.b = nn.Linear(4, 4); self.a = Caller(self.b)
    def forward(self, x): return self.a(x)

def test_children_called_outside_the_forward_take_16bit_inputs_give_fp32_outputs():
    m = Twins()
    learn = make_learner(model=m, splitter=lambda m: [list(m.parameters())])
    learn.to_fp32().add_cb(ModelToHalf(BF))
    cb = learn.model_to_half
    cb.setup()
    try:
        x, seen = torch.randn(2, 4, device=DEVICE), []
        m.b.register_forward_hook(lambda mod, i, o: seen.append((i[0].dtype, o.dtype)))
        assert learn.model(x).dtype == BF and seen == [(BF, BF)]  # in the forward: as before (`after_pred` casts it)
        assert m.b(x).dtype == torch.float32 and seen[-1] == (BF, torch.float32)  # from outside: 16-bit in, FP32 out
        assert m.a(x).dtype == torch.float32 and seen[-1] == (BF, BF)  # `b` within an outside call of `a`: not cast
        with pytest.raises(RuntimeError): learn.model(torch.randn(2, 3, device=DEVICE))  # a forward that raised ...
        with pytest.raises(RuntimeError, match='dtype'): m.b(x)  # ... left its count: taken for a call within it
        cb.before_batch()  # the next batch starts afresh
        assert m.b(x).dtype == torch.float32 and cb.entries.depth == 0
    finally: cb.teardown()
    assert not m.a._forward_pre_hooks and not learn.model._forward_pre_hooks and cb.entries is None

@pytest.mark.parametrize('mode', list(HALF_MODES))
def test_a_child_called_outside_the_forward_that_raises_gives_its_params_back(mode):
    """A child called on its own mid-fit (as a GAN's loss calls the critic) whose forward raises: its FP32 Parameters
    are back in its places at once, and its next call is cast as any outside call. Before: its 16-bit copies stayed
    there and its call count stayed up until the next batch, so the next call in the same batch was taken for one
    inside another, not cast: `mat1 and mat2 must have the same dtype`. Inside the model's forward the children carry
    one pre-hook each; an outside call gets a forward hook of its own, gone before the next forward (before: two hooks
    per child on every call; a 150-layer model's forward went 8.0 -> 7.7 ms)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    seen = []
    class Outside(Callback):
        def after_pred(self): seen.append(('forward', len(model[1]._forward_hooks)))
        def after_loss(self):
            w = model[1].weight
            with pytest.raises(RuntimeError): model[1](torch.randn(2, 3, device=DEVICE))  # a wrong width: it raises
            seen.append(('raised', model[1].weight is w, w.dtype, type(w).__name__))
            seen.append(('next', model[1](torch.randn(2, 8, device=DEVICE)).dtype))
    learn = to_mode(make_learner(model=model, splitter=lambda m: [list(m.parameters())]), mode)
    quiet_fit(learn, 1, cbs=[Outside()])
    assert set(seen) == {('forward', 0), ('raised', True, torch.float32, 'Parameter'), ('next', torch.float32)}, seen

# ---- 12. AWD-LSTM with its embedding kept FP32
def _lm(n=40, sl=8, vocab=20):
    seed_all(0)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, vocab, (n, sl + 1), generator=g)
    items = [(t[:-1], t[1:]) for t in toks]
    dls = DataLoaders(DataLoader(items[:32], bs=8), DataLoader(items[32:], bs=8), device=DEVICE)
    cfg = dict(emb_sz=8, n_hid=16, n_layers=2, pad_token=1, bidir=False, output_p=.1, hidden_p=.1, input_p=.1,
               embed_p=.1, weight_p=.1, tie_weights=True, out_bias=True)
    model = get_language_model(AWD_LSTM, vocab, config=cfg)
    return Learner(dls, model, loss_func=CrossEntropyLossFlat(), opt_func=Adam, lr=1e-2,
                   cbs=[ModelResetter(), RNNCallback(), RNNRegularizer(alpha=2., beta=1.)])

def _lm_fit(mode:str, **kw):
    learn = to_mode(_lm(), mode, **kw)
    awd = learn.model[0]
    rec = Record(after_batch=lambda l: (awd.encoder.weight.dtype, awd.rnns[0].weight_hh_l0_raw.dtype))
    quiet_fit(learn, cbs=rec)
    return [float(o) for o in learn.recorder.losses], set(rec.log['after_batch']), learn

@pytest.mark.parametrize('mode', list(HALF_MODES))
def test_awd_lstm_with_its_embedding_kept_fp32_trains(mode):
    "Before: `ValueError: RNN input dtype (torch.float32) does not match weight dtype (torch.bfloat16)`."
    ref, _, _ = _lm_fit('fp32')
    losses, dtypes, learn = _lm_fit(mode, keep_fp32='embedding')
    assert dtypes == {(torch.float32, torch.float32)}  # the model keeps its FP32 params
    report = learn.mixed_precision.policy_report().set_index('module')['compute']
    half = str(dict(fp16=torch.float16, bf16=BF)[mode]).replace('torch.', '')
    assert report['0.encoder'] == 'float32' and report['0.rnns.0'] == half  # the embedding FP32, the LSTMs 16-bit
    assert all(math.isfinite(o) for o in losses) and losses == pytest.approx(ref, rel=.01)
    assert learn.model[0].encoder.weight.dtype == torch.float32

def _entry_hooked(model) -> list:
    return [n for n, m in model.named_modules()
            if any(getattr(h, '__func__', None) is EntryCasts._cast_entry for h in m._forward_pre_hooks.values())]

def test_entry_casts_only_beside_a_kept_module_holding_params():
    "The cost: the outermost 16-bit layers beside the kept embedding (not the LSTMs inside them); none by default."
    for keep, hooked in [(None, []), ('embedding', ['0.rnns.0', '0.rnns.1'])]:
        learn = _lm()
        learn.add_cb(ModelToHalf(BF, keep_fp32=keep))
        cb = learn.model_to_half
        cb.setup()
        try: assert _entry_hooked(learn.model) == hooked
        finally: cb.teardown()
        assert _entry_hooked(learn.model) == []

@pytest.mark.parametrize('mode', list(HALF_MODES))
def test_wgan_clipping_through_data_reaches_the_fp32_weights(mode):
    """fastai's `GANTrainer(clip=...)` clamps the critic's weights through `.data` before each batch (torch does not count
    such writes): each step starts from the clamped weights, as in FP32. Before: the masters were stepped unclamped and
    copied back over the clamp (the critic ended with |w| up to its initial size)."""
    def critic_max(mode):
        learn = to_mode(_gan(.01), mode)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            warnings.filterwarnings('error', message='.*through `.data`')  # none: every batch saw the clamp
            quiet_fit(learn)
        if mode != 'fp32': learn.to_fp32()
        return max(float(p.detach().abs().max()) for p in learn.model.critic.parameters())
    ref, got = critic_max('fp32'), critic_max(mode)
    assert ref < .05 and got == pytest.approx(ref, rel=.2, abs=2e-3)

# ---- activation checkpointing: blocks recomputed in the backward (`torch.utils.checkpoint`, Hugging Face's
# `gradient_checkpointing_enable`, timm's `set_grad_checkpointing`)
class Block(nn.Module):
    def __init__(self, d:int=8): super().__init__(); self.lin, self.norm = nn.Linear(d, d), nn.LayerNorm(d)
    def forward(self, x): return x + torch.tanh(self.norm(self.lin(x)))

class Checkpointed(nn.Module):
    "Linear(4, 8), three residual blocks (each recomputed in the backward when `reentrant` is not None), a head."
    def __init__(self, reentrant=None):
        super().__init__()
        self.inp, self.blocks, self.head = nn.Linear(4, 8), nn.ModuleList(Block() for _ in range(3)), nn.Linear(8, 1)
        self.reentrant = reentrant
    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h) if self.reentrant is None else torch.utils.checkpoint.checkpoint(b, h, use_reentrant=self.reentrant)
        return self.head(h)

def _checkpointed_fit(meth, kw, reentrant):
    seed_all(0)
    learn = make_learner(model=Checkpointed(reentrant), opt_func=Adam, lr=1e-2, splitter=lambda m: [list(m.parameters())])
    if meth is not None: getattr(learn, meth)(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # (the validation under no_grad: "None of the inputs have requires_grad=True")
        quiet_fit(learn, 2)
    if meth is not None: learn.to_native_fp32() if meth.startswith('to_native') else learn.to_fp32()
    return [p.detach().clone() for p in learn.model.parameters()], [float(o) for o in learn.recorder.losses]

@pytest.mark.parametrize('reentrant', [False, True])
@pytest.mark.parametrize('meth,kw', [('to_bf16', {}), ('to_fp16', {'max_loss_scale': 2.**8}),
                                     ('to_bf16', {'flat_master': True}), ('to_bf16', {'half_storage': True}),
                                     ('to_bf16', {'state_dtype': torch.bfloat16}), ('to_native_bf16', {})])
def test_checkpointed_blocks_train_as_without_checkpointing(meth, kw, reentrant):
    """Recomputing a block in the backward changes nothing, as in FP32: the same weights bit for bit. Before (one copy of
    the truth): `mat1 and mat2 must have the same dtype` (the block ran again with its FP32 params and 16-bit input)."""
    ref, ref_losses = _checkpointed_fit(None, {}, reentrant)
    assert [torch.equal(a, b) for a, b in zip(ref, _checkpointed_fit(None, {}, None)[0])] == [True] * len(ref)  # FP32
    plain, _ = _checkpointed_fit(meth, kw, None)
    got, losses = _checkpointed_fit(meth, kw, reentrant)
    assert all(math.isfinite(o) for o in losses) and losses == pytest.approx(ref_losses, rel=.05)
    if reentrant and 'state_dtype' in kw:
        # a reentrant checkpoint's params get their grads in a backward of their own, in buffers of their own: the
        # state is stepped in other groups, so its stochastic rounding draws other noise. Off by far less than a
        # step's update (lr 1e-2), which a lost or doubled grad would be off by
        assert max(float((a - b).abs().max()) for a, b in zip(got, plain)) < 2e-3
    else: assert [torch.equal(a, b) for a, b in zip(got, plain)] == [True] * len(got)

@pytest.mark.parametrize('meth,kw', [('to_bf16', {}), ('to_fp16', {'max_loss_scale': 2.**8})])
def test_a_backward_of_other_code_recomputes_checkpointed_blocks_as_fastais(meth, kw):
    """A callback's own backward through checkpointed blocks, before fastai's: the grads FP32's are. Before: `mat1 and
    mat2 must have the same dtype` (the copies for recomputed layers were on only from `before_backward`)."""
    seed_all(0)
    learn = make_learner(model=Checkpointed(False), opt_func=Adam, lr=1e-2, splitter=lambda m: [list(m.parameters())])
    getattr(learn, meth)(**kw)
    cb = GradOfLoss()  # the grads of `torch.autograd.grad(learn.loss, params)` in `after_loss`, and FP32's
    quiet_fit(learn, 1, cbs=cb)
    assert len(cb.pairs) == 4 and max(cb.errors()) < 5e-2, cb.errors()
