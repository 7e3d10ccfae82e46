"""Write the documentation notebooks of nbs/ (index, conversion_and_masters, callbacks, diagnostics, experiments) clean:
no outputs, no execution counts, minimal metadata, stable cell ids. `--clean` strips every nbs/*.ipynb instead."""
import sys
from pathlib import Path
import nbformat
from nbformat.v4 import new_notebook, new_markdown_cell, new_code_cell

NBS = Path(__file__).resolve().parents[1]/'nbs'
KERNEL = {'kernelspec': {'display_name': 'Python 3', 'language': 'python', 'name': 'python3'}}

SETUP = '''import inspect, warnings
import torch
from torch import nn
from fastai.basics import *
import matplotlib; matplotlib.use('Agg')
import matplotlib.pyplot as plt
import fp16cb
warnings.filterwarnings('ignore', message='.*(fp16|bf16) training on the CPU.*')  # said once: 16-bit math on a CPU may be emulated

def show_sig(f):
    "Print `f`'s signature and docstring, like fastai's `show_doc`."
    print(f"{getattr(f, '__qualname__', f)}{inspect.signature(f)}\\n    {inspect.getdoc(f)}")'''

def write(name, cells):
    nb = new_notebook(metadata=dict(KERNEL))
    for i, (kind, src) in enumerate(cells):
        c = new_markdown_cell(src) if kind == 'md' else new_code_cell(src)
        c.id = f"{name.split('.')[0][:20]}-{i:02d}"
        nb.cells.append(c)
    nbformat.validate(nb)
    nbformat.write(nb, NBS/name)

def clean(path):
    "Strip outputs, execution counts and all metadata but the kernel spec from the notebook at `path`."
    nb = nbformat.read(path, as_version=4)
    nb.metadata = {k: v for k, v in nb.metadata.items() if k == 'kernelspec'}
    for c in nb.cells:
        c.metadata = {}
        if c.cell_type == 'code': c.outputs, c.execution_count = [], None
    nbformat.write(nb, path)

md = lambda s: ('md', s.strip())
code = lambda s: ('code', s.strip())

INDEX = [
md("""# fp16cb: mixed-precision training for fastai

`fp16cb` trains fastai models in mixed precision following Micikevicius et al. (ICLR 2018), with the API of fastai v1's
`fp16` module: a 16-bit model (BatchNorm kept in FP32), **FP32 master weights** stepped by the optimizer, and
**loss scaling** (dynamic by default) with overflowing steps skipped. It runs on CPU and GPU.

## Install

```sh
pip install -e ".[dev]"
pytest
python -m fp16cb            # the main job: a tiny CNN on scikit-learn's digits in fp32 / fp16 / bf16 / native AMP
python -m fp16cb --experiments   # seed 002's table and the three failure modes of pure fp16, a few minutes
```"""),
md("""## A tour

`import fp16cb` patches `Learner` with `to_fp16`, `to_bf16`, `to_fp32`, `to_native_fp16` and `to_native_fp32`.
We use the tiny CNN of the main job on the 8x8 digits shipped with scikit-learn (no download)."""),
code(SETUP),
code("""from fp16cb.experiments import make_learner
learn = make_learner('digits', 'fp32', seed=0)
learn.model"""),
md("""### `to_fp16`
Adds `ModelToHalf` (the model runs in fp16, BatchNorm in FP32, predictions cast back to FP32 so the loss is FP32)
and `MixedPrecision` (FP32 masters, dynamic loss scaling starting at 2^24, skips on overflow)."""),
code("show_sig(Learner.to_fp16)"),
code("""learn.to_fp16()
with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(2, 1e-2)
mp = learn.mixed_precision
print(f"accuracy {learn.recorder.values[-1][2]:.3f}, final loss scale 2^{math.log2(mp.loss_scale):g}, "
      f"{sum(mp.skips)} of {len(mp.skips)} steps skipped (the scale coming down from 2^24)")
assert learn.recorder.values[-1][2] > 0.9
assert all(p.dtype == torch.float32 for p in learn.model.parameters())  # after the fit: FP32, holding the masters
assert mp.skips[0] and mp.scales[0] == 2.**24 and not mp.skips[-1]"""),
md("""### `to_bf16`
bfloat16 has FP32's exponent range, so there is nothing to scale: FP32 masters, loss scale 1.
(On a CPU without native bf16 math, such as this AVX2 one, it is slower than FP32, and fp16cb says so once; with AVX512-BF16/AMX, or on a recent GPU, it is faster.)"""),
code("""learn = make_learner('digits', 'fp32', seed=0).to_bf16()
with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(2, 1e-2)
assert learn.mixed_precision.loss_scale == 1 and not any(learn.mixed_precision.skips)
assert learn.recorder.values[-1][2] > 0.9
[type(cb).__name__ for cb in learn.precision_callbacks()]"""),
md("""### `to_fp32`
Removes the precision callbacks; the model keeps the trained weights, exactly (they were the FP32 masters)."""),
code("""w = learn.model[0].weight.detach().clone()
learn.to_fp32()
assert learn.precision_callbacks() == [] and torch.equal(learn.model[0].weight, w)
with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3)  # plain FP32 training again
assert learn.model[0].weight.dtype == torch.float32"""),
md("""### Native AMP
`to_native_fp16()` uses PyTorch's `autocast` + `GradScaler` on the model's device (CPU included).

Next: [conversion and masters](conversion_and_masters.ipynb), [loss scalers](loss_scalers.ipynb),
[callbacks](callbacks.ipynb), [workflow](workflow.ipynb), [diagnostics](diagnostics.ipynb),
[experiments](experiments.ipynb)."""),
code("""learn = make_learner('digits', 'fp32', seed=0).to_native_fp16()
with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
assert learn.recorder.values[-1][2] > 0.8 and learn.native_mixed_precision.loss_scale > 1"""),
]

