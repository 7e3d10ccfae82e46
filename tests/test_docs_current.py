"""Nothing stale in the docs: README.md, CONTRIBUTING.md, bench/README.md, bench/RESULTS.md (the current results; the
log of older runs, bench/HISTORY.md, is history) and the notebooks (markdown and code) name only
things that exist (`fp16cb.…` modules and attributes, `python -m …` commands and their flags, files and tests), the
README's figures are one dated benchmark run's (`bench/results_cpu.json` and `bench/results_state_memory.json`, one
machine), the speed ratios of the notebooks and of bench/README.md are those of the run they name (with its day and
machine), the timings a notebook stores follow a line naming their machine and date, the README's quick start runs as
pasted, its compatibility table's columns are explained, its signatures are
`inspect.signature`'s, it lists every `Learner` method fp16cb patches, user-facing text carries no
internal work-item labels, and settings.ini holds only keys that setup.py reads."""
import ast, importlib, importlib.util, inspect, json, os, re, statistics, subprocess, sys
from pathlib import Path
import pytest
import torch
from fastai.learner import Learner

import fp16cb  # noqa: F401 (patches Learner: the signatures and the patched methods checked below)

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path: sys.path.insert(0, str(REPO))  # `bench` is a top-level package of the checkout
NBS = sorted((REPO/'nbs').glob('*.ipynb'))
RESULTS_JSON = REPO/'bench'/'results_cpu.json'
OUTPUTS = {'bench/results_cuda.json'}  # files the documented commands write (not in the repository until run on a GPU)
HELP_CLIS = ('fp16cb', 'bench', 'fp16cb.demos.ddp')  # documented commands whose flags `--help` lists

def notebook_text(path:Path, outputs:bool=False) -> str:
    "The markdown and code of a notebook (and the text of its outputs when `outputs`), one cell after another."
    parts = []
    for c in json.loads(path.read_text())['cells']:
        parts.append(''.join(c['source']))
        for o in c.get('outputs', []) if outputs else []:
            parts.append(''.join(o.get('text', '')))
            parts += [''.join(v) for k, v in o.get('data', {}).items() if k.startswith('text/') and k != 'text/html']
    return '\n\n'.join(parts)

def docs(outputs:bool=False) -> dict:
    "`{name: text}` of every document scanned here."
    res = {n: (REPO/n).read_text() for n in ('README.md', 'CONTRIBUTING.md', 'bench/README.md', 'bench/RESULTS.md')}
    res.update({f'nbs/{p.name}': notebook_text(p, outputs) for p in NBS})
    return res

def section(text:str, heading:str) -> str:
    "The body of the markdown section whose `## ` heading starts with `heading`, up to the next `## ` heading."
    m = re.search(rf'^## {re.escape(heading)}.*?$(.*?)(?=^## |\Z)', text, re.M | re.S)
    assert m, f"no section '## {heading}'"
    return m.group(1)

README = (REPO/'README.md').read_text()

# ---- names, commands and files that must exist

DOTTED = re.compile(r'(?<![\w./-])fp16cb(?:\.[A-Za-z_]\w*)+')

def resolve(dotted:str):
    "The module or attribute `dotted` names: the longest importable prefix, then attributes."
    parts = dotted.split('.')
    for i in range(len(parts), 0, -1):
        try: obj = importlib.import_module('.'.join(parts[:i]))
        except ModuleNotFoundError: continue
        for a in parts[i:]: obj = getattr(obj, a)
        return obj
    raise ModuleNotFoundError(dotted)

def test_fp16cb_names_exist():
    "Every `fp16cb.x.y` the docs name is a module or an attribute of one."
    bad = {}
    for name, text in docs().items():
        for dotted in sorted(set(DOTTED.findall(text))):
            try: resolve(dotted)
            except (ImportError, AttributeError) as e: bad.setdefault(name, []).append(f"{dotted}: {e}")
    assert bad == {}

COMMAND = re.compile(r'python3? -m ([A-Za-z_][\w.]*)([^\n`#|]*)')

def commands() -> list:
    "`(doc, module, flags)` for every `python -m module ...` the docs name."
    return [(name, m.group(1).rstrip('.'), re.findall(r'(?<!\S)(--[\w-]+)', m.group(2)))
            for name, text in docs().items() for m in COMMAND.finditer(text)]

def test_python_m_commands_exist():
    "`python -m X`: X is a module, or a package with a `__main__`, of this checkout or the environment."
    missing = set()
    for name, mod, _ in commands():
        spec = importlib.util.find_spec(mod)
        if spec is not None and spec.submodule_search_locations is not None: spec = importlib.util.find_spec(f'{mod}.__main__')
        if spec is None: missing.add((name, mod))
    assert commands() and not missing, sorted(missing)

