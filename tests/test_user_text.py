"""What users read names its sources (Micikevicius et al. 2018; fastai's docs; NVIDIA's NVCaffe and TF AMP slides;
OpenSeq2Seq's guide), never internal labels such as "seed 001"; `python -m fp16cb --help` is plain and explains its
mode names; the figures of `python -m fp16cb --plot` are honest (no hidden axis truncation, error bars over seeds,
every legend entry visible)."""
import importlib, inspect, pkgutil, re
from pathlib import Path
import pytest
import matplotlib
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.collections import Collection
from matplotlib.container import ErrorbarContainer
from matplotlib.text import Text

import fp16cb
from fp16cb.demos import cli
from fp16cb.demos.experiments import MODES, DEFAULT_MODES, EXPERIMENTS, Run

REPO = Path(__file__).resolve().parents[1]
# internal names of the source documents ("seed 001", "seed 002's table", "Seed 000/004's"), or "the seed's behaviour"
INTERNAL = re.compile(r"\bseeds?\s*0\d\d\b|\bseed\s+documents?\b|\bthe\s+seed's\b|\bseed\s+0\d\d's\b", re.I)

def _internal(text) -> list: return [m.group(0) for m in INTERNAL.finditer(text)]

# --help

def _help(capsys) -> str:
    with pytest.raises(SystemExit) as e: cli.parse_args(['--help'])
    assert e.value.code == 0
    return capsys.readouterr().out

def _options(text) -> dict:
    "The entries of the `options:` section of a help text, by their first flag."
    body = text.split('options:', 1)[1].split('\n\n', 1)[0]
    entries, cur = {}, None
    for line in body.splitlines():
        m = re.match(r'\s{2}(-{1,2}[\w-]+)', line)
        if m: cur = m.group(1); entries[cur] = line
        elif cur: entries[cur] += ' ' + line.strip()
    return entries

def test_help_names_no_internal_labels(capsys):
    text = _help(capsys)
    assert _internal(text) == [], _internal(text)

def test_help_shows_each_default_once_and_no_python_repr(capsys):
    text = _help(capsys)
    opts = _options(text)
    assert {'--modes', '--epochs', '--device', '--seed', '--seeds', '--plot', '--threads'} <= set(opts)
    for flag, entry in opts.items():
        assert len(re.findall(r'\bdefault\b', entry, re.I)) <= 1, f"{flag} shows several defaults: {entry}"
        assert '(default: None)' not in entry and '(default: False)' not in entry, entry
    assert not re.search(r"\[\s*'", text), "a Python list in --help"
    assert f"default: {','.join(DEFAULT_MODES)}" in ' '.join(opts['--modes'].split())

def test_help_explains_every_mode(capsys):
    "Each mode name heads a line of its own with what it means; `to_fp16_wait20`'s says what the 20 is."
    text = _help(capsys)
    lines = {m.group(1): m.group(2) for m in re.finditer(r'^[ ]+(\w+)[ ]{2,}(\S.*)$', text, re.M)}
    for name in MODES: assert name in lines, f"mode {name!r} is not explained in --help"
    wait20 = text.split('to_fp16_wait20', 1)[1].split('\n  fp16_unchecked', 1)[0]
    assert 'scale_wait=20' in wait20 and 'clean steps' in wait20

def test_help_names_the_sources(capsys):
    text = ' '.join(_help(capsys).split())
    assert 'Micikevicius et al. 2018' in text and "fastai's" in text and 'NVCaffe' in text

# README, notebooks, docstrings

def test_readme_names_sources_not_labels():
    text = (REPO/'README.md').read_text()
    assert _internal(text) == [], _internal(text)
    assert 'Micikevicius' in text and 'NVCaffe' in text and 'OpenSeq2Seq' in text

def test_readme_lists_the_notebooks():
    "The README's docs table links every notebook."
    text = (REPO/'README.md').read_text()
    docs = text.split('## Documentation', 1)[1].split('\n## ', 1)[0]
    for p in (REPO/'nbs').glob('*.ipynb'): assert f"(nbs/{p.name})" in docs, p.name

