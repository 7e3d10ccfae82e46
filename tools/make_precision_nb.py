"""The cells of nbs/precision_policy.ipynb: the per-layer precision policy, FP16 master-weight storage and FP32
regularization. `python tools/make_docs_nbs.py` (or this script, for this notebook alone) writes and executes it;
`pytest` executes it again (tests/test_notebooks.py)."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_docs_nbs import md, code, det, SETUP

CELLS = [
md("""# Precision policy, FP16 master-weight storage, FP32 regularization

Three parts of the recipe beyond "cast the whole model, keep BatchNorm FP32":

1. **A per-layer precision policy** (`keep_fp32=`): which modules stay FP32, after the op categories of the Google/NVIDIA
   "Automated Mixed-Precision for TensorFlow" slides (2019), with a per-module override as a Keras layer carries its own
   dtype policy and an NVCaffe layer chooses its math (NVIDIA's "Training with mixed precision" slides, 2017).
2. **FP16 master-weight storage** (`half_storage=True`): one 16-bit copy of the weights and no FP32 masters, trained with
   the modified momentum rule of NVIDIA's slides.
3. **FP32 regularization**: weight decay and L2 act on FP32 values, as OpenSeq2Seq's mixed-precision guide asks."""),
code(SETUP),
md("""## 1. The precision policy

`learn.to_fp16(keep_fp32=...)` / `to_bf16(keep_fp32=...)` / `ModelToHalf(dtype, keep_fp32=...)` take a spec or a list of
specs, added to the default (BatchNorm): a module type, a category (`fp16cb.policy.CATEGORIES`), a glob on the module's
name (`'layer4.*'`), `'re:<regex>'`, or a predicate `(name, module) -> bool`. `module.fp16cb_dtype = torch.float32`
keeps one module FP32 (a 16-bit dtype there exempts it from the specs). A kept module keeps its whole subtree."""),
det("""from fp16cb.policy import CATEGORIES, PrecisionPolicy, policy_report
for k, (what, _) in CATEGORIES.items(): print(f"{k:11s} {what}")"""),
md("""Casts go only at the edges of an *FP32 island* (a kept subtree whose parent is 16-bit): its floating inputs are cast
up once as it is entered, its outputs back to 16-bit once as it returns; nothing inside it is cast. BatchNorm needs no
casts: torch's kernels take 16-bit inputs with FP32 parameters. An island output that is also the model's output stays
FP32, so the loss sees the exact FP32 logits. `policy_report()` shows the colouring of a network: each module's storage
dtype (its own params, during the fit), compute dtype, the casts inserted and why it is FP32.

### A ResNet-18
(timm's `resnet18` if timm is installed, else torchvision's; random weights, nothing downloaded.)"""),
code("""try:
    import timm; resnet = timm.create_model('resnet18', pretrained=False); src = 'timm'
except ImportError:
    from torchvision.models import resnet18; resnet = resnet18(weights=None); src = 'torchvision'
rep = policy_report(resnet, PrecisionPolicy('classifier'), torch.bfloat16, leaves=True)
print(f"{src} resnet18: {len(rep)} leaf modules")
rep.head(12)"""),
code("""rep[rep.fp32_because != '-'].groupby(['type', 'fp32_because', 'casts']).size()"""),
md("""Only the classifier gets casts (one in, one out); the 20 BatchNorm layers stay FP32 without any.

### A small transformer, trained
8x8 digits as 8 tokens of 8 pixels, one pre-norm encoder layer: LayerNorms and the classifier kept FP32."""),
code("""from fp16cb.demos.experiments import make_learner, train
learn = make_learner('transformer', 'fp32', seed=0)
learn.to_bf16(keep_fp32=['norm', 'classifier'])
rep = learn.mixed_precision.policy_report(leaves=True)
rep"""),
code("""run = train(learn, epochs=2)
mth = learn.model_to_half
print(f"accuracy {run.accuracy:.3f}; after the fit every param is FP32 again:",
      all(p.dtype == torch.float32 for p in learn.model.parameters()))
assert set(rep[rep.casts != '-'].module) == {'encoder.norm1', 'encoder.norm2', 'norm', 'head'}"""),
md("""### Tied parameters
A parameter shared between a kept module and a 16-bit one stays one FP32 tensor: the other module joins the FP32 side
(its reason says so)."""),
code("""class TiedLM(nn.Module):
    def __init__(self, v=11, d=8):
        super().__init__()
        self.emb, self.ff, self.head = nn.Embedding(v, d), nn.Linear(d, d), nn.Linear(d, v, bias=False)
        self.head.weight = self.emb.weight
    def forward(self, x): return self.head(self.ff(self.emb(x)))
policy_report(TiedLM(), PrecisionPolicy('embedding'), torch.float16)"""),
md("""### When keeping the classifier FP32 is what makes 16-bit match FP32
The digits CNN whose logits all carry +4096 (the softmax ignores a common shift): 16-bit logits there are spaced by 4
(fp16) or 32 (bf16), so a 16-bit classifier rounds the class differences away. Kept FP32, it gives the exact logits.
Measured with `python -m fp16cb --experiments` (3 seeds, 6 epochs; AMD EPYC with AVX512, 1 thread): FP32 98.06%,
`to_fp16` 96.33%, `to_fp16(keep_fp32='classifier')` 97.78%, `to_bf16` 84.61%, `to_bf16(keep_fp32='classifier')` 97.94%.
Here with one seed and 3 epochs:"""),
code("""acc = {m: train(make_learner('logit_offset', m, 0), epochs=3).accuracy for m in ('fp32', 'to_bf16', 'bf16_classifier')}
print({m: round(100 * a, 2) for m, a in acc.items()})
assert acc['to_bf16'] < acc['fp32'] - 0.05 and abs(acc['bf16_classifier'] - acc['fp32']) < 0.02"""),
md("""The cost of each opt-in on the small transformer (3 seeds, 6 epochs, same machine; bf16 is native on this CPU):
FP32 91.33% at 0.10 s/epoch; `to_bf16` 91.28% at 0.12; + norms FP32 91.28% at 0.14; + classifier 91.39% at 0.15;
+ both 91.44% at 0.16. Each island costs two casts per forward (and their backward); on so small a model that is
visible, on a real one the matmuls dominate.

## 2. FP16 master-weight storage

`to_fp16(half_storage=True)` keeps one 16-bit copy of the weights and no FP32 masters. The update follows NVIDIA's
slides: the momentum buffer accumulates the raw gradients, G = m G + dW (never the tiny lr dW, which underflows in
fp16), and W = W - lr G is computed in FP32 and only the result is stored in 16-bit. `HalfStorage` does it for any
fastai optimizer: each step lifts the weights and their loss-scaled grads to FP32 (unscaling there), runs the
optimizer's own code (SGD, momentum, Adam...) with its state in FP32, and rounds back.

**Rounding on the store.** Even computed in FP32, an update smaller than half the 16-bit spacing of its weight is
rounded away by round-to-nearest. We chose **stochastic rounding by default** (`stochastic_rounding=False` for
nearest): it is unbiased, so such updates still move the weights on average. It costs a random draw per weight and step
(on the digits CNN, 8.0 s vs 5.4 s for 3 seeds x 8 epochs in fp16 on this CPU), and the failure it prevents is silent.

The experiment at small scale: a loss weighted by 2^-22 (raw gradients below fp16's subnormals once unscaled), SGD with
momentum 0.9. Measured (3 seeds, 4 epochs): FP32 masters 95.83%; fp16 storage with the plain update (classic
momentum H = m H - lr dW in fp16, grads unscaled in fp16) 87.67%; modified rule, nearest 95.83%; modified, stochastic
95.89%."""),
code("""acc = {m: train(make_learner('storage', m, 0), epochs=2).accuracy for m in ('to_fp16', 'fp16_storage_plain', 'fp16_storage')}
print({m: round(100 * a, 2) for m, a in acc.items()})
assert acc['fp16_storage_plain'] < acc['to_fp16'] - 0.02 and abs(acc['fp16_storage'] - acc['to_fp16']) <= 0.005"""),
md("""Updates under half a spacing: the `vanishing` task puts every weight near 24 (fp16 spacing 2^-6) with Adam steps of
about 5e-3. Round-to-nearest stores none of them; stochastic rounding trains (3 seeds, 6 epochs: FP32 masters 93.11%,
nearest 5.39%, stochastic 93.11%). The fraction of weights that moved in one epoch:"""),
code("""moved = {m: train(make_learner('vanishing', m, 0), epochs=1).weights_moved for m in ('fp16_storage_rn', 'fp16_storage')}
print(moved); assert moved['fp16_storage_rn'] < 0.1 < 0.9 < moved['fp16_storage']"""),
md("""Memory, in bytes per trainable parameter during a fit (SGD with momentum; `fp16cb.diagnostics.state_bytes`): FP32 masters
hold 2 (16-bit weight) + 2 (16-bit grad) + 4 (master) + 4 (master grad) + 4 (momentum) = 16; 16-bit storage holds
2 + 2 + 4 (momentum, FP32) = 8. (No GPU was available for this run: on CUDA the same accounting applies.)"""),
code("""from fp16cb.diagnostics import state_bytes
import pandas as pd
class Snapshot(Callback):
    "After the first optimizer step: the bytes per parameter the learner holds, then stop."
    order = 20
    def after_step(self): self.bytes = state_bytes(self.learn); raise CancelFitException()
rows = {}
for half in (False, True):
    learn = make_learner('storage', 'fp32', 0)
    learn.to_fp16(half_storage=half, dynamic=False, loss_scale=2.**20)
    snap = Snapshot()
    with learn.no_bar(), learn.no_logging(): learn.fit(1, cbs=[snap])
    rows['fp16 storage' if half else 'FP32 masters'] = snap.bytes
rows = pd.DataFrame(rows).T
assert round(rows.loc['FP32 masters', 'total']) == 16 and round(rows.loc['fp16 storage', 'total']) == 8  # BatchNorm's FP32 params: a little over
rows.round(3)"""),
md("""## 3. FP32 regularization

OpenSeq2Seq's guide: weight decay (lambda in [1e-5, 1e-3]) on weights initialised small underflows when computed on
16-bit values. With FP32 masters the optimizer steps the masters, so fastai's `wd` (true weight decay or, with
`true_wd=False`, L2), `wd_bn_bias` included, acts on FP32 values; with `half_storage=True` the decay runs in FP32
inside the update. Tiny weights (1e-3 to 4e-3), a zero loss, SGD lr 1e-2, 3 steps of decay:"""),
code("""from functools import partial
from fastai.optimizer import SGD
def decayed(mode, wd, true_wd=True):
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        for p in m.parameters(): p.copy_(torch.linspace(1e-3, 4e-3, p.numel()).reshape(p.shape))
    x = torch.randn(48, 4)
    dls = DataLoaders(DataLoader(list(zip(x, x[:, :1])), bs=16), DataLoader(list(zip(x, x[:, :1])), bs=16))
    learn = Learner(dls, m, loss_func=lambda p, t: (p * 0.).sum(), opt_func=partial(SGD, mom=0.), lr=1e-2, wd=wd)
    learn.true_wd = true_wd
    if mode == '16-bit weights': learn.add_cb(fp16cb.ModelToHalf(torch.bfloat16))
    elif mode == 'to_bf16': learn.to_bf16()
    w0 = m[0].weight.detach().clone()
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    return (w0 - m[0].weight.detach()).abs().max().item()
tab = pd.DataFrame({(wd, tw): {mode: decayed(mode, wd, tw) for mode in ('FP32', '16-bit weights', 'to_bf16')}
                    for wd in (1e-5, 1e-3) for tw in (True, False)})
tab.columns.names = ['wd', 'true_wd']
tab"""),
code("""assert (tab.loc['16-bit weights'] == 0).all() and ((tab.loc['to_bf16'] - tab.loc['FP32']).abs() <= 1e-3 * tab.loc['FP32']).all()"""),
]

if __name__ == '__main__':
    import make_docs_nbs
    make_docs_nbs.main(['precision_policy', *sys.argv[1:]])
