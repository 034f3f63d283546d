"""Optional heavy dependencies (torchrec, fbgemm-gpu): a command that needs one and does not
find it says how to install it, in one line, instead of a ModuleNotFoundError traceback.

A predictor into float tables (``DeltaConsumer`` with ``TensorDictApplier``) needs neither;
the reference trainer (`deltad train`) and quantized serving (``QuantApplier``,
`deltad consume --serve-dtype`) need both.
"""

from __future__ import annotations

import importlib

from deltad.errors import ConfigError

#: How to install each optional dependency (what scripts/install.sh does).
INSTALL_HINTS = {
    "torchrec": "pip install --no-deps torchrec==1.8.0 (after fbgemm-gpu-cpu==1.8.0; "
    "scripts/install.sh does both)",
    "fbgemm_gpu": "pip install fbgemm-gpu-cpu==1.8.0 (CUDA: fbgemm-gpu==1.8.0 from the torch "
    "index; scripts/install.sh does it)",
}


def need(*modules: str, purpose: str) -> None:
    """ConfigError with an install hint unless every module in ``modules`` imports."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            hint = INSTALL_HINTS.get(name, f"pip install {name}")
            missing = e.name or name
            raise ConfigError(
                f"{purpose} needs {name} ({missing} cannot be imported); install it: {hint}"
            ) from None
