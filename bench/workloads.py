"""The benchmark's workloads: per workload a model and synthetic batches, both sized by one factor `s` (1: the size
GPU users train; a CPU runs them scaled down). No downloads: ResNet-50 and the GPT-style LM are written out here."""
from __future__ import annotations
import math
from typing import Callable, NamedTuple
import torch
from torch import nn
import torch.nn.functional as F

__all__ = ['Workload', 'WORKLOADS', 'WORKLOAD_SETS', 'CPU_SCALE', 'resnet50', 'GPT', 'make_data', 'n_params']

def _r(x, lo=1): return max(lo, int(round(x)))

# ------------------------------------------------------------------------------------------ small CPU models
def _mlp(d, h, n_blocks, n_out):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.fc1, self.act, self.fc2 = nn.LayerNorm(d), nn.Linear(d, h), nn.GELU(), nn.Linear(h, d)
        def forward(self, x): return x + self.fc2(self.act(self.fc1(self.ln(x))))
    return nn.Sequential(*[Block() for _ in range(n_blocks)], nn.LayerNorm(d), nn.Linear(d, n_out))

def _many_small(w, n_layers, n_out):
    "`n_layers` Linear(w, w) (+ bias): 2 param tensors each, the compute per param tiny with a tiny batch."
    layers = []
    for _ in range(n_layers): layers += [nn.Linear(w, w), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(w, n_out))

def _convnet(c, n_out):
    def blk(ci, co, s): return nn.Sequential(nn.Conv2d(ci, co, 3, s, 1, bias=False), nn.BatchNorm2d(co), nn.ReLU())
    return nn.Sequential(blk(3, c, 1), blk(c, c, 1), blk(c, 2*c, 2), blk(2*c, 2*c, 1), blk(2*c, 4*c, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4*c, n_out))

def _act_heavy(w, n_layers, n_in, n_out):
    "Narrow and deep: cheap matmuls, many saved activations per param."
    layers = [nn.Linear(n_in, w)]
    for _ in range(n_layers): layers += [nn.GELU(), nn.Linear(w, w)]
    return nn.Sequential(*layers, nn.GELU(), nn.Linear(w, n_out))

