"""The weight store, the second room of a training step: what the optimizer steps in a mixed-precision fit and how a
step's gradients get there. One concern per module; each imports only modules below it in this list
(`tests/test_structure.py` checks the order):

- `params`: the model's own FP32 params as what the optimizer steps (`ModelParams`, the default: its forward computes
  with 16-bit copies), and fastai's `_step` counted (`counted_step`);
- `stored`: its optimizer's state stored in 16 or 8 bits between steps, widened around them a chunk at a time
  (fastai's loop, `fastai_step`; a torch optimizer's, `wrapper_step`), read in FP32 through the optimizer's state dict;
- `half`: 16-bit storage without masters (`HalfStorage`), and the rounding back to 16-bit;
- `store`: the interface `HalfStorage` implements (`WeightStore`) and its `Stage`, with the rules for what may be
  converted;
- `drivers`: fastai's loop over a run of consecutive params (or per-param masters) as one flat tensor (`FusedRun`),
  the params laid out for it (`lay_out`), and the runs of a fit's optimizer (`FusedLoop`);
- `functional`: fastai's original `get_master`, `to_master_grads`, `to_model_params`, `copy_clone`;
- `optstate`: the optimizer's per-param state moved between the model's params and what the optimizer steps;
- `route`: the visible optimizer, whose class is routed to the store for a fit (`Route`);
- `lift`: how the 16-bit grads reach FP32 inside the step, a bounded chunk at a time (runs, chunk plans, coalescing);
- `state_storage`: the optimizer's state between steps (`StateStorage`): FP32, bfloat16 (rounded back stochastically)
  or 8-bit, widened to FP32 with its param for the step;
- `state8`: the 8-bit codes, torchao's block-wise quantization with one scale per block (`State8`);
- `lazy`: FP32 tensors that a checkpoint writes one at a time (`Stream`), made as `torch.save` reaches them;
- `backward`: the step in the backward (`step_in_backward`): each param stepped by a hook as its grad completes;
- `layout`: flat buffers and their views, each keeping its tensor's strides."""
from .layout import dense_strides, flat_views, flatten_like, owns_storage, with_layout_of, shared, own_storages
from .lazy import Stream
from .functional import MASTERED, get_master, to_master_grads, to_model_params, copy_clone, check_unique_params
from .optstate import move_opt_state
from .store import Stage, WeightStore
from .half import HalfStorage, round_stochastic, round_to
from .state_storage import StateStorage
from .stored import fastai_step, fastai_state_dict, wrapper_step
from .params import ModelParams, counted_step

__all__ = ['MASTERED', 'Stage', 'WeightStore', 'HalfStorage',
           'check_unique_params', 'get_master', 'to_master_grads', 'to_model_params', 'copy_clone', 'move_opt_state',
           'round_stochastic', 'round_to', 'StateStorage', 'ModelParams', 'counted_step', 'fastai_step',
           'fastai_state_dict', 'wrapper_step',
           'dense_strides', 'flat_views', 'flatten_like', 'with_layout_of', 'owns_storage', 'shared', 'own_storages',
           'Stream']
