"""Instructions per step, counted: `python -m bench.instructions [--workloads book] [--modes fp32,bf16,fp16]`.

A machine whose speed drifts by 30% within minutes (the shared 2-core CPUs) cannot tell two checkouts 5% apart by
their times. The instructions a step executes do not drift: this runs the benchmark's learners under valgrind's
callgrind, counting only inside each mode's timed fit (switched on and off around it with `callgrind_control`), and
reports instructions per step. It counts work, not time: a memory-bound copy costs more time per instruction than
Python's bookkeeping does, and the kernel's time (page faults) is not counted. Run it in two checkouts to compare them
(cwd first on the path: `cd <checkout> && python -m bench.instructions`). Needs valgrind (`apt install valgrind`);
slow (about 50x: minutes a workload)."""
from __future__ import annotations
import argparse, os, re, shutil, subprocess, sys, tempfile

__all__ = ['count', 'totals', 'main']

def totals(text:str) -> int:
    "The instructions (`totals:` line) of a callgrind dump's text."
    m = re.search(r'^totals:\s+(\d+)', text, re.M)
    if m is None: raise ValueError("not a callgrind dump: no `totals:` line")
    return int(m.group(1))

def count(workload:str, modes:list, steps:int, out:str):
    "Inside callgrind: each mode's fit of `steps` batches counted on its own, dumped as `<out>-<mode>`."
    import torch
    torch.set_num_threads(1)
    from .run import _learner, _fit
    from .workloads import WORKLOADS, make_data, CPU_SCALE
    s = CPU_SCALE[workload]
    torch.manual_seed(0)
    init = WORKLOADS[workload].model(s)
    batches, valid = make_data(workload, s, 'cpu', steps)
    learners = {m: _learner(workload, m, 'adam', 'cpu', batches, valid, init, 1e-3, False, False)[0] for m in modes}
    for m in modes: _fit(learners[m])  # warm-up: the set-up and the first steps are not counted
    ctl = lambda *a: subprocess.run(['callgrind_control', *a, str(os.getpid())], capture_output=True, check=True)
    for m in modes:
        ctl('-z'); ctl('-i', 'on')
        _fit(learners[m])
        ctl('-i', 'off'); ctl('-d', f'{out}-{m}')  # (the dump's description: `Trigger: dump <out>-<mode>`)

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--workloads', default='book', help="comma-separated `bench.workloads.WORKLOADS` keys")
    ap.add_argument('--modes', default='fp32,bf16,fp16', help="comma-separated `bench.modes.MODES` keys")
    ap.add_argument('--steps', type=int, default=10, help="training batches of the counted epoch (and one held out)")
    ap.add_argument('--inside', help=argparse.SUPPRESS)  # (the run under valgrind: its dumps' description)
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(',') if m]
    if a.inside: return count(a.workloads, modes, a.steps, a.inside)
    if shutil.which('valgrind') is None or shutil.which('callgrind_control') is None:
        raise SystemExit("bench.instructions counts with valgrind's callgrind, which is not installed here "
                         "(`apt install valgrind`)")
    for wl in [w for w in a.workloads.split(',') if w]:
        with tempfile.TemporaryDirectory() as d:
            prefix = os.path.join(d, 'cg')  # (the dumps' files)
            cmd = ['valgrind', '--tool=callgrind', '--instr-atstart=no', f'--callgrind-out-file={prefix}.%p',
                   sys.executable, '-m', 'bench.instructions', '--workloads', wl, '--modes', ','.join(modes),
                   '--steps', str(a.steps), '--inside', 'fp16cb']
            subprocess.run(cmd, check=True, capture_output=True)
            per = {}
            for f in os.listdir(d):
                text = open(os.path.join(d, f)).read()
                if m := re.search(r'^desc: Trigger: .*dump fp16cb-(\S+)$', text, re.M): per[m.group(1)] = totals(text)
            if set(per) != set(modes): raise SystemExit(f"callgrind's dumps hold {sorted(per)}, not {modes}")
        base = per.get('fp32')
        for m in modes:  # (an epoch: `steps` training steps and the held-out batch's forward)
            print(f"{wl:6} {m:10} {per[m] / a.steps / 1e6:9.1f} M instructions a step"
                  + (f"  {per[m] / base:.3f}x fp32's" if base else ''))

if __name__ == '__main__': main()
