"""`python -m fp16cb` (or `fp16cb`): train a tiny CNN on scikit-learn's digits in several precisions and compare them;
`--experiments` reproduces seed 002's table and seed 001's three failure modes at small scale."""
from __future__ import annotations
import argparse, math, sys, time, warnings
import torch

from .dtypes import has_fast_half_math
from .devices import resolve_device
from .experiments import MODES, DEFAULT_MODES, TOLERANCE, run_many, run_experiments, mean_acc

__all__ = ['parse_args', 'format_table', 'format_experiments', 'main']

def _device(s:str) -> torch.device:
    try: return resolve_device(s)
    except ValueError as e: raise argparse.ArgumentTypeError(str(e))

def _modes(s:str) -> list:
    modes = [m.strip() for m in s.split(',') if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {', '.join(map(repr, bad)) or repr(s)}: "
                                         f"choose from {', '.join(MODES)}")
    return modes

def _seeds(s:str) -> list:
    try: seeds = [int(o) for o in s.split(',') if o.strip()]
    except ValueError: raise argparse.ArgumentTypeError(f"seeds must be integers separated by commas, got {s!r}")
    if not seeds: raise argparse.ArgumentTypeError("no seed given")
    return seeds

def _positive_int(s:str) -> int:
    try: v = int(s)
    except ValueError: v = 0
    if v < 1: raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {s!r}")
    return v

