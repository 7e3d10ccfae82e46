"""Write and execute the documentation notebooks of nbs/: the docs show their outputs (tables, plots), like fastai's.

    python tools/make_docs_nbs.py                 # write the generated notebooks, then execute every nbs/*.ipynb
    python tools/make_docs_nbs.py examples index  # the same for these notebooks only
    python tools/make_docs_nbs.py --no-exec       # write the generated notebooks, without outputs
    python tools/make_docs_nbs.py --clean         # strip the outputs of every notebook

Generated from this file: index, conversion_and_masters, callbacks, diagnostics, experiments, examples, which_mode,
troubleshooting. `loss_scalers`, `workflow` and `overflow_diagnostics` are written by hand: they are executed in place.

Execution (also what tests/test_notebooks.py does): this checkout's fp16cb first on the path, one torch thread,
matplotlib's inline backend (figures stored as PNG), 72 dpi. Stored: outputs and execution counts; metadata: the
kernel spec, and cell tags. Cells tagged `deterministic` print nothing that depends on the machine, the timing or
the numerics of training; the tests check that their stored outputs are those of a fresh run."""
import os, sys
from pathlib import Path
import nbformat
from nbformat.v4 import new_notebook, new_markdown_cell, new_code_cell

REPO = Path(__file__).resolve().parents[1]
NBS = REPO/'nbs'
KERNEL = {'kernelspec': {'display_name': 'Python 3', 'language': 'python', 'name': 'python3'}}
DETERMINISTIC = 'deterministic'  # the tag of cells whose stored outputs must equal a fresh run's

SETUP = '''%matplotlib inline
import inspect, warnings
import torch
from torch import nn
import fp16cb
from fastai.basics import *
import matplotlib.pyplot as plt
plt.rcParams['figure.dpi'] = 72  # light notebooks
warnings.filterwarnings('ignore', message='.*(fp16|bf16) training on the CPU.*')  # said once: 16-bit math on a CPU may be emulated

def show_sig(f):
    "Print `f`'s signature and docstring, like fastai's `show_doc`."
    print(f"{getattr(f, '__qualname__', f)}{inspect.signature(f)}\\n    {inspect.getdoc(f)}")'''

def new_nb(name, cells):
    "A notebook from `cells`: `(kind, source)` or `(kind, source, tags)`, with stable cell ids and no outputs."
    nb = new_notebook(metadata=dict(KERNEL))
    for i, (kind, src, *tags) in enumerate(cells):
        c = new_markdown_cell(src) if kind == 'md' else new_code_cell(src)
        c.id = f"{name.split('.')[0][:20]}-{i:02d}"
        if tags and tags[0]: c.metadata['tags'] = list(tags[0])
        nb.cells.append(c)
    nbformat.validate(nb)
    return nb

def tidy(nb):
    "Keep the kernel spec, cell tags, outputs and execution counts; drop the rest (timings, versions, widget state)."
    nb.metadata = {k: v for k, v in nb.metadata.items() if k == 'kernelspec'}
    for c in nb.cells:
        c.metadata = {'tags': c.metadata['tags']} if c.metadata.get('tags') else {}
        c.pop('attachments', None) if c.cell_type == 'code' else None
    return nb

def clean(nb):
    "`tidy`, and no outputs or execution counts."
    for c in tidy(nb).cells:
        if c.cell_type == 'code': c.outputs, c.execution_count = [], None
    return nb

def kernel_env() -> dict:
    "The kernel's environment: this checkout's fp16cb first, one thread (tiny models), matplotlib's inline backend."
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONHASHSEED='0',
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get('PYTHONPATH', '')]).rstrip(os.pathsep))
    env.pop('MPLBACKEND', None)  # a forced backend (Agg) would keep the figures out of the notebook
    return env

def execute(nb, timeout:int=300):
    "Run `nb` in place in a fresh kernel started in nbs/ (raises `CellExecutionError` with the cell and traceback)."
    from nbclient import NotebookClient
    NotebookClient(nb, timeout=timeout, kernel_name='python3', record_timing=False, shutdown_kernel='immediate',
                   resources={'metadata': {'path': str(NBS)}}).execute(env=kernel_env())
    return nb

md = lambda s: ('md', s.strip())
code = lambda s, tags=(): ('code', s.strip(), tags)
det = lambda s: ('code', s.strip(), [DETERMINISTIC])  # a cell whose outputs are the same on every machine and run

