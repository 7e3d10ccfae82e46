"""Issue 12: the first dynamic scale, an explicit `loss_scale`, export without fp16cb, fastai's names and arguments,
the slow-fp16 warning, the Recorder columns."""
import math
import pytest
import torch
from fastai.basics import Callback
from fp16cb.scalers import BackoffScaler, FP16_MAX
from fp16cb.experiments import make_learner as digits_learner, train
from conftest import make_learner, quiet_fit, count_host_reads

# ---- 1. the first dynamic scale comes from the first step's gradients -------------------------------------------
def test_calibrated_scale_is_the_largest_power_of_2_under_the_headroom():
    s = BackoffScaler(1., calibrate=True, headroom=16.)
    assert s.scale == 1. and not s.calibrated and s.needs_max_grad
    s.update(False, 0.3)  # the first finite step: counted as a step, not a skip
    assert s.scale == 2.**math.floor(math.log2(FP16_MAX / (16 * 0.3))) == 2.**13
    assert s.calibrated and not s.needs_max_grad and s.n_skipped == 0 and s.n_steps == 1
    assert BackoffScaler(1., calibrate=True, max_scale=2.**10).calibrated_scale(1e-9) == 2.**10  # the ceiling holds
    assert BackoffScaler(1., calibrate=True).calibrated_scale(1e4) == 1.  # the floor holds
    assert BackoffScaler(1., calibrate=True).calibrated_scale(0.) == 2.**24  # no gradient seen: seed 001's start

def test_calibration_survives_overflow_and_checkpoints():
    s = BackoffScaler(1., calibrate=True)
    s.update(True, float('nan'))  # a NaN first batch is skipped (no error at the floor), the next one calibrates
    assert not s.calibrated and s.scale == 1. and s.n_skipped == 1
    s.update(False, 1.)
    t = BackoffScaler(1., calibrate=True); t.load_state_dict(s.state_dict())
    assert t.calibrated and t.scale == s.scale == 2.**11

def test_default_to_fp16_skips_at_most_two_steps_at_the_start():
    "Before: the scale started at 2^24 and the first ~7 steps of this 1-epoch digits fit were skipped."
    run = train(digits_learner('digits', 'to_fp16', seed=0), epochs=1)
    assert sum(run.skips) <= 2 and run.scales[0] == 1. and run.scales[1] > 2.**8 and run.accuracy > .5

def test_calibration_keeps_one_host_read_per_step_and_the_first_step(monkeypatch):
    from fp16cb import MixedPrecision
    calls = count_host_reads(monkeypatch, MixedPrecision)
    learn = make_learner().to_fp16()
    w0 = learn.model[3].weight.detach().clone()
    quiet_fit(learn, 1, lr=1e-2, cbs=_StopAfter(1))
    monkeypatch.undo()
    mp = learn.mixed_precision
    assert mp.skips == [False] and mp.scaler.calibrated and len(calls) == 1
    assert not torch.equal(w0, learn.model[3].weight)  # the calibrating step was applied

class _StopAfter(Callback):
    order = 30
    def __init__(self, n): self.n = n
    def after_step(self):
        self.n -= 1
        if self.n == 0: raise __import__('fastai').callback.core.CancelFitException()

class _InfAt(Callback):
    "An inf in the head's grad at the optimizer steps numbered in `steps`."
    order = 5
    def __init__(self, steps): self.steps, self.n = set(steps), 0
    def after_backward(self):
        if self.n in self.steps: self.learn.model[3].weight.grad[0, 0] = float('inf')
        self.n += 1

def test_overflow_later_in_the_run_still_backs_off_and_grows():
    learn = make_learner(n_train=160).to_fp16(scale_wait=3)
    quiet_fit(learn, 1, lr=1e-3, cbs=_InfAt([4]))
    sc, sk = learn.mixed_precision.scales, learn.mixed_precision.skips
    assert sk == [False]*4 + [True] + [False]*5 and sc[0] == 1.
    assert sc[5] == sc[4] / 2 and sc[8] == sc[4]  # halved on the overflow, grown back after 3 clean steps

# ---- 2. an explicit loss_scale is the dynamic scale's start -------------------------------------------------------
def test_explicit_loss_scale_starts_the_dynamic_scale():
    learn = make_learner().to_fp16(loss_scale=1024)
    quiet_fit(learn, 1, lr=1e-2)
    mp = learn.mixed_precision
    assert mp.scales[0] == 1024. and mp.scaler.calibrated