def parse_args(argv=None) -> argparse.Namespace:
    "The command line of the main job; bad values exit with status 2 and a message that says what is wrong."
    p = argparse.ArgumentParser(prog='python -m fp16cb', description=__doc__.split(';')[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--modes', type=_modes, default=list(DEFAULT_MODES),
                   help=f"comma-separated precision modes: {', '.join(MODES)}")
    p.add_argument('--epochs', type=_positive_int, default=None, help="epochs per run (default: each task's own, 8)")
    p.add_argument('--device', type=_device, default=torch.device('cpu'), help="cpu, cuda, cuda:1, mps")
    g = p.add_mutually_exclusive_group()
    g.add_argument('--seed', type=int, default=None, help="one seed (data order and initial weights)")
    g.add_argument('--seeds', type=_seeds, default=None, help="comma-separated seeds; accuracies are averaged")
    p.add_argument('--experiments', action='store_true',
                   help="seed 002's table and seed 001's three failure modes, 3 seeds (a few minutes on 2 cores)")
    p.add_argument('--plot', default=None, metavar='OUT.png', help="save a figure of the runs there")
    p.add_argument('--threads', type=_positive_int, default=1,
                   help="CPU threads for torch (tiny models run fastest on one)")
    args = p.parse_args(argv)
    args.seeds = args.seeds or ([args.seed] if args.seed is not None else ([0, 1, 2] if args.experiments else [0]))
    if args.experiments and len(args.seeds) < 2:
        print("note: --experiments averages over seeds; with one seed the 0.5-point check is noisy", file=sys.stderr)
    return args

def _acc(runs) -> str:
    if any(math.isnan(r.accuracy) for r in runs): return 'stopped'
    accs = [100 * r.accuracy for r in runs]
    m = sum(accs) / len(accs)
    if len(accs) == 1: return f"{m:.2f}"
    sd = (sum((a - m)**2 for a in accs) / (len(accs) - 1))**.5
    return f"{m:.2f} ± {sd:.2f}"

def _scale(runs) -> str:
    s = runs[-1].loss_scale
    if s is None: return '-'
    e = math.log2(s) if s > 0 else 0
    return f"2^{e:g}" if e == int(e) and abs(e) >= 4 else f"{s:g}"

def format_table(rows:list, extra:dict|None=None) -> str:
    "A text table from `[(label, runs)]`: accuracy (mean ± sd over seeds), s/epoch, final loss scale, skipped steps."
    head = ['mode', 'accuracy %', 's/epoch', 'final scale', 'skipped'] + list(extra or {})
    body = []
    for label, runs in rows:
        line = [label, _acc(runs), f"{sum(r.secs_per_epoch for r in runs) / len(runs):.2f}", _scale(runs),
                f"{sum(r.skipped for r in runs) / len(runs):g}"]
        body.append(line + [f(runs) for f in (extra or {}).values()])
    widths = [max(len(str(r[i])) for r in [head] + body) for i in range(len(head))]
    fmt = lambda r: '  '.join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return '\n'.join([fmt(head), '  '.join('-' * w for w in widths)] + [fmt(r) for r in body])

_EXTRA = {
    'digits': {},
    'vanishing': {'weights moved': lambda runs: f"{100 * sum(r.weights_moved for r in runs) / len(runs):.1f}%"},
    'underflow': {'weights moved': lambda runs: f"{100 * sum(r.weights_moved for r in runs) / len(runs):.1f}%"},
}

def _finite_col(runs): return 'yes' if all(r.finite for r in runs) else 'NO: inf/NaN'

def format_experiments(res:list) -> tuple:
    "Text for the result of `run_experiments`, and whether every recipe run is within `TOLERANCE` points of FP32."
    from .experiments import TASKS
    out, ok = [], True
    for title, task, rows in res:
        out += ['', f"== {title} ==", f"task: {task}: {TASKS[task].note}"]
        extra = dict(_EXTRA.get(task, {}))
        if title.startswith('Failure 3'): extra = {'weights finite': _finite_col}
        out.append(format_table([(label, runs) for label, _, runs in rows], extra))
        base = next(mean_acc(runs) for _, role, runs in rows if role == 'fp32')
        for label, role, runs in rows:
            d = mean_acc(runs) - base
            if role == 'recipe':
                good = abs(d) <= TOLERANCE if not math.isnan(d) else False
                ok &= good
                out.append(f"  {label}: {d:+.2f} points vs FP32 over {len(runs)} seed(s): "
                           f"{'within' if good else 'NOT within'} {TOLERANCE} points")
            elif role == 'breaks':
                out.append(f"  {label}: {d:+.2f} points vs FP32 (the failure)")
    return '\n'.join(out), ok

def _plot_default(path, rows):
    import matplotlib; matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from .diagnostics import plot_loss_scale
    scaled = [(label, runs[0]) for label, runs in rows if runs[0].scales and runs[0].loss_scale not in (None, 1.)]
    fig, axs = plt.subplots(1, 1 + len(scaled), figsize=(5 * (1 + len(scaled)), 3.5), squeeze=False)
    ax = axs[0, 0]
    for label, runs in rows: ax.plot(range(1, len(runs[0].valid_acc) + 1), runs[0].valid_acc, marker='o', label=label)
    ax.set_xlabel('epoch'); ax.set_ylabel('validation accuracy'); ax.legend(); ax.set_title('digits, tiny CNN')
    for ax, (label, run) in zip(axs[0, 1:], scaled): plot_loss_scale(run, ax=ax, title=f"{label}: loss scale")
    fig.tight_layout(); fig.savefig(path, dpi=100); plt.close(fig)

def _plot_experiments(path, res, device):
    import matplotlib; matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from .diagnostics import plot_loss_scale, plot_gradient_range, gradient_report
    from .experiments import make_learner
    fig, axs = plt.subplots(2, 2, figsize=(13, 8))
    (_, _, table), (_, _, van), (_, _, und), (_, _, ovf) = res[:4]  # the rest: `experiments_precision`'s rows
    ax = axs[0, 0]
    ax.barh([l for l, _, _ in table][::-1], [mean_acc(r) for _, _, r in table][::-1])
    ax.set_xlim(min(mean_acc(r) for _, _, r in table) - 2, 100); ax.set_xlabel('accuracy % (mean of seeds)')
    ax.set_title("seed 002's table: digits, tiny CNN")
    ax = axs[0, 1]
    for label, _, runs in van: ax.plot(runs[0].valid_acc, marker='o', label=label)
    ax.set_xlabel('epoch'); ax.set_ylabel('validation accuracy'); ax.legend(); ax.set_title('1: vanishing updates')
    plot_gradient_range(gradient_report(make_learner('underflow', 'fp32', 0, device)), ax=axs[1, 0])
    axs[1, 0].set_title('2: gradients of a loss x 2^-20 (FP32) vs fp16', fontsize='medium')
    plot_loss_scale(ovf[-1][2][0], ax=axs[1, 1], title='3: dynamic loss scale, overflows skipped')
    fig.tight_layout(); fig.savefig(path, dpi=100); plt.close(fig)

def main(argv=None) -> int:
    "Entry point of `python -m fp16cb` and of the `fp16cb` console script."
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try: return _main(args)
    finally: torch.set_num_threads(threads)

def _note_slow_half():
    "Say which 16-bit dtypes this CPU computes without native instructions (their modes run correctly, but slowly)."
    slow = [n for n, dt in (('fp16', torch.float16), ('bf16', torch.bfloat16)) if not has_fast_half_math(dt, 'cpu')]
    if slow:
        print(f"note: this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native {' or '.join(slow)} math: "
              f"those modes are correct but slower than FP32 here" +
              ("" if 'bf16' in slow else " (bf16 is the CPU choice)"))

def _main(args) -> int:
    if args.device.type == 'cpu' and (args.experiments or any(m != 'fp32' for m in args.modes)): _note_slow_half()
    warnings.filterwarnings('ignore', message='.*(fp16|bf16) training on the CPU.*')
    t0 = time.perf_counter()
    if args.experiments:
        print(f"fp16cb experiments on {args.device}, seeds {','.join(map(str, args.seeds))} (failing runs: first seed)")
        res = run_experiments(args.seeds, args.device, args.epochs)
        text, ok = format_experiments(res)
        print(text)
        print(f"\nrecipe within {TOLERANCE} accuracy points of FP32 everywhere: {'yes' if ok else 'NO'}")
        if args.plot: _plot_experiments(args.plot, res, args.device)
    else:
        print(f"digits (scikit-learn, 8x8), tiny CNN, on {args.device}, seeds {','.join(map(str, args.seeds))}")
        rows = []
        for m in args.modes:
            rows.append((m, run_many(m, args.seeds, 'digits', args.device, args.epochs)))
            print(f"  {m}: {MODES[m][0]}", flush=True)
        print(format_table(rows))
        if args.plot: _plot_default(args.plot, rows)
        ok = True
    if args.plot: print(f"figure saved to {args.plot}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0 if ok else 1

if __name__ == '__main__': sys.exit(main())
