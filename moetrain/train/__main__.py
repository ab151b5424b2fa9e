"""``python -m moetrain.train`` / ``torchrun -m moetrain.train``: the training entry point."""

import sys

from moetrain.train.cli import train_main

sys.exit(train_main())
