"""Checkpoints: learn.save / learn.load during and after mixed-precision fits, resume, export / load_learner; save and
export are atomic (a failed write keeps the previous file), and an exported learner loads with fastai alone."""
import errno, io, os, subprocess, sys, warnings, tempfile
import pytest, torch
from torch import nn
from fastai.basics import Learner, DataLoaders, Datasets, ItemGetter, MSELossFlat, set_seed, Callback, load_learner
from fastai.callback.tracker import SaveModelCallback
from fastai.optimizer import OptimWrapper
from conftest import DEVICE, quiet_fit, weights, synth_data, tiny_model
from conftest import make_learner as synth_learner  # conftest's regression learner; `make_learner` here uses `Datasets`

warnings.filterwarnings('ignore', message='(fp16|bf16) training on the CPU')

def make_dls(n=64, bs=16):
    set_seed(0)
    x = torch.randn(n + 16, 6); y = x[:, :2].sum(1, keepdim=True) + .1 * x[:, 2:3] ** 2
    dsets = [Datasets(list(zip(x[a:b], y[a:b])), tfms=[[ItemGetter(0)], [ItemGetter(1)]]) for a, b in ((0, n), (n, n + 16))]
    return DataLoaders.from_dsets(*dsets, bs=bs, shuffle=False, device=DEVICE)

def make_learner(seed=0, path=None, **kw):
    "Always the same data; `seed` picks the model's initial weights."
    dls = make_dls(**kw)
    set_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Dropout(.1), nn.Linear(12, 1)).to(DEVICE)
    return Learner(dls, model, loss_func=MSELossFlat(), path=path or tempfile.mkdtemp())

def plain_loaded(path, opt_func=None, make=None, name='mid'):
    """A plain FP32 learner (no precision callbacks) that loaded `name` from `path` with its optimizer state, and
    whether fastai warned that it could not load that state (`(learner, warned)`)."""
    plain = (make or make_learner)(seed=1, path=path)
    if opt_func: plain.opt_func = opt_func
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        plain.load(name, with_opt=True)
    return plain, any('optimizer' in str(w.message) for w in ws)  # "Could not load the optimizer state"

def fit(learn, n, lr=1e-2, cbs=None):
    with learn.no_bar(), learn.no_logging(): learn.fit(n, lr, cbs=cbs)

def flat_state(sd): return {k: v.clone() for k, v in sd.items()}

class SaveAt(Callback):
    "Saves (or loads) the learner at the end of epoch `epoch`, and remembers the FP32 masters it should have written."
    order = 70
    def __init__(self, epoch, fname='mid', load=None): self.epoch, self.fname, self.load = epoch, fname, load
    def after_epoch(self):
        if self.epoch_idx() != self.epoch: return
        if self.load: self.learn.load(self.load); return
        mp = self.learn.mixed_precision
        self.expected = {n: mp.store.fp32_views()[p].clone() for n, p in self.learn.model.named_parameters()
                         if p in mp.store.fp32_views()}
        self.dtypes = {n: p.dtype for n, p in self.learn.model.named_parameters()}
        self.learn.save(self.fname)
    def epoch_idx(self): return self.learn.epoch

def torch_adamw(params, **kw): return OptimWrapper(params, opt=torch.optim.AdamW, **kw)

STORES = {'own': {}, 'flat': {'flat_master': True}, 'state': {'state_dtype': torch.bfloat16}}

