"""The seed-to-seed spread behind the accuracy tests' margins (`tests/test_state16.py`, `tests/test_state8.py`): the
digits CNN of `fp16cb.demos.experiments` (fastai's Adam, one-cycle, 3 epochs), trained from seeds 0 to N-1 in FP32 and
in every 16-bit mode those tests train, on this CPU's kernels. Reported per mode: the validation loss relative to
FP32's from the same seed (its mean, lowest and highest over the seeds) and the accuracy difference in images of the
600 held out.

    python -m bench.margins --seeds 6 --json bench/results_margins_avx512bf16.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-avx2 \\
        python -m bench.margins --seeds 6 --json bench/results_margins_avx2.json

The second line runs torch's and oneDNN's AVX2 kernels on a CPU that has AVX512-BF16: what a CPU with AVX2 only runs
(bf16 matmuls emulated), the other kind of machine the suite must pass on. Its compiled kernels (the 8-bit state's)
go to a cache of their own: loaded by a process with the CPU's own kernels, they corrupted its memory (`malloc():
unaligned tcache chunk detected`). The tests' margins are chosen from both runs.
"""
from __future__ import annotations
import argparse, json, os, statistics, time, warnings
import torch

from fp16cb.dtypes import cpu_flags, cpu_has_native
from fp16cb.demos.experiments import make_learner, train

BF16 = torch.bfloat16
MODES = {  # the modes of the two accuracy tests, by the names they use
    'bf16 storage': lambda l: l.to_bf16(half_storage=True),
    'bf16 state': lambda l: l.to_bf16(state_dtype=BF16),
    'bf16 storage + state': lambda l: l.to_bf16(half_storage=True, state_dtype=BF16),
    'fp16 storage + state': lambda l: l.to_fp16(half_storage=True, state_dtype='bf16'),
    '8bit state': lambda l: l.to_bf16(state_dtype='8bit'),
    'bf16 storage + 8bit state': lambda l: l.to_bf16(half_storage=True, state_dtype='8bit'),
}

def run_one(mode, seed:int) -> tuple:
    "(validation loss, correct images of the held-out set) after the tests' 3 epochs."
    learn = make_learner('digits', mode, seed)
    run = train(learn, epochs=3)
    return float(learn.recorder.values[-1][1]), round(run.accuracy * len(learn.dls.valid_ds))

def measure(seeds:int, modes=tuple(MODES)) -> dict:
    from fp16cb.storage import state8
    state8.MIN_NUMEL = 1  # as tests/test_state8.py: every moving average of the CNN 8-bit
    res = {}
    for seed in range(seeds):
        loss32, acc32 = run_one(lambda l: l, seed)
        for name in modes:
            loss, acc = run_one(MODES[name], seed)
            res.setdefault(name, []).append({'seed': seed, 'rel_loss': loss / loss32 - 1, 'acc_diff': acc - acc32})
        print(f"seed {seed}: " + ', '.join(f"{n} {v[-1]['rel_loss']:+.2%} ({v[-1]['acc_diff']:+d})"
                                            for n, v in res.items()), flush=True)
    return res

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--seeds', type=int, default=6)
    ap.add_argument('--json', default=None, help='write the results here')
    a = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter('ignore')
    t0 = time.time()
    res = measure(a.seeds)
    kernels = {'ATEN_CPU_CAPABILITY': os.environ.get('ATEN_CPU_CAPABILITY'),
               'ONEDNN_MAX_CPU_ISA': os.environ.get('ONEDNN_MAX_CPU_ISA')}
    print(f"CPU: {cpu_flags()}; torch kernels {torch.backends.cpu.get_cpu_capability()}, native bf16 "
          f"{cpu_has_native(BF16)} ({kernels}); {a.seeds} seeds, {time.time() - t0:.0f} s")
    print(f"{'mode':28} {'loss vs FP32: mean':>18} {'min':>8} {'max':>8} {'images: min':>12} {'max':>5}")
    for name, rows in res.items():
        rel, acc = [r['rel_loss'] for r in rows], [r['acc_diff'] for r in rows]
        print(f"{name:28} {statistics.mean(rel):>+18.2%} {min(rel):>+8.2%} {max(rel):>+8.2%} {min(acc):>12d} "
              f"{max(acc):>5d}")
    if a.json:
        meta = {'date': time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), 'cpu_flags': cpu_flags(),
                'kernels': torch.backends.cpu.get_cpu_capability(), 'env': kernels, 'torch': torch.__version__,
                'native_bf16': cpu_has_native(BF16), 'seeds': a.seeds}
        with open(a.json, 'w') as f: json.dump({'meta': meta, 'modes': res}, f, indent=1)

if __name__ == '__main__': main()
