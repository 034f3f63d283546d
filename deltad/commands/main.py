"""The `deltad` command line: one console script with a subcommand per role.

Each subcommand lives in its own module and registers itself through ``add_arguments`` /
``run``; this module imports them, dispatches, turns deltad errors into exit code 2 with one line on
stderr, and keeps ``--help`` listing every role.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import NoReturn

from deltad import __version__, output
from deltad.config import Range, check_endpoint, check_number
from deltad.errors import DeltadError
from deltad.parent import die_with_parent


def _bench_commands() -> ModuleType | None:
    """``bench/run.py`` of the source checkout this deltad runs from, or None when deltad was
    installed from a wheel: the benchmarks are a checkout tool and are not installed."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "bench" / "run.py").is_file():
        return None
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from bench import run as bench_run

    return bench_run


def _subcommands() -> dict[str, tuple[ModuleType | None, str]]:
    """subcommand -> (module with ``add_arguments(parser)`` and ``run(args) -> int``, help)."""
    from deltad import demo
    from deltad.commands import export as export_cli
    from deltad.commands import rollout as rollout_cli
    from deltad.commands import status
    from deltad.evaluate import cli as evaluate_cli
    from deltad.reference.consumers import cli as consume_cli
    from deltad.reference.trainer import cli as train_cli
    from deltad.serve import cli as serve_cli

    return {
        "train": (
            train_cli,
            "run the reference online trainer (multi-rank, gloo) and publish segments",
        ),
        "serve": (serve_cli, "run the sidecar: index the spool, serve GetDelta over gRPC"),
        "consume": (consume_cli, "run the reference predictor: pull deltas, apply, commit"),
        "status": (status, "print consumers, lag, head and tables of a sidecar"),
        "rollout": (
            rollout_cli,
            "the model's release controls (admin): status, hold, release, pin, unpin, canary, "
            "rollback",
        ),
        "evaluate": (
            evaluate_cli,
            "the canary evaluator: score each step on labelled data; release, hold, roll back",
        ),
        "demo": (demo, "trainer + sidecars + Redis + predictors on this machine, with a report"),
        "export": (export_cli, "write the reference model's TorchScript artifact (C++ predictors)"),
        "bench": (
            _bench_commands(),
            "run the benchmark suite (JSON + PNG under bench/out; from a source checkout)",
        ),
    }


#: Options whose default (read from the environment) may hold a secret: never printed.
_SECRET_WORDS = ("url", "token", "password", "secret")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default once: appended unless its help states it already, and never
    for a default that says nothing (None, False, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        if any(w in action.dest for w in _SECRET_WORDS):  # (a default from the environment)
            return text
        return super()._get_help_string(action)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit 2), as every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class SubcommandParser(OneLineParser):
    """A subcommand's parser: an argument it does not know is its usage error, reported with
    its prog (``deltad serve: error: unrecognized arguments: --bogus``), not left for the top
    parser to report as ``deltad``'s."""

    def parse_known_args(  # type: ignore[override]  # (one signature for its overloads)
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="deltad",
        description="Stream fresh embedding rows from an online TorchRec trainer to predictors.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"deltad {__version__}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="deltad's own logging: -v INFO (a line per pull and commit), -vv DEBUG; "
        "third-party loggers stay at WARNING",
    )
    parser.add_argument(
        "--log-json",
        action="store_true",
        default=os.environ.get("DELTAD_LOG_JSON", "") not in ("", "0"),
        help="log one JSON object per line (ts, level, logger, msg) [DELTAD_LOG_JSON]",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=SubcommandParser)
    for name, (module, help_text) in _subcommands().items():
        p = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            formatter_class=HelpFormatter,
        )
        if module is None:
            p.set_defaults(
                _unavailable=f"deltad {name} runs from a source checkout (bench/ is not installed)"
            )
            continue
        module.add_arguments(p)
        p.set_defaults(
            _run=module.run,
            _ranges=getattr(module, "RANGES", {}),
            _endpoints=getattr(module, "ENDPOINTS", ()),
        )
    return parser


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (epoch seconds), ``level``, ``logger``, ``msg``."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"))


def setup_logging(verbose: int, *, json_lines: bool = False) -> None:
    """Logging to stderr: deltad's loggers at INFO (``-v``) or DEBUG (``-vv``); everything
    else (fbgemm, torch, grpc) stays at WARNING whatever the verbosity."""
    output.use_json(json_lines)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonLogFormatter()
        if json_lines
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    level = logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING
    for name in ("deltad", "trainer", "consumers", "bench"):
        logging.getLogger(name).setLevel(level)
    # torch.fx warns once per process that is_fx_tracing() also covers torch.export: TorchRec's
    # inference modules call it, and it says nothing to a deltad user
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


def check_flags(
    args: argparse.Namespace, ranges: dict[str, Range], endpoints: Sequence[str] = ()
) -> None:
    """Every numeric flag within its range and every endpoint flag (``endpoints``: their
    dests) a HOST:PORT with a valid port (ConfigError naming the flag): nan, inf, negative or
    huge values, port 99999, end here as one line and exit 2. Values still to come from the
    environment (``deltad serve``) are checked where they are converted."""
    for dest, rng in ranges.items():
        v = getattr(args, dest, None)
        if isinstance(v, int | float):
            check_number("--" + dest.replace("_", "-"), v, rng)
    for dest in endpoints:
        v = getattr(args, dest, None)
        if v is not None:
            check_endpoint("--" + dest.replace("_", "-"), v)


def main(argv: Sequence[str] | None = None) -> int:
    if not die_with_parent():
        print("deltad: parent process already exited", file=sys.stderr)
        return 1
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.verbose, json_lines=args.log_json)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if getattr(args, "_unavailable", None):
        output.line(f"deltad: {args._unavailable}", level="ERROR")
        return 2
    try:
        check_flags(args, args._ranges, args._endpoints)
        return int(args._run(args) or 0)
    except DeltadError as e:
        output.line(f"deltad {args.command}: error: {e}", level="ERROR")
        return 2
    except KeyboardInterrupt:
        output.line(f"deltad {args.command}: interrupted", level="WARNING")
        return 130
    except BrokenPipeError:  # stdout's reader went away (`deltad status | head -1`): as a
        output.muted(sys.stdout)  # command killed by SIGPIPE would, without a traceback
        return 128 + 13


if __name__ == "__main__":
    sys.exit(main())
