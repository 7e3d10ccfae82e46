"""Multi-process training under torch's `DistributedDataParallel`: 2 processes on 127.0.0.1, launched once for the module
by `fp16cb.demos.ddp.launch` and bounded in time; `tests/ddp_worker.py` runs the scenarios on each rank and these tests
compare what the ranks saw. Every rank starts from its own random init and trains on its own data. The ranks run where
`conftest.ranks_device` says: on CUDA with one GPU per rank (nccl), else on the CPU with gloo (CUDA hidden from them),
as in CI; `test_ranks_run_where_the_run_says` checks that they did."""
import json, sys
from pathlib import Path
import pytest
import torch
import torch.distributed as dist
from fastai.callback.progress import ProgressCallback

import fp16cb  # noqa: F401  (patches Learner.to_fp16 & co.)
from fp16cb.demos.ddp import launch, demo_learner, shard
from fp16cb.distributed import reduce_max_, syncs, is_multiprocess
from conftest import ranks_device, ranks_env, ranks_backend

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")

WORKER = Path(__file__).with_name('ddp_worker.py')
WORLD = 2
TIMEOUT = 90  # seconds for the 2 processes to run every scenario (about 25 s on 2 idle cores)
MODES = ('to_fp16', 'to_fp16_flat', 'to_fp16_state', 'to_fp16_half', 'to_bf16', 'to_native_fp16')
HALF = {'to_fp16': 'torch.float16', 'to_fp16_flat': 'torch.float16', 'to_fp16_state': 'torch.float16',
        'to_fp16_half': 'torch.float16', 'to_bf16': 'torch.bfloat16'}
STORE = ('to_fp16_half',)  # the modes whose model is converted to 16 bits for the fit (a store beside it)

@pytest.fixture(scope='module')
def ranks(tmp_path_factory):
    "`(rank 0's results, rank 1's results, output folder)`: one launch of 2 processes for the whole module."
    out = tmp_path_factory.mktemp('ddp')
    launch([sys.executable, str(WORKER), str(out)], nprocs=WORLD, timeout=TIMEOUT, env=ranks_env(WORLD))
    r0, r1 = (json.loads((out/f'rank{r}.json').read_text()) for r in (0, 1))
    return r0, r1, out

def both(ranks, name):
    r0, r1, _ = ranks
    for r in (r0, r1): assert 'error' not in r[name], r[name]['error']
    return r0[name], r1[name]

def test_ranks_run_where_the_run_says(ranks):
    "On CUDA (nccl), rank r on GPU r, when this run is on CUDA with a GPU for each rank; else on the CPU (gloo)."
    r0, r1, _ = ranks
    cuda = ranks_device(WORLD).type == 'cuda'
    for rank, r in enumerate((r0, r1)):
        assert r['_where'] == dict(backend=ranks_backend(WORLD), device=f'cuda:{rank}' if cuda else 'cpu', world=WORLD)

@pytest.mark.parametrize('order', ['after', 'before'])  # DDP wraps after our callbacks (fastai's way), or the user wrapped first
@pytest.mark.parametrize('mode', MODES)
def test_ranks_bit_identical(ranks, order, mode):
    a, b = both(ranks, f'identical_{order}_{mode}')
    assert (a['device'], b['device']) == (ranks[0]['_where']['device'], ranks[1]['_where']['device'])  # the rank's own
    assert a['fp'] == b['fp']  # different inits and data, the same FP32 weights and buffers, bit for bit
    assert a['skips'] == b['skips'] and not any(a['skips'])  # steps were taken
    # what the all-reduce moves: the FP32 grads of the model's own params (laid out flat or not, 16-bit state or not; as
    # FSDP2 reduces in FP32); 16-bit buckets where a store converts the model (`half_storage`)
    assert a['dtypes'] == sorted(['torch.float32', HALF[mode]] if mode in STORE else ['torch.float32'])

@pytest.mark.parametrize('order', ['after', 'before'])
def test_allreduce_bytes_by_mode(ranks, order):
    """The model's own FP32 params (the default, `flat_master`, `state_dtype`): the all-reduce moves FP32 grads, as
    autocast's does. A 16-bit model (`half_storage`): 16-bit gradient buckets, half the bytes (plus BatchNorm's FP32
    params)."""
    fp32 = both(ranks, f'identical_{order}_to_native_fp16')[0]['bytes_per_step']  # autocast keeps FP32 params and grads
    n_params, n_bn = 70913, 512
    assert fp32 == 4 * n_params
    for mode in HALF:
        want = 2 * (n_params - n_bn) + 4 * n_bn if mode in STORE else 4 * n_params
        assert both(ranks, f'identical_{order}_{mode}')[0]['bytes_per_step'] == want

def test_user_ddp_is_an_fp32_ddp_again_after_the_fit(ranks):
    "A model the user wrapped before `to_fp16` is converted and wrapped again; after the fit it all-reduces in FP32."
    for mode in MODES:
        a, b = both(ranks, f'identical_before_{mode}')
        assert a['after'] == {'ddp': True, 'dtype': 'torch.float32'}
        assert a['fp_after'] == b['fp_after'] != a['fp']  # one more FP32 step on different data: still identical

@pytest.mark.parametrize('mode', ['to_fp16', 'to_native_bf16'])
def test_inf_on_one_rank_skips_every_rank(ranks, mode):
    "An inf in rank 1's gradients after the all-reduce (only there): the flag is all-reduced, both ranks skip."
    a, b = both(ranks, f'inf_{mode}')
    assert a['skips'] == b['skips'] == [False, True, False, False]
    assert a['scales'] == b['scales'] and a['fp'] == b['fp']

