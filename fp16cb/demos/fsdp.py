"""Past one device's memory, end to end on CPUs: 2 processes (gloo, localhost) train a classifier of scikit-learn's
digits whose model is sharded with PyTorch FSDP2 (`fp16cb.shard_model`), in FP32 and in each precision mode, and report
the validation accuracy, the bytes of training state each rank holds per parameter (its shards of the params, their
grads and the optimizer's state) and whether the ranks' gathered models are bit-identical.

    python -m fp16cb.demos.fsdp                        # launches 2 local processes itself (gloo)
    torchrun --nproc_per_node=2 -m fp16cb.demos.fsdp   # the same under torchrun (nccl when each process has a GPU)"""
from __future__ import annotations
import argparse, os, sys
import torch
import torch.distributed as dist
from torch import nn

from .ddp import launch, init, shutdown, ranks_on_cuda, fingerprint

__all__ = ['nbytes', 'state_bytes', 'digits_learner', 'MODES', 'main']

def nbytes(t) -> int:
    "The bytes this rank holds for `t`: a DTensor's shard; 8-bit state's codes and block scales."
    from fp16cb.distributed import local_shard
    from fp16cb.storage.state8 import State8
    t = local_shard(t)
    return t.numel() + t.scale.numel() * 4 if isinstance(t, State8) else t.numel() * t.element_size()

def state_bytes(learn) -> dict:
    "This rank's bytes of the trainable params, their grads and the optimizer's state (tensors shaped like a param)."
    from fp16cb.weights.optstate import opt_state
    ps, st = [p for p in learn.model.parameters() if p.requires_grad], opt_state(learn.opt)
    return dict(params=sum(nbytes(p) for p in ps), grads=sum(nbytes(p.grad) for p in ps if p.grad is not None),
                state=sum(nbytes(v) for p in ps for v in st.get(p, {}).values() if torch.is_tensor(v) and v.dim()))

class Measure:
    "A fastai callback's worth: the rank's `state_bytes` at the fit's first `after_step`."
    def __new__(cls):
        from fastai.callback.core import Callback
        class _Measure(Callback):
            order = 30
            def after_step(self):
                if not hasattr(self, 'res'): self.res = state_bytes(self.learn)
        return _Measure()

def digits_learner(device, hidden:int=512, seed:int=0):
    "A classifier of scikit-learn's digits (8x8 images, 10 classes), its model the same on every rank (`seed`)."
    from sklearn.datasets import load_digits
    from fastai.basics import Learner, DataLoaders, Adam, CrossEntropyLossFlat, accuracy
    import fastai.callback.schedule  # noqa: F401  (Learner.fit_one_cycle)
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(len(x), generator=g)
    items = [(x[i], y[i]) for i in idx.tolist()]
    dls = DataLoaders.from_dsets(items[:1536], items[1536:], bs=64, shuffle=False, num_workers=0, device=device)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                          nn.ReLU(), nn.Linear(hidden, 10)).to(device)
    return Learner(dls, model, loss_func=CrossEntropyLossFlat(), opt_func=Adam, lr=3e-3, metrics=accuracy)

MODES = {'fp32': lambda l: l, 'to_bf16()': lambda l: l.to_bf16(), 'to_fp16()': lambda l: l.to_fp16(),
         "to_bf16(state_dtype='8bit')": lambda l: l.to_bf16(state_dtype='8bit')}

def _worker(epochs:int):
    import warnings; warnings.filterwarnings('ignore')
    from fp16cb import shard_model, DistributedData, full_state_dict
    from fp16cb.storage import state8
    state8.MIN_NUMEL = 4096  # this small model's hidden layers (262k elements) 8-bit, as a large model's would be
    rank, world = init(), int(os.environ['WORLD_SIZE'])
    device = torch.device('cuda', torch.cuda.current_device()) if ranks_on_cuda() else torch.device('cpu')
    rows = []
    for name, mode in MODES.items():
        learn = digits_learner(device)
        n = sum(p.numel() for p in learn.model.parameters())
        shard_model(learn.model, layers=[nn.Linear])
        learn, measure = mode(learn), Measure()
        with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(epochs, cbs=[DistributedData(), measure])
        fps = [None] * world
        params = dict(learn.model.named_parameters())  # (BatchNorm's running statistics are each rank's own)
        dist.all_gather_object(fps, fingerprint(_Whole({k: v for k, v in full_state_dict(learn.model).items()
                                                        if k in params})))
        b = {k: v / n for k, v in measure.res.items()}
        rows.append((name, *learn.recorder.values[-1][1:], b, len(set(fps)) == 1))
        learn.to_fp32()
    if rank == 0:
        print(f"{world} processes ({dist.get_backend()}), an MLP of {n:,} params sharded with FSDP2, "
              f"{epochs} epochs, batch {64*world}")
        print(f"{'mode':<28} {'valid loss':>10} {'accuracy':>8}  {'bytes/param on a rank: params + grads + state':>45}"
              f"  ranks' weights agree")
        for name, loss, acc, b, same in rows:
            parts = f"{b['params']:.2f} + {b['grads']:.2f} + {b['state']:.2f} = {sum(b.values()):.2f}"
            print(f"{name:<28} {loss:>10.4f} {acc:>8.3f}  {parts:>45}  {same}")
    shutdown()

class _Whole:
    "A whole state dict in `fingerprint`'s hands."
    def __init__(self, sd): self.sd = sd
    def state_dict(self): return self.sd

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--epochs', type=int, default=4)
    a = p.parse_args(argv)
    if 'RANK' in os.environ: return _worker(a.epochs)
    print(launch([sys.executable, '-m', 'fp16cb.demos.fsdp', '--epochs', str(a.epochs)], nprocs=2, timeout=600)[0])

if __name__ == '__main__': main()
