"""Experiments of the per-layer precision policy and of FP16 master-weight storage, added to `fp16cb.experiments`
(`python -m fp16cb --experiments`) by `register`: their modes, tasks and rows."""
from __future__ import annotations
from functools import partial
import torch
from torch import nn
from fastai.optimizer import SGD

from .callbacks import ModelToHalf
from fastai.optimizer import Optimizer

__all__ = ['digits_transformer', 'offset_cnn', 'MODES', 'EXPERIMENTS', 'register']

class DigitsTransformer(nn.Module):
    "An 8x8 image as 8 tokens of 8 pixels: linear embedding + position, one pre-norm encoder layer, mean, LayerNorm, head."
    def __init__(self, d:int=32, heads:int=4):
        super().__init__()
        self.embed, self.pos = nn.Linear(8, d), nn.Parameter(torch.zeros(8, d))
        self.encoder = nn.TransformerEncoderLayer(d, heads, 2*d, dropout=0., batch_first=True, norm_first=True)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 10)
    def forward(self, x): return self.head(self.norm(self.encoder(self.embed(x.flatten(1, 2)) + self.pos).mean(1)))

def digits_transformer() -> nn.Module: return DigitsTransformer()

def offset_cnn(offset:float=4096.) -> nn.Module:
    """The digits CNN whose classifier adds `offset` to every logit (its bias): the softmax ignores a common shift, but
    16-bit logits near 4096 are spaced by 4 (fp16) or 32 (bf16), so a 16-bit classifier rounds class differences away."""
    from .experiments import digits_cnn
    m = digits_cnn()
    with torch.no_grad(): m[-1].bias.add_(offset)
    return m

def _plain_storage(learn):
    "16-bit storage with the plain update: the classic momentum rule in fp16, grads unscaled in fp16 (no masters)."
    from .experiments import HalfLossScale
    learn.opt_func = partial(ClassicSGD, mom=0.9)
    return learn.to_fp32().add_cbs([ModelToHalf(), HalfLossScale(1000.)])

MODES = {
    'bf16_norm': ("to_bf16, LayerNorm/GroupNorm kept FP32", lambda learn: learn.to_bf16(keep_fp32='norm')),
    'bf16_classifier': ("to_bf16, final classifier kept FP32", lambda learn: learn.to_bf16(keep_fp32='classifier')),
    'bf16_norm_classifier': ("to_bf16, norms and classifier FP32", lambda learn: learn.to_bf16(keep_fp32=['norm', 'classifier'])),
    'fp16_norm': ("to_fp16, norms kept FP32", lambda learn: learn.to_fp16(keep_fp32='norm')),
    'fp16_classifier': ("to_fp16, final classifier kept FP32", lambda learn: learn.to_fp16(keep_fp32='classifier')),
    'fp16_storage_plain': ("fp16 storage, classic momentum in fp16, no masters", _plain_storage),
    'fp16_storage_rn': ("fp16 storage, modified rule, round to nearest",
                        lambda learn: learn.to_fp16(half_storage=True, stochastic_rounding=False)),
    'fp16_storage': ("fp16 storage, modified rule, stochastic rounding", lambda learn: learn.to_fp16(half_storage=True)),
}

def _tasks():
    from .experiments import Task
    k = 22  # the loss x 2^-22: raw gradients below fp16's subnormals once unscaled; SGD's lr x 2^22 (< 65504) makes up
    return {
        'transformer': Task('transformer', digits_transformer, epochs=6, lr=1e-2,
                            note="8 tokens of 8 pixels, 1 pre-norm encoder layer (d=32), Adam, one-cycle"),
        'logit_offset': Task('logit_offset', offset_cnn, epochs=6,
                             note="tiny CNN whose logits all carry +4096 (16-bit spacing 4 in fp16, 32 in bf16), Adam, one-cycle"),
        'storage': Task('storage', partial(_digits_cnn), epochs=4, lr=0.015 * 2**k, opt_func=partial(SGD, mom=0.9),
                        one_cycle=False, loss_func=_scaled_loss(2.**-k),
                        note="tiny CNN, loss x 2^-22, SGD momentum 0.9, lr 0.015 x 2^22"),
    }

def _digits_cnn():
    from .experiments import digits_cnn
    return digits_cnn()

def _scaled_loss(factor):
    from .experiments import ScaledLoss
    return ScaledLoss(factor)

EXPERIMENTS = [
    ("Precision policy: opt-ins on a small transformer (speed and accuracy)", 'transformer',
     [('FP32', 'fp32', 'fp32'), ('to_bf16 (BatchNorm only)', 'to_bf16', 'recipe'), ('+ norms FP32', 'bf16_norm', 'recipe'),
      ('+ classifier FP32', 'bf16_classifier', 'recipe'), ('+ norms + classifier', 'bf16_norm_classifier', 'recipe')]),
    ("Precision policy: keeping the classifier FP32 is what makes fp16 match FP32", 'logit_offset',
     [('FP32', 'fp32', 'fp32'), ('to_fp16', 'to_fp16', 'breaks'), ('to_fp16, classifier FP32', 'fp16_classifier', 'recipe'),
      ('to_bf16', 'to_bf16', 'breaks'), ('to_bf16, classifier FP32', 'bf16_classifier', 'recipe')]),
    ("FP16 master-weight storage (NVIDIA's NVCaffe slides): plain vs modified update", 'storage',
     [('FP32 masters (to_fp16)', 'to_fp16', 'fp32'), ('fp16 storage, plain update', 'fp16_storage_plain', 'breaks'),
      ('fp16 storage, modified, nearest', 'fp16_storage_rn', 'recipe'),
      ('fp16 storage, modified, stochastic', 'fp16_storage', 'recipe')]),
    ("FP16 storage: updates under half an fp16 spacing need stochastic rounding", 'vanishing',
     [('FP32 masters (to_fp16)', 'to_fp16', 'fp32'), ('fp16 storage, nearest', 'fp16_storage_rn', 'breaks'),
      ('fp16 storage, stochastic', 'fp16_storage', 'recipe')]),
]

def register(modes:dict, tasks:dict, experiments:list):
    "Add this module's modes, tasks and experiment rows to those of `fp16cb.experiments` (once)."
    modes.update(MODES)
    tasks.update(_tasks())
    experiments.extend(e for e in EXPERIMENTS if e not in experiments)

def classic_momentum(p, lr, mom, mom_buf=None, **kwargs):
    """The 'vanilla' momentum of the slides, in the weights' own dtype: H = m*H - lr*dW, W = W + H. In 16-bit the product
    lr*dW underflows and W + H rounds small updates away: the vanishing updates that FP32 masters, or the modified rule, avoid."""
    if mom_buf is None: mom_buf = torch.zeros_like(p.data)
    mom_buf.mul_(mom).sub_(p.grad.data * torch.tensor(lr, dtype=p.dtype))  # lr*dW computed in the param's dtype
    p.data.add_(mom_buf)
    return {'mom_buf': mom_buf}

def ClassicSGD(params, lr, mom=0.9, wd=0.):
    "SGD with the classic momentum rule `classic_momentum` (for the 'plain update' experiment of FP16 storage)."
    return Optimizer(params, [classic_momentum], lr=lr, mom=mom, wd=wd)
