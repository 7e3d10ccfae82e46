"""The weight store, the second room of a training step: what the optimizer steps in a mixed-precision fit and how a
step's gradients get there. The optimizer is the user's, on the model's own params; what changes its step is set on
fastai's classes (`fp16cb.patches`) and reads the registries here. One concern per module; each imports only modules
below it in this list (`tests/test_structure.py` checks the order):

- `half`: 16-bit storage (`half_storage`): the model's params 16-bit for the fit, fp16's grads loss-scaled until the
  step (`HalfStorage`);
- `sharded`: the model's own FP32 params sharded with FSDP2 (`ShardedParams`): this rank's shards checked, the
  grads clipped by the norm over every rank's;
- `params`: the model's own FP32 params as what the optimizer steps (`ModelParams`, the default: its forward computes
  with 16-bit copies), the `Stage` of a step, and fastai's `_step` counted (`counted_step`);
- `lifted`: 16-bit params stepped in FP32 by the optimizer's own code, a bounded chunk at a time, and rounded back to
  nearest or stochastically (`LiftedSteps`, `round_to`);
- `stored`: the optimizer's state stored in 16 or 8 bits between steps, widened around them a chunk at a time
  (fastai's loop, `fastai_step`; a torch optimizer's, `wrapper_step`), read in FP32 through the optimizer's state dict;
- `drivers`: fastai's loop over a run of consecutive params as one flat tensor (`FusedRun`), the params laid out for it
  (`lay_out`), and the runs of a fit's optimizer (`FusedLoop`);
- `functional`: fastai's original `get_master`, `to_master_grads`, `to_model_params`, `copy_clone`;
- `optstate`: which optimizer holds the params and state, fastai's one-param update, a param stepped a slice at a time;
- `state_storage`: the optimizer's state between steps (`StateStorage`): FP32, bfloat16 (rounded back stochastically)
  or 8-bit, widened to FP32 with its param for the step;
- `state8`: the 8-bit codes, torchao's block-wise quantization with one scale per block (`State8`);
- `lazy`: FP32 tensors that a checkpoint writes one at a time (`Stream`), made as `torch.save` reaches them;
- `backward`: the step in the backward (`step_in_backward`): each param stepped by a hook as its grad completes;
- `layout`: flat buffers and their views, each keeping its tensor's strides."""
from .layout import dense_strides, flat_views, flatten_like, owns_storage, with_layout_of, shared, own_storages
from .lazy import Stream
from .functional import MASTERED, get_master, to_master_grads, to_model_params, copy_clone, check_unique_params
from .state_storage import StateStorage
from .stored import fastai_step, fastai_state_dict, wrapper_step
from .lifted import round_stochastic, round_to
from .params import ModelParams, Stage, counted_step
from .half import HalfStorage
from .sharded import ShardedParams

__all__ = ['MASTERED', 'Stage', 'HalfStorage', 'ShardedParams',
           'check_unique_params', 'get_master', 'to_master_grads', 'to_model_params', 'copy_clone',
           'round_stochastic', 'round_to', 'StateStorage', 'ModelParams', 'counted_step', 'fastai_step',
           'fastai_state_dict', 'wrapper_step',
           'dense_strides', 'flat_views', 'flatten_like', 'with_layout_of', 'owns_storage', 'shared', 'own_storages',
           'Stream']
