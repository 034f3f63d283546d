"""Child processes that die with the parent that spawned them (the demo's sidecars, trainer
and predictors): one environment variable, read once at start-up."""

from __future__ import annotations

import os
import sys

#: Set by a parent that spawns ``deltad`` children (the demo) to its own pid: the child then
#: asks for SIGTERM when that parent dies. Done here, after exec, instead of in a Popen
#: ``preexec_fn``, which runs Python between fork and exec and is unsafe in a threaded parent.
PARENT_PID_ENV = "DELTAD_PARENT_PID"


def die_with_parent() -> bool:
    """PR_SET_PDEATHSIG from ``DELTAD_PARENT_PID``; False if that parent is already gone."""
    want = os.environ.pop(PARENT_PID_ENV, None)  # not for this process's own children
    if not want or not sys.platform.startswith("linux"):
        return True
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    return str(os.getppid()) == want  # it died before the prctl: nobody would signal us
