"""One rank of the multi-process tests (`tests/test_distributed.py` launches 2 with `fp16cb.demos.ddp.launch`): runs
every scenario in turn, each with a fresh DDP, and writes what it saw to `OUT/rank{RANK}.json` for the test to compare.
Every rank starts from a different random init (`seed=rank`) and trains on its own shard of the data. The ranks train
where `init` puts them: on CUDA (nccl, the GPU of their LOCAL_RANK) when CUDA is visible to them, else on the CPU
(gloo; the test hides CUDA from them where there is no GPU for each rank); `_where` in the results says which."""
import hashlib, json, math, os, sys, warnings
from pathlib import Path
warnings.filterwarnings('ignore')
import torch
import torch.utils.checkpoint
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from fastai.callback.core import Callback
from fastai.callback.progress import ProgressCallback

import fp16cb  # noqa: F401  (patches Learner.to_fp16 & co.)
from fp16cb.callbacks import MixedPrecision
from fp16cb.callbacks import NativeMixedPrecision
from fp16cb.demos.ddp import init, demo_learner, DDPWrap, ByteCounter, fingerprint

torch.set_num_threads(1)
OUT = Path(sys.argv[1])
RANK = init(timeout=60)
WORLD = dist.get_world_size()
DEVICE = torch.device('cuda', torch.cuda.current_device()) if dist.get_backend() == 'nccl' else torch.device('cpu')

def precision_cb(learn):
    return next(c for c in learn.cbs if isinstance(c, (MixedPrecision, NativeMixedPrecision)))

class OnRank(Callback):
    "Runs `fn(learn)` at `event` of training iteration `it` (every iteration if None), on rank `rank` only."
    def __init__(self, event, fn, rank=1, it=None): self.event, self.fn, self.rank, self.it = event, fn, rank, it
    def __call__(self, event_name):
        if event_name == self.event and self.training and RANK == self.rank and self.it in (None, self.learn.iter):
            self.fn(self.learn)
        super().__call__(event_name)

def inner(learn): return getattr(learn.model, 'module', learn.model)

def fit(learn, epochs=1):
    learn.remove_cb(ProgressCallback)
    with learn.no_logging(): learn.fit(epochs)
    return learn

S = 2.**12  # the first loss scale: these gradients overflow fp16 above it, and every step would be skipped
MODES = {'to_fp16': lambda l: l.to_fp16(max_loss_scale=S), 'to_fp16_flat': lambda l: l.to_fp16(max_loss_scale=S, flat_master=True),
         'to_fp16_state': lambda l: l.to_fp16(max_loss_scale=S, state_dtype=torch.bfloat16),
         'to_fp16_half': lambda l: l.to_fp16(max_loss_scale=S, half_storage=True),
         'to_bf16': lambda l: l.to_bf16(), 'to_native_fp16': lambda l: l.to_native_fp16(init_scale=S)}

def identical(order, mode):
    "Train under DDP, wrapped after the precision callbacks (`order='after'`, as fastai does) or by the user before."
    counter = ByteCounter()
    if order == 'after': learn = MODES[mode](demo_learner(RANK, WORLD, seed=RANK, cbs=DDPWrap(counter)))
    else:
        learn = demo_learner(RANK, WORLD, seed=RANK)
        learn.model = DDP(learn.model.to(DEVICE)); counter.register(learn.model)  # the user's DDP, on the rank's device
        MODES[mode](learn)
    fit(learn)
    pcb = precision_cb(learn)
    after = {'ddp': isinstance(learn.model, DDP), 'dtype': str(next(learn.model.parameters()).dtype)}
    n_bytes, fp = counter.bytes, fingerprint(learn.model)
    if order == 'before':  # the user's DDP model still all-reduces in FP32 after the fit: one plain step
        learn.to_fp32(); fit(learn)
    return dict(fp=fp, dtypes=sorted(counter.dtypes), bytes_per_step=n_bytes / len(pcb.skips), skips=pcb.skips,
                scales=pcb.scales, after=after, fp_after=fingerprint(learn.model),
                device=str(next(learn.model.parameters()).device))

class Recomputed(torch.nn.Module):
    "`inner` under torch's non-reentrant activation checkpointing: its forward runs again in the backward."
    def __init__(self, inner): super().__init__(); self.inner = inner
    def forward(self, x): return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)

def checkpointed(mode):
    """The demo model's hidden Linear and ReLU recomputed in the backward (wrapped by DDP after the precision callbacks),
    and the same fit without it: their weights, and the losses of the checkpointed fit."""
    fps = {}
    for ck in (False, True):
        learn = demo_learner(RANK, WORLD, seed=RANK, cbs=DDPWrap(ByteCounter()))
        # (a layer below the model's children: the one the backward calls again is no child of the model)
        if ck: learn.model[3], learn.model[4] = torch.nn.Sequential(Recomputed(learn.model[3:5])), torch.nn.Identity()
        MODES[mode](learn)
        fit(learn, 2)
        learn.to_fp32()
        vals = getattr(learn.model, 'module', learn.model).state_dict().values()  # (in the same order, other names)
        fps[ck] = hashlib.sha256(b''.join(v.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
                                          for v in vals)).hexdigest()[:16]
    return dict(plain=fps[False], recomputed=fps[True], losses=[float(l) for l in learn.recorder.losses])

def grad_of(learn):
    "The first Linear's weight grad as the precision callback will read it (after DDP's all-reduce)."
    return inner(learn)[0].weight.grad

def set_inf(learn): grad_of(learn).view(-1)[0] = float('inf')

