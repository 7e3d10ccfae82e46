"""Training state per rank under FSDP2, in bytes per parameter of the whole model: `python -m bench.fsdp_memory
[--json out.json]` (2 local processes on the CPU with gloo, against one unsharded process).

Counted right after an optimizer step (fastai's `after_step`): this rank's FP32 params (its shards), their grads and
the optimizer's state (fastai's `Adam`; bf16 state as its shards, 8-bit state as this rank's codes and block scales),
divided by the parameters of the whole model, an MLP of about 9.5M. With 2 ranks, each holds half of one process's,
plus what does not divide (8-bit state's block scales are per rank's shard)."""
from __future__ import annotations
import argparse, json, os, sys, time, warnings
import torch
from torch import nn
from fastai.basics import Learner, DataLoaders, Adam, MSELossFlat, Callback

import fp16cb  # noqa: F401
from fp16cb.demos.fsdp import state_bytes

MODES = {'bf16': {}, 'bf16-state': dict(state_dtype=torch.bfloat16), 'bf16-state8': dict(state_dtype='8bit')}

class Count(Callback):
    "Bytes of params, grads and optimizer state at the first `after_step`."
    order = 30
    def after_step(self):
        if not hasattr(self, 'res'): self.res = state_bytes(self.learn)

def mlp(width:int=1536) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(width, width), nn.GELU())], nn.Linear(width, 1))

def run(mode:str, sharded:bool) -> dict:
    x, y = torch.randn(64, 1536), torch.randn(64, 1)
    dls = DataLoaders.from_dsets(list(zip(x, y)), list(zip(x[:8], y[:8])), bs=8, num_workers=0)
    model = mlp()
    n = sum(p.numel() for p in model.parameters())
    if sharded: fp16cb.shard_model(model, layers=[nn.Linear])
    learn = Learner(dls, model, loss_func=MSELossFlat(), opt_func=Adam, lr=1e-3).to_bf16(**MODES[mode])
    count = Count()
    with learn.no_bar(), learn.no_logging(): learn.fit(1, cbs=[count, *([fp16cb.DistributedData()] if sharded else [])])
    return {k: v / n for k, v in count.res.items()} | {'n_params': n}

def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--json', default=None)
    p.add_argument('--rank-out', default=None, help=argparse.SUPPRESS)  # one rank of the 2-process launch
    a = p.parse_args()
    warnings.filterwarnings('ignore')
    torch.set_num_threads(1)
    if a.rank_out:
        from fp16cb.demos.ddp import init, shutdown
        rank = init(timeout=120)
        res = {m: run(m, sharded=True) for m in MODES}
        if rank == 0: open(a.rank_out, 'w').write(json.dumps(res))
        return shutdown()
    from fp16cb.demos.ddp import launch
    one = {m: run(m, sharded=False) for m in MODES}
    out = f'/tmp/fsdp_memory_{os.getpid()}.json'
    launch([sys.executable, '-m', 'bench.fsdp_memory', '--rank-out', out], nprocs=2, timeout=600)
    two = json.loads(open(out).read())
    from bench.measure import cpu_flags
    print(f"bytes/param after a step, fastai Adam, MLP of {one['bf16']['n_params']/1e6:.1f}M params; CPU: {cpu_flags()}")
    print("| mode | params | grads | state | total | 2 ranks: each rank's total | ratio |\n|---|---:|---:|---:|---:|---:|---:|")
    for m in MODES:
        t1, t2 = (sum(r[k] for k in ('params', 'grads', 'state')) for r in (one[m], two[m]))
        print(f"| `to_bf16({', '.join(f'{k}={v!r}' for k, v in MODES[m].items())})` | {one[m]['params']:.2f} | "
              f"{one[m]['grads']:.2f} | {one[m]['state']:.2f} | {t1:.2f} | {t2:.2f} "
              f"({two[m]['params']:.2f} + {two[m]['grads']:.2f} + {two[m]['state']:.2f}) | {t2/t1:.3f} |")
    if a.json: json.dump(dict(date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), cpu=cpu_flags(), one=one,
                              two_ranks_rank0=two), open(a.json, 'w'), indent=1)

if __name__ == '__main__': main()
