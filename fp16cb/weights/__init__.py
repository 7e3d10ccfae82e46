"""The weight store, the second room of a training step: what the optimizer steps in a mixed-precision fit and how a
step's gradients get there. The optimizer is the user's, on the model's own FP32 params; what changes its step is set
on fastai's classes (`fp16cb.patches`) and reads the registries here (`loop`), which storage precision
(`fp16cb.storage`) fills. One concern per module; each imports only modules below it in this list
(`tests/test_structure.py` checks the order):

- `sharded`: the model's own FP32 params sharded with FSDP2 (`ShardedParams`): this rank's shards checked, the
  grads clipped by the norm over every rank's;
- `params`: the model's own FP32 params as what the optimizer steps (`ModelParams`, the default: its forward computes
  with 16-bit copies), the `Stage` of a step, and fastai's `_step` counted (`counted_step`);
- `loop`: fastai's optimizer steps during a fit (`fastai_step`, `wrapper_step`, `step_one`) and its `zero_grad`, and
  the registries where storage precision joins them;
- `drivers`: fastai's loop over a run of consecutive params as one flat tensor (`FusedRun`), the params laid out for it
  (`lay_out`), and the runs of a fit's optimizer (`FusedLoop`);
- `functional`: fastai's original `get_master`, `to_master_grads`, `to_model_params`, `copy_clone`;
- `optstate`: which optimizer holds the params and state, fastai's one-param update, a param stepped a slice at a time;
- `backward`: the step in the backward (`step_in_backward`): each param stepped by a hook as its grad completes;
- `layout`: flat buffers and their views, each keeping its tensor's strides."""
from .layout import dense_strides, flat_views, flatten_like, owns_storage, with_layout_of, shared, own_storages
from .functional import MASTERED, get_master, to_master_grads, to_model_params, copy_clone, check_unique_params
from .loop import fastai_step, fastai_zero_grad, wrapper_step
from .params import ModelParams, Stage, counted_step
from .sharded import ShardedParams

__all__ = ['MASTERED', 'Stage', 'ShardedParams', 'check_unique_params', 'get_master', 'to_master_grads',
           'to_model_params', 'copy_clone', 'ModelParams', 'counted_step', 'fastai_step', 'fastai_zero_grad',
           'wrapper_step', 'dense_strides', 'flat_views', 'flatten_like', 'with_layout_of', 'owns_storage', 'shared',
           'own_storages']
