"""The reference row: a plain PyTorch AMP loop (no fastai) on the same model and batches, so that users see what the
framework costs (and, with its model compiled, what a compiled model costs in fastai). Timed like a fastai step: from
the start of the forward to the end of `zero_grad`, synchronised."""
from __future__ import annotations
import torch

from .measure import new_record, end_step, sync, clock, SavedTensors, held_bytes, channels_last_share
from .modes import half_dtype, plain_loss

__all__ = ['PlainAMP']

class PlainAMP:
    "autocast forward, FP32 loss, `GradScaler`-scaled backward and step (fp16; bf16 needs none), `zero_grad(set_to_none)`."
    def __init__(self,
        model, # the model (moved to `device`)
        batches:list, # `(x, y)` on `device`: one `fit` is one pass over them
        device,
        lr:float=1e-3, # AdamW's learning rate
        fused:bool=True, # torch's fused AdamW (else its foreach implementation)
        channels_last:bool=False, # the model in channels-last memory format (as fastai's `ChannelsLast` does)
        compile_backend:str=None, # `torch.compile` the model on this backend (None: eager)
    ):
        self.device, self.batches = torch.device(device), batches
        self.model = model.to(self.device, memory_format=torch.channels_last) if channels_last else model.to(self.device)
        if compile_backend is not None: self.model = torch.compile(self.model, backend=compile_backend)
        self.dtype = half_dtype(self.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, **({'fused': True} if fused else {'foreach': True}))
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)
        self.rec, self.mem_peak = new_record(), 0

    def fit(self, measure_memory:bool=False):
        "One pass over the batches; `measure_memory` (CPU): track the bytes a step holds in `mem_peak`."
        self.model.train()
        for x, y in self.batches: self._step(x, y, measure_memory)

    def _step(self, x, y, measure_memory):
        scale = self.scaler.get_scale()  # a host read: outside the timed step
        sync(self.device); t0 = clock()
        saved = SavedTensors().__enter__() if measure_memory else None
        with torch.autocast(self.device.type, dtype=self.dtype): pred = self.model(x)
        loss = plain_loss(pred, y)
        if saved is not None: saved.__exit__(None, None, None)
        self.scaler.scale(loss).backward()
        if saved is not None: self.mem_peak = max(self.mem_peak, held_bytes(self) + saved.bytes(list(self.model.parameters())))
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        sync(self.device)
        rec = self.rec
        rec['steps'].append(clock() - t0); rec['cb_steps'].append(0.)
        rec['channels_last'] = channels_last_share(self.model)
        rec['skip'] = self.scaler.get_scale() < scale  # GradScaler backs off exactly when it skipped the step
        end_step(rec)
