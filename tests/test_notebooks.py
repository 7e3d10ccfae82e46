"""The notebooks of nbs/ are the docs, and their own source. Every one runs on CPU against this checkout's fp16cb (so
the docs cannot rot), stores its outputs (tables, figures) for the reader, and the stored outputs of the cells tagged
`deterministic` are those of a fresh run. `python tools/run_nbs.py [NAME]` re-executes them in place."""
import base64, importlib.util, re
from pathlib import Path
import pytest

nbformat = pytest.importorskip('nbformat')
nbclient = pytest.importorskip('nbclient')

REPO = Path(__file__).resolve().parents[1]
NBS = sorted((REPO/'nbs').glob('*.ipynb'))

_spec = importlib.util.spec_from_file_location('run_nbs', REPO/'tools'/'run_nbs.py')
run_nbs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_nbs)
TAG = run_nbs.DETERMINISTIC
REGENERATE = "run `python tools/run_nbs.py {}` and commit the notebook"

CHECK = f"""import fp16cb, pathlib
assert pathlib.Path(fp16cb.__file__).resolve().parent == pathlib.Path({str(REPO)!r}).resolve()/'fp16cb', fp16cb.__file__"""

_runs = {}
def executed(path):
    "The notebook at `path` run in a fresh kernel as `run_nbs` runs it, after a check of which fp16cb it imports."
    if path not in _runs:
        nb = nbformat.read(path, as_version=4)
        check = nbformat.v4.new_code_cell(CHECK)
        check.id = 'test-check-fp16cb'
        nb.cells.insert(0, check)
        try: _runs[path] = run_nbs.execute(nb, timeout=180)
        except Exception as e: _runs[path] = e
    if isinstance(_runs[path], Exception): raise _runs[path]  # CellExecutionError: the cell and its traceback
    return _runs[path]

def test_there_are_notebooks():
    names = {p.stem for p in NBS}
    assert {'index', 'conversion_and_masters', 'callbacks', 'loss_scalers', 'workflow', 'diagnostics', 'experiments',
            'examples', 'which_mode', 'troubleshooting', 'overflow_diagnostics', 'precision_policy', 'distributed'} <= names

@pytest.mark.parametrize('path', NBS, ids=[p.stem for p in NBS])
def test_notebook_runs(path):
    executed(path)  # raises CellExecutionError, with the cell and its traceback, on any error

def _texts(outputs) -> list:
    "The text of `outputs`: streams (consecutive chunks of one stream joined), and the text/plain of results."
    res = []
    for o in outputs:
        if o.output_type == 'stream':
            if res and res[-1][0] == o.name: res[-1] = (o.name, res[-1][1] + o.text)
            else: res.append((o.name, o.text))
        elif o.output_type in ('execute_result', 'display_data'): res.append(('data', o.data.get('text/plain', '')))
        elif o.output_type == 'error': res.append(('error', o.ename))
    return res

def _images(outputs) -> int: return sum('image/png' in o.get('data', {}) for o in outputs)

@pytest.mark.parametrize('path', NBS, ids=[p.stem for p in NBS])
def test_stored_outputs_are_current(path):
    "Where a cell is tagged `deterministic` its stored text is a fresh run's; a stored figure is drawn again."
    stored = nbformat.read(path, as_version=4)
    fresh = {c.id: c for c in executed(path).cells}
    tagged = [c for c in stored.cells if TAG in c.metadata.get('tags', [])]
    assert tagged, f"{path.name}: no cell is tagged {TAG!r}: nothing checks that its stored outputs are current"
    for c in stored.cells:
        if c.cell_type != 'code': continue
        if c in tagged:
            assert _texts(c.outputs) == _texts(fresh[c.id].outputs), \
                f"{path.name}, cell {c.id}: stored outputs are out of date: " + REGENERATE.format(path.stem)
        if _images(c.outputs):
            assert _images(fresh[c.id].outputs), f"{path.name}, cell {c.id}: the figure is not displayed any more"

PLOTS = re.compile(r"plt\.show\(\)|\.plot\b|\.plot\.\w+\(|plot_loss_scale\(|plot_gradient_range\(|show_batch\(|show_results\(")
MACHINE_PATHS = re.compile(r"/work/|/root/|/home/|/tmp/|site-packages")

@pytest.mark.parametrize('path', NBS, ids=[p.stem for p in NBS])
def test_notebook_stores_its_outputs(path):
    "Read as docs, a notebook shows what its cells print and draw: executed top to bottom, figures as PNG, no noise."
    nb = nbformat.read(path, as_version=4)
    assert set(nb.metadata) <= {'kernelspec'}, f"notebook metadata: {sorted(nb.metadata)}"
    cells = [c for c in nb.cells if c.cell_type == 'code']
    assert [c.execution_count for c in cells] == list(range(1, len(cells) + 1)), \
        f"{path.name} was not executed top to bottom in one run: " + REGENERATE.format(path.stem)
    assert any(c.outputs for c in cells), f"{path.name} stores no outputs"
    for c in nb.cells:
        assert set(c.metadata) <= {'tags'}, f"cell {c.id} has metadata {dict(c.metadata)}"
        if c.cell_type != 'code': continue
        assert 'matplotlib.use(' not in c.source, f"cell {c.id} forces a matplotlib backend: its figures would not show"
        for o in c.outputs:
            assert o.output_type != 'error', f"cell {c.id} stores an error"
            assert not (o.output_type == 'stream' and o.name == 'stderr'), \
                f"cell {c.id} stores stderr (a warning?): {o.text[:200]}"
            text = o.get('text', '') + str(o.get('data', {}).get('text/plain', ''))
            assert not MACHINE_PATHS.search(text), f"cell {c.id} stores a path of the machine: {text[:200]}"
        if 'plt.show()' in c.source: assert _images(c.outputs), f"cell {c.id} shows a figure but stores none"
    if any(PLOTS.search(c.source) for c in cells):
        assert sum(_images(c.outputs) for c in cells), f"{path.name} plots but stores no image/png"

def test_notebooks_are_light():
    "Outputs stay small: figures at 72 dpi, short tables."
    sizes = {p.name: p.stat().st_size for p in NBS}
    assert sum(sizes.values()) < 2_000_000, sizes
    assert max(sizes.values()) < 300_000, sizes
    for p in NBS:
        for c in nbformat.read(p, as_version=4).cells:
            for o in c.get('outputs', []):
                png = o.get('data', {}).get('image/png')
                if png: assert len(base64.b64decode(png)) < 100_000, f"{p.name}, cell {c.id}: a large figure"