@pytest.mark.parametrize('opt_func', [None, torch_adamw])
@pytest.mark.parametrize('store', list(STORES))
def test_save_mid_fit_writes_fp32_masters_and_loads_into_plain_fp32(store, opt_func):
    learn = make_learner()
    if opt_func: learn.opt_func = opt_func  # a torch optimizer keeps its state in `opt.opt.state`
    learn.to_fp16(max_loss_scale=2.**10, **STORES[store])
    cb = SaveAt(0)
    fit(learn, 1, cbs=cb)
    assert not all(learn.mixed_precision.skips)
    # it was saved mid-fit: from the model's own FP32 params (laid out flat or not; with 16-bit state, widened as written)
    assert cb.dtypes['0.weight'] == torch.float32
    sd = torch.load(learn.path/'models/mid.pth', weights_only=False)
    assert all(v.dtype == torch.float32 for k, v in sd['model'].items() if v.is_floating_point())
    for k, v in cb.expected.items(): assert torch.equal(sd['model'][k], v), k  # the exact masters, not fp16-rounded
    for k, v in learn.model.state_dict().items(): assert torch.equal(sd['model'][k], v), k  # = the FP32 model after the fit
    plain, warned = plain_loaded(learn.path, opt_func)
    assert not warned
    for (k, v), w in zip(learn.model.state_dict().items(), plain.model.state_dict().values()): assert torch.equal(v, w), k
    # optimizer state keyed as for the model's own params: equal to the fp16 learner's after its fit
    ost = lambda l: l.opt.opt.state if opt_func else l.opt.state
    for p, q in zip(learn.model.parameters(), plain.model.parameters()):
        s, t = ost(learn)[p], ost(plain)[q]
        assert s
        # (torch's `step` is a CPU tensor; fastai's `load` maps the file onto the model's device, as it does in FP32)
        assert s.keys() == t.keys() and all(torch.equal(s[k].cpu(), t[k].cpu()) if torch.is_tensor(s[k]) else s[k] == t[k] for k in s)

class TiedNet(nn.Module):
    "Two Linear(6, 6) holding one weight Parameter (as a language model's head tied to its embedding), then a head."
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 6, bias=False), nn.Linear(6, 6), nn.Linear(6, 1)
        self.b.weight = self.a.weight
    def forward(self, x): return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))

@pytest.mark.parametrize('meth,kw', [('to_bf16', {}), ('to_bf16', {'half_storage': True}),
                                     ('to_fp16', {'half_storage': True, 'max_loss_scale': 2.**10})])
def test_a_tied_param_is_saved_fp32_under_each_of_its_names(meth, kw):
    "Before: with `half_storage`, `learn.save` mid-fit wrote the tied weight's second name (`b.weight`) in 16 bits."
    learn = make_learner()
    set_seed(0)
    learn.model = TiedNet().to(DEVICE)
    getattr(learn, meth)(**kw)
    fit(learn, 1, cbs=SaveAt(0))
    sd = torch.load(learn.path/'models/mid.pth', weights_only=False)['model']
    assert {k: v.dtype for k, v in sd.items() if v.dtype != torch.float32} == {}
    assert torch.equal(sd['a.weight'], sd['b.weight'])
    for k, v in learn.model.state_dict().items(): assert torch.equal(sd[k], v), k  # = the FP32 model after the fit
    assert learn.model.a.weight is learn.model.b.weight

def test_load_into_fp16_learner_restores_scaler_state():
    learn = make_learner().to_fp16(scaler='lognormal')
    fit(learn, 2)
    sc = learn.mixed_precision.scaler
    sc.scale = 2.**5  # something a fresh scaler would not have
    learn.save('ck')
    new = make_learner(seed=3, path=learn.path).to_fp16(scaler='lognormal')
    new.load('ck')
    assert new.mixed_precision.scaler.state_dict() == sc.state_dict() and new.mixed_precision.loss_scale == 32.
    fit(new, 1)  # and trains on from there
    assert new.mixed_precision.scaler.n_steps == sc.n_steps + 4
    # with_opt=False: weights only, the scaler is left alone
    other = make_learner(seed=3, path=learn.path).to_fp16(scaler='lognormal')
    other.load('ck', with_opt=False)
    assert other.mixed_precision.loss_scale == 1. and other.mixed_precision.scaler.calibrating  # a fresh scaler calibrates
    # a checkpoint of another strategy warns instead of failing
    bo = make_learner(seed=3, path=learn.path).to_fp16(scaler='backoff')
    with pytest.warns(UserWarning, match='Could not restore the state of MixedPrecision'): bo.load('ck')

