"""Inference between fits: `learn.get_preds()` on a few items, per precision, modes interleaved in one process (medians
of the rounds, process CPU time). `python -m bench.inference [--rounds 9] [--items 16] [--width 2048]`

A 16-bit learner converts its model for each `get_preds`/`validate`/`predict` and gives the exact FP32 values back
after; what that costs beside the forward itself is the figure (an MLP of 8.4M params at the default width; `bare-bf16`:
the same model in bf16 for good, no conversion per call)."""
import argparse, statistics, time, warnings
import torch
from torch import nn
from fastai.basics import Learner, DataLoaders, DataLoader, MSELossFlat
import fp16cb  # noqa: F401 (Learner.to_fp16 & co.)

def _bare(learn:Learner) -> Learner:
    "The model in bf16 for good, its inputs cast as they enter, the loss in FP32: the forward's own cost, no conversion."
    from fp16cb.callbacks.casts import _cast_inputs
    learn.model.bfloat16().register_forward_pre_hook(_cast_inputs(torch.bfloat16), with_kwargs=True)
    loss = learn.loss_func
    learn.loss_func = lambda pred, *y: loss(pred.float(), *y)
    return learn

def _learner(mode:str, width:int, items:int) -> Learner:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
                          nn.ReLU(), nn.Linear(width, 1))
    x = torch.randn(items, 4); ds = list(zip(x, x.sum(1, keepdim=True)))
    dls = DataLoaders(DataLoader(ds, bs=items), DataLoader(ds, bs=items), device='cpu')
    learn = Learner(dls, model, loss_func=MSELossFlat())
    if mode == 'bare-bf16': return _bare(learn)
    return learn if mode == 'fp32' else getattr(learn, f'to_{mode}')()

def measure(modes=('fp32', 'bf16', 'bare-bf16', 'fp16'), rounds:int=9, items:int=16, width:int=2048) -> dict:
    "`{mode: median ms of one get_preds}`, the modes interleaved round by round (one warm-up call each first)."
    torch.set_num_threads(1)
    learners, times = {m: _learner(m, width, items) for m in modes}, {m: [] for m in modes}
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for r in range(rounds + 1):
            for m, l in learners.items():
                with l.no_bar(), l.no_logging():
                    t = time.process_time(); l.get_preds(); dt = time.process_time() - t
                if r: times[m].append(dt * 1e3)
    return {m: statistics.median(v) for m, v in times.items()}

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--rounds', type=int, default=9); p.add_argument('--items', type=int, default=16)
    p.add_argument('--width', type=int, default=2048)
    a = p.parse_args()
    res = measure(rounds=a.rounds, items=a.items, width=a.width)
    for m, ms in res.items(): print(f"{m:5s} {ms:7.1f} ms  {ms / res['fp32']:.2f}x FP32's time")