@pytest.fixture(scope='module')
def helps() -> dict:
    "`python -m X --help` of the documented command-line tools, run from the checkout root."
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(REPO), os.environ.get('PYTHONPATH', '')]),
           'PYTHONWARNINGS': 'ignore', 'OMP_NUM_THREADS': '1'}
    res = {}
    for mod in HELP_CLIS:
        p = subprocess.run([sys.executable, '-m', mod, '--help'], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0, f"python -m {mod} --help: {p.stderr[-2000:]}"
        res[mod] = p.stdout
    return res

def test_documented_flags_exist(helps):
    "Every flag given to a documented command line is one its `--help` lists."
    bad = {(name, mod, f) for name, mod, flags in commands() if mod in helps for f in flags
           if not re.search(rf'(?<![\w-]){re.escape(f)}(?![\w-])', helps[mod])}
    assert bad == set()

PATH = re.compile(r'(?<![\w./-])((?:fp16cb|tests|tools|bench|nbs)/[\w./-]*\w)(?:::(\w+))?')
LINK = re.compile(r'\]\((?!https?:|#|mailto:)([^)\s]+)\)')

def test_files_and_links_exist():
    "Every file of the checkout the docs name exists (`tests/x.py::name`: and defines `name`), and so does every relative link."
    bad = []
    for name, text in docs().items():
        for m in PATH.finditer(text):
            path, test = m.group(1), m.group(2)
            if path in OUTPUTS: continue
            if not (REPO/path).exists(): bad.append((name, path))
            elif test and not re.search(rf'^\s*(?:def|class) {test}\b', (REPO/path).read_text(), re.M): bad.append((name, f'{path}::{test}'))
        for link in LINK.findall(text):
            if not ((REPO/name).parent/link.split('#')[0]).exists(): bad.append((name, link))
    assert bad == []

def test_the_notebook_index_lists_every_notebook():
    text = notebook_text(REPO/'nbs'/'index.ipynb')
    table = text.split('## The docs', 1)[1]
    assert [p.name for p in NBS if p.stem != 'index' and f'({p.name})' not in table] == []

# ---- the README's which-mode figures come from the benchmark's results

RESULTS = json.loads(RESULTS_JSON.read_text())

def md_tables(text:str) -> list:
    "Each markdown table of `text` as a list of `{header: cell}` rows."
    tables, rows = [], None
    for line in text.splitlines() + ['']:
        if line.startswith('|'):
            cells = [c.strip() for c in line.strip().strip('|').split('|')]
            if rows is None: rows, header = [], cells
            elif not set(''.join(cells)) <= set('-: '): rows.append(dict(zip(header, cells)))
        elif rows is not None: tables.append(rows); rows = None
    return tables

def benchmark_figure(workload:str, mode:str, decimals:int) -> set:
    "The speed vs FP32 of `mode` on `workload` as printed, from results_cpu.json (one run: no other source)."
    run = RESULTS.get(workload, {}).get(mode)
    return {f"{run['speedup']:.{decimals}f}"} if run else set()

FIGURE = re.compile(r'(\d+\.\d+)x\b([^()]*)\(`([\w-]+)`, `([\w-]+)`[^)]*\)')

def which_mode_rows() -> list:
    "The which-mode table (the section's first; the second is the memory table)."
    return md_tables(section(README, 'Which mode'))[0]

def test_which_mode_table_has_every_mode():
    calls = ' '.join(r['call'] for r in which_mode_rows())
    for needed in ('to_fp16()', 'to_bf16()', 'to_native_fp16()', 'to_native_bf16()', 'half_storage=True', 'keep_fp32=',
                   'state_dtype=torch.bfloat16'):
        assert needed in calls, needed

def test_which_mode_figures_are_the_benchmarks():
    "Each figure is `N.NNx ... (`workload`, `mode`)`, equal to the benchmark's; no number in that column is unsourced."
    col = [k for k in which_mode_rows()[0] if k.startswith('the figure')][0]
    n = 0
    for row in which_mode_rows():
        cell = row[col]
        for m in FIGURE.finditer(cell):
            value, workload, mode = m.group(1), m.group(3), m.group(4)
            assert value in benchmark_figure(workload, mode, len(value.split('.')[1])), \
                f"{value}x for ({workload}, {mode}) is not in bench/results_cpu.json"
            n += 1
        rest = re.sub(r'`[^`]*`', '', FIGURE.sub('', cell))
        assert not re.search(r'(?<![\w.])\d+(?:\.\d+)?(?!\w)', rest), f"a figure without its source: {cell!r}"
    assert n >= 4

def test_which_mode_figures_are_dated_with_their_machine():
    """The caption names the results file's run: date, machine, its CPU flags as `lscpu` gives them (`cpu_flags`, added
    to the results files next to the run), torch; says how much figures vary between CPUs, points at the notebook that
    measures the reader's; and says plainly whether GPU figures exist."""
    text = ' '.join(section(README, 'Which mode').split())
    meta = RESULTS['meta']
    assert 'cpu_flags' in meta, "bench/results_cpu.json's meta has no 'cpu_flags': run the benchmark again (bench/README.md)"
    assert meta['date'] in text and meta['machine'] in text and meta['torch'].split('+')[0] in text
    assert meta['cpu_flags'] in text and 'bench/results_cpu.json' in text
    assert 'vary between CPUs' in text and 'AVX512-BF16' in text and '(nbs/which_mode.ipynb)' in text
    gpu = [f for f in H200_RUNS if (REPO/'bench'/f).exists()]
    assert ('No GPU figures exist yet' in text) != bool(gpu)
    assert all(f'bench/{f}' in text for f in gpu)

def _cuda_speedups(path:Path=REPO/'bench'/'results_cuda_rounds.log') -> dict:
    "`{(workload, run): speed vs FP32 with the same optimizer}` from a log of rounds, `bench/results_cuda_rounds.log` (medians)."
    runs, wl = {}, None
    for line in path.read_text().splitlines():
        if m := re.match(r'\[(\w+)\]', line): wl = m.group(1)
        elif m := re.match(r'\s+round \d+/\d+ (\S+)\s+([\d.]+) ms/step', line): runs.setdefault((wl, m.group(1)), []).append(float(m.group(2)))
    med = {k: statistics.median(v) for k, v in runs.items()}
    ref = lambda wl, run: med.get((wl, 'fp32+fused' if run.endswith('+fused') or run == 'torch-amp' else 'fp32'))
    return {(wl, run): ref(wl, run) / ms for (wl, run), ms in med.items() if ref(wl, run)}

H200_RUNS = ('results_cuda_h200_20261128_resnet50.json', 'results_cuda_h200_20261128_lm.json')  # the run the README quotes

def _h200(wl:str) -> dict:
    "One workload's results in the H200 run the README quotes (the two ResNet-50s in one file, the LM in the other)."
    return json.loads((REPO/'bench'/H200_RUNS[wl == 'lm']).read_text())[wl]

def test_gpu_figures_are_the_gpu_runs():
    """Each speed the README's GPU paragraph gives is one of the GPU run that it names, as rounded, and no other: speeds
    vs FP32 with the same optimizer, and the LM's time ratios within its run; the headline figures are there
    (`to_fp16()` and fastai's AMP against FP32 on ResNet-50 in both layouts and on the LM)."""
    if not all((REPO/'bench'/f).exists() for f in H200_RUNS): pytest.skip("no GPU run")
    text = ' '.join(section(README, 'Which mode').split())
    para = text[text.index('**On a GPU**'):]
    para = para[:para.index('**Memory**')] if '**Memory**' in para else para
    r, cl, lm = _h200('resnet50'), _h200('resnet50_cl'), _h200('lm')
    sp = lambda d, k: f"{d[k]['speedup']:.2f}x"
    ratio = lambda a, b: f"{lm[a]['ms_step']/lm[b]['ms_step']:.2f}x"
    runs = lambda d: [k for k in d if isinstance(d[k], dict) and d[k].get('ms_step')]
    allowed = {sp(d, k) for d in (r, cl, lm) for k in runs(d)} | {ratio(a, b) for a in runs(lm) for b in runs(lm)}
    for e in (sp(cl, 'fp16'), sp(r, 'fp16'), sp(cl, 'autocast'), sp(r, 'autocast'), sp(lm, 'fp16'), sp(lm, 'autocast')):
        assert e in para, e
    assert set(re.findall(r'\d+\.\d+x', para)) <= allowed, set(re.findall(r'\d+\.\d+x', para)) - allowed
    assert all(f'bench/{f}' in para for f in H200_RUNS) and 'H200' in para and '2026-11-28' in para

# ---- the README's signatures and calls are the real ones

METHODS = ('to_fp16', 'to_bf16', 'to_fp32', 'to_native_fp16', 'to_native_bf16', 'to_native_fp32', 'precision_check')
CALL = re.compile(r'(?:(?<=\.)|(?<![\w.]))(' + '|'.join(METHODS) + r')\(')

def calls(text:str) -> list:
    "`(method, argument text)` for each `learn.method(...)`, `.method(...)` or `method(...)` in `text` (balanced parentheses)."
    res = []
    for m in CALL.finditer(text):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {'(': 1, ')': -1}.get(text[i], 0); i += 1
        res.append((m.group(1), text[m.end():i - 1]))
    return res

def quoted_signature(args:str) -> list:
    "`(name, kind, default)` of each parameter of a signature quoted as `learn.method(<args>)`."
    fn = ast.parse(f'def f({args}): pass').body[0].args
    ev = lambda node: eval(compile(ast.Expression(node), '<README>', 'eval'), {'torch': torch})
    pos = fn.posonlyargs + fn.args
    res = [(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty) for a in pos]
    for k, d in enumerate(fn.defaults, len(pos) - len(fn.defaults)): res[k] = (res[k][0], res[k][1], ev(d))
    res += [(a.arg, inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.empty if d is None else ev(d))
            for a, d in zip(fn.kwonlyargs, fn.kw_defaults)]
    return res

def real_signature(method:str) -> list:
    return [(p.name, p.kind, p.default) for p in inspect.signature(getattr(Learner, method)).parameters.values()
            if p.name != 'self']

def test_readme_signatures_are_the_real_ones():
    "The first code block of '## API' quotes each `to_*` method's signature: names, order, kinds and defaults."
    block = re.search(r'```python\n(.*?)```', section(README, 'API'), re.S).group(1)
    quoted = {m: quoted_signature(args) for m, args in calls(block)}
    assert set(quoted) >= {'to_fp16', 'to_bf16', 'to_fp32', 'to_native_fp16', 'to_native_bf16'}
    for m, sig in quoted.items(): assert sig == real_signature(m), m
    names = {n for sig in quoted.values() for n, *_ in sig}
    assert {'half_storage', 'stochastic_rounding', 'keep_fp32', 'on_collapse'} <= names

def test_documented_calls_use_real_arguments():
    "Every `to_fp16(...)` & co. in the README and the notebooks' markdown passes only keywords the method takes."
    texts = [README] + ['\n'.join(''.join(c['source']) for c in json.loads(p.read_text())['cells'] if c['cell_type'] == 'markdown')
                        for p in NBS]
    bad = []
    for text in texts:
        for method, args in calls(text):
            try: call = ast.parse(f'f({args})', mode='eval').body
            except SyntaxError: continue  # a signature (`*, ...`) or prose inside the parentheses
            params = {n for n, *_ in real_signature(method)}
            bad += [(method, k.arg) for k in call.keywords if k.arg is not None and k.arg not in params]
    assert bad == []

# ---- what importing fp16cb changes in fastai

def patched_by_fp16cb() -> set:
    "The `Learner` attributes whose code lives in fp16cb/ (added, replaced or wrapped on import)."
    res = set()
    for name, v in vars(Learner).items():
        code = getattr(v, '__code__', None)
        if code is not None and Path(code.co_filename).resolve().is_relative_to(REPO/'fp16cb'): res.add(name)
    return res

def test_readme_lists_every_patched_learner_method():
    text = section(README, 'What importing fp16cb changes')
    listed = set(re.findall(r'`(\w+)`', text))
    assert patched_by_fp16cb() and patched_by_fp16cb() - listed == set()
    bullets = re.findall(r'^- (?:added|replaced|wrapped).*?(?=^- |^\s*$)', text, re.M | re.S)
    named = {n for b in bullets for n in re.findall(r'`(\w+)`', b) if n in vars(Learner)}
    assert named - patched_by_fp16cb() == set(), "listed as patched, but fastai's own"

# ---- no internal work-item labels in what users read

LABELS = re.compile(r"\bissues?\s*#?\d+|\bthe\s+issue'?s\b|\b(?:design|memory|diagnostics|data-safety|multi-process|CUDA|docs)"
                    r"\s+issue\b|\bseeds?\s*0\d\d\b|\bwork[- ]items?\b", re.I)

@pytest.mark.parametrize('name', sorted(docs()), ids=lambda n: n)
def test_no_internal_labels(name):
    text = docs(outputs=True)[name]
    assert [m.group(0) for m in LABELS.finditer(text)] == []

# ---- set-up commands and package metadata

def test_readme_set_up_commands():
    "The two set-up commands, as they are, and the main job."
    block = re.search(r'```bash\n(.*?)```', section(README, 'Install'), re.S).group(1)
    assert block.splitlines() == ['pip install -e ".[dev]"', 'pytest']
    assert re.search(r'^python -m fp16cb$', README, re.M)

def setup_py_words() -> set:
    "Every whitespace-separated word of every string literal in setup.py."
    tree = ast.parse((REPO/'setup.py').read_text())
    return {w for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) for w in n.value.split()}

