"""Storage precision, inside the optimizer's step (as in optimi and torchao): what the optimizer keeps between steps
in fewer bits, orthogonal to the precision the forward computes in (`fp16cb.weights`, `fp16cb.callbacks.copies`). The
optimizer is the user's; these widen what it steps to FP32 around its own code and narrow it after, joining fastai's
step through the registries of `fp16cb.weights.loop`. One concern per module; each imports only modules below it in
this list (`tests/test_structure.py` checks the order):

- `half`: 16-bit storage (`half_storage`): the model's params 16-bit for the fit, fp16's grads loss-scaled until the
  step (`HalfStorage`);
- `lifted`: 16-bit params stepped in FP32 by the optimizer's own code, a bounded chunk at a time, and rounded back to
  nearest or stochastically (`LiftedSteps`, `round_to`);
- `state_storage`: the optimizer's state between steps (`StateStorage`): FP32, bfloat16 (rounded back stochastically)
  or 8-bit, widened to FP32 with its param for the step, and attached to an optimizer for a fit;
- `fused16`: fastai's Adam, a run of params in one compiled pass (on a CPU): bf16 state's step, `half_storage`'s;
- `stored`: the stored state as a torch optimizer's step and whoever reads a state dict see it (`TorchHooks`,
  `fastai_state_dict`: FP32 copies);
- `lazy`: FP32 tensors that a checkpoint writes one at a time (`Stream`), made as `torch.save` reaches them;
- `state8`: the 8-bit codes, torchao's block-wise quantization with one scale per block (`State8`)."""
from .lazy import Stream
from .state_storage import StateStorage
from .stored import fastai_state_dict
from .lifted import round_stochastic, round_to
from .half import HalfStorage

__all__ = ['Stream', 'StateStorage', 'fastai_state_dict', 'round_stochastic', 'round_to', 'HalfStorage']
