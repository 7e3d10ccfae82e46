"""Saves mid-fit and the fit's end at their true peak (issue 39): `learn.save` from a callback (`SaveModelCallback`,
`lr_find`) streams the FP32 file param by param: the masters are written over their own memory (no clone), 16-bit
weights (`half_storage`) and 16-bit optimizer state (`state_dtype`) are widened one tensor at a time as `torch.save`
writes them. The file is the FP32 file it was (keys, shapes, strides, dtypes, values; each tensor its own storage),
and loads into plain FP32 fastai. The fit's end gives the FP32 learner back without a copy of the masters or of the
16-bit model, one state tensor widened at a time."""
import gc, io, zipfile
from contextlib import contextmanager
import pytest
import torch
import torch.serialization
from torch import nn
from fastai.basics import Learner, DataLoaders, Adam, MSELossFlat, Callback
from fastai.optimizer import OptimWrapper
from functools import partial

from fp16cb.checkpoint import fp32_view
from fp16cb.weights import shared
from fp16cb.storage import Stream
from bench.peak_memory import Tracker
from conftest import DEVICE, seed_all, set_chunk

N_IN, WIDTH, DEPTH = 128, 128, 4  # four 128x128 weights: one param's FP32 is a quarter of the model's
BIG = WIDTH * WIDTH * 4  # bytes of the largest param in FP32
SLACK = 16 << 10  # fixed buffers (the loss scale, the overflow flags, the scaler's state, step counts)
BF16 = torch.bfloat16
MODES = {'masters': {}, 'state': dict(state_dtype=BF16), 'flat-state': dict(flat_master=True, state_dtype=BF16),
         'half-state': dict(half_storage=True, state_dtype=torch.bfloat16),
         'half-sib-state': dict(half_storage=True, step_in_backward=True, state_dtype=torch.bfloat16),
         'torch-state': dict(state_dtype=torch.bfloat16), 'state8': dict(state_dtype='8bit'),
         'half-state8': dict(half_storage=True, state_dtype='8bit')}
cpu_only = pytest.mark.skipif(DEVICE.type != 'cpu', reason="exact bytes: counted on the CPU")

def _model():
    seed_all(0)
    return nn.Sequential(*[m for _ in range(DEPTH) for m in (nn.Linear(WIDTH, WIDTH, bias=False), nn.ReLU())][:-1])

def _data(n_batches=3, bs=8):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n_batches * bs, N_IN, generator=g), torch.randn(n_batches * bs, WIDTH, generator=g)
    items = list(zip(x, y))
    return DataLoaders.from_dsets(items, items[:bs], bs=bs, shuffle=False, device=DEVICE)

def _learner(mode, path, dls=None, model=None):
    opt = partial(OptimWrapper, opt=torch.optim.AdamW) if mode.startswith('torch') else Adam
    learn = Learner(dls or _data(), model or _model(), loss_func=MSELossFlat(), opt_func=opt, lr=1e-3, path=path)
    return learn if mode == 'fp32' else learn.to_bf16(**MODES[mode])

def _storages() -> dict:
    "`{data_ptr: bytes}` of every storage the garbage collector sees (of tensors, their grads, and storages)."
    res = {}
    def add(s, n):
        try: ptr = s.data_ptr()
        except RuntimeError: return  # a fake tensor (a `torch.compile` trace leaves some behind): no memory
        if n: res[ptr] = max(res.get(ptr, 0), n)
    for o in gc.get_objects():
        try: is_tensor = isinstance(o, torch.Tensor)
        except ReferenceError: continue  # a weak proxy whose object is gone
        if is_tensor and not o.is_meta:
            add(o.untyped_storage(), o.untyped_storage().nbytes())
            if o.is_leaf and o.grad is not None: add(o.grad.untyped_storage(), o.grad.untyped_storage().nbytes())
        elif isinstance(o, torch.UntypedStorage) and o.device.type != 'meta':
            add(o, torch._C.StorageBase.nbytes(o))  # the storage's bytes now (not a lazy one's size to be)
    return res

