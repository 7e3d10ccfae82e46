"""The package's shape: no import cycle among fp16cb's modules (late imports inside functions count too), no core
module over ~450 lines (the demos are not core), and no line of any module over 120 characters."""
import ast
import pytest
from pathlib import Path

PKG = Path(__file__).parent.parent / 'fp16cb'

def _modules() -> dict:
    "`{dotted name: path}` of every module of the package."
    res = {}
    for f in PKG.rglob('*.py'):
        parts = f.relative_to(PKG.parent).with_suffix('').parts
        res['.'.join(parts[:-1] if parts[-1] == '__init__' else parts)] = f
    return res

def _imports(name:str, path:Path, known:set) -> set:
    "The fp16cb modules `name` imports anywhere in its code (module level or inside functions)."
    pkg = name if path.name == '__init__.py' else name.rsplit('.', 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ''
            if node.level:
                up = pkg.split('.')[:len(pkg.split('.')) - node.level + 1]
                base = '.'.join(up + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.add(full if full in known else base)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in known and m != name}

def test_no_import_cycle():
    mods = _modules()
    graph = {n: _imports(n, p, set(mods)) for n, p in mods.items()}
    # a package's __init__ re-exports its modules: an arrow into the package is an arrow into the module it names
    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            n, path = stack.pop()
            for m in graph[n]:
                if m == start: return path + [m]
                if m not in seen and not start.startswith(m + '.') and not m.startswith(n + '.'):
                    seen.add(m); stack.append((m, path + [m]))
        return None
    cycles = [c for n in graph if n.count('.') >= 1 and not n.startswith('fp16cb.demos') for c in [cycle_from(n)] if c
              and not any(a.startswith(b + '.') or b.startswith(a + '.') for a, b in zip(c, c[1:]))]
    assert not cycles, cycles[0]

def test_no_core_module_over_450_lines():
    long = {str(p.relative_to(PKG.parent)): n for name, p in _modules().items() if not name.startswith('fp16cb.demos')
            for n in [len(p.read_text().splitlines())] if n > 450}
    assert not long, long

def test_no_line_over_120_characters():
    "Every line of every module under fp16cb/ (the demos too) is at most 120 characters: `file:line (length)`."
    long = [f"{p.relative_to(PKG.parent)}:{i} ({len(l)})" for p in sorted(PKG.rglob('*.py'))
            for i, l in enumerate(p.read_text().splitlines(), 1) if len(l) > 120]
    assert not long, long

def _room(name:str) -> str: return '.'.join(name.split('.')[:2])

def test_rooms_import_one_way():
    """Between rooms (a subpackage, or a top-level module) the arrows flow one way: no room imports, even late, a room
    that imports it back (the callbacks never import the diagnostics; the diagnostics read the callbacks)."""
    mods = _modules()
    arrows = {(_room(n), _room(m)) for n, p in mods.items() if n != 'fp16cb' and not n.startswith('fp16cb.demos')
              for m in _imports(n, p, set(mods)) if m != 'fp16cb' and _room(n) != _room(m)}
    both = sorted((a, b) for a, b in arrows if (b, a) in arrows and a < b)
    assert not both, both
    rooms, order = {r for a in arrows for r in a}, []
    while rooms:  # every arrow points to a room that comes earlier: a cycle of three or more is caught too
        free = {r for r in rooms if not any(a == r and b in rooms for a, b in arrows)}
        assert free, f"a cycle among {sorted(rooms)}"
        order += sorted(free); rooms -= free

def test_only_patches_changes_other_modules_classes():
    """No module but `patches` sets an attribute on a class it imports (`Imported.name = ...`, `setattr(...)` at module
    level, fastcore's `@patch`): every change to fastai's, torch's or our other modules' classes is listed there."""
    found = []
    for name, p in _modules().items():
        if name == 'fp16cb.patches': continue
        tree = ast.parse(p.read_text())
        imported = {a.asname or a.name.split('.')[0] for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                    for a in n.names}
        for n in tree.body:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AugAssign) else []
            found += [f"{name}:{n.lineno}" for t in targets
                      if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in imported]
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call) and getattr(n.value.func, 'id', '') == 'setattr':
                found.append(f"{name}:{n.lineno}")
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
                found += [f"{name}:{n.lineno}" for d in n.decorator_list if getattr(d, 'id', '') == 'patch']
    assert not found, found

@pytest.mark.parametrize('pkg', ['weights', 'storage'])
def test_the_package_docstring_lists_its_modules_in_import_order(pkg):
    "`fp16cb/<pkg>/__init__.py` lists every module of the package, each importing only modules listed below it."
    import re
    mods = _modules()
    listed = re.findall(r"^- `(\w+)`", (PKG/pkg/'__init__.py').read_text(), re.M)
    here = sorted(n.rsplit('.', 1)[1] for n in mods if n.startswith(f'fp16cb.{pkg}.'))
    assert sorted(listed) == here, (sorted(listed), here)
    for i, m in enumerate(listed):
        up = {n.rsplit('.', 1)[1] for n in _imports(f'fp16cb.{pkg}.{m}', mods[f'fp16cb.{pkg}.{m}'], set(mods))
              if n.startswith(f'fp16cb.{pkg}.')} & set(listed[:i])
        assert not up, f"{m} imports {up}, listed above it"

def test_the_default_path_never_imports_storage_precision():
    """`fp16cb.weights` (the default path: the model's FP32 params, stepped by the user's optimizer) imports nothing of
    `fp16cb.storage` (what the optimizer keeps in fewer bits), even late: storage joins the step through registries."""
    mods = _modules()
    found = {n: sorted(m for m in _imports(n, p, set(mods)) if m.startswith('fp16cb.storage'))
             for n, p in mods.items() if n.startswith('fp16cb.weights')}
    assert not any(found.values()), found

def test_importing_fp16cb_leaves_fsdp2_unimported():
    """FSDP2's and DTensor's modules are imported only by the code that shards a model (`shard_model`, FSDP2 itself):
    importing them took 1.7 s of `import fp16cb`'s 2.2 on an AVX2-only AMD EPYC, in every process (a notebook, a rank)."""
    import subprocess, sys
    code = ("import sys, fastai.basics; import fp16cb; "
            "print(sorted(m for m in ('torch.distributed.fsdp', 'torch.distributed.tensor') if m in sys.modules))")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == '[]', out.stdout
