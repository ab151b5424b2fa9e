"""Single-device model: transformer, MoE layer (router, dispatch, experts). No process groups."""

from moetrain.model.dispatch import Dispatcher, DispatchPlan, LocalDispatcher, plan_dispatch
from moetrain.model.moe import MoELayer, Router
from moetrain.model.transformer import (
    Transformer,
    build_model,
    empty_model,
    is_moe_layer,
    meta_model,
)

__all__ = [
    "DispatchPlan",
    "Dispatcher",
    "LocalDispatcher",
    "MoELayer",
    "Router",
    "Transformer",
    "build_model",
    "empty_model",
    "is_moe_layer",
    "meta_model",
    "plan_dispatch",
]