@pytest.mark.parametrize('path', sorted((REPO/'nbs').glob('*.ipynb')), ids=lambda p: p.stem)
def test_notebooks_name_sources_not_labels(path):
    nbformat = pytest.importorskip('nbformat')
    nb = nbformat.read(path, as_version=4)
    found = []
    for c in nb.cells:
        found += _internal(c.source)
        for o in c.get('outputs', []):
            text = o.get('text', '') + ''.join(str(v) for k, v in o.get('data', {}).items() if k.startswith('text/'))
            found += [m.group(0) for m in INTERNAL.finditer(text)]
    assert found == []

def test_tool_writes_no_labels():
    text = (REPO/'tools'/'run_nbs.py').read_text()
    assert _internal(text) == [], _internal(text)

def _public_texts(mod) -> dict:
    """The user-facing text of `mod`, keyed by (the module that defines it, what it is): its docstring, and the
    docstrings and documented arguments of its public names and of their public methods."""
    from fastcore.docments import docments
    texts = {(mod.__name__, mod.__name__): inspect.getdoc(mod) or ''}
    for name in getattr(mod, '__all__', []):
        obj = getattr(mod, name, None)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)): continue
        home = getattr(obj, '__module__', mod.__name__)
        texts[(home, name)] = inspect.getdoc(obj) or ''
        try: texts[(home, f"{name} arguments")] = ' '.join(str(v) for v in docments(obj).values() if v)
        except Exception: pass
        for attr, member in vars(obj).items() if inspect.isclass(obj) else []:
            if not attr.startswith('_') and callable(member): texts[(home, f"{name}.{attr}")] = inspect.getdoc(member) or ''
    return texts

MODULES = sorted(m.name for m in pkgutil.walk_packages(fp16cb.__path__, 'fp16cb.')  # with fp16cb.demos and its modules
                 if not m.name.rsplit('.', 1)[-1].startswith('_'))

@pytest.mark.parametrize('modname', ['fp16cb'] + MODULES)
def test_public_docstrings_name_sources_not_labels(modname):
    mod = importlib.import_module(modname)
    bad = {k: _internal(v) for k, v in _public_texts(mod).items() if _internal(v)}
    assert bad == {}

# figures

def _run(acc, seed=0, n_epochs=3, scales=None, skips=None):
    return Run('m', seed, acc, .1, (scales or [None])[-1], sum(skips or []), scales or [], skips or [],
               [acc * (i + 1) / n_epochs for i in range(n_epochs)])

def _fake_experiments(n_seeds=3):
    "A result shaped as `run_experiments`' (3 seeds, the failing rows 1), without training."
    scales = [2.**24 / 2**min(i, 6) for i in range(40)]
    skips = [i < 6 or i == 25 for i in range(40)]
    res = []
    for title, task, rows in EXPERIMENTS:
        out = []
        for k, (label, mode, role) in enumerate(rows):
            seeds = range(1 if role == 'breaks' else n_seeds)
            acc = .1 if role == 'breaks' else .97 + .003 * k
            out.append((label, role, [_run(acc + .004 * s, s, scales=scales, skips=skips) for s in seeds]))
        res.append((title, task, out))
    return res

@pytest.fixture
def saved_figures(monkeypatch):
    "The figures `python -m fp16cb --plot` saves (captured at `Figure.savefig`, without writing)."
    figs = []
    monkeypatch.setattr(Figure, 'savefig', lambda self, *a, **k: figs.append(self))
    return figs

def _draw(fig):
    "Draw `fig` on an Agg canvas (a bare `Figure` has none): tick labels and extents are known afterwards."
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    if not isinstance(fig.canvas, FigureCanvasAgg): FigureCanvasAgg(fig)
    fig.canvas.draw()
    return fig.canvas.get_renderer()