def _live(exclude) -> int:
    "Bytes of the union of the memory of the live storages (a part shared with a buffer counted once), less `exclude`."
    tot, end = 0, 0
    for p, n in sorted((p, n) for p, n in _storages().items() if p not in exclude):
        if p + n > end: tot, end = tot + p + n - max(p, end), p + n
    return tot

class _Counts(Callback):
    "Live bytes between steps, when `torch.save` is called mid-fit, and as its writer writes each storage."
    order = 60
    def __init__(self, exclude): self.exclude, self.between, self.at_call, self.writing = exclude, 0, 0, 0
    def before_batch(self):
        if self.training and self.iter: self.between = max(self.between, _live(self.exclude))
    def after_epoch(self):  # the last epoch's end: the state of every step there (each scan of the heap takes ~0.4 s)
        if self.epoch == self.n_epoch - 1:
            with _counting(self): self.learn.save('mid')

@contextmanager
def _counting(counts):
    "Within: `torch.save` counts the live bytes at its call, and its zip writer at each storage it writes."
    save, opener = torch.save, torch.serialization._open_zipfile_writer
    class Writer:
        def __init__(self, w): self.w = w
        def write_record(self, name, *args):
            if name.startswith('data/'): counts.writing = max(counts.writing, _live(counts.exclude))
            return self.w.write_record(name, *args)
        def __getattr__(self, k): return getattr(self.w, k)
    class Opened:
        def __init__(self, c): self.c = c
        def __enter__(self): return Writer(self.c.__enter__())
        def __exit__(self, *exc): return self.c.__exit__(*exc)
    def counting_save(*args, **kwargs):
        counts.at_call = max(counts.at_call, _live(counts.exclude))
        return save(*args, **kwargs)
    torch.save, torch.serialization._open_zipfile_writer = counting_save, lambda f: Opened(opener(f))
    try: yield
    finally: torch.save, torch.serialization._open_zipfile_writer = save, opener

@cpu_only
@pytest.mark.parametrize('mode', [m for m in MODES if 'state8' not in m])  # 8-bit: `test_mid_fit_save_true_peak`
def test_mid_fit_save_holds_one_param_more_than_between_steps(mode, tmp_path):
    """At a mid-fit `learn.save` the live storages are those between steps (before: the masters cloned for the file, 4
    bytes/param more, and the 16-bit state widened whole, 4 more), and while torch.save writes, at most one param's FP32
    tensor more (a 16-bit weight or state tensor widened as it is written)."""
    dls = _data()
    gc.collect()
    counts = _Counts(set(_storages()))
    learn = _learner(mode, tmp_path, dls)
    with learn.no_bar(), learn.no_logging(): learn.fit(2, cbs=counts)
    assert counts.between > 0
    assert counts.at_call <= counts.between + SLACK, (counts.at_call, counts.between)
    assert counts.writing <= counts.between + BIG + SLACK, (counts.writing - counts.between, BIG)

def _loaded(file) -> dict: return torch.load(file, map_location='cpu', weights_only=False)

def _tensors(o, prefix=''):
    "`{path: tensor}` of every tensor in the nested dicts and lists `o`."
    if isinstance(o, torch.Tensor): return {prefix: o}
    items = o.items() if isinstance(o, dict) else enumerate(o) if isinstance(o, (list, tuple)) else ()
    return {k: v for key, val in items for k, v in _tensors(val, f'{prefix}/{key}').items()}

