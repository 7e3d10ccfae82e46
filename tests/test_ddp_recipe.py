"""The multi-process recipe of the docs (nbs/distributed.ipynb), run as written: `torchrun --nproc_per_node=2 train.py` with fastai's
`distrib_ctx` (Accelerate wraps the model in DDP after our setup, and moves it). For every precision mode the model
must LEARN: the loss falls as FP32 DDP's does, the ranks agree, and the weights after the fit match one process
trained on the concatenated batches (what DDP's averaged gradients amount to). A rank that raises ends the job
promptly, with the user's own error on top. The ranks run where `conftest.ranks_device` says: on CUDA with one GPU per
rank (nccl), else on the CPU with gloo, CUDA hidden from them (what the script's `cpu=not torch.cuda.is_available()`
then chooses); each rank records its device and backend, and the tests check them."""
import json, os, re, shutil, socket, subprocess, sys, time
from pathlib import Path
import pytest
import torch
import torch.distributed as dist
from conftest import ranks_device, ranks_env, ranks_backend

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available() or shutil.which('torchrun') is None
                                or __import__('importlib').util.find_spec('accelerate') is None,
                                reason="needs torch.distributed with gloo, torchrun and accelerate")

DOCS = Path(__file__).parents[1]/'nbs'/'distributed.ipynb'
WORLD = 2  # `torchrun --nproc_per_node=2`
TIMEOUT = 180  # seconds for one 2-process run (about 15 s on 2 idle cores)
MODES = {'fp32': '', 'to_bf16': '.to_bf16()', 'to_fp16': '.to_fp16()', 'flat': '.to_bf16(flat_master=True)',
         'half_storage': '.to_bf16(half_storage=True)', 'keep_fp32': ".to_fp16(keep_fp32='classifier')",
         'native': '.to_native_fp16()'}

def readme_script() -> str:
    "The docs' `train.py` (a markdown cell of nbs/distributed.ipynb), as written."
    cells = json.loads(DOCS.read_text())['cells']
    text = '\n'.join(''.join(c['source']) for c in cells if c['cell_type'] == 'markdown')
    return re.search(r"```python\n(# train\.py\n.*?)```", text, re.S).group(1)

def in_mode(script:str, mode:str) -> str:
    "The script with its precision call (`.to_bf16()`) replaced by `mode`'s."
    assert '.to_bf16()' in script
    return script.replace('.to_bf16()', MODES[mode], 1)

DUMP = '''
import json, os
out = os.environ['FP16CB_OUT']
torch.save({k: v.detach().float().cpu() for k, v in learn.model.state_dict().items()}, f'{out}/rank{rank_distrib()}.pth')
json.dump({'losses': [[float(x) for x in v[:2]] for v in learn.recorder.values],
           'dtypes': sorted({str(p.dtype) for p in learn.model.parameters()}),
           'device': str(next(learn.model.parameters()).device), 'backend': torch.distributed.get_backend()},
          open(f'{out}/rank{rank_distrib()}.json', 'w'))
'''

END = 'if torch.distributed.is_initialized():  # leave together'

def with_dump(script:str) -> str:
    "The script writing what each rank holds (`DUMP`) after its fit, before it leaves the process group."
    assert END in script  # the recipe ends the group itself: a gloo rank can abort at exit otherwise (torch's advice)
    return script.replace(END, DUMP + END)

def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); return s.getsockname()[1]

def torchrun(script:str, out:Path, timeout:int=TIMEOUT) -> subprocess.CompletedProcess:
    "Run `script` with `torchrun --nproc_per_node=2` in `out` (its working folder), bounded in time, on `ranks_device`."
    (out/'train.py').write_text(script)
    env = {**os.environ, **ranks_env(WORLD), 'FP16CB_OUT': str(out), 'OMP_NUM_THREADS': '1', 'PYTHONWARNINGS': 'ignore'}
    cmd = ['torchrun', f'--nproc_per_node={WORLD}', '--master_addr=127.0.0.1', f'--master_port={free_port()}', 'train.py']
    return subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=timeout)