def test_native_gradscaler_state_saved_and_loaded():
    learn = make_learner().to_native_fp16(init_scale=2.**10)
    fit(learn, 1)
    learn.native_mixed_precision.scaler.update(2.**7)  # set the scale
    learn.save('native')
    new = make_learner(seed=2, path=learn.path).to_native_fp16()
    new.load('native')
    assert new.native_mixed_precision.loss_scale == 2.**7
    fit(new, 1)
    assert new.native_mixed_precision.loss_scale in (2.**7, 2.**6)  # kept by before_fit, not recreated at 2**16

def test_load_during_fit_updates_the_masters():
    learn = make_learner().to_fp16(max_loss_scale=2.**10)
    fit(learn, 1)
    learn.save('start')
    ref = flat_state(learn.model.state_dict())
    fit(learn, 2, cbs=SaveAt(1, load='start'))  # loads at the end of the last epoch: nothing trains after it
    for k, v in learn.model.state_dict().items(): assert torch.equal(v, ref[k]), k  # restored from the masters
    fit(learn, 1)  # and the learner trains on normally
    assert learn.model[0].weight.dtype == torch.float32 and not torch.equal(learn.model[0].weight, ref['0.weight'])

def test_save_model_callback_best_model():
    learn = make_learner().to_fp16(scaler='lognormal')
    fit(learn, 3, lr=3e-2, cbs=SaveModelCallback(with_opt=True, fname='best'))
    best = torch.load(learn.path/'models/best.pth', weights_only=False)
    for k, v in learn.model.state_dict().items(): assert torch.equal(v, best['model'][k]), k  # loaded in after_fit
    assert best['opt']['fp16cb']['MixedPrecision']['scaler']['type'] == 'LogNormalScaler'
    assert learn.model[0].weight.dtype == torch.float32

class Record(Callback):
    "Seeds every epoch (dropout) by its global index, and records each batch's loss."
    order = 0
    def __init__(self, offset=0): self.offset, self.losses = offset, []
    def before_epoch(self): torch.manual_seed(100 + self.epoch + self.offset)
    def after_loss(self): self.losses.append(self.learn.loss.item())

@pytest.mark.parametrize('flat,scaler', [(False, 'backoff'), (True, 'lognormal')])
def test_resume_is_bit_exact(flat, scaler):
    kw = dict(flat_master=flat, scaler=scaler, scale_wait=2, max_loss_scale=2.**14)
    a = make_learner(n=48); a.to_fp16(**kw)
    ra = Record(); fit(a, 3, cbs=[ra, SaveAt(0)])
    c = make_learner(n=48); c.to_fp16(**kw)
    rc = Record(); fit(c, 3, cbs=rc)
    assert ra.losses == rc.losses  # saving mid-fit does not disturb the fit
    b = make_learner(seed=5, path=a.path, n=48); b.to_fp16(**kw)
    b.load('mid')
    rb = Record(offset=1); fit(b, 2, cbs=rb)
    n = len(rb.losses)
    assert rb.losses == ra.losses[-n:]  # bit-exact: same masters, optimizer state, scaler state, dropout seeds
    for k, v in a.model.state_dict().items(): assert torch.equal(v, b.model.state_dict()[k]), k
    assert b.mixed_precision.scaler.state_dict() == a.mixed_precision.scaler.state_dict()

def floating_tensors(osd) -> list:
    "Every floating tensor of a saved optimizer state dict (fastai's list of per-param dicts, or torch's dict of them)."
    sts = osd['state'].values() if isinstance(osd['state'], dict) else osd['state']
    return [v for st in sts for v in st.values() if torch.is_tensor(v) and v.is_floating_point()]

STATE16 = {'masters-adam': ('to_bf16', {}, None), 'flat-fp16-torch': ('to_fp16', dict(flat_master=True), torch_adamw),
           'half-bf16-adam': ('to_bf16', dict(half_storage=True), None),
           'half-fp16-torch': ('to_fp16', dict(half_storage=True), torch_adamw),
           'sib-adam': ('to_bf16', dict(step_in_backward=True), None)}

