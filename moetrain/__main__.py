import sys

from moetrain.cli import main

sys.exit(main())