@pytest.mark.parametrize('mode', list(MODES))
def test_mid_fit_file_is_the_fp32_file(mode, tmp_path):
    """The file saved mid-fit holds what the FP32 learner of that moment saves (the fit paused, `fp32_view`: the model
    with its masters, the optimizer state in FP32): the same tensors, shapes, strides, dtypes and values, each in a
    storage of its own; and it loads into a plain FP32 fastai learner."""
    class Both(Callback):
        order = 60
        def after_epoch(self):
            if self.epoch != 0: return
            self.learn.save('mid')
            with fp32_view(self.learn):  # the plain FP32 learner of now, saved by fastai's own way
                sd = {'model': self.learn.model.state_dict(), 'opt': self.learn.opt.state_dict()}
                torch.save(sd, tmp_path/'fp32.pth')
    learn = _learner(mode, tmp_path)
    with learn.no_bar(), learn.no_logging(): learn.fit(2, cbs=Both())
    got, want = _loaded(tmp_path/'models'/'mid.pth'), _loaded(tmp_path/'fp32.pth')
    got['opt'].pop('fp16cb', None)
    g, w = _tensors(got), _tensors(want)
    assert g.keys() == w.keys() and any('state' in k for k in g)
    for k, t in g.items():
        assert (t.dtype, t.shape, t.stride()) == (w[k].dtype, w[k].shape, w[k].stride()), k
        assert torch.equal(t, w[k]), k
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), k  # its own storage, as FP32's
    assert all(t.dtype == torch.float32 for k, t in g.items() if k.startswith('/model') or 'avg' in k)
    plain = Learner(_data(), _model(), loss_func=MSELossFlat(), opt_func=Adam, path=tmp_path)
    if not mode.startswith('torch'):
        plain.load('mid')
        for (k, v), p in zip(got['model'].items(), plain.model.parameters()): assert torch.equal(p.detach().cpu(), v), k

@pytest.mark.parametrize('mode', ['state', 'flat-state', 'half-sib-state'])
def test_mid_fit_saves_change_nothing_of_the_fit(mode, tmp_path):
    "Saving each epoch (the optimizer's state seen through its FP32 view, flat state split and put back) trains alike."
    class Saver(Callback):
        order = 60
        def after_epoch(self): self.learn.save('each')
    runs = []
    for cbs in ([], [Saver()]):
        learn = _learner(mode, tmp_path)
        with learn.no_bar(), learn.no_logging(): learn.fit(3, cbs=cbs)
        runs.append([p.detach().clone() for p in learn.model.parameters()])
    for a, b in zip(*runs): assert torch.equal(a, b)

def test_mid_fit_legacy_format(tmp_path):
    "torch's legacy format writes a storage without asking its size: the FP32 tensors are made before it starts."
    class Saver(Callback):
        order = 60
        def after_epoch(self): self.learn.save('legacy', _use_new_zipfile_serialization=False)
    learn = _learner('half-state', tmp_path)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, cbs=Saver())
    sd = _loaded(tmp_path/'models'/'legacy.pth')
    assert all(v.dtype == torch.float32 for v in sd['model'].values())
    assert torch.equal(sd['model']['0.weight'], learn.model[0].weight.detach().cpu())

def test_stream_writes_the_file_torch_save_writes():
    "Stand-ins made as they are written give the file of the tensors themselves, byte for byte; one exists at a time."
    a, b = torch.randn(6, 5).bfloat16(), torch.randn(3, 4, 2, 2).bfloat16().to(memory_format=torch.channels_last)
    plain, streamed = io.BytesIO(), io.BytesIO()
    torch.save({'a': a.float(), 'x': [b.float(), 3], 'a2': a.float()}, plain)
    made = []
    def fill(src):
        def f(out): made.append(len([s for s in stream.storages if torch._C.StorageBase.nbytes(s)])); out.copy_(src)
        return f
    with Stream() as stream:
        la = stream.tensor(a.shape, a.stride(), a.device, fill(a))
        lb = stream.tensor(b.shape, b.stride(), b.device, fill(b))
        torch.save({'a': la, 'x': [lb, 3], 'a2': stream.tensor(a.shape, a.stride(), a.device, fill(a))}, streamed)
    za, zb = zipfile.ZipFile(plain), zipfile.ZipFile(streamed)
    assert za.namelist() == zb.namelist()
    for n in za.namelist(): assert za.read(n) == zb.read(n), n
    assert made == [1, 1, 1]  # as each is made, it alone: the one before it freed

def test_shared_is_its_own_storage_over_the_buffer():
    "`shared`: a part of a buffer as a tensor whose storage is exactly its elements, the buffer's memory (no copy)."
    buf = torch.arange(40.)
    part = buf[8:32].view(4, 6)
    s = shared(part)
    assert s.untyped_storage().nbytes() == 24 * 4 and s.data_ptr() == part.data_ptr() and torch.equal(s, part)
    s.add_(1)
    assert buf[8] == 9
    f = io.BytesIO(); torch.save(s, f)
    assert len(f.getvalue()) < 24 * 4 + 2048  # its own elements, not the buffer's
    assert shared(s) is s and shared(buf) is buf