def _figure_texts(fig) -> str:
    _draw(fig)
    return '\n'.join(t.get_text() for t in fig.findobj(Text))

def _visible(artist, ax) -> bool:
    "Whether some of `artist` (a legend entry's artist) is drawn inside `ax`."
    box = ax.bbox.padded(1)
    if isinstance(artist, ErrorbarContainer): artist = artist.lines[0]
    if isinstance(artist, Line2D):
        return any(box.contains(*p) for p in artist.get_transform().transform(artist.get_xydata()))
    if isinstance(artist, Collection) and len(artist.get_offsets()):
        return any(box.contains(*p) for p in artist.get_offset_transform().transform(artist.get_offsets()))
    ext = artist.get_window_extent(_draw(ax.figure))
    return ext.width > 0 and ext.x1 > box.x0 and ext.x0 < box.x1 and ext.y1 > box.y0 and ext.y0 < box.y1

def _check_legends(fig):
    _draw(fig)
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            assert _visible(handle, ax), f"legend entry {label!r} of {ax.get_title()!r} is drawn outside the axes"

def test_experiments_figure(saved_figures, tmp_path):
    cli._plot_experiments(tmp_path/'exp.png', _fake_experiments(), 'cpu')
    fig, = saved_figures
    assert _internal(_figure_texts(fig)) == []
    _check_legends(fig)
    ax = fig.axes[0]  # the comparison of precisions, top left
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert bars and bars[0].has_xerr, "no error bars (sd over seeds) in the comparison chart"
    segments = bars[0].lines[2][0].get_segments()
    assert any(abs(s[1][0] - s[0][0]) > 0 for s in segments), "the error bars are empty"
    lo = ax.get_xlim()[0]
    assert lo <= 0 or 'not 0' in ax.get_xlabel() or 'starts at' in ax.get_xlabel(), \
        f"the accuracy axis starts at {lo:.1f} without saying so: {ax.get_xlabel()!r}"

def test_default_figure(saved_figures, tmp_path):
    scales = [2.**24 / 2**min(i, 6) for i in range(30)]
    rows = [(m, [_run(.97 + .001 * s, s, scales=scales if m == 'to_fp16' else None,
                      skips=[i < 6 for i in range(30)] if m == 'to_fp16' else None) for s in range(2)])
            for m in ('fp32', 'to_fp16', 'to_bf16')]
    cli._plot_default(tmp_path/'runs.png', rows)
    fig, = saved_figures
    assert _internal(_figure_texts(fig)) == []
    _check_legends(fig)

def test_gradient_range_legend_is_visible():
    "The 'lost below this at the suggested scale' line lies inside the axes even for a scale of 2^24."
    from fp16cb.diagnostics import gradient_report, plot_gradient_range
    from fp16cb.demos.experiments import make_learner
    fig = Figure()
    ax = fig.subplots()
    plot_gradient_range(gradient_report(make_learner('underflow', 'fp32', 0)), ax=ax)
    _check_legends(fig)

def _overlap(a, b) -> bool: return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1