def inf_one_rank(mode):
    "An inf in rank 1's gradients after the all-reduce, at the second step: every rank must skip it."
    learn = demo_learner(RANK, WORLD, cbs=[DDPWrap(), OnRank('after_backward', set_inf, it=1)])
    learn = learn.to_native_bf16() if mode == 'to_native_bf16' else MODES[mode](learn)
    pcb = precision_cb(fit(learn))
    return dict(skips=pcb.skips, scales=pcb.scales, fp=fingerprint(learn.model))

def mul_loss_inf(learn): learn.loss_grad = learn.loss_grad * float('inf')

def inf_loss_one_rank():
    "GradScaler (`to_native_fp16`): an inf loss on rank 1 only; DDP's all-reduce carries the inf to every rank."
    learn = demo_learner(RANK, WORLD, cbs=[DDPWrap(), OnRank('before_backward', mul_loss_inf, it=1, rank=1)])
    pcb = precision_cb(fit(learn.to_native_fp16(init_scale=S)))
    return dict(skips=pcb.skips, scales=pcb.scales, fp=fingerprint(learn.model))

def bump(learn):
    "A large finite value in rank 1's grads only (after the all-reduce): the ranks' max|grad| differ."
    g = grad_of(learn).view(-1)
    g[0] = min(g.abs().max().item() * 64, 6e4)

def lognormal_scales():
    learn = demo_learner(RANK, WORLD, cbs=[DDPWrap(), OnRank('after_backward', bump)]).to_fp16(scaler='lognormal')
    pcb = precision_cb(fit(learn, 2))
    return dict(scales=pcb.scales, skips=pcb.skips, mu=pcb.scaler.mu, var=pcb.scaler.var, n_obs=pcb.scaler.n_obs)

def single():
    "No BatchNorm (its batch statistics are per rank): the run a single process on the concatenated batches matches."
    learn = fit(demo_learner(RANK, WORLD, seed=0, bn=False, cbs=DDPWrap()).to_fp16(max_loss_scale=2.**12), 2)
    if RANK == 0: torch.save({k: v.cpu() for k, v in inner(learn).state_dict().items()}, OUT/'ddp_single.pt')
    return dict(skips=precision_cb(learn).skips, fp=fingerprint(learn.model))

def save_load():
    "Mid-fit `learn.save` on every rank (as `SaveModelCallback` does): rank 0 alone writes; the DDP still all-reduces."
    saved = {}
    def save(learn):
        learn.save('mid'); saved.update(precision_cb(learn).state_dict()['scaler'])
    learn = demo_learner(RANK, WORLD, seed=RANK, cbs=[DDPWrap(), OnRank('after_batch', save, rank=RANK, it=2)])
    learn.path = OUT/f'r{RANK}'
    fit(learn.to_fp16(max_loss_scale=S, scale_wait=2), 2)
    learn.export('export.pkl')
    dist.barrier()
    fresh = demo_learner(RANK, WORLD).to_fp16(max_loss_scale=S, scale_wait=2)
    fresh.path = OUT/'r0'
    fresh.load('mid')
    loaded = precision_cb(fresh).state_dict()['scaler']
    return dict(saved=saved, loaded=loaded, wrote=(OUT/f'r{RANK}'/'models'/'mid.pth').exists(),
                exported=(OUT/f'r{RANK}'/'export.pkl').exists(), fp=fingerprint(learn.model),
                scales=precision_cb(learn).scales)

def fastai_accelerate(mode):
    "fastai's own path: `distrib_ctx` (Accelerate's DDP); on CPUs with `cpu=True, sync_bn=False` and gloo."
    import fastai.distributed  # noqa: F401  (needs accelerate)
    counter = ByteCounter()
    class Count(Callback):
        order = 12  # after fastai's `DistributedTrainer` (11) has wrapped the model
        def before_fit(self): counter.register(self.learn.model)
    learn = MODES[mode](demo_learner(0, 1, seed=RANK, cbs=Count()))  # the whole data: fastai's DistributedDL shards it
    with learn.distrib_ctx(sync_bn=False, cpu=DEVICE.type == 'cpu'): fit(learn)
    return dict(fp=fingerprint(learn.model), dtypes=sorted(counter.dtypes), skips=precision_cb(learn).skips,
                device=str(next(learn.model.parameters()).device))

def have_accelerate():
    try: import accelerate  # noqa: F401
    except ImportError: return False
    return True

SCENARIOS = {**{f'identical_{o}_{m}': (lambda o=o, m=m: identical(o, m)) for o in ('after', 'before') for m in MODES},
             **{f'inf_{m}': (lambda m=m: inf_one_rank(m)) for m in ('to_fp16', 'to_native_bf16')},
             'inf_loss_native': inf_loss_one_rank, 'lognormal': lognormal_scales, 'single': single, 'save_load': save_load,
             **{f'checkpoint_{m}': (lambda m=m: checkpointed(m)) for m in ('to_bf16', 'to_fp16')}}
if have_accelerate(): SCENARIOS.update({f'fastai_{m}': (lambda m=m: fastai_accelerate(m)) for m in ('to_fp16', 'to_native_fp16')})

results = {'_where': dict(backend=dist.get_backend(), device=str(DEVICE), world=WORLD)}
for name, fn in SCENARIOS.items():
    if len(sys.argv) > 2 and name not in sys.argv[2:]: continue
    try: results[name] = fn()
    except Exception as e: results[name] = {'error': f'{type(e).__name__}: {e}'}
    dist.barrier()
(OUT/f'rank{RANK}.json').write_text(json.dumps(results, default=str))
dist.barrier()  # leave together: a gloo rank exiting while its peer still talks can abort
dist.destroy_process_group()
