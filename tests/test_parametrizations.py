"""Models with torch's parametrizations (`torch.nn.utils.parametrize`): what a parametrization computes stays FP32, its
tensor cast to the module's 16-bit dtype as it leaves, so every mode trains them as FP32 does.

Before, the parametrization's `original` was converted and the map ran in 16 bits: `orthogonal`'s `matrix_exp` gave NaN
(a bf16 fit skipped 17 of its 19 steps, the update 0.58 cosine to FP32's; an fp16 fit skipped every step), `cayley` and
`householder` died in the first forward (`"lu_cpu"` / `"orgqr_cpu" not implemented for 'BFloat16'`)."""
import warnings
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm
from torch.nn.utils import prune
from torch.nn.utils import weight_norm as old_weight_norm, spectral_norm as old_spectral_norm
from fastai.learner import Learner
from fastai.callback.core import Callback
from fastai.losses import CrossEntropyLossFlat
from fastai.torch_core import set_seed

import fp16cb  # noqa: F401  (the Learner methods)
from fp16cb.demos.experiments import digits_data
from fp16cb.policy import PARAMETRIZATION, HOOKED
from conftest import DEVICE

class Symmetric(nn.Module):
    "A parametrization of one's own: a symmetric matrix from its upper triangle."
    def forward(self, x): return x.triu() + x.triu(1).transpose(-1, -2)

def parametrized(kind:str) -> nn.Module:
    hid = nn.Linear(64, 48 if kind == 'householder' else 64)
    if kind in ('matrix_exp', 'cayley', 'householder'): hid = orthogonal(hid, orthogonal_map=kind)
    elif kind == 'weight_norm': hid = weight_norm(hid)
    elif kind == 'spectral_norm': hid = spectral_norm(hid)
    elif kind == 'custom': parametrize.register_parametrization(hid, 'weight', Symmetric())
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), hid, nn.ReLU(), nn.Linear(hid.out_features, 10))

MODES = {'bf16': ('to_bf16', {}), 'fp16': ('to_fp16', {}), 'bf16-half': ('to_bf16', dict(half_storage=True))}
KINDS = ('matrix_exp', 'cayley', 'householder', 'weight_norm', 'spectral_norm', 'custom')

def fit(kind:str, mode=None):
    "One epoch on the digits (19 steps); the learner and the update of every param."
    set_seed(0, reproducible=True)
    torch.manual_seed(0)
    model = parametrized(kind).to(DEVICE)
    before = [p.detach().clone() for p in model.parameters()]
    learn = Learner(digits_data(64, DEVICE), model, loss_func=CrossEntropyLossFlat())
    if mode is not None: learn = getattr(learn, MODES[mode][0])(**MODES[mode][1])
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore', UserWarning)  # fp16 on a CPU: slow, said once
        learn.fit(1, 1e-3)
    skips = sum(learn.loss_scale_history.skips) if mode is not None else 0
    if mode is not None: learn.to_fp32()
    return learn, skips, torch.cat([(p.detach() - b).flatten() for p, b in zip(learn.model.parameters(), before)])

@pytest.mark.parametrize('kind', KINDS)
def test_parametrized_models_train_as_in_fp32(kind):
    """No step skipped, no crash, and the update within 2% (cosine) of FP32's: measured 0.991 to 1.000 over these
    kinds and modes on an AVX512-BF16 CPU (the least: `householder` with 16-bit storage); before, 0.58 and 0 or a
    crash for `orthogonal`'s three maps."""
    _, _, ref = fit(kind)
    for mode in MODES:
        learn, skips, upd = fit(kind, mode)
        assert skips == 0, (mode, skips)
        assert torch.isfinite(upd).all(), mode
        assert torch.nn.functional.cosine_similarity(upd.float(), ref.float(), dim=0) > .98, mode
        assert {p.dtype for p in learn.model.parameters()} == {torch.float32}  # `to_fp32()` gives the FP32 model back

def test_the_parametrization_is_kept_and_said_so():
    "The policy report names each parametrization as kept FP32 and why; the module itself computes in 16 bits."
    learn = Learner(digits_data(64, DEVICE), parametrized('matrix_exp').to(DEVICE),
                    loss_func=CrossEntropyLossFlat()).to_bf16()
    rep = learn.mixed_precision.policy_report().set_index('module')
    assert rep.loc['3.parametrizations.weight', 'fp32_because'] == PARAMETRIZATION
    assert rep.loc['3.parametrizations.weight', 'storage'] == 'float32'
    assert rep.loc['3', 'compute'] == 'bfloat16'