def settings_keys() -> set:
    from configparser import ConfigParser
    cfg = ConfigParser(delimiters=['='])
    cfg.read(REPO/'settings.ini', encoding='utf-8')
    return set(cfg['DEFAULT'])

def test_settings_ini_holds_only_what_setup_py_reads():
    assert settings_keys() - setup_py_words() == set()
    read = {n.slice.value for n in ast.walk(ast.parse((REPO/'setup.py').read_text()))
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == 'cfg'
            and isinstance(n.slice, ast.Constant)}
    assert read and read - settings_keys() == set()

# ---- the README's memory figures are the benchmark's
MEMORY_JSON = REPO/'bench'/'results_state_memory.json'
MEMORY_ROWS = {'FP32, fastai\'s AMP `to_fp16`, `to_native_bf16`': ('fp32', 'fastai to_fp16', 'to_native_bf16'),
               '`to_fp16()`, `to_bf16()`, flat or not': ('to_fp16', 'to_bf16', 'to_bf16 flat'),
               '`to_bf16(half_storage=True)`': ('to_bf16 half_storage',),
               '`to_bf16(step_in_backward=True)`': ('to_bf16 step_in_backward',),
               '`to_bf16(half_storage=True, step_in_backward=True)`': ('to_bf16 half_storage step_in_backward',),
               '`to_bf16(state_dtype=torch.bfloat16)`, flat or not': ('to_bf16 state_dtype', 'to_bf16 flat state_dtype'),
               '`to_bf16(half_storage=True, state_dtype=torch.bfloat16)`': ('to_bf16 half_storage state_dtype',),
               '`to_bf16(step_in_backward=True, state_dtype=torch.bfloat16)`': ('to_bf16 step_in_backward state_dtype',),
               '`to_bf16(half_storage=True, step_in_backward=True, state_dtype=torch.bfloat16)`':
                   ('to_bf16 half_storage step_in_backward state_dtype',),
               "`to_bf16(state_dtype='8bit')`": ('to_bf16 state8',),
               "`to_bf16(half_storage=True, state_dtype='8bit')`": ('to_bf16 half_storage state8',),
               "`to_bf16(step_in_backward=True, state_dtype='8bit')`": ('to_bf16 step_in_backward state8',),
               "`to_bf16(half_storage=True, step_in_backward=True, state_dtype='8bit')`":
                   ('to_bf16 half_storage step_in_backward state8',)}

