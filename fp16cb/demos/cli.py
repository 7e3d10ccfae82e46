"""`python -m fp16cb` (or `fp16cb`): train a tiny CNN on scikit-learn's digits in several precisions and compare them;
`--experiments` reproduces at small scale the precision comparison of NVIDIA's NVCaffe slides "Training with Mixed
Precision" and the three problems of pure fp16 named in fastai's mixed-precision docs (after Micikevicius et al.
2018)."""
from __future__ import annotations
import argparse, math, sys, textwrap, time, warnings
import torch

from ..dtypes import has_fast_half_math
from ..dtypes import resolve_device
from .experiments import MODES, DEFAULT_MODES, TASKS, TOLERANCE, run_many, run_experiments, mean_acc

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

_SOURCES = """\
--experiments reproduces, at small scale (scikit-learn's digits, no download):
  - the precision comparison of NVIDIA's NVCaffe slides "Training with Mixed
    Precision" (Ginsburg, Nikolaev and Micikevicius, 2017): FP32, mixed, pure
    FP16, FP16 with loss scale 1000 (plus bf16 and PyTorch's native AMP);
  - the three problems of pure fp16 named in fastai's mixed-precision docs,
    after Micikevicius et al. 2018, "Mixed Precision Training" (ICLR): updates
    that vanish without FP32 master weights, gradients that underflow without
    loss scaling, and overflow, handled by dynamic loss scaling. Each runs once
    where it breaks and once where the recipe fixes it."""

def _epilog(width:int=78) -> str:
    "The mode names of `--modes`, each with what it means, and where `--experiments` comes from."
    w = max(map(len, MODES))
    lines = ['modes (--modes takes a comma-separated list of these names):']
    for name, (what, _) in MODES.items():
        lines += textwrap.wrap(what.replace('`', ''), width, initial_indent=f"  {name:<{w}}  ",
                               subsequent_indent=' ' * (w + 4))
    return '\n'.join(lines + ['', _SOURCES])

def parse_args(argv=None) -> argparse.Namespace:
    "The command line of the main job; bad values exit with status 2 and a message that says what is wrong."
    p = argparse.ArgumentParser(prog='python -m fp16cb',
                                description=textwrap.fill(__doc__.split(';')[0].replace('`', ''), 78),
                                epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--modes', type=_modes, default=','.join(DEFAULT_MODES), metavar='MODE[,MODE...]',
                   help=f"precision modes to compare, named below (default: {','.join(DEFAULT_MODES)})")
    p.add_argument('--epochs', type=_positive_int, default=None, metavar='N',
                   help=f"epochs per run (default: each task's own; {TASKS['digits'].epochs} for the digits CNN)")
    p.add_argument('--device', type=_device, default=torch.device('cpu'),
                   help="cpu, cuda, cuda:1 or mps (default: cpu)")
    g = p.add_mutually_exclusive_group()
    g.add_argument('--seed', type=int, default=None, metavar='S',
                   help="one seed for the data order and initial weights (default: 0; 0,1,2 with --experiments)")
    g.add_argument('--seeds', type=_seeds, default=None, metavar='S[,S...]',
                   help="several seeds; the accuracies are averaged (mean and sd)")
    p.add_argument('--experiments', action='store_true',
                   help="reproduce the sources' comparison and failure modes, see below (a few minutes on 2 cores)")
    p.add_argument('--plot', default=None, metavar='OUT.png', help="save a figure of the runs there (default: none)")
    p.add_argument('--threads', type=_positive_int, default=1, metavar='N',
                   help="CPU threads for torch (default: 1, fastest for tiny models)")
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

def _mean_sd(xs) -> tuple:
    "Mean and sample standard deviation of `xs` (sd 0 for a single value)."
    m = sum(xs) / len(xs)
    return m, ((sum((x - m)**2 for x in xs) / (len(xs) - 1))**.5 if len(xs) > 1 else 0.)

def _acc_curves(ax, rows, title):
    "Validation accuracy after each epoch: the mean over the seeds of each row, a band of +- one sd."
    for label, runs in rows:
        curves = [r.valid_acc for r in runs if r.valid_acc]
        if not curves: continue
        n = min(map(len, curves))
        stats = [_mean_sd([100 * c[i] for c in curves]) for i in range(n)]
        x, m = range(1, n + 1), [o[0] for o in stats]
        line, = ax.plot(x, m, marker='o', ms=3, label=f"{label} ({len(curves)} seed{'s' * (len(curves) > 1)})")
        if len(curves) > 1:
            ax.fill_between(x, [a - sd for a, sd in stats], [a + sd for a, sd in stats], color=line.get_color(),
                            alpha=.2)
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, 100); ax.set_xlabel('epoch'); ax.set_ylabel('validation accuracy %')
    ax.legend(fontsize='small', loc='best'); ax.set_title(title, fontsize='medium')