# ---- 9. Recorder columns: with a dynamic scale only, printed but kept out of the recorded metrics -----------------
class _Printed(Callback):
    "What fastai prints for each epoch: the Recorder's names and the logged row (`learn.logger`)."
    order = 70
    def before_fit(self): self.names, self.rows, self.learn.logger = [], [], lambda row: self.rows.append(list(row))
    def after_epoch(self): self.names.append(list(self.recorder.metric_names))

@pytest.mark.parametrize('setup,shown', [(lambda l: l.to_fp16(), True), (lambda l: l.to_bf16(), False),
                                          (lambda l: l.to_fp16(dynamic=False, loss_scale=64.), False)])
def test_precision_columns_only_with_a_dynamic_scale(setup, shown):
    from fastai.metrics import mae
    learn = setup(make_learner(metrics=mae))
    p = _Printed()
    with learn.no_bar(): learn.fit(2, 1e-2, cbs=p)
    assert (p.names[-1][-3:-1] == ['loss_scale', 'n_skipped']) == shown  # the table printed during the fit
    assert all(len(r) == len(p.names[-1]) for r in p.rows)
    # what plots the metrics (e.g. the widespread `Recorder.plot_metrics` recipe) sees the user's columns only
    rec = learn.recorder
    assert list(rec.metric_names) == ['epoch', 'train_loss', 'valid_loss', 'mae', 'time']
    assert all(len(v) == 3 for v in rec.values) and learn.final_record is rec.values[-1]

# ---- 6. the slow-fp16 warning: how much slower, what to use, at the user's line ----------------------------------
@pytest.mark.parametrize('how', ['fit_one_cycle', 'fit'])
def test_slow_fp16_warning_says_how_much_and_points_at_the_users_line(reset_warned, monkeypatch, how):
    import warnings
    import fp16cb.dtypes
    monkeypatch.setattr(fp16cb.dtypes, 'cpu_has_native', {torch.float16: False, torch.bfloat16: True}.get)
    learn = make_learner().to_fp16()
    with warnings.catch_warnings(record=True) as w, learn.no_bar(), learn.no_logging():
        warnings.simplefilter('always')
        getattr(learn, how)(1, 1e-2)  # the user's line: fastai's fit -> its callbacks -> fp16cb
    ours = [o for o in w if 'fp16 training on the CPU' in str(o.message)]
    assert len(ours) == 1 and ours[0].filename == __file__, [(o.filename, o.lineno) for o in ours]
    msg = str(ours[0].message)
    assert '1.5x (a tabular model) to 14x (an LSTM, a resnet18) slower than FP32' in msg
    assert 'Use `learn.to_bf16()` instead: bf16 is native' in msg

# ---- 4. fastai's MixedPrecision and ours: each refuses the other's arguments, naming the right class -----------------
def test_fastai_mixed_precision_refuses_our_arguments_naming_ours():
    import fastai.callback.fp16 as fastai_fp16
    with pytest.raises(TypeError, match=r"from fp16cb import MixedPrecision, ModelToHalf"):
        fastai_fp16.MixedPrecision(loss_scale=512, flat_master=True)  # the README's line under fastai's star import
    with pytest.raises(TypeError, match="GradScaler's arguments"): fastai_fp16.MixedPrecision(growth=2.)
    assert fastai_fp16.MixedPrecision(amp_mode='fp16', init_scale=8.).kwargs == {'init_scale': 8.}  # fastai's own use

def test_our_callbacks_refuse_fastais_arguments_naming_theirs():
    from fp16cb import MixedPrecision, NativeMixedPrecision
    with pytest.raises(TypeError, match=r"NativeMixedPrecision\(init_scale=...\)"): MixedPrecision(init_scale=2.**16)
    with pytest.raises(TypeError, match="fastai.callback.fp16"): MixedPrecision(amp_mode='bf16')
    with pytest.raises(TypeError, match="to_native_bf16"): NativeMixedPrecision(amp_mode='bf16')

def test_readme_quick_start_imports_give_our_classes():
    import re, pathlib, fp16cb
    readme = (pathlib.Path(__file__).parents[1]/'README.md').read_text()
    quick = readme[readme.index('## Quick start'):readme.index('## API')]
    ns = {}
    exec('\n'.join(l for l in re.findall(r'^(from .*import .*|import .*)$', quick, re.M)), ns)
    assert ns['MixedPrecision'] is fp16cb.MixedPrecision and ns['ModelToHalf'] is fp16cb.ModelToHalf