# ------------------------------------------------------------------------------------------------ ResNet-50
def _cbr(ci, co, k, stride=1, relu=True):
    "Conv (no bias) + BatchNorm (+ ReLU)."
    layers = [nn.Conv2d(ci, co, k, stride, k // 2, bias=False), nn.BatchNorm2d(co)]
    return nn.Sequential(*layers, *([nn.ReLU(inplace=True)] if relu else []))

class _Bottleneck(nn.Module):
    "1x1 reduce, 3x3 (with the stride: ResNet v1.5, as torchvision), 1x1 expand x4; projection shortcut when needed."
    def __init__(self, ci, planes, stride):
        super().__init__()
        co = 4 * planes
        self.body = nn.Sequential(_cbr(ci, planes, 1), _cbr(planes, planes, 3, stride), _cbr(planes, co, 1, relu=False))
        self.down = None if stride == 1 and ci == co else _cbr(ci, co, 1, stride, relu=False)
    def forward(self, x): return F.relu(self.body(x) + (x if self.down is None else self.down(x)))

def resnet50(
    w:int=64, # stem width (64: torchvision's `resnet50`, 25.6M params with 1000 classes)
    n_out:int=1000, # classes
) -> nn.Module:
    "torchvision's ResNet-50 architecture in plain torch: bottleneck stages of [3, 4, 6, 3] blocks."
    layers, ci = [_cbr(3, w, 7, 2), nn.MaxPool2d(3, 2, 1)], w
    for i, n in enumerate((3, 4, 6, 3)):
        for j in range(n):
            layers.append(_Bottleneck(ci, w * 2**i, 2 if j == 0 and i > 0 else 1)); ci = 4 * w * 2**i
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(ci, n_out))

# ------------------------------------------------------------------------------------------------ GPT-style LM
class _Block(nn.Module):
    "Pre-norm transformer block: causal self-attention (`scaled_dot_product_attention`) and a 4x GELU MLP."
    def __init__(self, d, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

class GPT(nn.Module):
    "A GPT-2-style decoder: token + learned position embeddings, `n_layers` blocks, final LayerNorm, head tied to the embedding."
    def __init__(self,
        vocab:int=32768, # vocabulary size
        d:int=1024, # model width
        n_layers:int=12, # transformer blocks
        n_heads:int=16, # attention heads (d must divide by it)
        seq:int=256, # longest sequence (positions)
    ):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[_Block(d, n_heads) for _ in range(n_layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        for e in (self.tok, self.pos): nn.init.normal_(e.weight, std=.02)  # GPT-2's init (N(0, 1) logits would be huge)
    def forward(self, x):
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        return self.head(self.ln(self.blocks(h)))

def _gpt(s):
    d = _r(1024 * s / 16, 1) * 16
    return GPT(_r(32768 * s, 64), d, 12, max(1, d // 64), _lm_seq(s))

def _lm_seq(s): return _r(256 * s, 8)

# -------------------------------------------------------------------------------------------------- batches
def _teacher_batches(shape, bs):
    "`(s, generator) -> batch()`: random inputs of `shape(s)`, labels from a fixed random linear teacher (10 classes)."
    def make(s, g):
        sh, n = shape(s), bs(s)
        teacher = torch.randn(math.prod(sh), 10, generator=g)
        def batch():
            x = torch.randn(n, *sh, generator=g)
            return x, (x.reshape(n, -1) @ teacher).argmax(1)
        return batch
    return make

def _token_batches(s, g, p_follow=.75):
    "Next-token prediction on a Markov chain: each token is followed by its fixed successor with `p_follow`, else random."
    vocab, seq, n = _r(32768 * s, 64), _lm_seq(s), _r(32 * s, 2)
    succ = torch.randperm(vocab, generator=g)
    def batch():
        toks = [torch.randint(0, vocab, (n,), generator=g)]
        for _ in range(seq):
            follow = torch.rand(n, generator=g) < p_follow
            toks.append(torch.where(follow, succ[toks[-1]], torch.randint(0, vocab, (n,), generator=g)))
        t = torch.stack(toks, 1)
        return t[:, :-1], t[:, 1:]
    return batch

class Workload(NamedTuple):
    desc:str # what it is (sizes at s=1)
    model:Callable # s -> nn.Module
    data:Callable # (s, torch.Generator) -> a function returning one CPU batch `(x, y)`
    cpu_scale:float # the size factor on a CPU
    channels_last:bool=False # train with fastai's `ChannelsLast` callback (the plain loop: a channels-last model)

_image = _teacher_batches(lambda s: (3, _r(224 * math.sqrt(s), 32), _r(224 * math.sqrt(s), 32)), lambda s: _r(128 * s, 4))
_resnet = lambda s: resnet50(_r(64 * s, 2))
WORKLOADS = {
    'mlp': Workload('compute-bound: 4 blocks LN+Linear(d,4d)+GELU+Linear(4d,d), d=1024*s, batch 512*s',
                    lambda s: _mlp(_r(1024*s), _r(4096*s), 4, 10),
                    _teacher_batches(lambda s: (_r(1024*s),), lambda s: _r(512*s, 8)), .125),
    'book': Workload('bookkeeping-bound (the many-tensor model): 150 Linear(w,w) = 300 param tensors, w=256*sqrt(s) '
                     '(~20M params at s=1), batch 8',
                     lambda s: _many_small(_r(256*math.sqrt(s)*1.43), 150, 10),
                     _teacher_batches(lambda s: (_r(256*math.sqrt(s)*1.43),), lambda s: 8), .1),
    'conv': Workload('conv net with BatchNorm: 5 conv3x3+BN+ReLU, 32*s channels, 32x32 images, batch 256*s',
                     lambda s: _convnet(_r(32*s, 4), 10),
                     _teacher_batches(lambda s: (3, 32, 32), lambda s: _r(256*s, 8)), .125),
    'act': Workload('activation-heavy: 12 x (GELU + Linear(64,64)), batch 32768*s',
                    lambda s: _act_heavy(64, 12, 32, 10),
                    _teacher_batches(lambda s: (32,), lambda s: _r(32768*s, 64)), .125),
    'resnet50': Workload('ResNet-50 (bottlenecks [3,4,6,3], width 64*s, 25.6M params at s=1), NCHW, '
                         '224*sqrt(s) px images, batch 128*s', _resnet, _image, 1/16),
    'resnet50_cl': Workload("the same ResNet-50 and images with fastai's `ChannelsLast` callback", _resnet, _image, 1/16,
                            channels_last=True),
    'lm': Workload('GPT-style LM: 12 pre-norm blocks, d=1024*s, vocab 32768*s, head tied to the embedding '
                   '(~185M params at s=1), seq 256*s, batch 32*s', _gpt, _token_batches, 1/16),
}
WORKLOAD_SETS = {'cpu': ('mlp', 'book', 'conv', 'act'), 'gpu': ('resnet50', 'resnet50_cl', 'lm', 'book'),
                 'all': tuple(WORKLOADS)}
CPU_SCALE = {k: w.cpu_scale for k, w in WORKLOADS.items()}  # sizes on a CPU (a bf16 matmul there can be 100x slower)

def make_data(
    workload:str, # a key of `WORKLOADS`
    scale:float, # the size factor
    device, # where the batches go
    n_batches:int, # training batches
    seed:int=0,
) -> tuple:
    "`(training batches, held-out batch)`, the same for every mode."
    batch = WORKLOADS[workload].data(scale, torch.Generator().manual_seed(seed))
    def put(xy): return tuple(t.to(device) for t in xy)
    return [put(batch()) for _ in range(n_batches)], put(batch())

def n_params(model:nn.Module) -> int: return sum(p.numel() for p in model.parameters())  # tied params once
