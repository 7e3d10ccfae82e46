"""Execute the documentation notebooks of nbs/ in place: their sources are kept, fresh outputs are stored.

    python tools/run_nbs.py                       # every nbs/*.ipynb (about 3 minutes on 2 CPU cores)
    python tools/run_nbs.py which_mode index      # these notebooks only
    python tools/run_nbs.py --clean [NAME...]     # strip outputs and execution counts instead (no execution)

The notebooks are the source of the docs: edit one in Jupyter (or any editor), then run this on it and commit the
notebook with its outputs. tests/test_notebooks.py executes every notebook again with `execute` below, so they cannot
rot, and checks what is stored:

- Execution: a fresh `python3` kernel started in nbs/, this checkout's fp16cb first on `PYTHONPATH`, one OpenMP
  thread, `PYTHONHASHSEED=0`, matplotlib's inline backend (never force one: figures must be stored as PNG).
- Cells tagged `deterministic` (`DETERMINISTIC`) print nothing that depends on the machine, the timing or the
  numerics of training; their stored text outputs must equal a fresh run's. Every notebook has at least one.
- Stored: outputs and execution counts (1, 2, ... in one run); notebook metadata: the kernel spec only; cell
  metadata: tags only (`tidy`). No stderr (filter or catch expected warnings in the cell), no error, no path of the
  machine, figures at 72 dpi (`plt.rcParams['figure.dpi'] = 72`).
- The set-up cell, first code cell of a notebook: `%matplotlib inline`, the imports, `import fp16cb` before fastai's
  star import where fastai's import-time warnings would reach stderr, the 72 dpi setting, and a filter for the
  once-per-process "fp16/bf16 training on the CPU" warning where the notebook trains in a dtype the CPU may emulate.
"""
import os, sys
from pathlib import Path
import nbformat

REPO = Path(__file__).resolve().parents[1]
NBS = REPO/'nbs'
DETERMINISTIC = 'deterministic'  # the tag of cells whose stored text outputs must equal a fresh run's

__all__ = ['REPO', 'NBS', 'DETERMINISTIC', 'kernel_env', 'execute', 'tidy', 'clean', 'notebooks', 'main']

def kernel_env() -> dict:
    """The kernel's environment: this checkout's fp16cb first, one thread (tiny models), matplotlib's inline backend, and
    no warning from tqdm about a missing ipywidgets."""
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONHASHSEED='0',
               PYTHONWARNINGS='ignore:IProgress not found',  # tqdm.auto in a kernel without ipywidgets: not the reader's
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get('PYTHONPATH', '')]).rstrip(os.pathsep))
    env.pop('MPLBACKEND', None)  # a forced backend (Agg) would keep the figures out of the notebook
    return env

def execute(nb, timeout:int=300):
    "Run `nb` in place in a fresh kernel started in nbs/; returns it (raises `CellExecutionError` with the cell and traceback)."
    from nbclient import NotebookClient
    NotebookClient(nb, timeout=timeout, kernel_name='python3', record_timing=False, shutdown_kernel='immediate',
                   resources={'metadata': {'path': str(NBS)}}).execute(env=kernel_env())
    return nb

def tidy(nb):
    "Keep the kernel spec, cell tags, outputs and execution counts; drop the rest (timings, versions, widget state)."
    nb.metadata = {k: v for k, v in nb.metadata.items() if k == 'kernelspec'}
    for c in nb.cells:
        c.metadata = {'tags': c.metadata['tags']} if c.metadata.get('tags') else {}
        if c.cell_type == 'code': c.pop('attachments', None)
    return nb

def clean(nb):
    "`tidy`, and no outputs or execution counts."
    for c in tidy(nb).cells:
        if c.cell_type == 'code': c.outputs, c.execution_count = [], None
    return nb

def notebooks(names=()) -> list:
    "The paths of the notebooks named (`index` or `index.ipynb`), or of every notebook in nbs/."
    if not names: return sorted(NBS.glob('*.ipynb'))
    paths = [NBS/f"{n.removesuffix('.ipynb')}.ipynb" for n in names]
    missing = [p.name for p in paths if not p.exists()]
    if missing: raise SystemExit(f"no such notebook in nbs/: {', '.join(missing)}")
    return paths

def main(argv):
    flags = {a for a in argv if a.startswith('-')}
    if flags - {'--clean'}: raise SystemExit(__doc__)
    for path in notebooks([a for a in argv if not a.startswith('-')]):
        nb = clean(nbformat.read(path, as_version=4))  # sources kept; outputs and counts from scratch
        if '--clean' not in flags:
            print(f"executing {path.name}", flush=True)
            execute(nb)
        nbformat.write(tidy(nb), path)

if __name__ == '__main__': main(sys.argv[1:])
