"""Optional heavy dependencies (torchrec, fbgemm-gpu): a command that needs one and does not
find it says how to install it, in one line, instead of a ModuleNotFoundError traceback.

A predictor into float tables (``DeltaConsumer`` with ``TensorDictApplier``) needs neither;
the reference trainer (`deltad train`) and quantized serving (``QuantApplier``,
`deltad consume --serve-dtype`) need both.
"""

from __future__ import annotations

import importlib
import importlib.metadata

from deltad.errors import ConfigError

#: The fbgemm and torchrec tested with each torch (scripts/install.sh's DELTAD_STACK trios).
STACKS = {"2.13": ("1.8.0", "1.8.0"), "2.14": ("1.9.0", "1.9.2")}
#: The trio ``make setup`` installs.
DEFAULT_STACK = "2.13"


def installed_stack() -> str:
    """The :data:`STACKS` key of the installed torch (read from its metadata, torch is not
    imported); :data:`DEFAULT_STACK` without torch or for a torch of no tested trio."""
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return DEFAULT_STACK
    minor = ".".join(torch_version.split("+")[0].split(".")[:2])
    return minor if minor in STACKS else DEFAULT_STACK


def install_hint(name: str) -> str:
    """How to install ``name`` next to the installed torch (what scripts/install.sh does)."""
    stack = installed_stack()
    fbgemm, torchrec = STACKS[stack]
    where = "" if stack == DEFAULT_STACK else f" DELTAD_STACK={stack}"
    if name == "torchrec":
        return (
            f"pip install --no-deps torchrec=={torchrec} (after fbgemm-gpu-cpu=={fbgemm};"
            f"{where} scripts/install.sh does both)"
        )
    if name == "fbgemm_gpu":
        return (
            f"pip install fbgemm-gpu-cpu=={fbgemm} (CUDA: fbgemm-gpu=={fbgemm} from the torch "
            f"index;{where} scripts/install.sh does it)"
        )
    return f"pip install {name}"


def need(*modules: str, purpose: str) -> None:
    """ConfigError with an install hint unless every module in ``modules`` imports."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            hint = install_hint(name)
            missing = e.name or name
            raise ConfigError(
                f"{purpose} needs {name} ({missing} cannot be imported); install it: {hint}"
            ) from None
