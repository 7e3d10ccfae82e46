"""Which devices the main job and the benchmark can run on: a bad or unavailable one is a clear error."""
from __future__ import annotations
import torch

__all__ = ['resolve_device', 'model_device']

def resolve_device(
    s, # a device name: 'cpu', 'cuda', 'cuda:1', 'mps', ...
    types=('cpu', 'cuda', 'mps'), # the device types the caller supports
    expected:str='cpu, cuda, cuda:N or mps', # how to name them in the error
) -> torch.device:
    "`s` as a `torch.device` that exists on this machine; a `ValueError` that says what is wrong otherwise."
    try: d = torch.device(s)
    except (RuntimeError, ValueError, TypeError): raise ValueError(f"not a torch device: {s!r} (expected {expected})")
    if d.type not in types: raise ValueError(f"unsupported device type: {s!r} (expected {expected})")
    if d.type == 'cuda' and not torch.cuda.is_available():
        raise ValueError(f"{s!r}: CUDA is not available on this machine (try --device cpu)")
    if d.type == 'cuda' and d.index is not None and d.index >= torch.cuda.device_count():
        raise ValueError(f"{s!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if d.type == 'mps' and not (hasattr(torch.backends, 'mps') and torch.backends.mps.is_available()):
        raise ValueError(f"{s!r}: MPS is not available on this machine")
    return d

def model_device(model) -> torch.device:
    "The device of `model`'s first parameter (or buffer); CPU for a model without any."
    for t in model.parameters(): return t.device
    for t in model.buffers(): return t.device
    return torch.device('cpu')
