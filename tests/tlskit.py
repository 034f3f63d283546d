"""A real openssl PKI for the TLS tests, made once a session (RSA key generation was most of
what those tests cost): two independent CAs, ``a`` and ``b``, each with certificates
(CN = name, SAN localhost and 127.0.0.1) and keys. Tests only read the files; one that rotates
them copies them first. Keys are ECDSA P-256 (0.01 s each, against 0.27 s for RSA 2048);
test_client_options' self-signed certificate keeps an RSA key in the fast lane."""

from __future__ import annotations

import subprocess
from pathlib import Path

#: The certificates under each CA's folder (``<name>.pem`` and ``<name>.key``).
NAMES = {"a": ("server", "client", "pred-1", "stranger"), "b": ("server", "client")}


#: openssl's arguments for a new key.
NEW_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1")


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(d: Path, *names: str, ca: str = "ca") -> None:
    """A CA ``<ca>.pem`` and a certificate ``<name>.pem``/``.key`` (CN = name) per name."""
    d.mkdir(exist_ok=True)
    openssl("req", "-x509", *NEW_KEY, "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
            "-days", "2", "-subj", f"/CN={ca}", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in names:
        openssl("req", *NEW_KEY, "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext",
                cwd=d)  # fmt: skip


def make_pkis(root: Path) -> Path:
    """Every CA of :data:`NAMES` under ``root``; returns ``root``."""
    for ca_dir, names in NAMES.items():
        make_pki(root / ca_dir, *names)
    return root
