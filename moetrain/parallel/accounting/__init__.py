"""Memory and communication accounting: what a step allocates and sends, measured on the real
thing, set beside the analytic figures (derived in ``docs/parallel.md``; measured ratios in
``docs/accounting.md``).

- measured: ``comm`` (``CommCounter``: every collective's bytes), ``memory`` (model-state
  bytes, optimizer state per parameter, saved activations), ``step`` (one step measured,
  ``measure_step``, and its figures beside the analytic ones, ``step_figures``; what they
  use of the run is the ``MeasuredRun`` protocol);
- analytic: ``analytic`` (the ZeRO formula, the bytes each axis sends, whole-sequence K/V
  under cp, expert FLOPs), which ``moetrain.plan`` prices layouts with.
"""

from moetrain.parallel.accounting.analytic import (
    analytic_cp_activations,
    analytic_expert_flops,
    analytic_sent,
    full_sequence_kv_bytes,
    zero_bytes_per_param,
)
from moetrain.parallel.accounting.comm import Collective, CommCounter
from moetrain.parallel.accounting.memory import (
    MemorySample,
    SavedActivations,
    model_state_bytes,
    optimizer_state_bytes_per_param,
    params_before_dp,
)
from moetrain.parallel.accounting.step import (
    MeasuredRun,
    Probe,
    StepEngine,
    StepReport,
    layer_counts,
    measure_step,
    step_figures,
)

__all__ = [
    "Collective",
    "CommCounter",
    "MeasuredRun",
    "MemorySample",
    "Probe",
    "SavedActivations",
    "StepEngine",
    "StepReport",
    "analytic_cp_activations",
    "analytic_expert_flops",
    "analytic_sent",
    "full_sequence_kv_bytes",
    "layer_counts",
    "measure_step",
    "model_state_bytes",
    "optimizer_state_bytes_per_param",
    "params_before_dp",
    "step_figures",
    "zero_bytes_per_param",
]
