"""AdamW: torch's, or with its moments kept in bf16 (``optim.moments_dtype=bf16``).

``moetrain.train.optim`` builds it (and Muon, ``moetrain.train.muon``, which is built on it).
Where every tensor it steps is on a CUDA device, torch's AdamW runs its fused step (one
kernel launch per group of tensors: read the parameter, gradient and both moments, write
the parameter and the moments; ``torch_kwargs``); elsewhere (CPU, and the meta device
``moetrain plan`` builds on) torch's default, the multi-tensor ``foreach`` step. The bf16
moments variant steps its tensors together with ``torch._foreach_*`` ops everywhere."""

from __future__ import annotations

import math

import torch

from moetrain.config import OptimConfig

__all__ = ["AdamW", "BF16MomentsAdamW", "adamw", "fused_applies", "torch_kwargs"]


def _kind(t: torch.Tensor) -> tuple:
    """What tensors must share to go through one multi-tensor kernel: their class (a
    DTensor and a plain tensor cannot), the mesh of a DTensor, the device and dtype."""
    mesh = getattr(t, "device_mesh", None)
    return type(t), id(mesh) if mesh is not None else None, t.device, t.dtype


def fused_applies(tensors: list[torch.Tensor]) -> bool:
    """torch's fused AdamW for these tensors: every one floating point on a CUDA device and
    all of one kind (``_kind``: plain tensors, such as ZeRO-1's flat slices, or DTensors of
    one mesh, FSDP2's and TP's; torch registers the fused step for DTensor). Not on CPU,
    where moetrain keeps torch's default, nor on the meta device."""
    one_kind = len({_kind(t)[:2] for t in tensors}) == 1
    return bool(tensors) and one_kind and all(
        t.device.type == "cuda" and t.is_floating_point() for t in tensors)


def torch_kwargs(cfg: OptimConfig, tensors: list[torch.Tensor], moments_dtype: str) -> dict:
    """The constructor arguments of torch's AdamW (and what is built on it) for ``cfg``:
    ``fused=True`` where it applies to ``tensors`` with fp32 moments (``fused_applies``);
    the bf16 moments variant has a step of its own."""
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                  weight_decay=cfg.weight_decay)  # fmt: skip
    if moments_dtype == "fp32" and fused_applies(tensors):
        kwargs["fused"] = True
    return kwargs


def adamw(
    decay: list[torch.Tensor], no_decay: list[torch.Tensor], cfg: OptimConfig
) -> torch.optim.AdamW:
    """AdamW with the two groups of ``build_optimizer`` over any tensors (model parameters, or
    ZeRO-1's flat slices of them)."""
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    cls = AdamW if cfg.moments_dtype == "fp32" else BF16MomentsAdamW
    return cls(groups, **torch_kwargs(cfg, [*decay, *no_decay], cfg.moments_dtype))


class AdamW(torch.optim.AdamW):
    """torch's AdamW; ``moments_dtype`` None: its moments take each parameter's dtype."""

    moments_dtype: torch.dtype | None = None


class BF16MomentsAdamW(torch.optim.AdamW):
    """AdamW whose moments are stored in bf16 (``optim.moments_dtype=bf16``): each step reads
    them into fp32, updates them and the parameter exactly as torch's AdamW does (decoupled
    weight decay, bias corrections), and rounds them back to nearest. The parameters (the
    master weights) keep their dtype. The state dict has torch's keys and layout, so
    checkpoints, ZeRO-1's shadows and DCP's resharding treat it like torch's."""

    moments_dtype: torch.dtype | None = torch.bfloat16

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loading casts every floating state tensor to its parameter's dtype (fp32):
        the moments are cast back (a checkpoint of fp32 moments is rounded to nearest)."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].dtype != self.moments_dtype:
                    state[key] = state[key].to(self.moments_dtype)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Each group's tensors of one kind (``_kind``) stepped together
        (``torch._foreach_*``: one kernel per op on a GPU), each with the arithmetic of
        torch's AdamW in fp32; the casts of the moments to fp32 and back are per tensor."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            batches: dict[tuple, list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    batches.setdefault(_kind(p), []).append(p)
            for params in batches.values():
                self._step_group(group, params)
        return loss

    def _step_group(self, group: dict, params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        states = [self.state[p] for p in params]
        for p, state in zip(params, states, strict=True):
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, dtype=self.moments_dtype)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moments_dtype)
            state["step"] += 1
        steps = [float(state["step"]) for state in states]
        grads = [p.grad.float() for p in params]
        m = [state["exp_avg"].float() for state in states]
        v = [state["exp_avg_sq"].float() for state in states]
        torch._foreach_lerp_(m, grads, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
        torch._foreach_mul_(params, 1 - lr * wd)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, [math.sqrt(1 - beta2**s) for s in steps])
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(
            params, [x.to(p.dtype) for x, p in zip(m, params, strict=True)],
            [d.to(p.dtype) for d, p in zip(denom, params, strict=True)],
            [-lr / (1 - beta1**s) for s in steps])  # fmt: skip
        for state, m_i, v_i in zip(states, m, v, strict=True):  # rounded back to bf16
            state["exp_avg"].copy_(m_i)  # (DTensor has no _foreach_copy_)
            state["exp_avg_sq"].copy_(v_i)
