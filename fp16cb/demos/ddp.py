"""Multi-process mixed precision, end to end on CPUs: 2 processes (gloo, localhost) train a small MLP wrapped in torch's
`DistributedDataParallel`, in FP32 and in each precision mode, and report what the all-reduce moved per step, the
buckets' dtypes, the final loss scale, and whether the ranks ended bit-identical.

    python -m fp16cb.demos.ddp                             # launches 2 local processes itself (gloo)
    torchrun --nproc_per_node=2 -m fp16cb.demos.ddp        # the same under torchrun (nccl when each process has a GPU)

`launch` (local processes with the environment `torchrun` sets), `init`, `shard`, `DDPWrap` and `ByteCounter` are also
what the tests of `tests/test_distributed.py` are built from."""
from __future__ import annotations
import argparse, hashlib, math, os, socket, subprocess, sys
from datetime import timedelta
from functools import partial
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from fastai.callback.core import Callback

__all__ = ['free_port', 'launch', 'ranks_on_cuda', 'init', 'shard', 'ByteCounter', 'count_allreduce', 'DDPWrap',
           'fingerprint', 'demo_learner', 'shutdown', 'main']

def free_port() -> int:
    "A TCP port free on 127.0.0.1 now (for `MASTER_PORT`)."
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); return s.getsockname()[1]

def launch(
    cmd:list, # the command each process runs, e.g. `[sys.executable, '-m', 'fp16cb.demos.ddp']`
    nprocs:int=2, # number of processes (ranks)
    timeout:float=60., # seconds before every process is killed and a `TimeoutError` raised
    env:dict|None=None, # more environment variables
) -> list: # each rank's stdout
    "Run `cmd` as `nprocs` local processes with the variables `torchrun` sets (RANK, WORLD_SIZE, MASTER_ADDR/PORT...)."
    port, procs = free_port(), []
    for rank in range(nprocs):
        e = {**os.environ, 'OMP_NUM_THREADS': '1', **(env or {}), 'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': str(port),
             'RANK': str(rank), 'LOCAL_RANK': str(rank), 'WORLD_SIZE': str(nprocs), 'LOCAL_WORLD_SIZE': str(nprocs)}
        procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try: outs = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs: p.kill()
        errs = [p.communicate()[1][-2000:] for p in procs]
        raise TimeoutError(f"{cmd} did not finish in {timeout:g} s on {nprocs} processes; stderr tails: {errs}")
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        if p.returncode: raise RuntimeError(f"rank {rank} of {cmd} exited with {p.returncode}:\n{err[-4000:]}")
    return [o for o, _ in outs]

def ranks_on_cuda(local_world:int|None=None) -> bool:
    """Whether this machine's `local_world` processes (default: `LOCAL_WORLD_SIZE`, as `torchrun` sets it) train on
    GPUs: one for each. Else they train on the CPU with gloo: nccl refuses two ranks on one GPU (a one-GPU H100
    machine)."""
    n = int(os.environ.get('LOCAL_WORLD_SIZE', 1)) if local_world is None else local_world
    return torch.cuda.is_available() and torch.cuda.device_count() >= n

def init(timeout:float=60.) -> int:
    "Join the process group the environment describes (nccl on GPUs, one per process, else gloo); returns this rank."
    if not dist.is_initialized():
        backend = 'nccl' if ranks_on_cuda() else 'gloo'
        dist.init_process_group(backend, init_method='env://', timeout=timedelta(seconds=timeout))
        if backend == 'nccl': torch.cuda.set_device(int(os.environ.get('LOCAL_RANK', 0)))
    return dist.get_rank()

def shard(items:list, bs:int, rank:int, world:int) -> list:
    """This rank's part of `items` when global batch `i` is `items[i*bs*world:(i+1)*bs*world]` cut into `world` batches
    of `bs` in rank order: one process on batches of `bs*world` sees exactly the concatenation of the ranks' batches."""
    B = bs * world
    return [x for i in range(0, len(items), B) for x in items[i + rank*bs: i + (rank+1)*bs]]

class ByteCounter:
    """Counts what DDP's all-reduces move (bytes per rank, all buckets): `counter.register(ddp_model)` before the first
    backward; it then all-reduces as DDP does by default. `bytes`, `calls` and the buckets' `dtypes` so far."""
    def __init__(self): self.bytes, self.calls, self.dtypes = 0, 0, set()
    def register(self, ddp:DDP): ddp.register_comm_hook(self, count_allreduce)

def count_allreduce(state:ByteCounter, bucket):
    "A DDP comm hook: count the bucket into `state` (a `ByteCounter`), then DDP's default all-reduce (the average)."
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    buf = bucket.buffer()
    state.bytes += buf.numel() * buf.element_size(); state.calls += 1; state.dtypes.add(str(buf.dtype))
    return allreduce_hook(None, bucket)

class DDPWrap(Callback):
    """Wraps the model in torch's DDP in `before_fit`, after the precision callbacks (order 11, as fastai's
    `DistributedTrainer`, which does the same through Accelerate), and unwraps it in `after_fit`."""
    order = 11
    def __init__(self,
        counter=None, # a `ByteCounter` to count the all-reduced bytes with
    ): self.counter = counter
    def before_fit(self):
        self.learn.model = DDP(self.learn.model)
        if self.counter is not None: self.counter.register(self.learn.model)
    def after_fit(self):
        if isinstance(self.learn.model, DDP): self.learn.model = self.learn.model.module

