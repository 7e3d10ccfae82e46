"""`convert_network`, the dtype policy (`resolve_dtype`) and `cast_floats`, on the test device."""
from collections import namedtuple
import pytest
import torch
from torch import nn
from fastai.layers import BatchNorm
from fp16cb import convert_network, resolve_dtype, cast_floats
from fp16cb.dtypes import convert_network_keeping
from conftest import DEVICE

HALF = [torch.float16, torch.bfloat16]

@pytest.mark.parametrize('dtype', HALF)
@pytest.mark.parametrize('bn', [lambda n: nn.BatchNorm1d(n), lambda n: BatchNorm(n, ndim=1)], ids=['torch_bn', 'fastai_bn'])
def test_linear_converted_batchnorm_kept(dtype, bn):
    model = nn.Sequential(nn.Linear(10, 30), bn(30), nn.Linear(30, 2)).to(DEVICE)
    res = convert_network(model, dtype)
    assert res is model
    for i, t in enumerate([dtype, torch.float32, dtype]):
        assert model[i].weight.dtype == t and model[i].bias.dtype == t, (i, model[i].weight.dtype)
    # BatchNorm statistics stay FP32; num_batches_tracked stays an integer
    assert model[1].running_mean.dtype == torch.float32 and model[1].running_var.dtype == torch.float32
    assert model[1].num_batches_tracked.dtype == torch.long
    # still nn.Parameters, still trainable
    assert isinstance(model[0].weight, nn.Parameter) and model[0].weight.requires_grad

@pytest.mark.parametrize('dtype', HALF)
def test_batchnorm_2d_and_fastai_2d(dtype):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), BatchNorm(4), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1)).to(DEVICE)
    convert_network(model, dtype)
    assert model[0].weight.dtype == dtype and model[3].weight.dtype == dtype
    assert model[1].weight.dtype == torch.float32 and model[2].weight.dtype == torch.float32

class WithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer('fbuf', torch.randn(3))
        self.register_buffer('ibuf', torch.arange(3))
    def forward(self, x): return self.lin(x) + self.fbuf

@pytest.mark.parametrize('dtype', HALF)
def test_buffers_converted_integers_kept(dtype):
    m = WithBuffers().to(DEVICE)
    ibuf = m.ibuf
    convert_network(m, dtype)
    assert m.fbuf.dtype == dtype
    assert m.ibuf.dtype == torch.long and m.ibuf is ibuf
    assert m(torch.randn(2, 3, dtype=dtype, device=DEVICE)).dtype == dtype

def test_convert_values_round_once():
    m = nn.Linear(5, 5).to(DEVICE)
    w = m.weight.detach().clone()
    convert_network(m, torch.float16)
    assert torch.equal(m.weight.data, w.half())

def test_convert_keeping_returns_exact_originals():
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to(DEVICE)
    w = m[0].weight.detach().clone(); ptr = m[0].weight.data_ptr()
    recs = convert_network_keeping(m, torch.bfloat16)
    assert m[0].weight.dtype == torch.bfloat16
    origs = [r[3] for r in recs.values()]
    assert any(o.data_ptr() == ptr and torch.equal(o, w) for o in origs)  # the original storage itself, not a copy
    assert all(o.dtype == torch.float32 for o in origs)
    assert len(recs) == 2  # Linear weight and bias; BatchNorm not converted

def test_shared_parameter_converted_once():
    lin = nn.Linear(3, 3, bias=False).to(DEVICE)
    m = nn.Sequential(lin, nn.ReLU(), lin)
    recs = convert_network_keeping(m, torch.float16)
    assert len(recs) == 1 and lin.weight.dtype == torch.float16

def test_convert_back_to_fp32():
    m = convert_network(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).to(DEVICE), torch.float16)
    with pytest.raises(ValueError):  # the policy only knows 16-bit dtypes; going back is `.float()`
        resolve_dtype(torch.float32)
    m.float()
    assert all(p.dtype == torch.float32 for p in m.parameters())

@pytest.mark.parametrize('name,dtype', [('fp16', torch.float16), ('half', torch.float16), ('FLOAT16', torch.float16),
                                        ('bf16', torch.bfloat16), ('bfloat16', torch.bfloat16),
                                        (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_resolve_dtype(name, dtype): assert resolve_dtype(name) is dtype

@pytest.mark.parametrize('bad', ['fp8', 'float32', torch.float32, torch.float64, torch.int8, None, 16])
def test_resolve_dtype_rejects(bad):
    with pytest.raises(ValueError, match='dtype'): resolve_dtype(bad)

def test_cast_floats_nested():
    NT = namedtuple('NT', 'a b')
    d = DEVICE
    x = {'f': torch.randn(2, device=d), 'i': torch.arange(3, device=d),
         'l': [torch.randn(1, device=d), (torch.ones(1, dtype=torch.long, device=d), 3)], 'nt': NT(torch.randn(2, device=d), 'text')}
    r = cast_floats(x, torch.bfloat16)
    assert r['f'].dtype == torch.bfloat16 and r['i'].dtype == torch.long and r['i'] is x['i']
    assert r['l'][0].dtype == torch.bfloat16 and isinstance(r['l'][1], tuple) and r['l'][1][0].dtype == torch.long
    assert r['l'][1][1] == 3
    assert isinstance(r['nt'], NT) and r['nt'].a.dtype == torch.bfloat16 and r['nt'].b == 'text'
    back = cast_floats(r, torch.float32)
    assert back['f'].dtype == torch.float32 and torch.equal(back['f'], x['f'].bfloat16().float())
