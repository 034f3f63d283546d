"""The `deltad` command line: one console script with a subcommand per role.

Each subcommand lives in its own module and registers itself through ``add_parser`` /
``run``; this module only dispatches, turns deltad errors into exit code 2 with one line on
stderr, and keeps ``--help`` listing every role.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from deltad import __version__
from deltad.errors import DeltadError

#: subcommand -> module with ``add_arguments(parser)`` and ``run(args) -> int``.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": (
        "trainer.cli",
        "run the reference online trainer (multi-rank, gloo) and publish segments",
    ),
    "serve": ("deltad.server.cli", "run the sidecar: index the spool, serve GetDelta over gRPC"),
    "consume": ("consumers.cli", "run the reference predictor: pull deltas, apply, commit"),
    "status": ("deltad.status", "print consumers, lag, head and tables of a sidecar"),
    "demo": (
        "deltad.demo",
        "trainer + sidecars + Redis + two predictors on this machine, with a report",
    ),
    "bench": ("bench.run", "run the benchmark suite (JSON + PNG under bench/out)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deltad",
        description="Stream fresh embedding rows from an online TorchRec trainer to predictors.",
    )
    parser.add_argument("--version", action="version", version=f"deltad {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            mod = importlib.import_module(module)
        except ImportError as e:  # a role whose module is not installed here
            p.set_defaults(_unavailable=f"deltad {name} is not available: {e}")
            continue
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


#: Set by a parent that spawns ``deltad`` children (the demo) to its own pid: the child then
#: asks for SIGTERM when that parent dies. Done here, after exec, instead of in a Popen
#: ``preexec_fn``, which runs Python between fork and exec and is unsafe in a threaded parent.
PARENT_PID_ENV = "DELTAD_PARENT_PID"


def _die_with_parent() -> bool:
    """PR_SET_PDEATHSIG from ``DELTAD_PARENT_PID``; False if that parent is already gone."""
    want = os.environ.pop(PARENT_PID_ENV, None)  # not for this process's own children
    if not want or not sys.platform.startswith("linux"):
        return True
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    return str(os.getppid()) == want  # it died before the prctl: nobody would signal us


def main(argv: Sequence[str] | None = None) -> int:
    if not _die_with_parent():
        print("deltad: parent process already exited", file=sys.stderr)
        return 1
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG
        if args.verbose > 1
        else logging.INFO
        if args.verbose
        else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if getattr(args, "_unavailable", None):
        print(f"deltad: {args._unavailable}", file=sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except DeltadError as e:
        print(f"deltad {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"deltad {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
