"""``python -m moetrain.ablation SWEEP ...`` runs a sweep (as ``moetrain ablate``);
``--run-one CONFIG RESULT`` is how ``--parallel`` starts each run in its own process."""

import sys

from moetrain.ablation.runner import child_main, main

if len(sys.argv) == 4 and sys.argv[1] == "--run-one":
    sys.exit(child_main(sys.argv[2], sys.argv[3]))
sys.exit(main())