def test_precision_check_figure_is_readable():
    """The figure of `learn.precision_check()` as a reader sees it: the whole advice on top, inside the figure and clear
    of the panels' titles; no two tick labels of a panel on top of each other; the shares' axes from 0. Before the fix:
    the advice was cut at 120 characters and overlapped the titles, the log axis crowded its labels."""
    import matplotlib.pyplot as plt
    import pandas as pd
    from fp16cb.diagnostics import plot_precision_check
    df = pd.DataFrame({'overflow': [0, 8, 0, 0], 'underflow': [0., 0., 0., 0.], 'underflow_act': [0., 0., 0., 0.],
                       'swallowed': [.21, 0., .45, .21], 'rel_diff': [3.1e-4, 2.2e-3, 2.1e-3, 2.0e-3]},
                      index=['stem', 'block.amp', 'block.norm', 'head'])
    df.attrs['advice'] = ("keep_fp32=['block']: `learn.to_fp16(keep_fp32=['block'])` (inf/NaN starts in 'block.amp'; "
                          "with those modules FP32 the failing batch runs clean in 8 of 8 batches).")
    axs = plot_precision_check(df)
    fig = axs[0].figure
    try:
        r = _draw(fig)
        title = fig._suptitle
        assert title.get_text().replace('\n', ' ') == df.attrs['advice'], "the advice is cut"
        box, page = title.get_window_extent(r), fig.bbox
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1, "the advice is cut off"
        for ax in axs:
            assert not _overlap(box, ax.title.get_window_extent(r)), f"the advice overlaps {ax.get_title()!r}"
            ticks = [(t.get_text(), t.get_window_extent(r)) for t in ax.get_xticklabels(which='both') if t.get_visible() and t.get_text()]
            ticks = [(t, e) for t, e in ticks if ax.bbox.x0 - 1 <= (e.x0 + e.x1) / 2 <= ax.bbox.x1 + 1]  # drawn under the panel
            assert len(ticks) >= 2, ax.get_title()
            assert not any(_overlap(a, b) for i, (_, a) in enumerate(ticks) for _, b in ticks[i + 1:]), \
                f"tick labels of {ax.get_title()!r} overlap: {[t for t, _ in ticks]}"
        assert axs[1].get_xlim() == (0, 1) and axs[2].get_xlim() == (0, 1), "a share's axis from 0 to 1"
    finally: plt.close(fig)

def test_a_fit_loads_no_accelerate():
    """A plain fit in mixed precision imports neither `fastai.distributed` nor Accelerate, which fastai alone would not:
    in a Jupyter kernel without ipywidgets, Accelerate's `tqdm.auto` import printed "TqdmWarning: IProgress not found"
    on the first fit (the notebooks stored it). Before the fix: the set-up imported `fastai.distributed` to look for its
    `DistributedTrainer`."""
    import os, subprocess, sys
    code = ("import sys, torch; from fastai.basics import *; import fp16cb\n"
            "x = torch.randn(64, 4); dls = DataLoaders.from_dsets(list(zip(x, x.sum(1, keepdim=True))), list(zip(x, x.sum(1, keepdim=True))), bs=16)\n"
            "learn = Learner(dls, torch.nn.Linear(4, 1), loss_func=MSELossFlat()).to_bf16()\n"
            "with learn.no_bar(), learn.no_logging(): learn.fit(1)\n"
            "print(sorted(m for m in ('fastai.distributed', 'accelerate', 'tqdm.auto') if m in sys.modules))")
    p = subprocess.run([sys.executable, '-W', 'ignore', '-c', code], capture_output=True, text=True, timeout=120,
                       cwd=REPO, env={**os.environ,  # this checkout's fp16cb first, then what the parent's path has (fastai)
                                      'PYTHONPATH': os.pathsep.join(filter(None, [str(REPO), os.environ.get('PYTHONPATH')]))})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == '[]', p.stdout

# the slow-fp16 warning

def test_slow_fp16_warning_says_what_was_measured(monkeypatch):
    """The fp16-on-CPU warning gives what was measured and where (1.9x a tabular MLP to over 40x a resnet18, on an AMD
    EPYC without fp16 math: bench/RESULTS.md), no invented '20 to 100'."""
    import torch
    import fp16cb.dtypes as dtypes
    monkeypatch.setattr(dtypes, 'cpu_has_native', {torch.float16: False, torch.bfloat16: True}.get)
    msg = ' '.join(dtypes._slow_half_message(torch.float16).split())
    assert '20 to 100' not in msg and '100x' not in msg
    assert '1.9x (a small tabular MLP), 8x (a compute-bound MLP), 23x (an LSTM) and over 40x (a resnet18) slower than FP32' in msg
    assert 'AMD EPYC with AVX512-BF16 and no fp16 math' in msg  # where it was measured
    assert 'depends on the model' in msg and 'compute-bound layers' in msg and 'suffer most' in msg