CONVERSION = [
md("""# Conversion and FP32 master weights

Why masters: fp16 has 10 fraction bits, so between 1 and 2 it can only represent steps of 2^-10: `1 + 0.0001 == 1`.
An optimizer step `w - lr*grad` done in fp16 is lost whenever `lr*grad` is below half that spacing."""),
code(SETUP),
code("""one = torch.tensor(1., dtype=torch.float16)
assert one + 0.0001 == one                      # the update vanishes in fp16
assert torch.tensor(1.) + 0.0001 != 1.          # FP32 keeps it
# ... and FP32 masters accumulate it: ten updates of 1e-4 reach 1.001, which fp16 can tell from 1
m = torch.tensor(1.)
for _ in range(10): m -= -1e-4
print(m.half(), one + 0.0001)
assert m.half() > one"""),
md("""## `convert_network`
Converts parameters and buffers to the 16-bit dtype, except BatchNorm layers (torch's and fastai's `BatchNorm`), which
stay in FP32 for stable statistics."""),
code("show_sig(fp16cb.convert_network)"),
code("""from fp16cb import convert_network
model = nn.Sequential(nn.Linear(10, 30), BatchNorm(30, ndim=1), nn.Linear(30, 2))
model = convert_network(model, torch.float16)
for i, t in enumerate([torch.float16, torch.float32, torch.float16]):
    test_eq(model[i].weight.dtype, t); test_eq(model[i].bias.dtype, t)
test_eq(model[1].running_mean.dtype, torch.float32)
model = convert_network(model, torch.float32)
assert all(p.dtype == torch.float32 for p in model.parameters())"""),
md("""## `get_master`, `to_master_grads`, `to_model_params`
Per fastai param group, the trainable model params and FP32 copies of them (`flat_master=True`: one flat FP32 tensor
per group). Gradients go model -> master (FP32), the optimizer steps the masters, weights go master -> model (rounded
once)."""),
code("""from fp16cb import get_master, to_master_grads, to_model_params
for f in (get_master, to_master_grads, to_model_params): show_sig(f)"""),
code("""model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).half()
opt = SGD([list(model[0].parameters()), list(model[1].parameters())], lr=0.1)  # two param groups
model_pgs, master_pgs = get_master(opt)
test_eq(len(master_pgs), 2)
assert all(m.dtype == torch.float32 and torch.equal(m.half(), p) for mg, pg in zip(master_pgs, model_pgs) for m, p in zip(mg, pg))
model(torch.randn(5, 4).half()).float().pow(2).mean().backward()
to_master_grads(model_pgs, master_pgs)
assert all(torch.equal(m.grad, p.grad.float()) for mg, pg in zip(master_pgs, model_pgs) for m, p in zip(mg, pg))
for mg in master_pgs:
    for m in mg: m.data -= 1e-5 * m.grad        # an FP32 step on the masters
to_model_params(model_pgs, master_pgs)
assert all(torch.equal(p, m.half()) for mg, pg in zip(master_pgs, model_pgs) for m, p in zip(mg, pg))"""),
code("""# flat masters: one FP32 tensor per param group, the same values
_, flat = get_master(opt, flat_master=True)
test_eq([len(g) for g in flat], [1, 1])
test_eq(flat[0][0].numel(), sum(p.numel() for p in model[0].parameters()))"""),
md("""## Exact weights after a fit
During a fit the masters *are* the FP32 originals of the params (shared storage, not copies), so after the fit the
model holds the master weights exactly, not values rounded through fp16."""),
code("""from fp16cb.experiments import make_learner
learn = make_learner('digits', 'to_fp16', seed=0)
with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
params = list(learn.model.parameters())
assert all(p.dtype == torch.float32 for p in params)
assert any((p.half().float() != p).any() for p in params)  # values fp16 cannot hold: the masters, not a rounding"""),
]

