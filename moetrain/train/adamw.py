"""AdamW: torch's, or with its moments kept in bf16 (``optim.moments_dtype=bf16``).

``moetrain.train.optim`` builds it (and Muon, ``moetrain.train.muon``, which is built on it)."""

from __future__ import annotations

import math

import torch

from moetrain.config import OptimConfig

__all__ = ["AdamW", "BF16MomentsAdamW", "adamw"]


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
    return cls(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay
    )


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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.moments_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moments_dtype)
                state["step"] += 1
                step = float(state["step"])
                grad = p.grad.float()
                m = state["exp_avg"].float().lerp_(grad, 1 - beta1)
                v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                p.mul_(1 - lr * wd)
                denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
                p.addcdiv_(m.to(p.dtype), denom.to(p.dtype), value=-lr / (1 - beta1**step))
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
        return loss