def test_inf_loss_on_one_rank_reaches_gradscaler_everywhere(ranks):
    "GradScaler checks each rank's grads alone: DDP's all-reduce is what carries rank 1's inf to rank 0."
    a, b = both(ranks, 'inf_loss_native')
    assert a['skips'] == b['skips'] == [False, True, False, False] and a['scales'] == b['scales']

def test_lognormal_statistics_equal_on_every_rank(ranks):
    "Rank 1's max|grad| is larger (after the all-reduce): the MAX over ranks feeds both scalers the same statistic."
    a, b = both(ranks, 'lognormal')
    assert a['n_obs'] > 0 and a['scales'] == b['scales']
    assert (a['mu'], a['var']) == (b['mu'], b['var'])

def test_matches_one_process_on_the_concatenated_batches(ranks):
    a, _ = both(ranks, 'single')
    ddp = torch.load(ranks[2]/'ddp_single.pt')
    learn = demo_learner(0, 1, bs=32, seed=0, bn=False).to_fp16(max_loss_scale=2.**12)
    learn.dls.to(ranks_device(WORLD))  # where the ranks trained (`demo_learner` picks CUDA whenever this process sees it)
    learn.remove_cb(ProgressCallback)
    with learn.no_logging(): learn.fit(2)
    assert learn.mixed_precision.skips == a['skips']
    assert next(learn.model.parameters()).device.type == ranks_device(WORLD).type
    ref = {k: v.cpu() for k, v in learn.model.state_dict().items()}
    for k, v in ddp.items():  # fp16 grads are averaged in fp16 by DDP: equal up to 16-bit rounding
        torch.testing.assert_close(v, ref[k], rtol=2e-2, atol=2e-3)
    assert max((v - ref[k]).abs().max().item() for k, v in ddp.items()) > 0  # not the same run by accident

def test_save_and_export_write_on_rank_0_and_load_restores_the_scaler(ranks):
    a, b = both(ranks, 'save_load')
    assert (a['wrote'], b['wrote']) == (a['exported'], b['exported']) == (True, False)  # only rank 0 writes
    for r in (a, b): assert r['loaded'] == r['saved'] and r['saved']['n_steps'] > 0
    assert a['fp'] == b['fp']  # the save wrapped DDP again on every rank: it still all-reduces afterwards

@pytest.mark.parametrize('mode', ['to_fp16', 'to_native_fp16'])
def test_fastai_distrib_ctx(ranks, mode):
    "fastai's own path (`distrib_ctx`, Accelerate's DDP): on CPUs gloo and `cpu=True, sync_bn=False`; on GPUs nccl."
    pytest.importorskip('accelerate')
    a, b = both(ranks, f'fastai_{mode}')
    assert (a['device'], b['device']) == (ranks[0]['_where']['device'], ranks[1]['_where']['device'])
    assert a['fp'] == b['fp'] and a['skips'] == b['skips']
    assert a['dtypes'] == ['torch.float32']  # the model's own FP32 params' grads (autocast's too)

def test_single_process_does_nothing():
    "No process group: nothing is all-reduced or broadcast, and nothing needs to be."
    t = torch.tensor([1., 2.])
    assert not is_multiprocess() and reduce_max_(t, torch.nn.Linear(1, 1)) is t and t.tolist() == [1., 2.]
    assert not syncs(torch.nn.Linear(1, 1))

def test_shard_concatenates_to_the_global_batches():
    items = list(range(10))
    r0, r1 = shard(items, 2, 0, 2), shard(items, 2, 1, 2)
    assert r0 == [0, 1, 4, 5, 8, 9] and r1 == [2, 3, 6, 7]

@pytest.mark.parametrize('gpus,local_world,backend', [(0, 2, 'gloo'), (1, 2, 'gloo'), (2, 2, 'nccl'), (1, 1, 'nccl')])
def test_the_demo_puts_ranks_on_gpus_only_one_each(monkeypatch, gpus, local_world, backend):
    """`python -m fp16cb.demos.ddp` launches two ranks itself: on a machine with one GPU it picked nccl and both ranks
    asked for it (rank 1 'invalid device ordinal', rank 0 waiting until the timeout; an H100 machine). nccl now only
    when each local process has a GPU, else gloo on the CPU, and the demo's learner follows."""
    import fp16cb.demos.ddp as demo
    chosen = []
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: gpus)
    monkeypatch.setattr(torch.cuda, 'set_device', lambda d: chosen.append(('device', d)))
    monkeypatch.setattr(demo.dist, 'is_initialized', lambda: False)
    monkeypatch.setattr(demo.dist, 'init_process_group', lambda b, **k: chosen.append(('backend', b)))
    monkeypatch.setattr(demo.dist, 'get_rank', lambda: 0)
    monkeypatch.setenv('LOCAL_WORLD_SIZE', str(local_world)); monkeypatch.setenv('LOCAL_RANK', '0')
    demo.init()
    assert chosen[0] == ('backend', backend) and (('device', 0) in chosen) == (backend == 'nccl')
    assert demo.ranks_on_cuda() == (backend == 'nccl')

@pytest.mark.parametrize('mode', ['to_bf16', 'to_fp16'])
def test_checkpointed_layers_under_ddp_train_as_without(ranks, mode):
    """Activation checkpointing (torch's non-reentrant) under DDP: the ranks learn (the smoothed loss falls from 8.3
    to 6.3 in 16 steps) and end with the same weights, bit for bit those of the same fit without checkpointing."""
    a, b = both(ranks, f'checkpoint_{mode}')
    assert a['recomputed'] == b['recomputed'] == a['plain'] == b['plain']
    assert a['losses'][-1] < .85 * a['losses'][0]