@pytest.mark.parametrize('name', list(STATE16))
def test_bf16_state_resumes_bit_identically_and_loads_into_plain_fp32(name):
    """bf16 optimizer state, rounded stochastically: saved mid-fit (widened to FP32) and between fits, it resumes in a new
    learner bit for bit (the state narrows back exactly, the rounding's generator is in the checkpoint), a save changes
    nothing of the run, and the file loads into plain FP32 fastai with FP32 state."""
    call, kw, opt_func = STATE16[name]
    kw = {**kw, **({'max_loss_scale': 2.**10} if call == 'to_fp16' else {}), 'state_dtype': torch.bfloat16}
    def learner(seed=0, path=None):
        l = make_learner(seed=seed, path=path, n=48)
        if opt_func: l.opt_func = opt_func
        return getattr(l, call)(**kw)
    a = learner(); ra = Record(); fit(a, 3, cbs=[ra, SaveAt(0)])
    c = learner(); rc = Record(); fit(c, 3, cbs=rc)
    assert ra.losses == rc.losses  # saving mid-fit disturbs nothing (no rounding, no random draw)
    b = learner(seed=5, path=a.path); b.load('mid')
    rb = Record(offset=1); fit(b, 2, cbs=rb)
    assert rb.losses == ra.losses[-len(rb.losses):]
    for k, v in a.model.state_dict().items(): assert torch.equal(v, b.model.state_dict()[k]), k
    sd = torch.load(a.path/'models/mid.pth', weights_only=False)
    assert floating_tensors(sd['opt']) and {t.dtype for t in floating_tensors(sd['opt'])} == {torch.float32}
    plain, warned = plain_loaded(a.path, opt_func)
    assert not warned and not plain.precision_callbacks()
    assert {t.dtype for t in floating_tensors(plain.opt.state_dict())} == {torch.float32}
    for s, t in zip(floating_tensors(plain.opt.state_dict()), floating_tensors(sd['opt'])): assert torch.equal(s.cpu(), t.cpu())  # a GPU learner's state beside the file's
    # between fits
    a.save('between')
    ra2 = Record(offset=3); fit(a, 1, cbs=ra2)
    d = learner(seed=7, path=a.path); d.load('between')
    rd = Record(offset=3); fit(d, 1, cbs=rd)
    assert rd.losses == ra2.losses
    for k, v in a.model.state_dict().items(): assert torch.equal(v, d.model.state_dict()[k]), k
    for s, t in zip(floating_tensors(a.opt.state_dict()), floating_tensors(d.opt.state_dict())):
        assert s.dtype == torch.float32 and torch.equal(s.cpu(), t.cpu())  # fastai's `load` maps a torch step count onto the GPU

def test_export_and_load_learner():
    learn = make_learner().to_fp16(scaler='lognormal')
    fit(learn, 1)
    learn.export('exp.pkl')
    new = load_learner(learn.path/'exp.pkl')  # cpu=True: fastai calls `to_fp32()` on a learner with `mixed_precision`
    assert new.model[0].weight.dtype == torch.float32 and not new.precision_callbacks()
    assert all(p.device.type == 'cpu' for p in new.model.parameters())
    new.dls.to(DEVICE); new.model.to(DEVICE)  # the same device as `learn`: the same kernels, bit for bit
    x = torch.randn(5, 6, device=DEVICE)
    new.model.eval(); learn.model.eval()
    assert torch.equal(new.model(x), learn.model(x))
    preds, _ = new.get_preds(dl=new.dls.test_dl([(t, torch.zeros(1)) for t in x.cpu()]))
    assert preds.dtype == torch.float32 and torch.allclose(preds, learn.model(x).cpu(), atol=1e-6)
    kept = load_learner(learn.path/'exp.pkl', cpu=False)  # the FP32 learner, without our callbacks
    assert kept.model[0].weight.dtype == torch.float32 and not kept.precision_callbacks()
    kept.dls = learn.dls
    fit(kept.to_fp16(scaler='lognormal'), 1)  # to train in mixed precision: to_fp16 again
    assert kept.mixed_precision.scaler.n_steps == 4 and len(kept.mixed_precision.scales) == 4