def test_memory_figures_are_the_benchmarks():
    """Each cell of the memory table after a step (bench/README.md's; the README gives the true peak) is what
    `bench/results_state_memory.json` holds for every mode of its row."""
    res = json.loads(MEMORY_JSON.read_text())
    text = section((REPO/'bench'/'README.md').read_text(), 'Results so far')
    table = next(t for t in md_tables(text) if 'fastai\'s `Adam`' in t[0])
    assert [r['mode'] for r in table] == list(MEMORY_ROWS)
    cols = {"fastai's `Adam`": 'fastai Adam', '`OptimWrapper(torch.optim.AdamW)`': 'torch AdamW'}
    for row in table:
        for col, opt in cols.items():
            got = {f"{res['bytes_per_param'][opt][m]:.2f}" if m in res['bytes_per_param'][opt] else '-' for m in MEMORY_ROWS[row['mode']]}
            assert got == {row[col]}, (row['mode'], col, got, row[col])
    flat = ' '.join(text.split())
    assert res['date'] in flat and 'bench/results_state_memory.json' in flat and res['torch'].split('+')[0] in flat
    assert res['cpu'].split(',')[0].replace('(R)', '').replace(' Processor', '') in flat.replace('(R)', '')
    assert f"{res['n_params'] / 1e6:.1f}M" in flat

