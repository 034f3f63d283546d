"""The house conventions a user and an operator see: one package installed, `python -m deltad`,
the public API from `deltad`, logging that stays deltad's own, `--help` defaults."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import deltad
from deltad.commands.main import build_parser

ROOT = Path(__file__).resolve().parent.parent


def _deltad(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deltad", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",  # not the checkout: what is importable must come from the install
    )


def test_python_dash_m_deltad_is_the_console_script() -> None:
    out = _deltad("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"deltad {deltad.__version__}"
    help_text = _deltad("--help").stdout
    for command in ("train", "serve", "consume", "status", "rollout", "demo", "bench"):
        assert command in help_text


def test_every_subcommand_help_shows_its_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    # `deltad <command> --help` is the CLI's parser exiting 0 with the help on stdout; a new
    # interpreter per command would only repeat what `python -m deltad --help` shows above
    for command in ("serve", "consume", "train", "demo", "status", "rollout"):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args([command, "--help"])
        out = capsys.readouterr()
        assert e.value.code == 0, out.err
        assert "(default:" in out.out, f"deltad {command} --help shows no defaults"


def test_the_public_api_imports_from_deltad_without_loading_torch() -> None:
    code = (
        "import sys, deltad; assert 'torch' not in sys.modules; "
        "from deltad import DeltaConsumer, SegmentPublisher, ConsumerConfig, PublisherConfig; "
        "print(sorted(deltad.__all__))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert out.returncode == 0, out.stderr
    names = set(eval(out.stdout))  # a printed list of str
    assert {"DeltaConsumer", "SegmentPublisher", "TorchRecApplier", "__version__"} <= names
    for name in deltad.__all__:
        assert getattr(deltad, name) is not None


def test_only_the_deltad_package_is_installed() -> None:
    """trainer/, consumers/ install as deltad.reference.*; bench/ is not installed; the
    explicit package list in pyproject.toml covers every package folder of deltad/."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(meta["packages"])
    assert all(p == "deltad" or p.startswith("deltad.") for p in packages)
    on_disk = {
        "deltad." + ".".join(p.parent.relative_to(ROOT / "deltad").parts)
        for p in (ROOT / "deltad").rglob("__init__.py")
    }
    on_disk = {p.rstrip(".") for p in on_disk}
    assert on_disk - {"deltad.reference"} <= packages
    assert meta["package-dir"] == {
        "deltad.reference.trainer": "trainer",
        "deltad.reference.consumers": "consumers",
    }
    out = subprocess.run(
        [sys.executable, "-c", "import trainer"], capture_output=True, text=True, cwd="/"
    )
    assert out.returncode != 0 and "No module named 'trainer'" in out.stderr


def test_verbose_logging_is_deltads_own_and_json_lines_parse() -> None:
    code = (
        "import logging; from deltad.commands.main import setup_logging; "
        "setup_logging(1, json_lines=True); "
        "logging.getLogger('fbgemm_gpu.x').info('noise'); "
        "logging.getLogger('torch.distributed').info('noise'); "
        "logging.getLogger('deltad.serve.edge.service').info('pull %s', 'ok'); "
        "logging.getLogger('deltad.consume.client').debug('hidden at -v')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/"
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stderr.splitlines() if line.strip()]
    assert [(r["logger"], r["level"], r["msg"]) for r in lines] == [
        ("deltad.serve.edge.service", "INFO", "pull ok")
    ]
