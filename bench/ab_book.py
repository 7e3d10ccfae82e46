"""A/B of the bookkeeping hot path in ONE process (the fair way to compare two versions on shared, noisy cores):
`MasterWeights`, `OverflowCheck` and `MixedPrecision.before_step/after_step` of git revision REV ('old') against this
checkout ('new'), on the bookkeeping-bound workload, learners interleaved round-robin, CPU clock.
    python -m bench.ab_book REV [MODES] [ROUNDS]    e.g. `HEAD~1 bf16-flat,bf16,fp16-flat 6` (from the repository root)"""
import sys, time, statistics, importlib.util, contextlib, subprocess, tempfile, ast, textwrap, os, torch
torch.set_num_threads(1)
from fp16cb import callbacks as C
from bench import run as R, workloads as W, measure as M

rev = sys.argv[1]
modes = (sys.argv[2] if len(sys.argv) > 2 else 'bf16-flat,bf16,fp16-flat').split(',')
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
tmp = tempfile.mkdtemp()
def old_module(name):
    path = os.path.join(tmp, f'{name}.py')
    with open(path, 'w') as f: f.write(subprocess.check_output(['git', 'show', f'{rev}:fp16cb/{name}.py'], text=True))
    spec = importlib.util.spec_from_file_location(f'old_{name}', path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m, open(path).read()
(old_m, _), (old_o, _) = old_module('master'), old_module('overflow')
src = subprocess.check_output(['git', 'show', f'{rev}:fp16cb/callbacks.py'], text=True)
OLD, NEW = {}, {}
for node in ast.parse(src).body:
    if isinstance(node, ast.ClassDef) and node.name == 'MixedPrecision':
        for f in node.body:
            if isinstance(f, ast.FunctionDef) and f.name in ('before_step', 'after_step'):
                ns = {}; exec(textwrap.dedent(ast.get_source_segment(src, f)), C.__dict__, ns)
                OLD[f.name], NEW[f.name] = ns[f.name], C.MixedPrecision.__dict__[f.name]
new_m, new_o = C.MasterWeights, C.OverflowCheck

@contextlib.contextmanager
def version(v):
    "Learners are built and fit under their version: `MixedPrecision` looks these names up at run time."
    C.MasterWeights, C.OverflowCheck = (old_m.MasterWeights, old_o.OverflowCheck) if v == 'old' else (new_m, new_o)
    for k, f in (OLD if v == 'old' else NEW).items(): setattr(C.MixedPrecision, k, f)
    try: yield
    finally:
        C.MasterWeights, C.OverflowCheck = new_m, new_o
        for k, f in NEW.items(): setattr(C.MixedPrecision, k, f)

M.set_clock('cpu')
s = W.CPU_SCALE['book']; torch.manual_seed(0)
init = W.WORKLOADS['book'].model(s); batches, valid = W.make_data('book', s, 'cpu', 3)
L = {}
for m in modes:
    for v in ('old', 'new'):
        with version(v):
            learn, rec = R._learner('book', m, 'adam', 'cpu', batches, valid, init, 1e-3, cb_timers=True, fused_ok=False)
            for cb in learn.cbs:
                if isinstance(cb, C.MixedPrecision): cb.check = C.OverflowCheck()
            for _ in range(3): R._fit(learn)  # warm-up
            rec.update(steps=[], cb_steps=[], skips=[], events={})
        L[(m, v)] = (learn, rec)
n_params, bounds, keys = sum(p.numel() for p in init.parameters()), [], list(L)
for r in range(rounds):
    bounds.append(M.copy_bound(n_params, torch.bfloat16, 'cpu'))
    for k in (keys if r % 2 == 0 else keys[::-1]):
        with version(k[1]): R._fit(L[k][0])
bound = 1e3 * statistics.median(bounds)
print(f"A/B {rev} (old) vs checkout (new), book workload, {rounds} rounds x 3 steps; bookkeeping bound {bound:.2f} ms\n")
print("| mode | version | ms/step | ms in precision cbs | cbs / bound | before_step | after_step |\n|---|---|---:|---:|---:|---:|---:|")
for (m, v), (learn, rec) in L.items():
    n, cb = len(rec['steps']), 1e3 * statistics.median(rec['cb_steps'])
    ev = {e: 1e3 * t / n for e, t in rec['events'].items()}
    print(f"| {m} | {v} | {1e3*statistics.median(rec['steps']):.1f} | {cb:.2f} | {cb/bound:.2f} | "
          f"{ev.get('before_step', 0):.2f} | {ev.get('after_step', 0):.2f} |")
