"""``python -m deltad``: the same as the ``deltad`` console script."""

import sys

from deltad.commands.main import main

sys.exit(main())