PEAK_JSON = REPO/'bench'/'results_peak_memory.json'
PEAK_ROWS = {'FP32': 'fp32', '`to_bf16()`': 'to_bf16', '`to_bf16(state_dtype=torch.bfloat16)`': 'to_bf16 state_dtype',
             '`to_bf16(half_storage=True)`': 'to_bf16 half_storage',
             '`to_bf16(half_storage=True, state_dtype=torch.bfloat16)`': 'to_bf16 half_storage state_dtype',
             '`to_bf16(step_in_backward=True)`': 'to_bf16 step_in_backward',
             '`to_bf16(half_storage=True, step_in_backward=True, state_dtype=torch.bfloat16)`':
                 'to_bf16 half_storage step_in_backward state_dtype',
             "`to_bf16(state_dtype='8bit')`": 'to_bf16 state8',
             "`to_bf16(half_storage=True, state_dtype='8bit')`": 'to_bf16 half_storage state8',
             "`to_bf16(half_storage=True, step_in_backward=True, state_dtype='8bit')`":
                 'to_bf16 half_storage step_in_backward state8'}

def test_peak_figures_are_the_benchmarks():
    """The README's true-peak table: each mode's memory between steps and its peak over a fit, with the moment of the
    peak, as `bench/results_peak_memory.json` holds them for both models; the caption names that run."""
    from bench.peak_memory import PHASES
    res = json.loads(PEAK_JSON.read_text())
    text = section(README, 'Which mode')
    table = next(t for t in md_tables(text) if any('true peak' in k for k in t[0]))
    assert [r['mode'] for r in table] == list(PEAK_ROWS)
    names = {'between': 'between steps', 'step': 'step', 'backward': 'backward', 'save': 'mid-fit save',
             'end': "fit's end"}
    for row in table:
        cells = [v for k, v in row.items() if k != 'mode']
        for model, (between, peak) in zip(res['peaks'], zip(cells[::2], cells[1::2])):
            r = res['peaks'][model][PEAK_ROWS[row['mode']]]
            top = f"{max(r[p] for p in PHASES):.1f}"
            where = ', '.join(names[p] for p in PHASES if f"{r[p]:.1f}" == top)
            assert (between, peak) == (f"{r['between']:.1f}", f"{top} ({where})"), (row['mode'], model)
    flat = ' '.join(text.split())
    assert res['date'] in flat and 'bench/results_peak_memory.json' in flat

