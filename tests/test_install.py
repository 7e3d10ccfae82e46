"""The README's install, as a newcomer meets it: `git clone` makes a folder named `fp16cb`, and scripts run from the
folder that holds it. Run against the environment `pip install -e ".[dev]"` made (a fresh Python, not pytest's path)."""
import importlib.metadata, os, subprocess, sys
from pathlib import Path
import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """import fp16cb
from fastai.learner import Learner
print(fp16cb.__file__)
print(Learner.to_fp16.__module__)
"""

def test_a_clone_named_fp16cb_does_not_shadow_the_package(tmp_path):
    """Before the fix the editable install was an import hook, which Python asks only after `sys.path`: the clone in
    the script's folder, `fp16cb/` without an `__init__.py` of its own, imported as an empty namespace package,
    `import fp16cb` patched nothing, and `learn.to_fp16()` was silently fastai's. The install now puts the checkout's
    folder on `sys.path`, where the real package is found and wins over a namespace one."""
    try: importlib.metadata.distribution('fp16cb')
    except importlib.metadata.PackageNotFoundError:  # tools/gpu-check.sh: the checkout on PYTHONPATH, nothing installed
        pytest.skip("fp16cb is not pip-installed here (it is imported from PYTHONPATH): no install to check")
    (tmp_path/'fp16cb').symlink_to(REPO, target_is_directory=True)  # the clone, as `git clone` names it
    (tmp_path/'train.py').write_text(SCRIPT)
    paths = [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p and Path(p).resolve() != REPO]
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    if paths: env['PYTHONPATH'] = os.pathsep.join(paths)  # what else is there (fastai from a folder), the checkout not
    r = subprocess.run([sys.executable, 'train.py'], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    file, module = r.stdout.split()[-2:]
    assert file != 'None', "fp16cb imported as an empty namespace package: the clone shadows the installed package"
    assert Path(file).resolve() == REPO/'fp16cb'/'__init__.py', (
        f"{file}: not this checkout's fp16cb; install it with `pip install -e \".[dev]\"` from {REPO}")
    assert module == 'fp16cb.learner'