def fingerprint(model) -> str:
    "A hash of every parameter and buffer of `model` (bit-exact comparison across processes)."
    h = hashlib.sha256()
    for k, v in sorted(getattr(model, 'module', model).state_dict().items()):
        h.update(k.encode()); h.update(v.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]

def synth(n:int=128, n_in:int=16, seed:int=0) -> list:
    "`y = x @ w + noise`, the same for every process."
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(n, n_in, generator=g), torch.randn(n_in, 1, generator=g)
    y = x @ w + 0.1*torch.randn(n, 1, generator=g)
    return list(zip(x, y))

def mlp(n_in:int=16, n_hidden:int=256, bn:bool=True) -> nn.Module:
    layers = [nn.Linear(n_in, n_hidden)] + ([nn.BatchNorm1d(n_hidden)] if bn else []) + [nn.ReLU(),
              nn.Linear(n_hidden, n_hidden), nn.ReLU(), nn.Linear(n_hidden, 1)]
    return nn.Sequential(*layers)

def demo_learner(rank:int=0, world:int=1, bs:int=16, n:int=128, seed:int=0, bn:bool=True, lr:float=1e-2, cbs=None):
    "A CPU/CUDA `Learner` on this rank's shard of fixed synthetic data; the model initialised from `seed`."
    from fastai.basics import Learner, DataLoaders, Datasets, ItemGetter, SGD, MSELossFlat
    torch.manual_seed(seed)
    model = mlp(bn=bn)
    dsets = [Datasets(shard(items, bs, rank, world), tfms=[[ItemGetter(0)], [ItemGetter(1)]])
             for items in (synth(n), synth(32, seed=1))]
    device = torch.device('cuda', torch.cuda.current_device()) if ranks_on_cuda() else torch.device('cpu')
    dls = DataLoaders.from_dsets(*dsets, bs=bs, shuffle=False, num_workers=0, device=device)
    return Learner(dls, model, loss_func=MSELossFlat(), opt_func=partial(SGD, mom=0.9), lr=lr, cbs=cbs)

MODES = {'fp32': lambda l: l, 'to_fp16': lambda l: l.to_fp16(), 'to_fp16 flat': lambda l: l.to_fp16(flat_master=True),
         'to_bf16': lambda l: l.to_bf16(), 'to_native_fp16': lambda l: l.to_native_fp16()}

def _pow2(x:float) -> str:
    e = math.log2(x)
    return f"2^{int(e)}" if e == int(e) and e != 0 else f"{x:g}"

def _worker(epochs:int):
    import warnings; warnings.filterwarnings('ignore')
    import fp16cb  # noqa: F401  (patches Learner.to_fp16 & co.)
    from fastai.callback.progress import ProgressCallback
    rank, world = init(), int(os.environ['WORLD_SIZE'])
    rows = []
    for name, mode in MODES.items():
        counter = ByteCounter()
        # the ranks start from different inits: DDP's broadcast and fp16cb's make them agree
        learn = mode(demo_learner(rank, world, seed=rank, cbs=DDPWrap(counter)))
        learn.remove_cb(ProgressCallback)
        with learn.no_logging(): learn.fit(epochs)
        steps = epochs * len(learn.dls.train)
        pcb = next((c for c in learn.cbs if hasattr(c, 'loss_scale')), None)
        fps = [None] * world
        dist.all_gather_object(fps, fingerprint(learn.model))
        rows.append((name, counter.bytes // steps, '+'.join(sorted(d.replace('torch.', '') for d in counter.dtypes)),
                     _pow2(pcb.loss_scale) if pcb is not None else '-', len(set(fps)) == 1))
        del learn, pcb
    if rank == 0:
        n = sum(p.numel() for p in mlp().parameters())
        print(f"{world} processes ({dist.get_backend()}), MLP of {n} params, {steps} steps per mode, batch {16*world}")
        print(f"{'mode':<15} {'all-reduce bytes/step':>22} {'buckets':>14} {'loss scale':>10}  ranks bit-identical")
        for name, b, dts, scale, same in rows: print(f"{name:<15} {b:>22,} {dts:>14} {scale:>10}  {same}")
    shutdown()

def shutdown():
    """Leave the process group in order: the DDP wrappers (which hold it) freed while it is alive, every rank done
    with its collectives (a barrier), then destroyed here rather than by the interpreter's exit, where gloo's threads
    could be torn down under a peer that is still using them (`terminate called without an active exception`)."""
    import gc
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--nproc', type=int, default=2, help="processes to launch when not started by torchrun")
    p.add_argument('--epochs', type=int, default=1)
    args = p.parse_args(argv)
    if 'RANK' in os.environ:  # one rank (started by `launch` or torchrun)
        _worker(args.epochs)
        # every collective is done and the group destroyed: leave without the interpreter's teardown, in which gloo's
        # threads once aborted a finished rank ("terminate called without an active exception")
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(0)
    outs = launch([sys.executable, '-m', 'fp16cb.demos.ddp', '--epochs', str(args.epochs)], args.nproc, timeout=300)
    print(outs[0], end='')

if __name__ == '__main__': main()