# ---- 5. fastai 2.8's to_fp16 arguments, to_non_native_fp16, unknown keywords ----------------------------------------
@pytest.mark.parametrize('kw', ['init_scale', 'growth_factor', 'backoff_factor', 'growth_interval', 'enabled', 'amp_mode'])
def test_to_fp16_with_fastais_amp_arguments_points_to_native(kw):
    learn = make_learner()
    with pytest.raises(TypeError, match=r"`learn.to_fp16\(\)` got '" + kw + r"'.*learn.to_native_fp16\("):
        learn.to_fp16(**{kw: 2})
    assert learn.precision_callbacks() == []

def test_unknown_keyword_names_the_method_and_the_valid_ones():
    learn = make_learner()
    with pytest.raises(TypeError, match=r"`learn.to_fp16\(\)` got .*'loss_scael' \(did you mean 'loss_scale'\?\); it takes: loss_scale, flat_master"):
        learn.to_fp16(loss_scael=3)
    with pytest.raises(TypeError, match=r"`learn.to_bf16\(\)` got"): learn.to_bf16(bogus=1)
    with pytest.raises(TypeError, match=r"`learn.to_native_fp16\(\)` got 'loss_scale': .*`learn.to_fp16\(\)`"):
        learn.to_native_fp16(loss_scale=8)

def test_fastais_to_non_native_fp16_replaces_ours():
    import fastai.callback.fp16 as fastai_fp16
    learn = make_learner().to_fp16()
    learn.to_non_native_fp16()
    assert sorted(type(cb).__module__ for cb in learn.precision_callbacks()) == ['fastai.callback.fp16']*2
    learn.to_fp16()
    assert not any(isinstance(cb, fastai_fp16.NonNativeMixedPrecision) for cb in learn.cbs)

def test_to_channelslast_keeps_our_precision():
    learn = make_learner().to_native_fp16()
    learn.to_channelslast()
    assert [type(cb).__name__ for cb in learn.precision_callbacks()] == ['NativeMixedPrecision']

# ---- 3. an exported learner loads with fastai alone, as the FP32 learner -------------------------------------------
_LOAD_WITHOUT_FP16CB = r"""
import sys, torch
class Refuse:
    "fp16cb is not installed here."
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'fp16cb': raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Refuse())
from fastai.learner import load_learner
learn = load_learner(sys.argv[1])
assert not any(m.startswith('fp16cb') for m in sys.modules)
learn.model.eval()
torch.save(learn.model(torch.load(sys.argv[2])).detach(), sys.argv[3])
print(sorted(type(cb).__name__ for cb in learn.cbs))
"""

@pytest.mark.parametrize('setup', ['to_fp16', 'to_bf16', 'to_native_fp16'])
def test_exported_learner_loads_with_fastai_alone(setup, tmp_path):
    import subprocess, sys
    from fastai.basics import Datasets, DataLoaders, ItemGetter, Learner, MSELossFlat
    from conftest import synth_data, tiny_model
    dsets = [Datasets(synth_data(n, seed=s), tfms=[[ItemGetter(0)], [ItemGetter(1)]]) for n, s in ((64, 1), (32, 2))]
    learn = Learner(DataLoaders.from_dsets(*dsets, bs=16), tiny_model(), loss_func=MSELossFlat(), path=tmp_path)
    learn = getattr(learn, setup)()
    quiet_fit(learn, 1, lr=1e-2)
    cbs = list(learn.cbs)
    learn.export('exp.pkl')
    assert list(learn.cbs) == cbs and learn.precision_callbacks()  # the learner itself keeps its precision
    x = torch.randn(5, 4)
    torch.save(x, tmp_path/'x.pt')
    r = subprocess.run([sys.executable, '-c', _LOAD_WITHOUT_FP16CB, str(tmp_path/'exp.pkl'), str(tmp_path/'x.pt'),
                        str(tmp_path/'y.pt')], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'MixedPrecision' not in r.stdout and 'ModelToHalf' not in r.stdout  # no precision callback: FP32 inference
    learn.model.eval()
    assert torch.equal(torch.load(tmp_path/'y.pt'), learn.model(x).detach())  # the FP32 model's predictions, exactly
    quiet_fit(learn, 1, lr=1e-2)  # and the exporting learner trains on in its precision