CALLBACKS = [
md("""# The callbacks

`to_fp16()` is two callbacks: `ModelToHalf` (order -50) and `MixedPrecision` (order 10). They can be used directly."""),
code(SETUP),
code("""from fp16cb import ModelToHalf, MixedPrecision, NativeMixedPrecision
for f in (ModelToHalf, MixedPrecision, NativeMixedPrecision): show_sig(f)"""),
md("""## What each event sees
A small callback records dtypes during a fit: the model is fp16 (BatchNorm FP32), the input batch fp16, the predictions
and the loss FP32; `learn.loss` is the real, unscaled loss while `learn.loss_grad` (what is backpropagated) is
multiplied by the loss scale. From `MixedPrecision.before_step` on, the step's gradients are in the FP32 masters
(the optimizer's params, unscaled): a callback that looks at gradients reads `learn.opt`'s params. The model's 16-bit
grads are cleared for the next backward, right there while they are in cache, or in `after_step` when a later
callback has a `before_step` of its own (like this spy: it could cancel the batch to accumulate the grads)."""),
code("""from fp16cb.experiments import make_learner
class Spy(Callback):
    order = 50
    def before_batch(self): self.x = self.learn.xb[0].dtype
    def after_pred(self):
        self.pred, self.conv, self.bn = self.learn.pred.dtype, self.learn.model[0].weight.dtype, self.learn.model[1].weight.dtype
    def before_backward(self):
        self.ratio = (self.learn.loss_grad / self.learn.loss).item(); self.scale = self.learn.mixed_precision.loss_scale
    def before_step(self): self.master_grads = {p.grad.dtype for p, *_ in self.opt.all_params(with_grad=True)}
    def after_step(self):
        self.model_grads_cleared = all(p.grad is None or not p.grad.any() for p in self.learn.model.parameters())
learn = make_learner('digits', 'fp32', seed=0).add_cbs([ModelToHalf(), MixedPrecision(), Spy()])
with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
s = learn.spy
print(s.x, s.conv, s.bn, s.pred, s.ratio, s.master_grads, s.model_grads_cleared)
assert (s.x, s.conv, s.bn, s.pred) == (torch.float16, torch.float16, torch.float32, torch.float32)
assert s.ratio == s.scale > 1
assert s.master_grads == {torch.float32} and s.model_grads_cleared"""),
md("""## Overflow: skip the step, lower the scale
On an inf/NaN in the gradients (checked in one fused pass, one host sync per step) the step is skipped (masters
untouched) and the scale divided by `div_factor`; after `scale_wait` clean steps it is multiplied again, never above
`max_loss_scale`."""),
code("""learn = make_learner('digits', 'fp32', seed=0).to_fp16(max_loss_scale=2.**24, scale_wait=5)
with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
mp = learn.mixed_precision
first_clean = mp.skips.index(False)
assert all(mp.skips[:first_clean]) and mp.scales[first_clean] == 2.**24 / 2**first_clean
grown = [b / a for a, b in zip(mp.scales, mp.scales[1:]) if b > a]
assert grown and set(grown) == {2.}   # grew back by div_factor after 5 clean steps
print(f"{sum(mp.skips)} skipped of {len(mp.skips)}; scale went {mp.scales[0]:g} -> {mp.loss_scale:g}")"""),
md("""Static scaling keeps `loss_scale`; invalid arguments are refused when the callback is created:"""),
code("""learn = make_learner('digits', 'fp32', seed=0).to_fp16(dynamic=False, loss_scale=128)
with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
assert set(learn.mixed_precision.scales) == {128.}
for bad in (dict(loss_scale=0), dict(div_factor=1.), dict(scale_wait=0), dict(clip=-1.)):
    try: MixedPrecision(**bad); raise AssertionError(bad)
    except ValueError as e: print(type(e).__name__, e)"""),
md("""## `NativeMixedPrecision`
PyTorch's `autocast` + `GradScaler`, on the model's device. Its scale history is kept like `MixedPrecision`'s."""),
code("""learn = make_learner('digits', 'fp32', seed=0).to_native_fp16(init_scale=2.**20)
with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
cb = learn.native_mixed_precision
print(cb.scales[:6], cb.skips[:6])
assert len(cb.scales) == len(learn.dls.train) and learn.recorder.values[-1][2] > .8"""),
]

