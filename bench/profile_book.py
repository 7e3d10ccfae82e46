"Per-step time of the bookkeeping methods on the bookkeeping-bound workload: `python -m bench.profile_book bf16-flat` (or bf16, fastai; from the repository root)."
import torch, sys, time, statistics
torch.set_num_threads(1)
from bench import run as R, workloads as W, measure as BM
from fp16cb.weights import params as P, drivers as D
from fp16cb import scaling as O
import fastai.callback.fp16 as F
T={}
def wrap(obj, name, key=None):
    f=getattr(obj,name); key=key or name
    def w(*a, **k):
        t=time.process_time(); r=f(*a,**k)
        if isinstance(r, torch.Tensor): r.tolist()
        T.setdefault(key,[]).append(time.process_time()-t); return r
    setattr(obj,name,w)
for n in ('prepare_grads','skip','finish','clip'): wrap(P.ModelParams,n)
wrap(O.OverflowCheck,'__call__','overflow_check+sync')
wrap(D.FusedLoop,'runs'); wrap(D.FusedRun,'step')
for n in ('grad_overflow','to_master_grads','to_model_params'): wrap(F,n,'fastai.'+n)
mode = sys.argv[1]
s=.1; torch.manual_seed(0)
init=W.WORKLOADS['book'].model(s); batches, valid = W.make_data('book', s, 'cpu', 5)
BM.set_clock('cpu')
learn, rec = R._learner('book', mode, 'adam', 'cpu', batches, valid, init, 1e-3, cb_timers=True, fused_ok=False)
for _ in range(3): R._fit(learn)
T.clear(); BM.clear_steps(rec)
for _ in range(4): R._fit(learn)
n=len(rec['steps'])
print(mode, 'per step ms (median):', {k: round(statistics.median(v)*1e3,3) for k,v in T.items()})
print('  events:', {k: round(v*1e3/n,3) for k,v in rec['events'].items()}, 'callbacks total', round(statistics.median(rec['cb_steps'])*1e3,3))
np_=sum(p.numel() for p in init.parameters())
print('  bound cold', round(BM.copy_bound(np_, torch.bfloat16, 'cpu')*1e3,3), 'hot', round(BM.copy_bound(np_, torch.bfloat16, 'cpu', cold=False)*1e3,3))