@cpu_only
@pytest.mark.parametrize('mode,widened', [('masters', 0), ('state', 4), ('flat-state', 4), ('half-state', 6),
                                          ('half-sib-state', 6)])
def test_fit_end_peak(mode, widened, tmp_path, monkeypatch):
    """The fit's end: the FP32 model over the masters' memory (no copy; 16-bit storage: one param widened at a time, its
    16-bit tensor let go), the 16-bit state widened one tensor at a time, the 16-bit buffers freed at once (not when
    the garbage collector finds the store). Peak: the fit's memory, plus what becomes FP32 (`widened` bytes/param: the
    state's 4, 16-bit storage's weights 2), plus one param's FP32."""
    set_chunk(monkeypatch, WIDTH * WIDTH)  # flat masters: one param each
    dls = _data()
    tracker = Tracker('cpu')
    class Marks(Callback):
        order = -10**6
        def before_batch(self):
            if self.training and self.iter: tracker.mark('between')
        def after_fit(self): tracker.mark('end:start')
    with tracker.running():
        learn = _learner(mode, tmp_path, dls)
        with learn.no_bar(), learn.no_logging(): learn.fit(1, cbs=Marks())
        tracker.mark('end')
    marks = {name: (now, peak) for name, now, peak in tracker.marks()}
    n = sum(p.numel() for p in learn.model.parameters())
    between, (after, peak) = marks['between'][0], marks['end']
    # the FP32 learner: weights and Adam's two moments, the 16-bit ones gone; the model's own params (the default, with
    # 16-bit state too) keep their grads, zeroed by fastai's `zero_grad`, as an FP32 fit leaves them
    own = mode in ('masters', 'state', 'flat-state')
    assert after <= (16 if own else 12) * n + SLACK, after / n
    assert peak <= max(between, marks['end:start'][0]) + widened * n + BIG + SLACK, ((peak - between) / n, mode)
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())

def test_save_before_any_fit(tmp_path):
    "A learner that never fitted has no optimizer yet: `learn.save` writes its model alone, as fastai's does."
    learn = _learner('state', tmp_path)
    assert learn.opt is None
    learn.save('none')
    assert _loaded(tmp_path/'models'/'none.pth').keys() == learn.model.state_dict().keys()

def test_between_fits_file_after_a_fit(tmp_path):
    "After the fit the model's params share the masters' memory, yet `learn.save` writes each alone, as FP32's file."
    learn = _learner('state', tmp_path)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    learn.save('after')
    sd = _loaded(tmp_path/'models'/'after.pth')
    for k, v in sd['model'].items():
        assert v.untyped_storage().nbytes() == v.numel() * 4, k
        assert torch.equal(v, learn.model.state_dict()[k].cpu()), k

@cpu_only
@pytest.mark.parametrize('mode', ['state', 'state8', 'half-state8'])
def test_mid_fit_save_true_peak(mode, tmp_path):
    """A mid-fit save at its true peak (every allocation and free, from torch's profiler), not only where the writer
    writes: at most one param's FP32 tensor above the memory between steps (8-bit state: dequantized straight into the
    tensor the file is written from, through one piece of the dequantizer's output; before, into a tensor of its own
    first, and copied: one param's FP32 more)."""
    from fp16cb.storage import state8
    piece = 4 * min(WIDTH * WIDTH, state8._piece('cpu')) if MODES[mode]['state_dtype'] == '8bit' else 0
    dls = _data()
    tracker = Tracker('cpu')
    class Marks(Callback):
        order = 60
        def before_batch(self):
            if self.training and self.iter: tracker.mark('between')
        def after_epoch(self):
            tracker.mark('save:start'); self.learn.save('mid'); tracker.mark('save')
    with tracker.running():
        learn = _learner(mode, tmp_path, dls)
        with learn.no_bar(), learn.no_logging(): learn.fit(1, cbs=Marks())
    marks = {name: (now, peak) for name, now, peak in tracker.marks()}
    base = max(marks['between'][0], marks['save:start'][0])
    assert marks['save'][1] <= base + BIG + piece + SLACK, ((marks['save'][1] - base) / BIG, mode)
