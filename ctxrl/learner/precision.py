"""Mixed precision: the dtype the model computes in, and the float32 master weights the optimiser updates.

``model.dtype`` is the storage dtype: the policy's module holds its weights in it and computes
its forward and backward passes in it, exactly as the engine's copy does (so the learner's
log-probs are the sampler's up to kernel differences, not a different arithmetic).
``train.master_weights`` says what the optimiser updates:

- ``float32`` (the default): with ``model.dtype`` bfloat16 or float16, AdamW (``MasterAdamW``)
  keeps a float32 master copy of every trainable weight with float32 moments. Each backward
  pass's low-precision gradient is added into a float32 gradient buffer as soon as it is
  produced (so accumulation over micro-batches is in float32), clipping and the update run on
  the masters, and the result is rounded into the model's weights. An update of 1e-6 on a
  weight of 0.02 accumulates in the master (bf16's spacing there is 1.2e-4, where a direct bf16
  update would round it away) and reaches the model once the sum crosses that spacing. float16
  adds dynamic loss scaling (``torch.amp.GradScaler``): the loss is multiplied before backward
  so small gradients do not underflow, the master gradients are unscaled before clipping, and a
  step whose scaled gradients overflowed is skipped while the scale halves.
- ``model``: AdamW updates the ``model.dtype`` weights directly (no master copy: 6 bytes per
  parameter less; in bf16 most small updates are lost). float16 is refused here.

With ``model.dtype = float32`` both are plain float32 AdamW. Memory per trainable parameter with
bf16 and float32 masters: 2 (weights) + 4 (master) + 4 (gradient) + 8 (moments) bytes. On CUDA,
TF32 matmuls are enabled for the float32 parts and AdamW uses its fused kernel (not with loss
scaling). Why not ``torch.autocast`` over float32 weights: its arithmetic differs from the engine's
bf16 forward pass (a learner/sampler log-prob gap), and it measured 1.7 GiB more for the 0.5B update
on an H100 (docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ctxrl.errors import ConfigError
from ctxrl.learner.grad_accumulate import Waiting

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Precision:
    """The storage dtype, whether the optimiser keeps float32 masters, and loss scaling (module docstring)."""

    def __init__(self, storage: str = "float32", master_weights: str = "float32", device: str = "cpu") -> None:
        if storage not in DTYPES:
            raise ConfigError(f"model.dtype must be one of {', '.join(DTYPES)}, not {storage!r}")
        if master_weights not in ("float32", "model"):
            raise ConfigError(f"train.master_weights must be float32 or model, not {master_weights!r}")
        self.device_type = torch.device(device).type
        self.storage = DTYPES[storage]
        if self.storage == torch.float16 and master_weights == "model":
            raise ConfigError("float16 weights cannot be trained directly (no loss scaling); set "
                              "train.master_weights=float32 or model.dtype=bfloat16")
        if self.storage == torch.float16 and self.device_type != "cuda":
            raise ConfigError(f"model.dtype=float16 trains with loss scaling on CUDA only; on {self.device_type} use "
                              "bfloat16 or float32")
        self.master = torch.float32 if master_weights == "float32" else self.storage
        self.scaler = torch.amp.GradScaler(self.device_type) if self.storage == torch.float16 else None
        if self.device_type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

    def __repr__(self) -> str:
        return f"Precision(storage={self.storage}, master={self.master}, loss_scaling={self.scaler is not None})"

    def optimizer(self, params: Iterable[torch.nn.Parameter], *, lr: float, weight_decay: float = 0.0,
                  betas: tuple[float, float] = (0.9, 0.99)) -> torch.optim.AdamW:
        """AdamW over the trainable ``params``: on float32 masters of low-precision weights, fused on CUDA."""
        params = [p for p in params if p.requires_grad]
        fused = self.scaler is None
        if self.master == torch.float32 and any(p.dtype != torch.float32 for p in params):
            return MasterAdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, fused=fused)
        return make_optimizer(params, lr=lr, weight_decay=weight_decay, betas=betas, fused=fused)

    # -- the backward pass and the step -------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale (before clipping); nothing without loss scaling."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.step(optimizer)
        else:
            optimizer.step()

    def update(self) -> None:
        """After every optimiser's step: adjust the loss scale (halve on overflow, grow after a run of good steps)."""
        if self.scaler is not None:
            self.scaler.update()

    @property
    def loss_scale(self) -> float | None:
        return float(self.scaler.get_scale()) if self.scaler is not None else None

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def trainable_grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors whose gradients ``optimizer`` steps on (a ``MasterAdamW``'s masters): what to clip."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def make_optimizer(params: Iterable[torch.nn.Parameter], *, lr: float, weight_decay: float = 0.0,
                   betas: tuple[float, float] = (0.9, 0.99), fused: bool = True) -> torch.optim.AdamW:
    """Plain AdamW over the parameters that train (``requires_grad``), fused on CUDA."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters: every parameter has requires_grad=False")
    fused = fused and all(p.is_cuda and p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, **({"fused": True} if fused
                                                                                       else {}))


class MasterAdamW(torch.optim.AdamW):
    """AdamW on float32 master copies of low-precision model parameters.

    ``param_groups`` hold the masters: clip ``trainable_grads(optimizer)``, as for any optimiser.
    Every model parameter gets a hook that takes its gradient as soon as a backward pass has
    accumulated it and frees the model's low-precision ``grad``. A master without a gradient yet takes the float32
    cast of it; later ones wait, and are added into their masters' float32 ``grad`` together
    (``ctxrl.learner.grad_accumulate``: one program on CUDA instead of a launch a parameter) once
    ``Waiting.FLUSH_BYTES`` of them wait and when the backward pass ends. ``step`` updates the masters and copies them
    (rounded) into the model. ``close()`` removes the hooks:
    call it before another optimiser trains the same parameters (the warm start's does). ``state_dict`` carries the
    masters too, so a resumed run continues from the exact float32 values.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], *, fused: bool = True, **kwargs) -> None:
        self.model_params = [p for p in params if p.requires_grad]
        if not self.model_params:
            raise ValueError("no trainable parameters: every parameter has requires_grad=False")
        masters = [p.detach().to(torch.float32, copy=True).requires_grad_(True) for p in self.model_params]
        fused = fused and all(p.is_cuda for p in masters)
        super().__init__(masters, **kwargs, **({"fused": True} if fused else {}))
        self._waiting = Waiting()
        self._hooks = [p.register_post_accumulate_grad_hook(_accumulate(m, self._waiting))
                       for p, m in zip(self.model_params, masters)]

    @property
    def masters(self) -> list[torch.Tensor]:
        return trainable_grads(self)

    def flush(self) -> None:
        """Add the waiting low-precision gradients into their masters' (the end of every backward pass does)."""
        self._waiting.flush()

    def consumes(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Whether this optimiser's hooks take every one of ``params``' gradients off the parameter as it is
        accumulated (they are live, and every parameter that trains is one of this optimiser's)."""
        mine = {id(p) for p in self.model_params} if self._hooks else set()
        return all(id(p) in mine for p in params if p.requires_grad)

    @torch.no_grad()
    def step(self, closure=None):
        self.flush()
        loss = super().step(closure)
        for p, m in zip(self.model_params, self.masters):
            p.copy_(m)
        return loss

    def close(self) -> None:
        """Remove the gradient hooks from the model's parameters (another optimiser may train them next)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._waiting.drop()
        super().zero_grad(set_to_none)
        for p in self.model_params:
            p.grad = None

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["masters"] = [m.detach() for m in self.masters]
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("masters", None)
        if masters is None or len(masters) != len(self.masters):
            raise ValueError("this optimiser state holds no float32 master weights for these parameters (was "
                             "train.master_weights or model.dtype changed?)")
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for m, saved, p in zip(self.masters, masters, self.model_params):
                m.copy_(saved)
                p.copy_(m)


def _accumulate(master: torch.Tensor, waiting: Waiting):
    """The hook on a model parameter: its gradient into ``master``'s (cast, or waiting to be added), the model's own
    freed. (It holds the master and the queue, not the optimiser, whose moments would otherwise live as long as the
    model does.)"""
    def hook(param: torch.Tensor) -> None:
        grad, param.grad = param.grad, None
        with torch.no_grad():
            if master.grad is None:  # (a copy even of a float32 gradient: it may be a CUDA graph's buffer)
                master.grad = grad.to(torch.float32, copy=True)
            else:
                waiting.add(master.grad, grad)
    return hook