def test_memory_caption_gives_the_lifts_scratch():
    """The scratch one chunk of FP32 grads is lifted into (kept between steps, not in the table): the run's own figure,
    at most one chunk (the CPU's chunk limit, `STATE_CHUNK`) in every mode (Adam is elementwise: a param bigger than a
    chunk is stepped a slice at a time)."""
    from fp16cb.weights.loop import state_chunk as chunk_limit
    res = json.loads(MEMORY_JSON.read_text())
    flat = ' '.join(section(README, 'Which mode').split())
    most = max(b for r in res['scratch_bytes'].values() for b in r.values())
    assert most <= chunk_limit('cpu') * 4, res['scratch_bytes']
    assert f"{most / 2**20:.0f} MiB at most" in flat

def test_every_figure_is_one_runs():
    """The speed and the memory figures come from one run on one machine: the two results files name the same CPU,
    flags and torch, and were written the same day, minutes apart."""
    import datetime as dt
    mem, meta = json.loads(MEMORY_JSON.read_text()), RESULTS['meta']
    assert mem.get('cpu_flags') == meta['cpu_flags'] and mem['torch'] == meta['torch']
    assert mem['cpu'].split(',')[0] == meta['machine'].split(',')[0]
    when = lambda s: dt.datetime.strptime(s, '%Y-%m-%d %H:%M UTC')
    assert abs(when(mem['date']) - when(meta['date'])) < dt.timedelta(hours=1), (mem['date'], meta['date'])

# ---- the figures outside the README: a speed ratio is its named run's, a timing is labelled with its machine

RUN_FILE = re.compile(r'(?<![\w.-])(?:bench/)?(results_[\w-]+\.(?:json|log))(?![\w.-])')
RATIO = re.compile(r"(?<![\w.])(\d+\.\d+)(?:x(?!\w)| times (?:faster|slower|FP32's speed))( the copy bound)?")
MD_TIMING = re.compile(r'(?<![\w.^-])\d+(?:\.\d+)?\s?(?:ms|s|secs?|seconds)(?:/(?:step|epoch))?(?!\w)')
OUT_TIMING = re.compile(r'ms/step|s/epoch|speed-?up|\bms\b|\bsecs?\b|\bseconds\b|<th>time</th>')
MACHINE_LINE = re.compile(r'^This machine: .+, \d+ cores \((?:flags [\w ]*;[\w ,]*|flags unknown)\), torch \S+, '
                          r'\d+ thread\(s\); executed \d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC$', re.M)
MACHINE = re.compile(r'NVIDIA \w+|AMD EPYC|Intel\S* Xeon\S*')  # a machine as the docs name it

def results_run(name:str) -> dict:
    """The benchmark run in `bench/<name>`: its speeds vs FP32 (`speed`: every `speedup` of a JSON's workloads and modes;
    a log of rounds: their medians'), the callbacks' time over the copy bound (`bound`), its day and its machine as the
    docs name it ('AMD EPYC', 'H200'; from the file, else from the dated section of bench/RESULTS.md that names it)."""
    path = REPO/'bench'/name
    assert path.exists(), f"bench/{name} does not exist"
    speed, bound, day, machine = [], [], None, None
    if name.endswith('.json'):
        res = json.loads(path.read_text())
        recs = [r for wl, runs in res.items() if wl not in ('meta', 'targets') and isinstance(runs, dict)
                for r in runs.values() if isinstance(r, dict)]
        speed, bound = [r['speedup'] for r in recs if r.get('speedup')], [r['cb_over_bound'] for r in recs if r.get('cb_over_bound')]
        meta = res.get('meta', res)  # the memory runs keep `date` and `cpu` at the top
        day, machine = meta.get('date', '')[:10] or None, MACHINE.search(str(meta.get('machine', meta.get('cpu', ''))))
    elif path.read_text().startswith('[') and ' ms/step' in path.read_text(): speed = list(_cuda_speedups(path).values())
    if day is None or machine is None:
        heading, body = next((h, b) for h, b in re.findall(r'^## (.*?)$(.*?)(?=^## |\Z)', (REPO/'bench'/'RESULTS.md').read_text(),
                                                             re.M | re.S) if f'bench/{name}' in b)
        day, machine = day or re.search(r'\d{4}-\d{2}-\d{2}', heading).group(0), machine or MACHINE.search(heading + body)
    return dict(speed=speed, bound=bound, day=day, machine=machine.group(0).removeprefix('NVIDIA '))

