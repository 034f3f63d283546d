"""``python -m deltad``: the same as the ``deltad`` console script."""

import sys

from deltad.cli import main

sys.exit(main())
