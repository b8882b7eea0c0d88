"""``OnePassAdamW`` (train.optimizer=one_pass): clipping, AdamW and the next forward's bf16 weights in one
pass over the optimizer's state.

The step with torch's own pieces (train.optimizer=torch) makes four passes over every parameter:

    clip_grad_norm_   the norm reads g (4 B); the rescale reads and writes g       (8 B)
    fused AdamW       reads p, g, m, v (16 B) and writes p, m, v                  (12 B)
    next forward      autocast reads the fp32 weight and writes its bf16 copy      (6 B)   = 46 B/parameter

Here the norm is the one pass that must come first (4 B: its result scales every gradient); then one pass
reads p, g, m, v, applies the clip scale to g, and writes p, m, v and, for the weights the forward casts
(``low_precision``), their bf16 copy (2 B): 34 B per parameter. The forward finds the copy through
``detector.model.low_precision``, which uses it only while the weight's version counter is the one
recorded right after the update, so a weight changed by anything else (a checkpoint load, a gathered
shard) is cast afresh, never read stale.

The arithmetic is torch's AdamW (``_fused_adamw``'s order: decay, lerp, addcmul, bias corrections) on the
clipped gradient ``g * min(1, max_norm / (norm + 1e-6))`` as ``clip_grad_norm_`` computes it; the state
keys are AdamW's (step, exp_avg, exp_avg_sq), so checkpoints move between the two optimizers. On CUDA the
pass is one ``torch.compile``d function (static shapes, compiled once at the first step, every scalar a
device tensor: no recompilation as the learning rate changes, no host synchronisation, capturable in a
CUDA graph); on the CPU the same function runs eagerly.
"""

from __future__ import annotations

import torch
from torch import Tensor


def clip_scale(grads: list[Tensor], max_norm: float) -> Tensor:
    """``clip_grad_norm_``'s factor for these gradients, a 0-dim device tensor: min(1, max_norm / (norm + 1e-6))."""
    return norm_scale(torch.nn.utils.get_total_norm(grads), max_norm)


def norm_scale(norm: Tensor, max_norm: float) -> Tensor:
    """``clip_grad_norm_``'s factor for gradients of global norm ``norm`` (0-dim): min(1, max_norm / (norm + 1e-6))."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def adamw_pass(params, grads, exp_avgs, exp_avg_sqs, steps, copies, lr, scale, skip, beta1, beta2, eps, decay):
    """One AdamW update of each parameter from ``grads * scale``, unless ``skip``; writes ``copies`` (bf16)
    of the updated parameters where a copy is given. All tensors updated in place; lr, scale, skip 0-dim."""
    for p, g, m, v, step, copy in zip(params, grads, exp_avgs, exp_avg_sqs, steps, copies, strict=True):
        g = g.float() * scale
        step_new = torch.where(skip, step, step + 1)
        m_new = m.lerp(g, 1 - beta1)
        v_new = v * beta2 + g * g * (1 - beta2)
        bias1 = 1 - beta1**step_new
        bias2_sqrt = (1 - beta2**step_new).sqrt()
        p_new = p * (1 - lr * decay)
        p_new = p_new - (lr / bias1) * m_new / (v_new.sqrt() / bias2_sqrt + eps)
        p_new = torch.where(skip, p, p_new)
        p.copy_(p_new)
        m.copy_(torch.where(skip, m, m_new))
        v.copy_(torch.where(skip, v, v_new))
        step.copy_(step_new)
        if copy is not None:
            copy.copy_(p_new)


class OnePassAdamW(torch.optim.Optimizer):
    """AdamW whose ``step(scale, skip)`` also clips (``scale``, from ``clip_scale``) and writes the bf16
    copies of the ``low_precision`` parameters, in one pass (see the module docstring)."""

    def __init__(self, params, lr, weight_decay: float, low_precision=(), copy_dtype=torch.bfloat16, compile=False):
        super().__init__(params, {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": weight_decay})
        self.copy_ids = {id(p) for p in low_precision}
        self.copy_dtype = copy_dtype
        self.copies: dict[int, Tensor] = {}  # id of a parameter -> its low-precision copy
        self.scalars: dict[tuple, Tensor] = {}  # the pass's 0-dim device arguments, made once (see scalar)
        self.update = torch.compile(adamw_pass, fullgraph=True, dynamic=False) if compile else adamw_pass

    @torch.no_grad()
    def step(self, closure=None, scale: Tensor | None = None, skip: Tensor | None = None):
        if closure is not None:
            raise ValueError("OnePassAdamW.step takes no closure (AdamW needs one gradient per step)")
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            device = params[0].device
            states = [self.state_of(p) for p in params]
            lr = group["lr"]
            if not isinstance(lr, Tensor):  # filled in, not copied: no host-to-device transfer, no recompilation
                lr = self.scalar(("lr", index), device, torch.float32).fill_(lr)
            beta1, beta2 = group["betas"]
            self.update(
                params,
                [p.grad for p in params],
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                [s["step"] for s in states],
                [self.copy_of(p) for p in params],
                lr,
                self.scalar(("no clip",), device, torch.float32, 1.0) if scale is None else scale,
                self.scalar(("no skip",), device, torch.bool, False) if skip is None else skip,
                beta1,
                beta2,
                group["eps"],
                group["weight_decay"],
            )
        self.mark_copies_current()

    def scalar(self, key: tuple, device: torch.device, dtype: torch.dtype, value: float = 0) -> Tensor:
        """The 0-dim tensor of ``key`` on ``device``, made once: a step allocates nothing and launches no fill
        for its constants (and a CUDA graph's capture reads tensors made before it)."""
        key = (*key, device)
        if key not in self.scalars:
            self.scalars[key] = torch.full((), value, dtype=dtype, device=device)
        return self.scalars[key]

    def state_of(self, param: Tensor) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        elif state["step"].device != param.device:  # a loaded state dict keeps a plain AdamW's step on the CPU
            state["step"] = state["step"].to(param.device, torch.float32)
        return state

    def copy_of(self, param: Tensor) -> Tensor | None:
        if id(param) not in self.copy_ids:
            return None
        if id(param) not in self.copies:
            self.copies[id(param)] = torch.empty_like(param, dtype=self.copy_dtype)
        return self.copies[id(param)]

    def mark_copies_current(self) -> None:
        """Record each copied parameter's version now: ``detector.model.low_precision`` uses a copy only while
        its parameter has not been written since (the version counter is shared by views of one tensor, so
        this runs once every parameter of the step is written)."""
        for group in self.param_groups:
            for param in group["params"]:
                copy = self.copies.get(id(param))
                if copy is not None:
                    param.low_precision = (copy, param._version)