@pytest.fixture(scope='module')
def runs(tmp_path_factory) -> dict:
    "`{mode: (rank 0, rank 1)}`, each `(results, weights)`: the docs' script run once per mode."
    res = {}
    for mode in MODES:
        out = tmp_path_factory.mktemp(mode)
        p = torchrun(with_dump(in_mode(readme_script(), mode)), out)
        assert p.returncode == 0, p.stderr[-3000:]
        res[mode] = [(json.loads((out/f'rank{r}.json').read_text()), torch.load(out/f'rank{r}.pth')) for r in (0, 1)]
        assert (out/'models'/'final.pth').exists()
    return res

def one_process(mode:str) -> tuple:
    """The same script in this process, with no DDP: each batch is the two ranks' batches of that step together, in the
    order fastai's `DistributedDL` gives them (rank 0's shuffle, each rank a contiguous half), so 128 rows a step; on the
    ranks' device (fastai's default device for the script's `DataLoaders`)."""
    from fastai.basics import DataLoader
    from fastai.torch_core import defaults
    script = re.sub(r'with learn\.distrib_ctx\(.*\):', 'if True:', in_mode(readme_script(), mode)).replace("learn.save('final')", '')
    class Concatenated(DataLoader):
        "Rank r's batch i is its half of the shuffled indices, rows i*bs:(i+1)*bs; one step holds both ranks' batch i."
        def __init__(self, dl): super().__init__(dl.dataset, bs=2*dl.bs, shuffle=False, drop_last=True, device=dl.device); self.inner = dl
        def randomize(self): self.inner.randomize()  # as `DistributedDL`: the wrapped loader's shuffle, reseeded each epoch
        def get_idxs(self):
            idxs, bs = list(self.inner.get_idxs()), self.inner.bs
            halves = [idxs[:len(idxs)//2], idxs[len(idxs)//2:]]
            return [i for b in range(len(halves[0])//bs) for h in halves for i in h[b*bs:(b+1)*bs]]
    ns = {'Concatenated': Concatenated}
    script = script.replace('learn.fit(', 'init = {k: v.detach().float().clone() for k, v in learn.model.state_dict().items()}; '
                                         'learn.dls.train = Concatenated(learn.dls.train); learn.fit(')
    use_cuda = defaults.use_cuda
    defaults.use_cuda = ranks_device(WORLD).type == 'cuda'
    try: exec(script, ns)
    finally: defaults.use_cuda = use_cuda
    assert next(ns['learn'].model.parameters()).device.type == ranks_device(WORLD).type
    cpu = lambda sd: {k: v.detach().float().cpu() for k, v in sd.items()}
    return cpu(ns['init']), cpu(ns['learn'].model.state_dict())

@pytest.mark.parametrize('mode', list(MODES))
def test_the_readme_recipe_learns(runs, mode):
    "The loss falls as FP32 DDP's does; the model comes back FP32; the ranks hold the same weights."
    (r0, w0), (r1, w1) = runs[mode]
    losses, ref = [l[0] for l in r0['losses']], [l[0] for l in runs['fp32'][0][0]['losses']]
    assert losses[-1] < 0.5 * losses[0], losses  # it learns
    assert abs(losses[-1] - ref[-1]) <= 0.1 * ref[-1] + 0.01, (losses, ref)  # as FP32 DDP does
    assert r0['dtypes'] == ['torch.float32']
    assert (r0['backend'], r1['backend']) == (ranks_backend(WORLD),) * 2  # where `ranks_device` says the ranks run
    assert [r0['device'], r1['device']] == (['cuda:0', 'cuda:1'] if ranks_device(WORLD).type == 'cuda' else ['cpu', 'cpu'])
    for k in w0: assert torch.equal(w0[k], w1[k]), k  # the ranks agree, bit for bit

@pytest.mark.parametrize('mode', list(MODES))
def test_two_processes_match_one_process_on_the_concatenated_batches(runs, mode):
    """DDP's averaged gradients: the weights after the fit are those of one process on batches of 2 x 64 rows. In FP32
    to the last bits; in 16-bit the two compute each step's gradients in another order (two averaged halves vs one
    batch), so they differ by 16-bit rounding, which Adam's 44 steps carry on: the trajectories must still coincide,
    far closer than a run without the averaging (rank 0 on its own half alone: 0.40 on this measure, with to_bf16;
    the 16-bit modes measured 0.004 to 0.012 here)."""
    init, ref = one_process(mode)
    got = runs[mode][0][1]
    dist_ = lambda a, b: torch.cat([(a[k] - b[k]).flatten() for k in a]).norm()
    rel = float(dist_(got, ref) / dist_(ref, init))  # the gap between the runs, in units of the way they went
    assert rel <= {'fp32': 1e-4}.get(mode, 0.1), rel

def test_a_rank_that_raises_ends_the_job_promptly_with_its_own_error(tmp_path):
    "Rank 1 raises in the middle of the fit: no collective in its teardown, so torchrun ends the job at once."
    raising = in_mode(readme_script(), 'to_bf16').replace('    learn.fit(4, 1e-2)', '''    class Boom(Callback):
        def after_batch(self):
            if rank_distrib() == 1 and self.iter == 3: raise ValueError('the user error on rank 1')
    learn.fit(4, 1e-2, cbs=Boom())''')
    t0 = time.time()
    p = torchrun(raising, tmp_path, timeout=120)
    assert p.returncode != 0 and time.time() - t0 < 100
    errors = re.findall(r'^\[rank1\]: (\w+(?:Error|Exception|Interrupt)\b.*)$', p.stderr, re.M)
    assert errors and errors[-1].startswith('ValueError: Exception occured in `Boom`'), p.stderr[-3000:]  # on top
    assert 'the user error on rank 1' in p.stderr

def syncs_buffers(ddp) -> bool:
    "Whether `ddp` syncs its buffers in the forward: `forward_sync_buffers` in newer torch (2.14), `broadcast_buffers` before (2.11)."
    d = vars(ddp)
    return d['forward_sync_buffers'] if 'forward_sync_buffers' in d else d['broadcast_buffers']

@pytest.mark.filterwarnings('ignore:`broadcast_buffers` is deprecated:FutureWarning')  # the user's own, on purpose
@pytest.mark.parametrize('recorded', [True, False], ids=['recorded', 'made-before-fp16cb'])
def test_a_rewrap_keeps_the_users_ddp_arguments(recorded):
    """A model the user wrapped with `broadcast_buffers=False` (and a bucket size) is wrapped again with the same ones:
    those fp16cb recorded when the DDP was made, or, for a DDP made before fp16cb was imported, those the DDP keeps as
    attributes (which differ between torch versions: the rewrap must not read one that this torch lacks)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from fp16cb.distributed import _ddp_kwargs, rewrap
    if not dist.is_initialized():
        dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)
    try:
        ddp = DDP(torch.nn.Linear(2, 2), broadcast_buffers=False, bucket_cap_mb=7, find_unused_parameters=True)
        if recorded:
            kw = _ddp_kwargs(ddp)
            assert kw['broadcast_buffers'] is False and kw['bucket_cap_mb'] == 7 and kw['find_unused_parameters'] is True
        else: del ddp.__dict__['_fp16cb_args']
        again = rewrap(ddp)
        assert again is not ddp and again.module is ddp.module
        assert syncs_buffers(again) is syncs_buffers(ddp) is False
        assert again.bucket_bytes_cap == ddp.bucket_bytes_cap == 7 * 2**20
        assert again.find_unused_parameters is ddp.find_unused_parameters is True
    finally: dist.destroy_process_group()

@pytest.mark.parametrize('recorded', [True, False], ids=['recorded', 'made-before-fp16cb'])
def test_a_rewrap_warns_nothing_of_ours(recorded):
    """Before the fix: torch 2.14 deprecates `broadcast_buffers`; the re-wrap passed the user's `broadcast_buffers=False`
    again (a `FutureWarning` from fp16cb/distributed.py in every run), and the user's own DDP's warning pointed at
    fp16cb's wrapper of `DistributedDataParallel.__init__`, not at the user's line. Now the user's line gets torch's
    warning, and the re-wrap, with the same arguments, says nothing."""
    import warnings
    from torch.nn.parallel import DistributedDataParallel as DDP
    from fp16cb.distributed import rewrap
    if not dist.is_initialized():
        dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)
    try:
        with warnings.catch_warnings(record=True) as users:
            warnings.simplefilter('always')
            ddp = DDP(torch.nn.Linear(2, 2), broadcast_buffers=False, bucket_cap_mb=7)
        assert all(w.filename == __file__ for w in users), [(w.filename, str(w.message)) for w in users]
        if not recorded: del ddp.__dict__['_fp16cb_args']
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            again = rewrap(ddp)
        assert again.module is ddp.module and syncs_buffers(again) is False and again.bucket_bytes_cap == 7 * 2**20
    finally: dist.destroy_process_group()