def _figure_default(rows):
    "The figure of `python -m fp16cb --plot`: accuracy per epoch per mode, and the loss scale of the scaled modes."
    from matplotlib.figure import Figure
    from ..diagnostics import plot_loss_scale
    scaled = [(label, runs[0]) for label, runs in rows if runs[0].scales and runs[0].loss_scale not in (None, 1.)]
    fig = Figure(figsize=(5 * (1 + len(scaled)), 3.5), layout='tight')
    axs = fig.subplots(1, 1 + len(scaled), squeeze=False)
    _acc_curves(axs[0, 0], rows, "digits (scikit-learn), tiny CNN")
    for ax, (label, run) in zip(axs[0, 1:], scaled):
        plot_loss_scale(run, ax=ax, title=f"{label}: loss scale (seed {run.seed})")
    return fig

def _comparison_chart(ax, rows):
    "Mean final accuracy +- sd over the seeds, one row per mode, against FP32's mean +- `TOLERANCE`."
    rows = [(label, role, [100 * r.accuracy for r in runs if not math.isnan(r.accuracy)]) for label, role, runs in rows]
    rows = [(label, role, accs) for label, role, accs in rows if accs][::-1]
    stats = [_mean_sd(accs) for _, _, accs in rows]
    ys = range(len(rows))
    base = next((m for (_, role, _), (m, _) in zip(rows, stats) if role == 'fp32'), None)
    if base is not None:
        ax.axvspan(base - TOLERANCE, base + TOLERANCE, color='green', alpha=.15,
                   label=f"FP32 mean ± {TOLERANCE} points")
    n = max(len(accs) for _, _, accs in rows)
    ax.errorbar([m for m, _ in stats], ys, xerr=[sd for _, sd in stats], fmt='o', capsize=4,
                label=f"mean ± sd over {n} seeds" if n > 1 else "one seed")
    for y, (m, sd) in zip(ys, stats): ax.annotate(f"{m:.2f}", (m + sd, y), xytext=(4, 4), textcoords='offset points',
                                                 fontsize='small')
    ax.set_yticks(list(ys), [label for label, _, _ in rows])
    lo = min(m - sd for m, sd in stats + ([(base, TOLERANCE)] if base is not None else []))
    hi = max(m + sd for m, sd in stats + ([(base, TOLERANCE)] if base is not None else []))
    pad = max(.5, (hi - lo) * .25)
    ax.set_xlim(lo - pad, min(100, hi + 2 * pad) if hi < 100 else hi + pad)
    ax.set_ylim(-.7, len(rows) - .3)
    ax.set_xlabel(f"validation accuracy % (zoomed: the axis starts at {ax.get_xlim()[0]:.1f}, not 0)")
    ax.legend(fontsize='small', loc='best')

def _figure_experiments(res, device='cpu'):
    "The figure of `python -m fp16cb --experiments --plot`: one chart per experiment of `run_experiments`' result."
    from matplotlib.figure import Figure
    from ..diagnostics import plot_loss_scale, plot_gradient_range, gradient_report
    from .experiments import make_learner
    fig = Figure(figsize=(13, 8), layout='tight')
    axs = fig.subplots(2, 2)
    # the rest: the precision-policy and FP16-storage rows
    (_, _, table), (_, _, van), (_, _, und), (_, _, ovf) = res[:4]
    _comparison_chart(axs[0, 0], table)
    axs[0, 0].set_title("precision comparison of NVIDIA's NVCaffe slides: digits, tiny CNN", fontsize='medium')
    _acc_curves(axs[0, 1], [(label, runs) for label, _, runs in van], '1: vanishing updates without FP32 masters')
    plot_gradient_range(gradient_report(make_learner('underflow', 'fp32', 0, device)), ax=axs[1, 0])
    axs[1, 0].set_title('2: gradients of a loss x 2^-20 (FP32) vs fp16', fontsize='medium')
    plot_loss_scale(ovf[-1][2][0], ax=axs[1, 1], title='3: dynamic loss scale, overflows skipped')
    return fig

def _plot_default(path, rows): _figure_default(rows).savefig(path, dpi=100)
def _plot_experiments(path, res, device): _figure_experiments(res, device).savefig(path, dpi=100)

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
