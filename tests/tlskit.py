"""A real openssl PKI for the TLS tests, made once a session (RSA key generation was most of
what those tests cost): two independent CAs, ``a`` and ``b``, each with certificates
(CN = name, SAN localhost and 127.0.0.1) and keys. Tests only read the files; one that rotates
them copies them first."""

from __future__ import annotations

import subprocess
from pathlib import Path

#: The certificates under each CA's folder (``<name>.pem`` and ``<name>.key``).
NAMES = {"a": ("server", "client", "pred-1", "stranger"), "b": ("server", "client")}


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(d: Path, *names: str, ca: str = "ca") -> None:
    """A CA ``<ca>.pem`` and a certificate ``<name>.pem``/``.key`` (CN = name) per name."""
    d.mkdir(exist_ok=True)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out",
            f"{ca}.pem", "-days", "2", "-subj", f"/CN={ca}", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in names:
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                f"{name}.csr", "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext",
                cwd=d)  # fmt: skip


def make_pkis(root: Path) -> Path:
    """Every CA of :data:`NAMES` under ``root``; returns ``root``."""
    for ca_dir, names in NAMES.items():
        make_pki(root / ca_dir, *names)
    return root