DIAGNOSTICS = [
md("""# Diagnostics

Three tools: the loss-scale history of a fit (`plot_loss_scale`), a report of where the gradients live against fp16's
range (`gradient_report`, `plot_gradient_range`, after seed 002's gradient histograms), and warnings emitted once
during a fit when the scale sits at its floor or many steps are skipped."""),
code(SETUP),
code("""from fp16cb.diagnostics import plot_loss_scale, gradient_report, plot_gradient_range, scale_health
for f in (plot_loss_scale, gradient_report, plot_gradient_range, scale_health): show_sig(f)"""),
md("""## Loss-scale history
`MixedPrecision` (and `NativeMixedPrecision`) record, per optimizer step, the scale used (`scales`) and whether the
step was skipped (`skips`)."""),
code("""from fp16cb.experiments import make_learner
learn = make_learner('digits', 'fp32', seed=0).to_fp16(scale_wait=10)
with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(2, 1e-2)
ax = plot_loss_scale(learn)
mp = learn.mixed_precision
assert len(ax.collections[0].get_offsets()) == sum(mp.skips) > 0
plt.show()"""),
md("""## Where the gradients live
`gradient_report` runs a few training batches in FP32 (the model outside a fit) and histograms |activation grads| (via
hooks on the outputs of the leaf modules) and |weight grads| in log2 bins. fp16 keeps full precision from 2^-14 to
65504, subnormals down to 2^-24, and loses anything smaller. A loss multiplied by 2^-20 (think of a small weight on
one term of a sum of losses) puts nearly all its gradients below 2^-24:"""),
code("""rep = gradient_report(make_learner('underflow', 'fp32', seed=0), n_batches=2)
print(rep.summary())
assert rep.at_1['activation'][0] > .5           # more than half the activation grads are lost at scale 1
assert rep.at_suggested['activation'][0] < .05  # the suggested scale brings them back
assert rep.suggested_scale >= 2.**16"""),
code("""plot_gradient_range(rep); plt.show()"""),
code("""# the same model on the plain loss: nothing to fear at scale 1, a moderate scale suggested
plain = gradient_report(make_learner('digits', 'fp32', seed=0))
print(plain.summary())
assert plain.at_1['activation'][0] < rep.at_1['activation'][0] and plain.suggested_scale < rep.suggested_scale"""),
md("""## Warnings
Once per callback and kind, at the end of an epoch: many skipped steps (beyond the leading overflows of a dynamic scale
finding its level), or a dynamic scale sitting at its floor. (A third, fp16 on a CPU without fp16 math, comes from
`ModelToHalf`.) Here a scale that tries to grow after every clean step keeps overflowing:"""),
code("""learn = make_learner('digits', 'fp32', seed=0).to_fp16(scale_wait=1)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter('always')
    with learn.no_bar(), learn.no_logging(): learn.fit(2, 1e-2)
msgs = [str(o.message) for o in w if 'skipped' in str(o.message)]
print(msgs)
assert len(msgs) == 1   # once, not once per epoch"""),
]