INDEX = [
md("""# fp16cb: mixed-precision training for fastai

`fp16cb` trains fastai models in mixed precision as described by Micikevicius et al. (2018, "Mixed Precision
Training", ICLR), with the API of fastai's original mixed-precision callbacks (fastai's docs: "Callback and utility
functions to allow mixed precision training"): a 16-bit model (BatchNorm kept in FP32), **FP32 master weights** stepped
by the optimizer, and **loss scaling** (dynamic by default) with overflowing steps skipped. It runs on CPU and GPU.

## Install

```sh
pip install -e ".[dev]"
pytest
python -m fp16cb                 # the main job: a tiny CNN on scikit-learn's digits in fp32 / fp16 / bf16 / native AMP
python -m fp16cb --experiments   # the comparison of NVIDIA's NVCaffe slides and the three problems of pure fp16, a few minutes
```

## The docs

| notebook | what is in it |
|---|---|
| [examples](examples.ipynb) | vision, text and tabular learners, each trained in FP32, `to_bf16()` and `to_fp16()` |
| [which mode do I pick?](which_mode.ipynb) | GPU fp16 vs bf16, CPUs with and without native bf16, native AMP vs ours, flat masters; measured here |
| [troubleshooting](troubleshooting.ipynb) | every step skipped, the scale at its floor, NaN in the data, slow CPUs |
| [conversion and masters](conversion_and_masters.ipynb) | `convert_network`, `get_master`, `to_master_grads`, `to_model_params` |
| [callbacks](callbacks.ipynb) | `ModelToHalf`, `MixedPrecision`, `NativeMixedPrecision`: what each training event sees |
| [loss scalers](loss_scalers.ipynb) | static, backoff and log-normal loss scaling |
| [workflow](workflow.ipynb) | `fit_one_cycle`, `lr_find`, gradient accumulation and clipping, inference, faults |
| [diagnostics](diagnostics.ipynb) | the loss-scale history, where the gradients sit against fp16's range, warnings |
| [overflow diagnostics](overflow_diagnostics.ipynb) | which module overflows fp16 and the remedy: `overflows`, the collapse error, `on_collapse`, `learn.precision_check()` |
| [experiments](experiments.ipynb) | why mixed precision works: each problem of pure fp16, shown and fixed |"""),
md("""## A tour

`import fp16cb` patches `Learner` with `to_fp16`, `to_bf16`, `to_fp32`, `to_native_fp16` and `to_native_fp32`.
We use the tiny CNN of the main job on the 8x8 digits shipped with scikit-learn (no download)."""),
code(SETUP),
det("""from fp16cb.demos.experiments import make_learner
learn = make_learner('digits', 'fp32', seed=0)
learn.model"""),
md("""### `to_fp16`
Adds `ModelToHalf` (the model runs in fp16, BatchNorm in FP32, predictions cast back to FP32 so the loss is FP32)
and `MixedPrecision` (FP32 masters, dynamic loss scaling whose start is set from the first step's gradients, skips on
overflow)."""),
det("show_sig(Learner.to_fp16)"),
md("""fastai's usual training loop, with two more columns: the loss scale and the number of skipped steps."""),
code("""learn.to_fp16()
learn.fit_one_cycle(2, 1e-2)"""),
code("""mp = learn.mixed_precision
print(f"accuracy {learn.recorder.values[-1][2]:.3f}, final loss scale 2^{math.log2(mp.loss_scale):g}, "
      f"{sum(mp.skips)} of {len(mp.skips)} steps skipped (the first step, at scale 1, set the scale)")
assert learn.recorder.values[-1][2] > 0.9
assert all(p.dtype == torch.float32 for p in learn.model.parameters())  # after the fit: FP32, holding the masters
assert mp.scales[0] == 1. and not mp.skips[0] and sum(mp.skips) <= 2 and not mp.skips[-1]
fp16cb.plot_loss_scale(learn); plt.show()"""),
md("""### `to_bf16`
bfloat16 has FP32's exponent range, so there is nothing to scale: FP32 masters, loss scale 1.
Whether it is faster than FP32 depends on the hardware: on recent GPUs and on CPUs with native bf16 math
(AVX512, AVX512-BF16, AMX) it is; on other CPUs it is slower, and fp16cb says so once
([which mode do I pick?](which_mode.ipynb))."""),
det("""learn = make_learner('digits', 'fp32', seed=0).to_bf16()
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
`to_native_fp16()` uses PyTorch's `autocast` + `GradScaler` on the model's device (CPU included)."""),
code("""learn = make_learner('digits', 'fp32', seed=0).to_native_fp16()
with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
assert learn.recorder.values[-1][2] > 0.8 and learn.native_mixed_precision.loss_scale > 1"""),
md("""Next: [examples](examples.ipynb), [which mode do I pick?](which_mode.ipynb),
[troubleshooting](troubleshooting.ipynb)."""),
]
CONVERSION = [
md("""# Conversion and FP32 master weights

Why masters (the first of the three problems of pure fp16 in fastai's mixed-precision docs; Micikevicius et al. 2018,
section 3.1): fp16 has 10 fraction bits, so between 1 and 2 it can only represent steps of 2^-10: `1 + 0.0001 == 1`.
An optimizer step `w - lr*grad` done in fp16 is lost whenever `lr*grad` is below half that spacing."""),
code(SETUP),
det("""one = torch.tensor(1., dtype=torch.float16)
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
det("show_sig(fp16cb.convert_network)"),
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
det("""from fp16cb import get_master, to_master_grads, to_model_params
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
The masters are made from the exact FP32 originals that `ModelToHalf` kept when it converted the model (FP32 copies, not
values read back from fp16), so after the fit the model holds the master weights exactly, each param in storage of its
own and in the memory layout it trained in."""),
code("""from fp16cb.demos.experiments import make_learner
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
det("""from fp16cb import ModelToHalf, MixedPrecision, NativeMixedPrecision
for f in (ModelToHalf, MixedPrecision, NativeMixedPrecision): show_sig(f)"""),
md("""## What each event sees
A small callback records dtypes during a fit: the model is fp16 (BatchNorm FP32), the inputs enter it in fp16 (cast by
a forward pre-hook: `learn.xb` stays as the data gave it, so callbacks such as fastai's `MixUp` mix FP32 inputs), the
predictions and the loss FP32; `learn.loss` is the real, unscaled loss while `learn.loss_grad` (what is backpropagated) is
multiplied by the loss scale. From `MixedPrecision.before_step` on, the step's gradients are in the FP32 masters
(the optimizer's params, unscaled): a callback that looks at gradients reads `learn.opt`'s params. The model's 16-bit
grads are cleared for the next backward, right there while they are in cache, or in `after_step` when a later
callback has a `before_step` of its own (like this spy: it could cancel the batch to accumulate the grads)."""),
code("""from fp16cb.demos.experiments import make_learner
class Spy(Callback):
    order = 50
    def before_fit(self):  # what the model's forward receives (ModelToHalf's cast runs first)
        self.hook = self.learn.model.register_forward_pre_hook(lambda m, args: setattr(self, 'inp', args[0].dtype))
    def after_fit(self): self.hook.remove()
    def after_pred(self):
        self.out, self.conv, self.bn = self.learn.pred.dtype, self.learn.model[0].weight.dtype, self.learn.model[1].weight.dtype
    def before_backward(self):
        self.ratio = (self.learn.loss_grad / self.learn.loss).item(); self.scale = self.learn.mixed_precision.loss_scale
    def before_step(self): self.master_grads = {p.grad.dtype for p, *_ in self.opt.all_params(with_grad=True)}
    def after_step(self):
        self.model_grads_cleared = all(p.grad is None or not p.grad.any() for p in self.learn.model.parameters())
learn = make_learner('digits', 'fp32', seed=0).add_cbs([ModelToHalf(), MixedPrecision(), Spy()])
with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
s = learn.spy
print(s.inp, s.conv, s.bn, s.out, s.ratio, s.master_grads, s.model_grads_cleared)
assert (s.inp, s.conv, s.bn, s.out) == (torch.float16, torch.float16, torch.float32, torch.float32)
assert s.ratio == s.scale > 1
assert s.master_grads == {torch.float32} and s.model_grads_cleared"""),
md("""## Overflow: skip the step, lower the scale
On an inf/NaN in the gradients (checked in one fused pass, one host sync per step) the step is skipped (masters
untouched) and the scale divided by `div_factor`; after `scale_wait` clean steps it is multiplied again, never above
`max_loss_scale`. Here the scale starts at 2^24 on purpose (`loss_scale=2.**24`; by default the first step sets it
from the gradients), so the first steps overflow."""),
code("""learn = make_learner('digits', 'fp32', seed=0).to_fp16(loss_scale=2.**24, max_loss_scale=2.**24, scale_wait=5)
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
range (`gradient_report`, `plot_gradient_range`, after the activation-gradient histograms of NVIDIA's NVCaffe slides
"Training with Mixed Precision" and of Micikevicius et al. 2018, figure 3), and warnings emitted once during a fit when
the scale sits at its floor or many steps are skipped. What to do about each warning: [troubleshooting](troubleshooting.ipynb)."""),
code(SETUP),
det("""from fp16cb.diagnostics import plot_loss_scale, gradient_report, plot_gradient_range, scale_health
for f in (plot_loss_scale, gradient_report, plot_gradient_range, scale_health): show_sig(f)"""),
md("""## Loss-scale history
`MixedPrecision` (and `NativeMixedPrecision`) record, per optimizer step, the scale used (`scales`) and whether the
step was skipped (`skips`)."""),
code("""from fp16cb.demos.experiments import make_learner
learn = make_learner('digits', 'fp32', seed=0).to_fp16(loss_scale=2.**24, scale_wait=10)  # start high: overflows to see
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

`python -m fp16cb --experiments` reproduces at small scale (digits, 2 CPU cores, a few minutes) the comparison table of
NVIDIA's NVCaffe slides "Training with Mixed Precision" (Ginsburg, Nikolaev and Micikevicius, 2017: FP32, mixed, FP16,
FP16 with loss scale 1000) and the three problems of pure fp16 named in fastai's mixed-precision docs (after
Micikevicius et al. 2018, "Mixed Precision Training", ICLR), each with a run where it breaks and one where the recipe
fixes it; the recipe must stay within 0.5 accuracy points of FP32 (mean of 3 seeds). This notebook runs one seed and few
epochs of each to show the mechanics; the command prints the full tables."""),
code(SETUP),
det("""from fp16cb.demos.experiments import MODES, TASKS, run_mode, make_learner
from fp16cb.demos.cli import format_table
for k, (what, _) in MODES.items(): print(f"{k:18}{what}")"""),
md("""## The NVCaffe slides' comparison, small
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
(set from the first step's gradients) shifts them back into range (Micikevicius et al. 2018, section 3.2)."""),
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
`python -m fp16cb --experiments --plot experiments.png` on 2 CPU cores (one torch thread) trains every row with the
random seeds 0, 1 and 2 (the failing rows with seed 0 only) and ends with
`recipe within 0.5 accuracy points of FP32 everywhere: yes`. Measured on the AVX2 machine this project was built on
(93 s; validation accuracy %, mean of 3 seeds):

| experiment | FP32 | where it breaks | with the recipe |
|---|---|---|---|
| the NVCaffe slides' comparison | 98.33 | pure fp16 98.11, fp16 + scale 1000 98.11 | to_fp16 98.00, to_bf16 98.39, native 98.39 |
| 1. vanishing updates | 93.06 | pure fp16: 10.00, 96% of the weights never move | FP32 masters: 93.11 |
| 2. gradient underflow | 98.00 | scale 1: 10.83, no weight moves | dynamic scale: 97.89 |
| 3. overflow | 98.33 | scale 2^24 unchecked: 8.83, inf/NaN weights | dynamic scale, 10 steps skipped: 97.89 |"""),
]


EX_SETUP = '''%matplotlib inline
import random, time, warnings
import fp16cb  # patches Learner.to_fp16 & co.
from fastai.vision.all import *
from fastai.text.all import *
from fastai.tabular.all import *
plt.rcParams['figure.dpi'] = 72  # light notebooks
warnings.filterwarnings('ignore', message='.*(fp16|bf16) training on the CPU.*')  # said once: see which_mode.ipynb
warnings.filterwarnings('ignore', message='The given NumPy array is not writable')  # pandas' read-only arrays'''

EXAMPLES = [
md("""# Examples: vision, text and tabular

Three fastai learners, each trained from the same seed in FP32, with `learn.to_bf16()` and with `learn.to_fp16()`:
a CNN on scikit-learn's handwritten digits through a `DataBlock`, an AWD-LSTM text classifier on generated reviews
(no corpus ships with scikit-learn, and these docs download nothing), and `tabular_learner` on scikit-learn's breast
cancer data. Everything runs on a CPU in well under a minute; on a GPU the same code uses it (`dls` on the GPU).

The recipe is the one of Micikevicius et al. (2018): the model in 16-bit (BatchNorm in FP32), FP32 master weights,
and with fp16 a dynamic loss scale; `to_fp16` runs its first step at scale 1, sets the scale from that step's gradients
and halves it on each overflow (fastai's docs: "Callback and utility functions to allow mixed precision training"). The accuracy of the three
modes should agree within noise. Their speed is not compared here: it depends on the hardware
([which mode do I pick?](which_mode.ipynb))."""),
code(EX_SETUP),
md("""A small helper: a fresh learner per mode from the same seed, a table of the results (and, for the mode
`show`, fastai's usual progress table: `to_fp16` adds the loss scale and the skipped steps as columns)."""),
code('''learners = {}  # the last learner trained in each mode

def compare(make_learner, epochs, lr, modes=('to_fp32', 'to_bf16', 'to_fp16'), show=None):
    "Train `make_learner()` in each precision of `modes` from the same seed; a table of the results."
    rows = []
    for mode in modes:
        set_seed(0, reproducible=True)
        learn = learners[mode] = getattr(make_learner(), mode)()
        t0 = time.perf_counter()
        if mode == show: learn.fit_one_cycle(epochs, lr)  # with fastai's progress table
        else:
            with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(epochs, lr)
        mp = getattr(learn, 'mixed_precision', None)
        rows.append({'mode': mode, 'accuracy %': 100 * float(learn.recorder.values[-1][2]),
                     'valid loss': float(learn.recorder.values[-1][1]), 's/epoch': (time.perf_counter() - t0) / epochs,
                     'final loss scale': mp.loss_scale if mp else None, 'skipped steps': mp.n_skipped if mp else 0})
    return pd.DataFrame(rows).set_index('mode').round(3)

results = {}'''),
md("""## Vision: digits through a `DataBlock`

scikit-learn's 1797 handwritten digits (8x8, grey levels 0-16) become fastai `PILImageBW` images; the model is a
small CNN of fastai `ConvLayer`s (conv, BatchNorm, ReLU)."""),
det('''from sklearn.datasets import load_digits
digits = load_digits()
pixels = (digits.images * 255 / 16).astype('uint8')
items = pd.DataFrame({'i': range(len(pixels)), 'label': digits.target})
dblock = DataBlock(blocks=(ImageBlock(cls=PILImageBW), CategoryBlock),
                   get_x=lambda r: PILImageBW.create(pixels[r['i']]), get_y=ColReader('label'),
                   splitter=RandomSplitter(0.2, seed=42), batch_tfms=Normalize())
dls = dblock.dataloaders(items, bs=64, num_workers=0)
print(len(dls.train_ds), 'train,', len(dls.valid_ds), 'valid; classes', ' '.join(map(str, dls.vocab)))'''),
code("dls.show_batch(max_n=8, nrows=1, figsize=(8, 1.6))"),
det('''def digits_cnn():
    return nn.Sequential(ConvLayer(1, 16), ConvLayer(16, 32, stride=2), ConvLayer(32, 64, stride=2),
                         nn.AdaptiveAvgPool2d(1), Flatten(), nn.Linear(64, 10))

def digits_learner():
    return Learner(dls, digits_cnn(), loss_func=CrossEntropyLossFlat(), metrics=accuracy)

learn = digits_learner().to_fp16()
learn.model[0]  # a ConvLayer: it will run in fp16, its BatchNorm in FP32'''),
code('''results['vision'] = compare(digits_learner, 3, 1e-2, show='to_fp16')
results['vision']'''),
md("""The `to_fp16` learner's predictions on validation images (the model is FP32 again after the fit):"""),
code("learners['to_fp16'].show_results(max_n=8, nrows=1, figsize=(8, 1.8))"),
md("""## Text: an AWD-LSTM on generated reviews

Each review is two to four clauses such as "the plot was dull" or "this ending not bad": all the clauses of a review
agree, and a negated clause takes the opposite adjective, so the model has to read "not" before the adjective, not
just count words. 3% of the labels are flipped at random: about 97% is the best any model can do. fastai tokenizes
with `BaseTokenizer` (split on spaces) and builds the vocabulary; `text_classifier_learner` gets a small AWD-LSTM,
not pretrained."""),
det('''POS = 'good great excellent wonderful enjoyable brilliant superb fun moving charming'.split()
NEG = 'bad awful boring terrible dull poor weak tedious clumsy painful'.split()
NOUNS = 'movie film plot story acting cast script ending soundtrack direction'.split()
FILL = 'the a this that was is really quite very so and but it honestly overall'.split()

def review(rng):
    "A generated review and its label: 2 to 4 clauses that agree, a negated clause with the opposite adjective."
    label, words = rng.random() < .5, []
    for _ in range(rng.randint(2, 4)):
        neg = rng.random() < .3
        words += rng.sample(FILL, 2) + [rng.choice(NOUNS)] + ['not'] * neg + [rng.choice(POS if label != neg else NEG)]
    return ' '.join(words), 'positive' if label != (rng.random() < .03) else 'negative'  # 3% of the labels flipped

rng = random.Random(0)
reviews = pd.DataFrame([review(rng) for _ in range(1500)], columns=['text', 'label'])
reviews.head(4)'''),
det('''dls_text = TextDataLoaders.from_df(reviews, text_col='text', label_col='label', valid_pct=0.2, seed=42,
                                   tok_tfm=BaseTokenizer(), n_workers=0, bs=64, num_workers=0)
config = awd_lstm_clas_config.copy()
config.update(emb_sz=32, n_hid=64, n_layers=1)  # small: a CPU trains it in seconds
def text_learner():
    return text_classifier_learner(dls_text, AWD_LSTM, config=config, pretrained=False, drop_mult=0.3, metrics=accuracy)
print(f"vocabulary: {len(dls_text.vocab[0])} tokens, {len(dls_text.train_ds)} training reviews")'''),
code("dls_text.show_batch(max_n=3)"),
code('''results['text'] = compare(text_learner, 4, 1e-2)
results['text']'''),
md("""## Tabular: breast cancer with `tabular_learner`

scikit-learn's breast cancer data (569 tumours, 30 measurements) as a DataFrame, plus one categorical column (the
tumour's size class) to show an embedding; fastai's usual procs (`Categorify`, `FillMissing`, `Normalize`)."""),
det('''from sklearn.datasets import load_breast_cancer
bc = load_breast_cancer()
df = pd.DataFrame(bc.data, columns=bc.feature_names)
df['diagnosis'] = pd.Categorical.from_codes(bc.target, bc.target_names)
df['size'] = pd.qcut(df['mean radius'], 3, labels=['small', 'medium', 'large']).astype(str)
cont = [c for c in bc.feature_names if c != 'mean radius']
dls_tab = TabularDataLoaders.from_df(df, y_names='diagnosis', cat_names=['size'], cont_names=cont,
                                     procs=[Categorify, FillMissing, Normalize], y_block=CategoryBlock(),
                                     valid_idx=list(range(0, len(df), 4)), bs=32, num_workers=0)
def tab_learner(): return tabular_learner(dls_tab, layers=[64, 32], metrics=accuracy)
print(df.shape, {k: int(v) for k, v in df['diagnosis'].value_counts().items()})'''),
code("dls_tab.show_batch(max_n=3)"),
code('''results['tabular'] = compare(tab_learner, 5, 1e-2)
results['tabular']'''),
md("""## All three

The 16-bit modes end within noise of FP32 (a few validation items either way). `to_fp16` runs its first step at loss
scale 1 and sets the scale from that step's gradients, so it skips at most a step or two; `to_bf16` has FP32's range
and never scales."""),
code('''summary = pd.concat({k: v['accuracy %'] for k, v in results.items()}, axis=1)
ax = summary.T.plot.bar(figsize=(6, 2.8), rot=0, ylim=(0, 100), ylabel='validation accuracy %', width=.8)
ax.legend(loc='lower right', fontsize='small'); ax.set_title('FP32 vs to_bf16 vs to_fp16, same seed'); plt.show()
summary'''),
code('''for task, table in results.items():
    assert (table['accuracy %'] - table.loc['to_fp32', 'accuracy %']).abs().max() < 5, (task, table)
    assert table.loc['to_bf16', 'skipped steps'] == 0 and table.loc['to_fp16', 'skipped steps'] <= 2'''),
]

WHICH_MODE = [
md("""# Which mode do I pick?

| where you train | pick | why |
|---|---|---|
| NVIDIA GPU with bf16 (Ampere and later: A100, H100, RTX 30/40; `torch.cuda.is_bf16_supported()`) | `learn.to_bf16()`, or `learn.to_fp16()` | both run on the tensor cores. bf16 has FP32's range: no loss scale, no skipped steps, nothing to tune; fp16 keeps 3 more bits of precision and needs the dynamic loss scale |
| NVIDIA GPU without bf16 (Volta, Turing: V100, T4, RTX 20) | `learn.to_fp16()` | the tensor cores take fp16 only: FP32 masters plus loss scaling, the recipe of Micikevicius et al. (2018) |
| CPU with native bf16 (AVX512, AVX512-BF16, AMX; `fp16cb.dtypes.cpu_has_native(torch.bfloat16)`) | `learn.to_bf16()` | oneDNN computes bf16 matmuls natively: large matmuls get faster; tiny models gain little |
| CPU without native bf16 (AVX2) | FP32 (`learn.to_fp32()`) | 16-bit math is emulated, slower than FP32: use 16-bit only to save activation memory, or to test a GPU recipe |
| fp16 on a CPU | only with AVX512-FP16 or AMX-FP16 | otherwise emulated and very slow; fp16cb warns once and suggests `to_bf16()` |

Then two choices that do not change the numbers much, only where the time and memory go:

- **ours (`to_fp16`, `to_bf16`) or PyTorch's native AMP (`to_native_fp16`, `to_native_bf16`)**. Ours stores the model
  in 16-bit (BatchNorm in FP32) and steps FP32 master weights, as in fastai's original callbacks: weights and
  activations take half the memory, every op of the model runs in 16-bit, and after the fit the model holds the exact
  FP32 masters. Native AMP keeps the weights in FP32 and casts per op under `torch.autocast`: matmuls and
  convolutions in 16-bit, softmax, norms, reductions and losses in FP32 (the "always / maybe / never" op lists of the
  TF AMP slides, Wanderman-Milne and Luehr 2019), no masters needed. Pick native AMP for a model with numerically
  touchy ops inside (attention softmax, LayerNorm over wide rows, large reductions), or fastai's `GradientClip`; pick
  ours for memory, fastai's original API (`loss_scale`, `scale_wait`, `clip`, `flat_master`), and the loss scalers
  (including OpenSeq2Seq's log-normal one, [loss scalers](loss_scalers.ipynb)).
- **`flat_master=True`**: one FP32 master tensor per param group (per run of params with the same optimizer flags)
  instead of one per parameter, so the optimizer steps a few big tensors. It pays off when a model has many small
  parameter tensors (the step is bookkeeping-bound); with the element-wise optimizers (SGD, Adam, RAdam...) the
  results are the same. Keep the default with optimizers that compute statistics per tensor (fastai's `Lamb`, or
  LARS-style trust ratios): on a flat master they would see one tensor per group."""),
code('''%matplotlib inline
import time, warnings
import pandas as pd
import torch
from torch import nn
import fp16cb
from fp16cb.dtypes import cpu_has_native
from fastai.basics import *
import matplotlib.pyplot as plt
plt.rcParams['figure.dpi'] = 72
warnings.filterwarnings('ignore', message='.*(fp16|bf16) training on the CPU.*')  # measured below instead'''),
md("""## This machine

What torch sees (the output stored here is that of the machine the docs were last executed on):"""),
code('''gpu = torch.cuda.is_available()
print('CPU instructions:', torch.backends.cpu.get_cpu_capability())
print('native bf16 on the CPU:', cpu_has_native(torch.bfloat16), '| native fp16 on the CPU:', cpu_has_native(torch.float16))
print('GPU:', torch.cuda.get_device_name() if gpu else 'none', '| bf16 on the GPU:', gpu and torch.cuda.is_bf16_supported())'''),
md("""A rule of thumb in code, the table above:"""),
code('''def pick_mode(device=None) -> str:
    "The `Learner` method to call for mixed precision on `device` (default: the GPU if there is one, else the CPU)."
    device = torch.device(device or ('cuda' if torch.cuda.is_available() else 'cpu'))
    if device.type == 'cuda': return 'to_bf16' if torch.cuda.is_bf16_supported() else 'to_fp16'
    if device.type == 'cpu': return 'to_bf16' if cpu_has_native(torch.bfloat16) else 'to_fp32'
    return 'to_fp16'  # mps and others: fp16 is the common denominator
pick_mode()'''),
md("""## Measured: matmuls

The time of one square matmul in each dtype, on one thread. Where the 16-bit rows are far slower than FP32, torch
falls back to reference kernels: that dtype is emulated on this CPU."""),
code('''def matmul_ms(n, dtype, device='cpu', min_time=.2):
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    a @ b; k, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_time: a @ b; k += 1
    return 1e3 * (time.perf_counter() - t0) / k

torch.set_num_threads(1)
sizes = [128, 256, 512]
mm = pd.DataFrame({str(dt).replace('torch.', ''): [matmul_ms(n, dt) for n in sizes]
                   for dt in (torch.float32, torch.bfloat16, torch.float16)}, index=pd.Index(sizes, name='n'))
mm.round(3).assign(**{'bf16 speed-up': (mm['float32'] / mm['bfloat16']).round(2),
                      'fp16 speed-up': (mm['float32'] / mm['float16']).round(2)})'''),
md("""## Measured: training steps

An MLP (3 hidden layers of 512, batch 256) on random data, trained with fastai's `fit` in each mode: three rounds,
the modes taking turns (so that a busy machine slows all of them alike), 16 steps per fit; per mode the median time of
a step after the first two of each fit. The tiny models of the other notebooks spend their time in Python and in the
fastai loop, so 16-bit gains nothing there; a model this size shows what the hardware does. It has only 8 parameter
tensors, so flat masters have nothing to gain here: they pay off with hundreds of small tensors."""),
code('''class StepTimer(Callback):
    "The time of each training batch, from `before_batch` to `after_batch`."
    order = 99
    def before_fit(self): self.times = getattr(self, 'times', [])
    def before_batch(self): self.t0 = time.perf_counter()
    def after_batch(self):
        if self.training and self.iter >= 2: self.times.append(time.perf_counter() - self.t0)

x, y = torch.randn(256 * 16, 512), torch.randint(0, 10, (256 * 16,))
def mlp_learner():
    "The same data order and initial weights at every call."
    set_seed(0)
    dls = DataLoaders.from_dsets(list(zip(x, y)), list(zip(x[:256], y[:256])), bs=256, num_workers=0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512),
                          nn.ReLU(), nn.Linear(512, 10))
    return Learner(dls, model, loss_func=CrossEntropyLossFlat(), cbs=StepTimer())

setups = {'FP32': lambda l: l, 'to_bf16()': lambda l: l.to_bf16(), 'to_bf16(flat_master=True)': lambda l: l.to_bf16(flat_master=True),
          'to_native_bf16()': lambda l: l.to_native_bf16()}
if cpu_has_native(torch.float16): setups.update({'to_fp16()': lambda l: l.to_fp16(), 'to_native_fp16()': lambda l: l.to_native_fp16()})
learns = {name: setup(mlp_learner()) for name, setup in setups.items()}
for _ in range(3):
    for learn in learns.values():
        with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3)
steps = pd.DataFrame({'ms/step': {k: 1e3 * torch.tensor(l.step_timer.times).median().item() for k, l in learns.items()}}).round(2)
steps['speed-up vs FP32'] = (steps.loc['FP32', 'ms/step'] / steps['ms/step']).round(2)
steps'''),
code('''ax = steps['ms/step'].plot.barh(figsize=(6, 2.4), xlabel='ms per training step (median, lower is better)')
ax.invert_yaxis(); ax.set_title(f"MLP 512x3, batch 256, {torch.backends.cpu.get_cpu_capability()} CPU, 1 thread"); plt.show()'''),
md("""(`to_fp16()` is timed only where the CPU computes fp16 natively: elsewhere one step of this MLP takes seconds.)

## Flat masters give the same weights

With Adam (element-wise), flat and per-parameter masters step the same values:"""),
det('''def fit_weights(**kw):
    learn = mlp_learner().to_bf16(**kw)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3)
    return [p.detach().clone() for p in learn.model.parameters()]
same = all(torch.equal(a, b) for a, b in zip(fit_weights(), fit_weights(flat_master=True)))
print('identical weights after a fit, flat or not:', same)
assert same'''),
md("""## On a GPU

The same cells measure a GPU when `dls` and the model live on it (`DataLoaders(..., device='cuda')`). On a GPU both
16-bit dtypes run on the tensor cores, so the choice between them is about range and precision, not speed. The
benchmark of the package (`python -m fp16cb.bench --device cuda`) compares every mode with fastai's own callbacks."""),
]

TROUBLESHOOTING = [
md("""# Troubleshooting

| symptom | likely cause | what to do |
|---|---|---|
| a warning that 16-bit training on the CPU is slow | the CPU has no native fp16 (or bf16) math | `to_bf16()` where bf16 is native, else FP32 ([which mode](which_mode.ipynb)) |
| `LossScaleError`: every step skipped | inf/NaN in every forward pass: inputs beyond fp16's range (65504), NaN targets, a diverged model | normalize the inputs (fastai's `Normalize`), look for NaN in the data, lower the learning rate; or `to_bf16()`, which has FP32's range |
| a warning that the loss scale sits at its floor | the gradients barely fit in fp16 even unscaled: a loss with a large weight, or summed instead of averaged | average the loss, or let the scale go under 1 (`to_fp16(min_loss_scale=2**-8)`), or `to_bf16()` |
| `n_skipped` grows now and then, train loss shows `nan` | a batch with NaN in it | its step is skipped and BatchNorm's statistics restored, so training goes on; fix the data (`FillMissing`) |
| a warning that many steps are skipped | a dynamic scale that grows again too soon, NaN in some batches, or intermittent overflows in the forward pass | raise `scale_wait`, check the data (below), or `to_bf16()` |

Each case below is a few lines that trigger it on data shipped with scikit-learn, and the fix. The warnings are
caught and printed here; in your notebook they show as usual, once each."""),
code('''%matplotlib inline
import time, warnings
import fp16cb
from fp16cb import LossScaleError
from fp16cb.dtypes import cpu_has_native
from fastai.tabular.all import *
plt.rcParams['figure.dpi'] = 72
warnings.filterwarnings('ignore', message='The given NumPy array is not writable')  # pandas' read-only arrays

def caught(f):
    "Run `f()`; print the warnings it raised (their messages, without file and line)."
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        warnings.filterwarnings('ignore', message='The given NumPy array is not writable')
        res = f()
    for w in ws: print(f"{w.category.__name__}: {w.message}")
    if not ws: print('(no warning)')
    return res

def quiet_fit(learn, epochs=3, lr=1e-2):
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(epochs, lr)
    return learn'''),
md("""The data: scikit-learn's breast cancer measurements (569 tumours, 30 columns) in a DataFrame."""),
det('''from sklearn.datasets import load_breast_cancer
bc = load_breast_cancer()
base = pd.DataFrame(bc.data, columns=bc.feature_names)
base['diagnosis'] = pd.Categorical.from_codes(bc.target, bc.target_names)
def learner(df, cont, procs=(Categorify, FillMissing, Normalize)):
    set_seed(0, reproducible=True)
    dls = TabularDataLoaders.from_df(df, y_names='diagnosis', cont_names=cont, procs=list(procs), y_block=CategoryBlock(),
                                     valid_idx=list(range(1, len(df), 4)), bs=32, num_workers=0)
    return tabular_learner(dls, layers=[64, 32], metrics=accuracy)
print(base.shape)'''),
md("""## A slow CPU

The first fit of a process in a 16-bit dtype that this CPU computes without native instructions warns once: fp16
without AVX512-FP16/AMX-FP16, bf16 without AVX512/AVX512-BF16/AMX. The mode is correct, only slow (see the measured
tables of [which mode do I pick?](which_mode.ipynb); the tiny model here is too small to show it). Below: the
warnings this machine gives."""),
code('''for mode in ('to_fp32', 'to_bf16', 'to_fp16'):
    print(f"{mode}:", end=' ')
    caught(lambda: quiet_fit(getattr(learner(base, list(bc.feature_names)), mode)()))
print('native bf16:', cpu_has_native(torch.bfloat16), '| native fp16:', cpu_has_native(torch.float16))'''),
md("""What to do: on a CPU, `to_bf16()` where `cpu_has_native(torch.bfloat16)` is true, FP32 elsewhere; fp16 only on a
GPU (or a CPU with AVX512-FP16/AMX-FP16). Silence the warning once you know:
`warnings.filterwarnings('ignore', message='(fp16|bf16) training on the CPU')`."""),
code("warnings.filterwarnings('ignore', message='(fp16|bf16) training on the CPU')"),
md("""## Every step skipped: `LossScaleError`

A column in raw units, here the time of the scan in Unix seconds (about 1.7e9), with `Normalize` forgotten. fp16's
largest value is 65504: the input is `inf` as soon as it is cast, the loss is NaN at every step and every step is
skipped; no scale can fix that. fp16cb does not run on silently: after `max_skipped` (50) skipped steps in a row
training stops with a `LossScaleError`, and a fit that ends with every step skipped warns, naming the likely causes:"""),
det('''df = base.copy()
df['scanned_at'] = 1.7e9 + np.random.default_rng(0).integers(0, 30_000_000, len(df))  # Unix time, seconds
cont = list(bc.feature_names) + ['scanned_at']
learn = learner(df, cont, procs=[FillMissing]).to_fp16()
with warnings.catch_warnings(record=True) as said:  # shown here as text: a fit that skips every step warns
    warnings.simplefilter('always')
    try: quiet_fit(learn)
    except LossScaleError as e: print(e)
for w in said: print(f"{w.category.__name__}: {w.message}")
mp = learn.mixed_precision
print(f"{sum(mp.skips)} of {len(mp.skips)} steps skipped; model back in", next(learn.model.parameters()).dtype)'''),
code('fp16cb.plot_loss_scale(learn, title="every step overflows: nothing is learned"); plt.show()'),
md("""Find the culprit: the largest absolute value of each input column, against fp16's range. Then fix the data
(fastai's `Normalize` proc, the default of `TabularDataLoaders`), or train in bf16, which has FP32's range:"""),
det('''big = df[cont].abs().max()
print(big[big > 65504])'''),
code('''for name, learn in [('Normalize, to_fp16', learner(df, cont).to_fp16()),
                    ('no Normalize, to_bf16', learner(df, cont, procs=[FillMissing]).to_bf16())]:
    quiet_fit(learn)
    print(f"{name:22} accuracy {learn.recorder.values[-1][2]:.3f}, {learn.mixed_precision.n_skipped} steps skipped")'''),
md("""## The loss scale at its floor

A loss with a large weight (here cross-entropy x 2^17; a loss summed over many elements instead of averaged does the
same) has gradients that barely fit in fp16 even at scale 1: the dynamic scale comes down to its floor and stays
there. Training still works (Adam does not care about the loss's weight), but small gradients have no headroom left,
and the next bigger gradient would stop the fit. fp16cb warns at the end of the epoch:"""),
code('''class Weighted(nn.Module):
    "A loss times a constant weight."
    def __init__(self, loss, w): super().__init__(); self.loss, self.w = loss, w
    def forward(self, *args): return self.loss(*args) * self.w
    def activation(self, x): return self.loss.activation(x)
    def decodes(self, x): return self.loss.decodes(x)

def weighted_learner():
    learn = learner(base, list(bc.feature_names))
    learn.loss_func = Weighted(learn.loss_func, 2.**17)
    return learn
learn = caught(lambda: quiet_fit(weighted_learner().to_fp16()))
print('final loss scale', learn.mixed_precision.loss_scale, '| accuracy', round(learn.recorder.values[-1][2], 3))'''),
md("""What to do: average the loss, or divide its weight out (and scale the learning rate if the optimizer is SGD).
If the weight must stay, let the scale go under 1 when a bigger gradient comes (`min_loss_scale`), instead of stopping
there; or use bf16, which needs no scale:"""),
code('''for name, learn in [('to_fp16(min_loss_scale=2**-8)', weighted_learner().to_fp16(min_loss_scale=2.**-8)),
                    ('to_bf16()', weighted_learner().to_bf16())]:
    caught(lambda: quiet_fit(learn))
    print(f"  {name}: final loss scale {learn.mixed_precision.loss_scale:g}, accuracy {learn.recorder.values[-1][2]:.3f}")'''),
md("""## NaN in the data

Three tumours have no `mean texture` and the procs lack `FillMissing`. In plain FP32 the first NaN batch turns every
weight into NaN for good. With `to_fp16` or `to_bf16` each such step is skipped (the FP32 masters, the optimizer state
and BatchNorm's running statistics are left as they were) and training goes on; the epoch's train loss, an average
over the batches, shows `nan`, and `n_skipped` counts the steps:"""),
code('''df = base.copy()
df.loc[[10, 200, 400], 'mean texture'] = np.nan
rows = {}
for mode in ('to_fp32', 'to_fp16', 'to_bf16'):
    print(f"{mode}:", end=' ')
    learn = caught(lambda: quiet_fit(getattr(learner(df, list(bc.feature_names), procs=[Normalize]), mode)()))
    mp = getattr(learn, 'mixed_precision', None)
    rows[mode] = {'train loss': learn.recorder.values[-1][0], 'accuracy': learn.recorder.values[-1][2],
                  'weights finite': all(torch.isfinite(p).all().item() for p in learn.model.parameters()),
                  'skipped steps': mp.n_skipped if mp else None}
pd.DataFrame(rows).T'''),
md("""Which steps were skipped, and which rows hold the NaNs: then fill them (fastai's `FillMissing` proc, which also
adds a `mean texture_na` column) or drop them."""),
code('''print('steps skipped:', [i for i, s in enumerate(learn.mixed_precision.skips) if s])
print('rows with NaN:', df.index[df[list(bc.feature_names)].isna().any(axis=1)].tolist())
learn = quiet_fit(learner(df, list(bc.feature_names)).to_bf16())  # Categorify, FillMissing, Normalize
print(f"with FillMissing: {learn.mixed_precision.n_skipped} steps skipped, accuracy {learn.recorder.values[-1][2]:.3f}")'''),
md("""## More help

- [diagnostics](diagnostics.ipynb): `plot_loss_scale(learn)` after any fit; `gradient_report(learn)` shows where the
  gradients sit against fp16's range and suggests a loss scale.
- [loss scalers](loss_scalers.ipynb): the log-normal scaler of OpenSeq2Seq's mixed-precision guide picks a scale from
  the gradient statistics instead of probing with overflows.
- [workflow](workflow.ipynb): interrupted fits, `lr_find`, gradient accumulation and clipping."""),
]

GENERATED = {'index': INDEX, 'conversion_and_masters': CONVERSION, 'callbacks': CALLBACKS, 'diagnostics': DIAGNOSTICS,
             'experiments': EXPERIMENTS, 'examples': EXAMPLES, 'which_mode': WHICH_MODE,
             'troubleshooting': TROUBLESHOOTING}

def main(argv):
    if 'precision_policy' not in GENERATED:  # its cells live in their own script (they import these helpers)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        GENERATED['precision_policy'] = __import__('make_precision_nb').CELLS
    flags = {a for a in argv if a.startswith('--')}
    names = [a.removesuffix('.ipynb') for a in argv if not a.startswith('--')]
    if flags - {'--clean', '--no-exec'}: sys.exit(__doc__)
    paths = sorted({*(NBS/f'{n}.ipynb' for n in GENERATED), *NBS.glob('*.ipynb')})
    if names:
        unknown = [n for n in names if NBS/f'{n}.ipynb' not in paths]
        if unknown: sys.exit(f"unknown notebook(s): {', '.join(unknown)}")
        paths = [NBS/f'{n}.ipynb' for n in names]
    NBS.mkdir(exist_ok=True)
    for path in paths:
        if '--clean' in flags:
            nbformat.write(clean(nbformat.read(path, as_version=4)), path); continue
        nb = new_nb(path.name, GENERATED[path.stem]) if path.stem in GENERATED else clean(nbformat.read(path, as_version=4))
        if '--no-exec' not in flags:
            print(f"executing {path.name}", flush=True)
            execute(nb)
        nbformat.write(tidy(nb), path)

if __name__ == '__main__': main(sys.argv[1:])
