"""Multi-process training under torch's `DistributedDataParallel`: 2 CPU processes (gloo on 127.0.0.1), launched once for
the module by `fp16cb.demos.ddp.launch` and bounded in time; `tests/ddp_worker.py` runs the scenarios on each rank and
these tests compare what the ranks saw. Every rank starts from its own random init and trains on its own data."""
import json, sys
from pathlib import Path
import pytest
import torch
import torch.distributed as dist
from fastai.callback.progress import ProgressCallback

import fp16cb  # noqa: F401  (patches Learner.to_fp16 & co.)
from fp16cb.demos.ddp import launch, demo_learner, shard
from fp16cb.distributed import reduce_max_, syncs, is_multiprocess

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")

WORKER = Path(__file__).with_name('ddp_worker.py')
TIMEOUT = 90  # seconds for the 2 processes to run every scenario (about 25 s on 2 idle cores)
MODES = ('to_fp16', 'to_fp16_flat', 'to_bf16', 'to_native_fp16')
HALF = {'to_fp16': 'torch.float16', 'to_fp16_flat': 'torch.float16', 'to_bf16': 'torch.bfloat16'}

@pytest.fixture(scope='module')
def ranks(tmp_path_factory):
    "`(rank 0's results, rank 1's results, output folder)`: one launch of 2 processes for the whole module."
    out = tmp_path_factory.mktemp('ddp')
    launch([sys.executable, str(WORKER), str(out)], nprocs=2, timeout=TIMEOUT)
    r0, r1 = (json.loads((out/f'rank{r}.json').read_text()) for r in (0, 1))
    return r0, r1, out

def both(ranks, name):
    r0, r1, _ = ranks
    for r in (r0, r1): assert 'error' not in r[name], r[name]['error']
    return r0[name], r1[name]

@pytest.mark.parametrize('order', ['after', 'before'])  # DDP wraps after our callbacks (fastai's way), or the user wrapped first
@pytest.mark.parametrize('mode', MODES)
def test_ranks_bit_identical(ranks, order, mode):
    a, b = both(ranks, f'identical_{order}_{mode}')
    assert a['fp'] == b['fp']  # different inits and data, the same FP32 weights and buffers, bit for bit
    assert a['skips'] == b['skips'] and not any(a['skips'])  # steps were taken
    assert a['dtypes'] == sorted(['torch.float32', HALF[mode]] if mode in HALF else ['torch.float32'])

@pytest.mark.parametrize('order', ['after', 'before'])
def test_16bit_buckets_halve_allreduce_bytes(ranks, order):
    "16-bit gradient buckets: the all-reduce moves half the bytes of FP32 (plus BatchNorm's FP32 params)."
    fp32 = both(ranks, f'identical_{order}_to_native_fp16')[0]['bytes_per_step']  # autocast keeps FP32 params and grads
    n_params, n_bn = 70913, 512
    assert fp32 == 4 * n_params
    for mode in HALF:
        assert both(ranks, f'identical_{order}_{mode}')[0]['bytes_per_step'] == 2 * (n_params - n_bn) + 4 * n_bn

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
    learn.remove_cb(ProgressCallback)
    with learn.no_logging(): learn.fit(2)
    assert learn.mixed_precision.skips == a['skips']
    ref = learn.model.state_dict()
    for k, v in ddp.items():  # fp16 grads are averaged in fp16 by DDP: equal up to 16-bit rounding
        torch.testing.assert_close(v, ref[k], rtol=2e-2, atol=2e-3)
    assert max((v - ref[k]).abs().max().item() for k, v in ddp.items()) > 0  # not the same run by accident

def test_save_and_export_write_on_rank_0_and_load_restores_the_scaler(ranks):
    a, b = both(ranks, 'save_load')
    assert (a['wrote'], b['wrote']) == (a['exported'], b['exported']) == (True, False)  # only rank 0 writes
    for r in (a, b): assert r['loaded'] == r['saved'] and r['saved']['n_steps'] > 0
    assert a['fp'] == b['fp']  # the save wrapped DDP again on every rank: it still all-reduces afterwards

@pytest.mark.parametrize('mode', ['to_fp16', 'to_native_fp16'])
def test_fastai_distrib_ctx_on_cpu(ranks, mode):
    "fastai's own path (`distrib_ctx`, Accelerate's DDP), on CPUs: gloo, `cpu=True, sync_bn=False`."
    pytest.importorskip('accelerate')
    a, b = both(ranks, f'fastai_{mode}')
    assert a['fp'] == b['fp'] and a['skips'] == b['skips']
    assert a['dtypes'] == (['torch.float16', 'torch.float32'] if mode == 'to_fp16' else ['torch.float32'])

def test_single_process_does_nothing():
    "No process group: nothing is all-reduced or broadcast, and nothing needs to be."
    t = torch.tensor([1., 2.])
    assert not is_multiprocess() and reduce_max_(t, torch.nn.Linear(1, 1)) is t and t.tolist() == [1., 2.]
    assert not syncs(torch.nn.Linear(1, 1))

def test_shard_concatenates_to_the_global_batches():
    items = list(range(10))
    r0, r1 = shard(items, 2, 0, 2), shard(items, 2, 1, 2)
    assert r0 == [0, 1, 4, 5, 8, 9] and r1 == [2, 3, 6, 7]