EXPERIMENTS = [
md("""# Experiments: why mixed precision works

`python -m fp16cb --experiments` reproduces at small scale (digits, 2 CPU cores, a few minutes) seed 002's table and
the three failure modes of pure fp16 listed in seed 001, each with a run where it breaks and one where the recipe fixes
it; the recipe must stay within 0.5 accuracy points of FP32 (mean of 3 seeds). This notebook runs one seed and few
epochs of each to show the mechanics; the command prints the full tables."""),
code(SETUP),
code("""from fp16cb.experiments import MODES, TASKS, run_mode, make_learner
from fp16cb.demo import format_table
for k, (what, _) in MODES.items(): print(f"{k:18}{what}")"""),
md("""## Seed 002's table, small
FP32, mixed (fp16 + FP32 masters + dynamic scale), pure fp16 (the optimizer on the fp16 weights), pure fp16 with a
static loss scale, bf16 and native AMP. On an easy task they all train; the differences show on the tasks below."""),
code("""rows = [(m, [run_mode(m, 0, 'digits', epochs=2)]) for m in ('fp32', 'to_fp16', 'fp16', 'to_bf16')]
print(format_table(rows))
acc = {m: r[0].accuracy for m, r in rows}
assert all(a > .9 for a in acc.values())"""),
md("""## 1. Vanishing updates without FP32 masters
A logistic regression whose weights all sit near 24 (inputs centred per image, so the shared offset adds nothing to
the logits): fp16's spacing there is 2^-6, and Adam's steps (about lr = 5e-3) are below half of it. The pure-fp16
optimizer rounds every update away; the FP32 masters accumulate them."""),
code("""print(TASKS['vanishing'].note)
runs = {m: run_mode(m, 0, 'vanishing', epochs=2) for m in ('fp32', 'fp16', 'to_fp16')}
for m, r in runs.items(): print(f"{m:8} accuracy {r.accuracy:.3f}  weights moved {r.weights_moved:.1%}")
assert runs['fp16'].weights_moved < .05 and runs['fp16'].accuracy < .3
assert abs(runs['to_fp16'].accuracy - runs['fp32'].accuracy) < .02"""),
code("""for m, r in runs.items(): plt.plot(r.valid_acc, marker='o', label=m)
plt.xlabel('epoch'); plt.ylabel('validation accuracy'); plt.legend(); plt.show()"""),
md("""## 2. Gradient underflow without loss scaling
The CNN's loss multiplied by 2^-20 (SGD's lr multiplied by 2^20, so FP32 trains as usual): its gradients live below
fp16's smallest subnormal, 2^-24. With FP32 masters but scale 1 every gradient flushes to zero; the dynamic scale
(starting at 2^24) shifts them back into range."""),
code("""runs = {m: run_mode(m, 0, 'underflow', epochs=2) for m in ('to_fp16_unscaled', 'to_fp16')}
for m, r in runs.items(): print(f"{m:17} accuracy {r.accuracy:.3f}  weights moved {r.weights_moved:.1%}  scale {r.loss_scale:g}")
assert runs['to_fp16_unscaled'].weights_moved == 0 and runs['to_fp16'].accuracy > .9"""),
md("""## 3. Overflow, handled by dynamic scaling
Too large a scale overflows the fp16 gradients. Unchecked, the infs reach the weights and training is lost; the
dynamic scale skips those steps, backs off, and keeps probing upwards (`scale_wait=20` here to show it)."""),
code("""bad = run_mode('fp16_unchecked', 0, 'digits', epochs=1)
good = run_mode('to_fp16_wait20', 0, 'digits', epochs=2)
print(f"unchecked: accuracy {bad.accuracy:.3f}; dynamic: accuracy {good.accuracy:.3f}, {good.skipped} steps skipped")
assert bad.accuracy < .2 and good.accuracy > .9 and good.skipped > 0
from fp16cb.diagnostics import plot_loss_scale
plot_loss_scale(good); plt.show()"""),
md("""## The full run
`python -m fp16cb --experiments --plot experiments.png` on 2 CPU cores (one torch thread) trains every row on seeds
0, 1 and 2 (the failing rows on seed 0) and ends with `recipe within 0.5 accuracy points of FP32 everywhere: yes`.
Measured (93 s; validation accuracy %, mean of 3 seeds):

| experiment | FP32 | where it breaks | with the recipe |
|---|---|---|---|
| seed 002's table | 98.33 | pure fp16 98.11, fp16 + scale 1000 98.11 | to_fp16 98.00, to_bf16 98.39, native 98.39 |
| 1. vanishing updates | 93.06 | pure fp16: 10.00, 96% of the weights never move | FP32 masters: 93.11 |
| 2. gradient underflow | 98.00 | scale 1: 10.83, no weight moves | dynamic scale: 97.89 |
| 3. overflow | 98.33 | scale 2^24 unchecked: 8.83, inf/NaN weights | dynamic scale, 10 steps skipped: 97.89 |"""),
]

if __name__ == '__main__':
    if '--clean' in sys.argv:
        for p in sorted(NBS.glob('*.ipynb')): clean(p)
    else:
        NBS.mkdir(exist_ok=True)
        for name, cells in (('index.ipynb', INDEX), ('conversion_and_masters.ipynb', CONVERSION),
                            ('callbacks.ipynb', CALLBACKS), ('diagnostics.ipynb', DIAGNOSTICS),
                            ('experiments.ipynb', EXPERIMENTS)):
            write(name, cells)
