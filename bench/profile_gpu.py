"""Where a step's time goes on a GPU, mode by mode: `python -m bench.profile_gpu [--workload resnet50] [--modes ...]
[--lift-chunks 22,25]` (from the repository root, on a CUDA machine; `--device cpu` rehearses it). For each mode (and
each chunk size of the lift, as powers of 2): the step time, the kernels launched per step, and the ops with the most
self time on the host (launch-bound steps) and on the device. A maintainer's tool beside `bench.profile_book` (the
CPU's): the benchmark itself never runs the profiler."""
import argparse, statistics
import torch
from torch.profiler import profile, ProfilerActivity
from bench import run as R, workloads as W, measure as BM
from fp16cb.weights import loop

# what waits for the device (a tensor read on the host; the runtime's waits) or copies across, counted per step
SYNCS = ('aten::_local_scalar_dense', 'aten::item', 'cudaStreamSynchronize', 'cudaDeviceSynchronize', 'cudaMemcpyAsync',
         'cudaEventSynchronize')

def _ms(rec) -> str:
    "The median of the steps that ran the optimizer, in ms (a skipped step is never timed as a step, as in the benchmark)."
    kept = BM.stepped(rec)
    return f"{1e3*statistics.median(rec['steps'][i] for i in kept):.1f}" if kept else '-'

def profile_mode(wl, mode, opt, device, batches, valid, init, top, chunk=None):
    learn, rec = R._learner(wl, mode, opt, device, batches, valid, init, 1e-3, cb_timers=False, fused_ok=device.type == 'cuda')
    for _ in range(3): R._fit(learn)  # warm-up: the dynamic scales settle, the allocator caches
    BM.clear_steps(rec)
    R._fit(learn); plain = _ms(rec)  # the same steps without the profiler
    BM.clear_steps(rec)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == 'cuda' else [])
    with profile(activities=acts) as prof: R._fit(learn)
    n = len(rec['steps'])
    evs = prof.key_averages()
    kernels = sum(e.count for e in evs if e.device_type == torch.autograd.DeviceType.CUDA)
    counts = {k: sum(e.count for e in evs if e.key == k) / n for k in SYNCS}
    what = f"{mode}+{opt}" + (f", lift chunk 2^{chunk}" if chunk else '')
    print(f"\n## {what}: {plain} ms/step ({_ms(rec)} profiled; {n - len(BM.stepped(rec))} of its {n} steps skipped), "
          f"{kernels/n:.0f} kernels/step")
    print('per step: ' + ', '.join(f"{v:g} {k}" for k, v in counts.items()))
    print(evs.table(sort_by='self_cpu_time_total', row_limit=top, max_name_column_width=60))
    if device.type == 'cuda': print(evs.table(sort_by='self_cuda_time_total', row_limit=top, max_name_column_width=60))
    del learn

def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--workload', default='resnet50')
    p.add_argument('--modes', default='bare-bf16,bf16,bf16-flat,fp16,fp16-flat,autocast')
    p.add_argument('--opts', default='adam')
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--scale', type=float, default=None)
    p.add_argument('--top', type=int, default=12)
    p.add_argument('--lift-chunks', default='', help="chunk sizes of the lift to compare, as powers of 2 (e.g. 22,25; default: the device's)")
    a = p.parse_args()
    device = torch.device(a.device)
    s = a.scale if a.scale is not None else (1. if device.type == 'cuda' else R.CPU_SCALE[a.workload])
    BM.set_clock('wall' if device.type == 'cuda' else 'cpu')
    torch.manual_seed(0)
    init = W.WORKLOADS[a.workload].model(s)
    batches, valid = W.make_data(a.workload, s, device, 3)
    default = dict(loop.STATE_CHUNK)
    for c in [int(c) for c in a.lift_chunks.split(',') if c] or [None]:
        loop.STATE_CHUNK = {'cpu': 2**c, 'cuda': 2**c} if c else default
        for o in a.opts.split(','):
            for m in a.modes.split(','): profile_mode(a.workload, m, o, device, batches, valid, init, a.top, c)
    loop.STATE_CHUNK = default

if __name__ == '__main__': main()
