"Every notebook of nbs/ runs on CPU without error (so the docs cannot rot), against this checkout's fp16cb; and is clean."
import os
from pathlib import Path
import pytest

nbformat = pytest.importorskip('nbformat')
nbclient = pytest.importorskip('nbclient')

REPO = Path(__file__).resolve().parents[1]
NBS = sorted((REPO/'nbs').glob('*.ipynb'))

CHECK = f"""import fp16cb, pathlib
assert pathlib.Path(fp16cb.__file__).resolve().parent == pathlib.Path({str(REPO)!r}).resolve()/'fp16cb', fp16cb.__file__"""

def test_there_are_notebooks():
    names = {p.name for p in NBS}
    assert {'index.ipynb', 'conversion_and_masters.ipynb', 'callbacks.ipynb', 'diagnostics.ipynb',
            'experiments.ipynb'} <= names

@pytest.mark.parametrize('path', NBS, ids=[p.stem for p in NBS])
def test_notebook_runs(path, monkeypatch):
    # the kernel inherits this environment: this checkout's fp16cb first, one thread (tiny models), no display
    monkeypatch.setenv('PYTHONPATH', os.pathsep.join([str(REPO), os.environ.get('PYTHONPATH', '')]).rstrip(os.pathsep))
    monkeypatch.setenv('OMP_NUM_THREADS', '1')
    monkeypatch.setenv('MPLBACKEND', 'Agg')
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(CHECK))
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name='python3',
                                     resources={'metadata': {'path': str(path.parent)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error

@pytest.mark.parametrize('path', NBS, ids=[p.stem for p in NBS])
def test_notebook_is_clean(path):
    "Committed notebooks carry no outputs, execution counts or metadata noise (`python tools/make_docs_nbs.py --clean`)."
    nb = nbformat.read(path, as_version=4)
    assert set(nb.metadata) <= {'kernelspec', 'language_info'}, f"notebook metadata: {sorted(nb.metadata)}"
    for i, c in enumerate(nb.cells):
        assert not c.get('metadata'), f"cell {i} has metadata {dict(c.metadata)}"
        if c.cell_type == 'code':
            assert c.outputs == [] and c.execution_count is None, f"cell {i} has outputs or an execution count"
