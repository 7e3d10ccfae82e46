"""A real Hugging Face model under every precision mode: `transformers`' `GPT2LMHeadModel`, built from a config (no
download), its head tied to the token embedding, its output a `ModelOutput` that the loss reads as `out.logits`. Each
fit is held to plain FP32 fastai's on the same data and init; the tie, the saved file and `to_fp32()` must be what an
FP32 learner gives. (`tests/test_open_world_casts.py` holds a stand-in of `ModelOutput` for the container rules.)"""
import math, warnings
import pytest
import torch
import torch.nn.functional as F
from fastai.basics import Learner, DataLoaders, DataLoader, Adam, Callback

from conftest import DEVICE, quiet_fit, seed_all

transformers = pytest.importorskip('transformers')

VOCAB, CTX = 32, 12

def gpt2():
    "A 2-block GPT-2 (d=32), dropout off, its head tied to the token embedding."
    seed_all(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=CTX, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.,
                                  embd_pdrop=0., attn_pdrop=0., tie_word_embeddings=True, bos_token_id=None,
                                  eos_token_id=None)
    m = transformers.GPT2LMHeadModel(cfg)
    assert m.lm_head.weight is m.transformer.wte.weight
    return m

def _data(n:int, seed:int) -> list:
    "Sequences counting up by a stride of 1 to 3 from a random start (mod `VOCAB`): learnable from the context."
    g = torch.Generator().manual_seed(seed)
    start, stride = torch.randint(0, VOCAB, (n, 1), generator=g), torch.randint(1, 4, (n, 1), generator=g)
    seq = (start + stride * torch.arange(CTX + 1)) % VOCAB
    return [(s[:-1], s[1:]) for s in seq]

def lm_loss(out, y): return F.cross_entropy(out.logits.float().flatten(0, 1), y.flatten())

def learner() -> Learner:
    dls = DataLoaders(DataLoader(_data(96, 0), bs=16, shuffle=False), DataLoader(_data(32, 1), bs=16), device=DEVICE)
    return Learner(dls, gpt2(), loss_func=lm_loss, opt_func=Adam, lr=1e-2)

class Tie(Callback):
    "After each step: whether the head is still the embedding's Parameter, and its dtype."
    def __init__(self): self.seen = set()
    def after_step(self):
        m = self.learn.model
        self.seen.add((m.lm_head.weight is m.transformer.wte.weight, m.lm_head.weight.dtype))

def checkpointing(m):
    "Hugging Face's activation checkpointing on `m` (its blocks recomputed in the backward; torch's non-reentrant)."
    on = getattr(m, 'activation_checkpointing_enable', None) or m.gradient_checkpointing_enable  # (before v5: the latter)
    on()

def fit(mode=None, epochs:int=3, recompute:bool=False):
    learn = learner()
    if recompute: checkpointing(learn.model)
    if mode is not None: getattr(learn, mode[0])(**mode[1])
    tie = Tie()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        quiet_fit(learn, epochs, cbs=tie)
    return learn, tie.seen

@pytest.fixture(scope='module')
def fp32():
    init = {k: v.clone() for k, v in gpt2().state_dict().items()}
    learn, _ = fit()
    return init, {k: v.clone() for k, v in learn.model.state_dict().items()}, learn.recorder.values[-1][1]

MODES = {'fp16': ('to_fp16', {}), 'bf16': ('to_bf16', {}), 'bf16-flat': ('to_bf16', {'flat_master': True}),
         'bf16-half': ('to_bf16', {'half_storage': True}), 'fp16-half': ('to_fp16', {'half_storage': True}),
         'bf16-state16': ('to_bf16', {'state_dtype': torch.bfloat16}), 'bf16-8bit': ('to_bf16', {'state_dtype': '8bit'}),
         'bf16-sib': ('to_bf16', {'step_in_backward': True}), 'native-bf16': ('to_native_bf16', {}),
         'native-fp16': ('to_native_fp16', {})}

def _dist(a:dict, b:dict) -> float: return math.sqrt(sum(float(((a[k].float() - b[k].float())**2).sum()) for k in b))

@pytest.mark.parametrize('mode', list(MODES))
def test_gpt2_trains_as_fp32_fastai_does(fp32, mode):
    init, ref, ref_valid = fp32
    learn, seen = fit(MODES[mode])
    assert all(math.isfinite(float(o)) for o in learn.recorder.losses)
    valid = learn.recorder.values[-1][1]  # the held-out loss: both learn the counting (uniform guessing: log(VOCAB))
    assert ref_valid < .6 * math.log(VOCAB) and valid < .6 * math.log(VOCAB), (ref_valid, valid)
    # the same trajectory: 16-bit rounding moves the weights by a few % of how far FP32's moved (0.4-5% here);
    # a mode that loses steps, keeps a stale copy or misses the loss scale lands at 30% or more
    assert _dist(learn.model.state_dict(), ref) < .15 * _dist(ref, init)
    # the tied head stays the embedding's one Parameter through the fit: FP32, or bf16/fp16 where the weights are
    half = MODES[mode][1].get('half_storage')
    assert seen == {(True, {'to_fp16': torch.float16, 'to_bf16': torch.bfloat16}[MODES[mode][0]] if half
                     else torch.float32)}
    learn.to_fp32() if not mode.startswith('native') else learn.to_native_fp32()
    m = learn.model
    assert m.lm_head.weight is m.transformer.wte.weight and {p.dtype for p in m.parameters()} == {torch.float32}

@pytest.mark.parametrize('mode', ['fp16', 'bf16-half', 'bf16-8bit'])
def test_gpt2_saved_mid_fit_loads_into_an_fp32_model(mode, tmp_path):
    "`learn.save` in the last epoch writes FP32 weights that a plain GPT-2 loads strictly, tie included."
    class SaveMid(Callback):  # (named `Save`, it would shadow `learn.save`)
        def after_epoch(self):
            if self.epoch == 1: self.learn.save(tmp_path/'mid', with_opt=False); self.at = {k: v.clone() for k, v in self.learn.model.state_dict().items()}
    learn = learner()
    getattr(learn, MODES[mode][0])(**MODES[mode][1])
    save = SaveMid()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        quiet_fit(learn, 3, cbs=save)
    sd = torch.load(tmp_path/'mid.pth', map_location='cpu')
    assert {k: v.dtype for k, v in sd.items() if v.dtype != torch.float32} == {}
    m = gpt2()
    m.load_state_dict(sd)
    assert m.lm_head.weight is m.transformer.wte.weight
    for k, v in m.state_dict().items(): assert torch.equal(v, save.at[k].float().cpu()), k

@pytest.mark.parametrize('mode', [None] + list(MODES))
def test_gpt2_with_activation_checkpointing_trains_as_without(mode):
    """Its blocks recomputed in the backward: the same weights bit for bit, as in FP32. Before: `mat1 and mat2 must have
    the same dtype` (a block ran again with the FP32 params and 16-bit activations)."""
    plain, _ = fit(MODES.get(mode))
    got, _ = fit(MODES.get(mode), recompute=True)
    a, b = plain.model.state_dict(), got.model.state_dict()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