def quoting_units(text:str) -> list:
    "The paragraphs of markdown `text` (a table: each row), the units in which a figure must name its run."
    units = []
    for para in re.split(r'\n\s*\n', text):
        rows = [l for l in para.splitlines() if l.startswith('|')]
        units += rows + ['\n'.join(l for l in para.splitlines() if not l.startswith('|'))]
    return [u for u in units if u.strip()]

def unsourced_ratios(text:str) -> list:
    """Each speed ratio (`1.72x`, `1.7 times faster`) of `text` that is not its unit's named run's, as rounded (one of
    the runs its unit names, whose day and machine it gives): `[(ratio, why)]`."""
    bad = []
    for unit in quoting_units(text):
        flat = ' '.join(unit.split())
        runs = {n: results_run(n) for n in RUN_FILE.findall(flat) if f'bench/{n}' not in OUTPUTS}
        for m in RATIO.finditer(flat):
            value, kind = m.group(1), 'bound' if m.group(2) else 'speed'
            fmt = lambda v: f"{v:.{len(value.split('.')[1])}f}"
            if not runs: bad.append((m.group(0), f"names no results file: {flat[:160]}"))
            elif not any(value in map(fmt, r[kind]) for r in runs.values()):
                bad.append((m.group(0), f"not in {', '.join(f'bench/{n}' for n in runs)}"))
        for n, r in runs.items():
            if r['day'] not in flat or r['machine'] not in flat:
                bad.append((n, f"quoted without its day {r['day']} and machine {r['machine']}"))
    return bad

def markdown(path:Path) -> str:
    return '\n\n'.join(''.join(c['source']) for c in json.loads(path.read_text())['cells'] if c['cell_type'] == 'markdown')

@pytest.mark.parametrize('path', NBS, ids=[p.stem for p in NBS])
def test_notebook_figures_are_dated_runs(path):
    """A notebook's markdown quotes a speed ratio only as one run of bench/ holds it, naming that run's file, day and
    machine (a ratio of anything else is written 'N times'), and quotes no timing (seconds, ms: machine-specific; the
    notebooks that time things measure the reader's machine)."""
    text = markdown(path)
    assert unsourced_ratios(text) == []
    assert MD_TIMING.findall(text) == [], "a timing in the markdown: quote a run of bench/ (a speed ratio), or time it live"

def test_bench_readme_results_are_dated_runs():
    "'Results so far' in bench/README.md: each ratio its paragraph quotes is in the run it names, with its day and machine."
    text = section((REPO/'bench'/'README.md').read_text(), 'Results so far')
    assert unsourced_ratios(text) == [] and len(RATIO.findall(text)) >= 3
    assert RESULTS['meta']['date'] in ' '.join(text.split()) and 'bench/results_cpu.json' in text

@pytest.mark.parametrize('path', NBS, ids=[p.stem for p in NBS])
def test_stored_timings_name_their_machine(path):
    """A code cell whose stored outputs show timings (ms, s/epoch, speed-ups, the `time` column of fastai's progress
    table) comes after a stored `This machine: <CPU>, <n> cores (flags ...), torch ..., executed <date> UTC` line (the
    notebooks' `machine_line()`), in it or in an earlier cell: the reader sees whose timings they are."""
    labelled = False
    for c in json.loads(path.read_text())['cells']:
        if c['cell_type'] != 'code': continue
        texts = [''.join(o.get('text', '')) for o in c.get('outputs', [])]
        texts += [''.join(v) for o in c.get('outputs', []) for k, v in o.get('data', {}).items() if k.startswith('text/')]
        labelled = labelled or any(MACHINE_LINE.search(t) for t in texts)
        timings = sorted({m for t in texts for m in OUT_TIMING.findall(t)})
        assert labelled or not timings, f"cell {c['id']} stores timings ({', '.join(timings)}) without a machine line before them"

# ---- what `loss_scale=512` means, where the argument is documented

def test_loss_scale_512_means_calibrate_where_documented():
    """'calibrate' (and fastai's default 512) calibrates the dynamic scale, a number is the start: said in `MixedPrecision`'s
    docments, in `help(learn.to_fp16)` and `help(MixedPrecision)`, and true of the scaler these arguments make."""
    import pydoc
    from fastcore.docments import docments
    from fp16cb import MixedPrecision
    from fp16cb.scaling import make_scaler
    doc = ' '.join(docments(MixedPrecision.__init__)['loss_scale'].split())
    assert '512' in doc and 'calibrate' in doc and 'start' in doc, doc
    for obj in (Learner.to_fp16, MixedPrecision):
        text = ' '.join(pydoc.render_doc(obj, renderer=pydoc.plaintext).split())
        assert "`loss_scale='calibrate'`" in text and "512" in text and 'n_skipped' in text, obj
    kw = dict(dynamic=True, max_loss_scale=2.**24, div_factor=2., scale_wait=500)
    calibrating, started = make_scaler(None, loss_scale=512, **kw), make_scaler(None, loss_scale=1024, **kw)
    assert (calibrating.calibrating, calibrating.scale) == (True, 1.) and (started.calibrating, started.scale) == (False, 1024.)