def test_a_parametrization_can_still_be_made_16_bit():
    "`fp16cb_dtype` on the parametrization wins, as on any module: it is then converted, and trains."
    model = parametrized('weight_norm').to(DEVICE)
    model[3].parametrizations.weight.fp16cb_dtype = torch.bfloat16
    learn = Learner(digits_data(64, DEVICE), model, loss_func=CrossEntropyLossFlat()).to_bf16()
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3)
    rep = learn.mixed_precision.policy_report().set_index('module')
    assert rep.loc['3.parametrizations.weight', 'fp32_because'] == '-'
    assert rep.loc['3.parametrizations.weight', 'compute'] == 'bfloat16'
    assert sum(learn.loss_scale_history.skips) == 0

# ---- reparametrizations by forward pre-hook: torch's pruning (mid-fit too), the former weight_norm and spectral_norm
class PruneEachEpoch(Callback):
    """Iterative magnitude pruning: 30% more of layer 3's weights at each epoch's end (`torch.nn.utils.prune`), ranked
    by the `weight` its hook left on the module in the last forward (`seen`: its dtype, and whether it is FP32's
    `weight_orig * weight_mask`)."""
    order = 60
    def before_fit(self): self.seen = []
    def after_epoch(self):
        m = self.learn.model[3]
        if 'weight_orig' in m._parameters:
            w = m.__dict__['weight']
            self.seen.append((w.dtype, torch.equal(w, m.weight_orig.float() * m.weight_mask.float())))
        prune.l1_unstructured(m, 'weight', amount=.3)

def _pruned_fit(mode=None, hook=None):
    set_seed(0, reproducible=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FutureWarning)  # (the former weight_norm: deprecated for the parametrization)
        if hook is not None: model[3] = hook(model[3])
    learn = Learner(digits_data(64, DEVICE), model.to(DEVICE), loss_func=CrossEntropyLossFlat())
    if mode is not None: learn = getattr(learn, MODES[mode][0])(**MODES[mode][1])
    pruning = PruneEachEpoch() if hook is None else None
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore', UserWarning)
        learn.fit(3, 1e-3, cbs=pruning)
    if mode is not None: learn.to_fp32()
    return learn.model.state_dict(), pruning.seen if pruning else None

@pytest.mark.parametrize('hook', [None, old_weight_norm, old_spectral_norm], ids=['prune', 'weight_norm', 'spectral_norm'])
@pytest.mark.parametrize('mode', list(MODES))
def test_a_module_reparametrized_by_a_hook_computes_in_fp32(mode, hook):
    """Pruned at each epoch's end: the masks are FP32's, and every tensor FP32 after `to_fp32()`. Before: the pruning
    ranked the weights by the 16-bit `weight` the hook left on the module, and its mask stayed 16-bit after the fit
    (with `half_storage`, `weight_orig` too, and the masks differed from FP32's)."""
    (ref, _), (got, seen) = _pruned_fit(hook=hook), _pruned_fit(mode, hook)
    assert sorted(got) == sorted(ref)
    assert {k: v.dtype for k, v in got.items() if v.is_floating_point() and v.dtype != torch.float32} == {}
    if hook is None:  # ranked by FP32 weights; as many pruned as FP32 prunes (16-bit training moves a few at the edge)
        assert seen == [(torch.float32, True)] * 2
        assert int((got['3.weight_mask'] == 0).sum()) == int((ref['3.weight_mask'] == 0).sum())
        assert float((got['3.weight_mask'] == ref['3.weight_mask']).float().mean()) > .95
    assert max(float((got[k] - ref[k]).abs().max()) for k in ref if not k.endswith('_mask')) < 5e-2

def test_a_pruned_module_is_kept_and_said_so():
    "The policy report names the pruned module as kept FP32, and why."
    model = parametrized('custom')
    prune.random_unstructured(model[1], 'weight', amount=.5)
    rep = Learner(digits_data(64, DEVICE), model.to(DEVICE), loss_func=CrossEntropyLossFlat()).to_bf16()
    rep = rep.mixed_precision.policy_report().set_index('module')
    assert rep.loc['1', 'fp32_because'] == HOOKED and rep.loc['1', 'compute'] == 'float32'
