"""Router ablation: sweeps of router variants over seeds (``moetrain ablate``), their tables and
plots, and the small-sample statistics that compare them.

    spec    a sweep file, read into runs (variant x seed), each a validated JobConfig
    runner  trains the runs (in subprocesses with --parallel), collects their figures
    report  results.csv / summary.csv / results.md and the plots
    stats   means, t intervals and paired differences (no scipy)

Arrows point down that list: the runner uses the spec and the report, the report the stats.
"""

from moetrain.ablation.runner import main, run_sweep
from moetrain.ablation.spec import RunSpec, Sweep, load_sweep

__all__ = ["RunSpec", "Sweep", "load_sweep", "main", "run_sweep"]
