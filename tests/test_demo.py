"The main job `python -m fp16cb`: its argument errors, a tiny run, and the failure modes it demonstrates."
import os, subprocess, sys
from pathlib import Path
import pytest
import torch
from fp16cb.demos.cli import parse_args, main, format_table
from fp16cb import ModelToHalf
from fp16cb.dtypes import has_fast_half_math
from fp16cb.demos.experiments import run_mode, MODES, HalfLossScale, make_learner, train
from conftest import DEVICE

REPO = Path(__file__).resolve().parents[1]

@pytest.mark.parametrize('argv, msg', [
    (['--modes', 'fp32,fp8'], "unknown mode(s) 'fp8'"),
    (['--device', 'meta'], "unsupported device type"),
    (['--device', 'tpu'], "not a torch device: 'tpu' (expected cpu, cuda, cuda:N or mps)"),
    (['--device', 'not a device'], "not a torch device"),
    (['--epochs', '0'], "expected an integer >= 1"),
    (['--seeds', '1,x'], "seeds must be integers"),
    (['--seed', '1', '--seeds', '2,3'], "not allowed with argument"),
])
def test_bad_arguments_exit_2(argv, msg, capsys):
    with pytest.raises(SystemExit) as e: parse_args(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err

@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as e: parse_args(['--device', 'cuda'])
    assert e.value.code == 2 and "CUDA is not available" in capsys.readouterr().err

def test_defaults_and_seeds():
    a = parse_args([])
    assert a.modes == ['fp32', 'to_fp16', 'to_bf16', 'native'] and a.seeds == [0] and a.device == torch.device('cpu')
    assert parse_args(['--experiments']).seeds == [0, 1, 2]
    assert parse_args(['--seed', '5']).seeds == [5]
    assert parse_args(['--seeds', '3,4', '--modes', 'to_bf16']).seeds == [3, 4]

def test_module_entry_point_reports_bad_mode():
    env = {**os.environ, 'PYTHONPATH': f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, '-m', 'fp16cb', '--modes', 'bogus'], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=120)
    assert r.returncode == 2 and "unknown mode(s) 'bogus'" in r.stderr and 'fp32' in r.stderr

def test_tiny_run_prints_the_table_and_plots(tmp_path, capsys):
    out = tmp_path/'runs.png'
    assert main(['--modes', 'fp32,to_fp16,to_bf16', '--epochs', '1', '--plot', str(out), '--device', str(DEVICE)]) == 0
    text = capsys.readouterr().out
    lines = {l.split()[0]: l.split() for l in text.splitlines() if l.split() and l.split()[0] in MODES}
    assert {'fp32', 'to_fp16', 'to_bf16'} <= set(lines)
    for m in ('fp32', 'to_fp16', 'to_bf16'): assert 50 < float(lines[m][1]) <= 100  # 1 epoch learns the digits
    assert lines['to_fp16'][3].startswith('2^') and int(lines['to_fp16'][4]) <= 2  # the first step picked the scale
    assert lines['fp32'][3] == '-' and lines['to_bf16'][3] == '1'
    assert out.exists() and out.stat().st_size > 10_000
    slow = [n for n, dt in (('fp16', torch.float16), ('bf16', torch.bfloat16)) if not has_fast_half_math(dt, DEVICE)]
    notes = [l for l in text.splitlines() if l.startswith('note:')]
    assert (notes == []) if not slow else (len(notes) == 1 and ' or '.join(slow) in notes[0])  # AVX2 CPU: both; GPU: none

def test_vanishing_updates_without_masters():
    "Weights near 24 (fp16 spacing 2^-6) and Adam steps of about 5e-3: pure fp16 cannot move them, FP32 masters do."
    pure = run_mode('fp16', 0, 'vanishing', DEVICE, epochs=1)
    mixed = run_mode('to_fp16', 0, 'vanishing', DEVICE, epochs=1)
    assert pure.weights_moved < .05 and mixed.weights_moved > .95
    assert mixed.accuracy > .7 and pure.accuracy < .3

def test_underflow_without_loss_scaling():
    "A loss x 2^-20: at scale 1 every fp16 gradient underflows to 0 and nothing moves; dynamic scaling trains."
    flat = run_mode('to_fp16_unscaled', 0, 'underflow', DEVICE, epochs=1)
    scaled = run_mode('to_fp16', 0, 'underflow', DEVICE, epochs=1)
    assert flat.weights_moved == 0 and flat.loss_scale == 1
    assert scaled.accuracy > .8

def test_unchecked_overflow_poisons_the_weights():
    learn = make_learner('digits', 'fp16_unchecked', 0, DEVICE)
    run = train(learn, epochs=1)
    assert any(not torch.isfinite(p).all() for p in learn.model.parameters())
    assert run.accuracy < .2 and run.skipped == 0 and not run.finite
    checked = make_learner('digits', lambda l: l.add_cbs([ModelToHalf(), HalfLossScale(2.**24)]), 0, DEVICE)
    run = train(checked, epochs=1)
    assert all(torch.isfinite(p).all() for p in checked.model.parameters()) and run.skipped == len(run.skips)
    assert run.finite

def test_format_table_handles_stopped_runs():
    from fp16cb.demos.experiments import Run
    t = format_table([('a', [Run('a', 0, float('nan'), 1., 2.**20, 3)]), ('b', [Run('b', 0, .5, 1., None, 0)] * 2)])
    assert 'stopped' in t and '2^20' in t and '50.00 ± 0.00' in t
