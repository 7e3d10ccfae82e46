"""The weight store, the second room of a training step: what the optimizer steps in a mixed-precision fit and how a
step's gradients get there. One concern per module, arrows pointing down this list:

- `store`: the interface (`WeightStore`) and its `Stage`, with the rules for what may be converted;
- `masters`: FP32 master weights, per param (`ParamMasters`) or one flat buffer per group (`FlatMasters`);
- `half`: 16-bit storage without masters (`HalfStorage`), and the rounding back to 16-bit;
- `lift`: how the 16-bit grads reach FP32 inside the step, a bounded chunk at a time (runs, chunk plans, coalescing);
- `state16`: the optimizer's state stored in bfloat16 between steps (`HalfState`), lifted to FP32 with its param;
- `state8`: or in 8 bits, torchao's block-wise codes with their scales (`State8`), which `HalfState` widens and narrows;
- `optstate`: the optimizer's per-param state moved between the model's params and what the optimizer steps;
- `functional`: fastai's original `get_master`, `to_master_grads`, `to_model_params`, `copy_clone`;
- `writes`: other code's in-place writes to the model's params reaching the FP32 masters (`WriteWatch`);
- `layout`: flat buffers and their views, each keeping its tensor's strides;
- `lazy`: FP32 tensors that a checkpoint writes one at a time (`Stream`), made as `torch.save` reaches them."""
from .layout import dense_strides, flat_views, flatten_like, owns_storage, with_layout_of, shared
from .lazy import Stream
from .functional import MASTERED, get_master, to_master_grads, to_model_params, copy_clone, check_unique_params
from .optstate import move_opt_state
from .store import Stage, WeightStore
from .masters import FP32Masters, FlatMasters, ParamMasters
from .half import HalfStorage, round_stochastic, round_to
from .state16 import HalfState, resolve_state_dtype

__all__ = ['MASTERED', 'Stage', 'WeightStore', 'FP32Masters', 'FlatMasters', 'ParamMasters', 'HalfStorage',
           'check_unique_params', 'get_master', 'to_master_grads', 'to_model_params', 'copy_clone', 'move_opt_state',
           'round_stochastic', 'round_to', 'HalfState', 'resolve_state_dtype', 'dense_strides', 'flat_views',
           'flatten_like', 'with_layout_of', 'owns_storage', 'shared', 'Stream']
