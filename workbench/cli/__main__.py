"""``python -m workbench.cli``."""

import sys

from workbench.cli.main import main

sys.exit(main())