# ---- the quick start runs as pasted

def quick_start() -> str:
    return re.search(r'```python\n(.*?)```', section(README, 'Quick start'), re.S).group(1)

def test_quick_start_imports_only_what_it_uses():
    "Each name a `from x import a, b` of the quick start brings in is used below it; `dls` is made there."
    code = quick_start()
    tree = ast.parse(code)
    imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names if a.name != '*'}
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert imported and imported <= used, imported - used
    assert re.search(r'^dls = ', code, re.M)

def test_quick_start_inputs_fit_fp16_on_every_split():
    """The quick start's data, up to its `dls`, on 10 random splits: every input the model sees, training and
    validation, is within fp16's range (fastai's `Normalize` divides a column constant in the training split by ~1e-7:
    its values ~1e7 in validation were inf in fp16, the valid loss nan, on 2 splits of 10)."""
    import warnings
    from fastai.torch_core import set_seed
    code = quick_start()
    made = next(n for n in ast.parse(code).body if isinstance(n, ast.Assign) and getattr(n.targets[0], 'id', '') == 'dls')
    data = '\n'.join(code.splitlines()[:made.end_lineno])
    bad = []
    for seed in range(10):
        set_seed(seed)
        ns = {}
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            exec(compile(data, 'README.md (quick start)', 'exec'), ns)
        top = max(float(b[1].abs().max()) for dl in (ns['dls'].train, ns['dls'].valid) for b in dl)
        if top > 65504: bad.append((seed, top))
    assert bad == [], bad

def test_quick_start_runs_as_pasted(tmp_path):
    """The quick start, run as it stands in a fresh namespace: it trains (3 short epochs) and leaves an FP32 model. Then
    the README's export recipe: the loaded learner has no data until given `dls`, and then trains with `to_fp16()`."""
    import math, warnings
    from fastai.learner import load_learner
    ns = {}
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # the once-per-process fp16-on-CPU warning
        exec(compile(quick_start(), 'README.md (quick start)', 'exec'), ns)
        learn = ns['learn']
        assert len(learn.recorder.values) == 3 and learn.recorder.values[-1][2] > .5
        assert all(p.dtype == torch.float32 for p in learn.model.parameters()) and learn.precision_callbacks() == []
        assert '`learn.dls = dls`, then `learn.to_fp16()`' in ' '.join(section(README, 'Checkpoints').split())
        learn.export(tmp_path/'export.pkl')
        loaded = load_learner(tmp_path/'export.pkl')
        assert len(loaded.dls.train.dataset) == 0  # no data: a fit would train on nothing
        loaded.dls = ns['dls']
        with loaded.no_bar(), loaded.no_logging(): loaded.to_fp16().fit(1, 1e-3)
        assert math.isfinite(loaded.recorder.values[-1][0]) and loaded.recorder.values[-1][2] > .5

# ---- the compatibility table's columns are explained

def test_compatibility_columns_are_explained():
    "Each column of the table (`fp16cb.compat.table()`) is named, in backticks, in the section's prose with what it means."
    from fp16cb.compat import table
    text = section(README, 'What works with what')
    prose = '\n'.join(l for l in text.splitlines() if not l.startswith('|'))
    heads = [h.strip() for h in table().splitlines()[0].strip('|').split('|')][1:]
    assert heads and [h for h in heads if not re.search(rf'`{re.escape(h)}` \(', prose)] == []

# ---- the torch.compile recipe for a splitter that indexes the model

def test_compile_recipe_for_an_indexing_splitter():
    """The README's recipe for `vision_learner`'s splitters, which index the model: without it plain fastai fails to
    make the optimizer ('not subscriptable'); with it the compiled learner trains in bf16 and is FP32 after."""
    from conftest import make_learner, quiet_fit  # its splitter, `two_groups`, indexes the model as vision_learner's do
    text = ' '.join(section(README, 'Checkpoints').split())
    assert '`split = learn.splitter`' in text and '`learn.splitter = lambda m: split(m._orig_mod)`' in text
    learn = make_learner()
    learn.model = torch.compile(learn.model, backend='aot_eager')  # the backend tests/test_compile.py uses (no C++)
    with pytest.raises(TypeError, match='not subscriptable'): quiet_fit(learn, 1)
    learn = make_learner()
    split = learn.splitter
    learn.model = torch.compile(learn.model, backend='aot_eager')
    learn.splitter = lambda m: split(m._orig_mod)
    quiet_fit(learn.to_bf16(), 1)
    assert len(learn.opt.param_groups) == 2 and len(learn.recorder.values) == 1
    learn.to_fp32()
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())
