"""``python -m deltad.healthcheck``, the probe command of existing images and pod specs: kept
as it was; the code is :mod:`deltad.commands.healthcheck`."""

from __future__ import annotations

from deltad.commands.healthcheck import main

if __name__ == "__main__":
    raise SystemExit(main())
