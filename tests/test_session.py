"The fit's one owner: `PrecisionSession` sets up and tears down, and what it installs on the optimizer comes off again."
import copy, pickle
from functools import partial
import pytest, torch
from fastai.basics import Callback, OptimWrapper, Adam, SGD
from fp16cb.session import session_of, PrecisionSession
from conftest import make_learner, quiet_fit

OPTS = {'fastai SGD': partial(SGD, mom=0.9), 'fastai Adam': Adam,
        'OptimWrapper(AdamW)': partial(OptimWrapper, opt=torch.optim.AdamW)}

@pytest.mark.parametrize('opt', list(OPTS))
@pytest.mark.parametrize('flat', [False, True])
def test_optimizer_gets_its_own_step_back(opt, flat):
    "During the fit the optimizer's step also copies the masters into the model; after it, nothing of ours is left on it."
    learn = make_learner(opt_func=OPTS[opt]).to_bf16(flat_master=flat)
    seen = []
    class Spy(Callback):
        order = 50
        def after_step(self): seen.append('step' in vars(self.learn.opt))
    quiet_fit(learn, 1, cbs=Spy())
    assert seen and all(seen)
    assert 'step' not in vars(learn.opt) and 'zero_grad' not in vars(learn.opt)
    w = [p.detach().clone() for p in learn.model.parameters()]
    quiet_fit(learn.to_fp32(), 1)  # a plain FP32 fit with the same optimizer trains
    assert any(not torch.equal(a, b) for a, b in zip(w, learn.model.parameters()))

def test_session_is_per_learner_and_never_copied():
    learn = make_learner().to_bf16()
    s = session_of(learn)
    assert session_of(learn) is s and isinstance(pickle.loads(pickle.dumps(s)), PrecisionSession)
    assert pickle.loads(pickle.dumps(s)).active == [] and session_of(copy.deepcopy(learn)) is not s

def test_nested_validate_keeps_the_setup_and_the_fit_tears_down():
    "validate() inside a fit (a callback) keeps the masters; the fit's end tears them down; a lone validate too."
    learn = make_learner().to_bf16()
    seen = []
    class Val(Callback):
        order, busy = 50, False
        def after_epoch(self):
            if self.busy: return  # validate() fires after_epoch itself
            self.busy, m = True, self.learn.mixed_precision.master
            with self.learn.no_bar(): self.learn.validate()
            self.busy = False
            seen.append(self.learn.mixed_precision.master is m and m is not None)
    quiet_fit(learn, 2, cbs=Val())
    assert seen == [True, True] and session_of(learn).active == [] and learn.mixed_precision.master is None
    learn.validate()
    assert session_of(learn).active == [] and all(p.dtype == torch.float32 for p in learn.model.parameters())

def test_a_pause_mid_fit_keeps_the_recorder_consistent(tmp_path):
    "A save in every epoch pauses the setup (`suspended`): the Recorder's columns are taken out once, at the fit's end."
    from fastai.callback.tracker import SaveModelCallback
    learn = make_learner(path=tmp_path).to_fp16(loss_scale=2.**20)
    quiet_fit(learn, 3, cbs=SaveModelCallback(every_epoch=True))
    rec = learn.recorder
    assert 'loss_scale' not in rec.metric_names and len(rec.values) == 3
    assert all(len(row) == len(rec.metric_names) - 2 for row in rec.values)  # no 'epoch', no 'time'
