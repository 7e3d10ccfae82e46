"""The package's shape: no import cycle among fp16cb's modules (late imports inside functions count too), no core
module over ~450 lines (the demos are not core), and no line of any module over 120 characters."""
import ast
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