def test_lr_find_restores_model_and_scaler():
    "lr_find saves in its before_fit (mid-fit for us) and loads in after_fit: weights and the scaler come back."
    from fastai.callback.schedule import lr_find  # noqa: F401 (patches Learner.lr_find)
    learn = make_learner(n=128).to_fp16(scaler='lognormal', flat_master=True)
    fit(learn, 1)
    before, sc = flat_state(learn.model.state_dict()), learn.mixed_precision.scaler.state_dict()
    with learn.no_bar(), learn.no_logging(): learn.lr_find(num_it=10, show_plot=False)
    for k, v in learn.model.state_dict().items(): assert torch.equal(v, before[k]), k
    assert learn.mixed_precision.scaler.state_dict() == sc and len(learn.metrics) == 0

@pytest.mark.parametrize('flat', [False, True])
@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
def test_save_mid_accumulation_keeps_the_accumulated_grads(mode, flat):
    """Gradient accumulation across an epoch's end, with `SaveModelCallback(every_epoch=True)` saving there: the grads
    accumulated so far survive the save (fastai's FP32 save leaves them alone), so the run ends exactly as without it."""
    from fastai.callback.training import GradientAccumulation
    finals = []
    for save in (False, True):
        learn = make_learner()
        getattr(learn, f'to_{mode}')(flat_master=flat, **({'max_loss_scale': 2.**8} if mode == 'fp16' else {}))
        cbs = [GradientAccumulation(48)] + ([SaveModelCallback(every_epoch=True)] if save else [])  # 3 batches of 16
        fit(learn, 3, 1e-1, cbs=cbs)  # 4 batches an epoch: accumulations span the epochs' ends
        finals.append([p.detach().clone() for p in learn.model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*finals))

# ---- atomic save and export -----------------------------------------------------------------------------------

def failing_save(real_save):
    "A `torch.save` that writes the first half of the real file, then fails as a full disk does."
    def save(obj, f, *args, **kwargs):
        buf = io.BytesIO(); real_save(obj, buf, *args, **kwargs)
        data = buf.getvalue()[:len(buf.getvalue()) // 2]
        if isinstance(f, (str, os.PathLike)):
            with open(f, 'wb') as fh: fh.write(data)
        else: f.write(data)
        raise OSError(errno.ENOSPC, 'No space left on device')
    return save

def files(d): return sorted(os.listdir(d))

def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    "Before the fix: `learn.save` truncated the old file first, so a save failing part-way destroyed the checkpoint."
    learn = synth_learner(path=tmp_path).to_bf16()
    quiet_fit(learn, 1, lr=1e-2)
    fname = learn.save('ck')
    saved, w = fname.read_bytes(), weights(learn)
    quiet_fit(learn, 1, lr=1e-2)
    monkeypatch.setattr(torch, 'save', failing_save(torch.save))
    with pytest.raises(OSError): learn.save('ck')
    monkeypatch.undo()
    assert fname.read_bytes() == saved and files(fname.parent) == ['ck.pth']  # intact, and no temporary file left
    learn.load('ck')
    for a, b in zip(weights(learn), w): assert torch.equal(a, b)

def test_failed_save_of_save_model_callback_keeps_the_previous_file(tmp_path, monkeypatch):
    "`SaveModelCallback` saves with `learn.save`: a failed save in a later fit keeps the best model of the earlier one."
    learn = synth_learner(path=tmp_path).to_fp16(max_loss_scale=2.**8)
    quiet_fit(learn, 1, lr=1e-2, cbs=SaveModelCallback(fname='best'))
    fname = tmp_path/'models'/'best.pth'
    saved = fname.read_bytes()
    monkeypatch.setattr(torch, 'save', failing_save(torch.save))
    with pytest.raises(OSError): quiet_fit(learn, 1, lr=1e-2, cbs=SaveModelCallback(fname='best'))  # a new best: saved
    monkeypatch.undo()
    assert fname.read_bytes() == saved and files(fname.parent) == ['best.pth']

def test_failed_export_keeps_the_previous_export(tmp_path, monkeypatch):
    "Before the fix: `learn.export` overwrote in place, so an export failing part-way destroyed the previous one."
    learn = make_learner(path=tmp_path).to_bf16()
    quiet_fit(learn, 1, lr=1e-2)
    learn.export('exp.pkl')
    fname = tmp_path/'exp.pkl'
    saved, dls, w = fname.read_bytes(), learn.dls, weights(learn)
    monkeypatch.setattr(torch, 'save', failing_save(torch.save))
    with pytest.raises(OSError): learn.export('exp.pkl')
    monkeypatch.undo()
    assert fname.read_bytes() == saved and files(tmp_path) == ['exp.pkl']
    assert learn.dls is dls and learn.opt is not None  # the learner keeps its data and optimizer
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        new = load_learner(fname)  # on the CPU (fastai's default)
    for a, b in zip(weights(new), w): assert torch.equal(a, b.cpu())

def test_atomic_write_replaces_only_on_success(tmp_path):
    from fp16cb.checkpoint import atomic_write
    fname = tmp_path/'f.bin'
    with atomic_write(fname) as f: f.write(b'old')
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(fname) as f:
            f.write(b'new, half written'); raise KeyboardInterrupt()
    assert fname.read_bytes() == b'old' and files(tmp_path) == ['f.bin']
    with atomic_write(fname) as f: f.write(b'new')
    assert fname.read_bytes() == b'new' and files(tmp_path) == ['f.bin']
    assert fname.stat().st_mode & 0o777 == 0o666 & ~_umask()  # permissions of a file made with `open`, not 0o600

def _umask():
    m = os.umask(0); os.umask(m)
    return m

# ---- an exported learner loads with fastai alone, as the FP32 learner -----------------------------------------

_LOAD_WITHOUT_FP16CB = r"""
import sys, torch
class Refuse:
    "fp16cb is not installed here."
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'fp16cb': raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Refuse())
from fastai.learner import load_learner
learn = load_learner(sys.argv[1])
assert not any(m.startswith('fp16cb') for m in sys.modules)
learn.model.eval()
torch.save(learn.model(torch.load(sys.argv[2])).detach(), sys.argv[3])
print(sorted(type(cb).__name__ for cb in learn.cbs))
"""

@pytest.mark.parametrize('setup', ['to_fp16', 'to_bf16', 'to_native_fp16'])
def test_exported_learner_loads_with_fastai_alone(setup, tmp_path):
    dsets = [Datasets(synth_data(n, seed=s), tfms=[[ItemGetter(0)], [ItemGetter(1)]]) for n, s in ((64, 1), (32, 2))]
    learn = Learner(DataLoaders.from_dsets(*dsets, bs=16), tiny_model(), loss_func=MSELossFlat(), path=tmp_path)
    learn = getattr(learn, setup)()
    quiet_fit(learn, 1, lr=1e-2)
    cbs = list(learn.cbs)
    learn.export('exp.pkl')
    assert list(learn.cbs) == cbs and learn.precision_callbacks()  # the learner itself keeps its precision
    x = torch.randn(5, 4)
    torch.save(x, tmp_path/'x.pt')
    r = subprocess.run([sys.executable, '-c', _LOAD_WITHOUT_FP16CB, str(tmp_path/'exp.pkl'), str(tmp_path/'x.pt'),
                        str(tmp_path/'y.pt')], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'MixedPrecision' not in r.stdout and 'ModelToHalf' not in r.stdout  # no precision callback: FP32 inference
    learn.model.eval()
    assert torch.equal(torch.load(tmp_path/'y.pt'), learn.model(x).detach())  # the FP32 model's predictions, exactly
    quiet_fit(learn, 1, lr=1e-2)  # and the exporting learner trains on in its precision

# ---- saving onto a symlink writes through it, as stock fastai does ----------------------------------------------------
def _links(tmp_path, kind):
    "A link `kind` in tmp_path/models/best.pth to a file in tmp_path/data (old content if it exists); (link, target)."
    import os
    (tmp_path/'models').mkdir(); (tmp_path/'data').mkdir()
    link, target = tmp_path/'models'/'best.pth', tmp_path/'data'/'best.pth'
    if kind != 'dangling': target.write_bytes(b'old checkpoint')
    if kind == 'chain':  # best.pth -> mid.pth -> (relative) ../data/best.pth
        mid = tmp_path/'models'/'mid.pth'
        os.symlink(os.path.join('..', 'data', 'best.pth'), mid); os.symlink(mid, link)
    elif kind == 'relative': os.symlink(os.path.join('..', 'data', 'best.pth'), link)
    else: os.symlink(target, link)
    return link, target

@pytest.mark.parametrize('kind', ['absolute', 'relative', 'chain', 'dangling'])
def test_atomic_write_replaces_the_target_of_a_symlink(tmp_path, kind):
    from fp16cb.checkpoint import atomic_write
    link, target = _links(tmp_path, kind)
    with atomic_write(link) as f: f.write(b'new checkpoint')
    assert link.is_symlink() and target.read_bytes() == b'new checkpoint' and link.read_bytes() == b'new checkpoint'
    assert sorted(p.name for p in (tmp_path/'data').iterdir()) == ['best.pth']  # no temporary file left behind
    assert not any(p.name.endswith('.tmp') for p in (tmp_path/'models').iterdir())

def test_atomic_write_through_a_symlink_keeps_the_old_target_on_failure(tmp_path):
    from fp16cb.checkpoint import atomic_write
    link, target = _links(tmp_path, 'absolute')
    with pytest.raises(RuntimeError, match='disk full'):
        with atomic_write(link) as f: f.write(b'half'); raise RuntimeError('disk full')
    assert link.is_symlink() and target.read_bytes() == b'old checkpoint'
    assert sorted(p.name for p in (tmp_path/'data').iterdir()) == ['best.pth']

def test_atomic_write_names_a_symlink_loop(tmp_path):
    import os
    from fp16cb.checkpoint import atomic_write
    os.symlink(tmp_path/'b.pth', tmp_path/'a.pth'); os.symlink(tmp_path/'a.pth', tmp_path/'b.pth')
    with pytest.raises(OSError, match=r"a\.pth.*form a loop"):
        with atomic_write(tmp_path/'a.pth') as f: f.write(b'x')
    assert (tmp_path/'a.pth').is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ['a.pth', 'b.pth']

def test_learn_save_writes_through_a_symlink(tmp_path):
    from conftest import make_learner as tiny_learner
    learn = tiny_learner(path=tmp_path).to_fp16()
    fit(learn, 1)
    link, target = _links(tmp_path, 'absolute')
    learn.save('best')
    assert link.is_symlink()
    sd = torch.load(target, weights_only=False)
    for k, v in learn.model.state_dict().items(): assert torch.equal(sd['model'][k], v), k

# ---- a path that is not a regular file (a device, a FIFO) is written through, never replaced --------------------------
def _read_fifo(path):
    """Start a thread reading the FIFO `path` to its end (a FIFO's writer waits for a reader); returns `received()`: the
    bytes it read (None if nothing was written to the FIFO: the waiting reader is then released)."""
    import threading
    got = []
    t = threading.Thread(target=lambda: got.append(open(path, 'rb').read()), daemon=True)
    t.start()
    def received():
        t.join(5)
        if t.is_alive(): open(path, 'wb').close(); t.join(5)  # nobody wrote: end the reader's wait
        return got[0] if got and got[0] else None
    return received

def _fifo(tmp_path, name='pipe'):
    if not hasattr(os, 'mkfifo'): pytest.skip('no FIFOs on this platform')
    path = tmp_path/name
    os.mkfifo(path)
    return path

def _is_fifo(path) -> bool:
    import stat
    return stat.S_ISFIFO(os.lstat(path).st_mode)

@pytest.mark.parametrize('through_link', [False, True])
def test_atomic_write_onto_a_fifo_writes_through_it(tmp_path, through_link):
    "Before the fix: the FIFO (as `/dev/null`) was replaced by a regular file holding the bytes, and its reader got nothing."
    from fp16cb.checkpoint import atomic_write
    fifo = _fifo(tmp_path)
    path = tmp_path/'link.pth' if through_link else fifo
    if through_link: os.symlink(fifo, path)
    received = _read_fifo(fifo)
    with atomic_write(path) as f: f.write(b'checkpoint bytes')
    assert received() == b'checkpoint bytes' and _is_fifo(fifo) and path.is_symlink() == through_link
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({'pipe', path.name})  # no temporary file left

def test_atomic_write_onto_a_character_device_keeps_the_device(tmp_path):
    "A node of the null device made here (as root): written through as `torch.save` does, the node stays a device."
    import stat
    from fp16cb.checkpoint import atomic_write
    dev = tmp_path/'null'
    try: os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # the null device's numbers on Linux
    except (OSError, AttributeError): pytest.skip('cannot make a device node here (not root, or not Linux)')
    link = tmp_path/'models'/'best.pth'
    link.parent.mkdir(); os.symlink(dev, link)
    for path in (dev, link):
        with atomic_write(path) as f: f.write(b'discarded')
        assert stat.S_ISCHR(os.lstat(dev).st_mode) and link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ['models', 'null'] and os.listdir(link.parent) == ['best.pth']

def test_learn_save_and_export_onto_a_fifo(tmp_path):
    "A save mid-fit onto `models/best.pth -> a FIFO`, and `export` onto a FIFO: the FIFO gets the file, and stays."
    learn = make_learner(path=tmp_path).to_fp16(max_loss_scale=2.**8)
    fifo = _fifo(tmp_path)
    (tmp_path/'models').mkdir(); os.symlink(fifo, tmp_path/'models'/'best.pth')
    received = _read_fifo(fifo)
    fit(learn, 1, cbs=SaveAt(0, 'best'))  # at the end of the epoch: the FP32 masters of the fit's end
    data = received()
    assert data and _is_fifo(fifo) and (tmp_path/'models'/'best.pth').is_symlink()
    sd = torch.load(io.BytesIO(data), weights_only=False)
    for k, v in learn.model.state_dict().items(): assert torch.equal(sd['model'][k], v), k
    received = _read_fifo(fifo)
    learn.export(fifo)
    data = received()
    assert data and _is_fifo(fifo) and sorted(p.name for p in tmp_path.iterdir()) == ['models', 'pipe']
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        new = torch.load(io.BytesIO(data), weights_only=False)
    for a, b in zip(weights(new), weights(learn)): assert torch.equal(a, b)

def test_a_rounding_generator_from_another_device_kind_warns_and_trains_on():
    """A checkpoint's stochastic-rounding generator is set on the generator of the device the model trains on, at the
    set-up; one saved on another kind of device (a CUDA state on a CPU) cannot be: a warning, and training goes on.
    Before: the state was forced into a CPU generator at load time (a CUDA state raised there, and a CPU state was then
    dropped by a fit on CUDA)."""
    learn = make_learner().to_bf16(half_storage=True)
    quiet_fit(learn, 1)
    mp = learn.mixed_precision
    good = mp.state_dict()
    other = torch.Generator().get_state() if DEVICE.type == 'cuda' else torch.zeros(16, dtype=torch.uint8)  # a CUDA one's size
    mp.load_state_dict({**good, 'rng': other})
    assert torch.equal(mp.state_dict()['rng'], other)  # kept as loaded until it can be set
    with pytest.warns(RuntimeWarning, match="saved on another kind of device"): quiet_fit(learn, 1)
    assert all(torch.isfinite(p).all() for p in learn.model.parameters())
    mp.load_state_dict(good)
    quiet_fit(learn, 1)  # the right kind: set at the set-up, no warning
