"""The conformance vector format (see docs/conformance.md): one directory per vector.

``vector.json`` names the files; streams are length-prefixed serialized ``GetDeltaResponse``
messages (``uint32`` little-endian length, then the bytes); single answers (Status, Register,
Commit) and requests are one serialized message each; the expected state is raw little-endian
arrays described (name, dtype, shape, sha256) in ``vector.json``.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1
MANIFEST = "vector.json"
_LEN = struct.Struct("<I")


def write_stream(path: Path, messages: list[bytes]) -> None:
    """Write ``messages`` length-prefixed."""
    out = bytearray()
    for m in messages:
        out += _LEN.pack(len(m))
        out += m
    path.write_bytes(bytes(out))


def read_stream(path: Path) -> list[bytes]:
    """The messages of a length-prefixed stream file; ValueError if it is cut short."""
    buf = path.read_bytes()
    out, pos = [], 0
    while pos < len(buf):
        if pos + 4 > len(buf):
            raise ValueError(f"{path}: truncated length prefix at byte {pos}")
        (n,) = _LEN.unpack_from(buf, pos)
        pos += 4
        if pos + n > len(buf):
            raise ValueError(f"{path}: message of {n} bytes at byte {pos} cut short")
        out.append(buf[pos : pos + n])
        pos += n
    return out


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def array_entry(root: Path, rel: str, arr: np.ndarray, **extra: Any) -> dict[str, Any]:
    """Write ``arr`` (little-endian, C order) to ``root/rel``; its manifest entry."""
    a = np.ascontiguousarray(arr)
    if a.dtype.byteorder == ">":
        a = a.byteswap().view(a.dtype.newbyteorder("<"))
    data = a.tobytes()
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return {
        **extra,
        "file": rel,
        "dtype": _dtype_name(a.dtype),
        "shape": list(a.shape),
        "sha256": sha256(data),
    }


def _dtype_name(dt: np.dtype) -> str:
    if dt == np.dtype("V2"):
        return "bfloat16"
    return str(dt.name)


#: numpy dtypes of the expected arrays' names ("bfloat16" dense tensors are kept as uint16)
NUMPY_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "float64": np.float64,
    "bfloat16": np.uint16,
    "uint8": np.uint8,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "bool": np.bool_,
}


def read_array(root: Path, entry: dict[str, Any]) -> np.ndarray:
    """An expected array of the manifest, checked against its sha256."""
    data = (root / entry["file"]).read_bytes()
    if sha256(data) != entry["sha256"]:
        raise ValueError(f"{root / entry['file']}: sha256 differs from the manifest")
    dt = np.dtype(NUMPY_DTYPES[entry["dtype"]]).newbyteorder("<")
    return np.frombuffer(data, dtype=dt).reshape(entry["shape"]).copy()


@dataclass
class PullRecord:
    """One recorded GetDelta of one rank (file names relative to the vector)."""

    status: str
    request: str
    stream: str
    commit: str | None = None  # the CommitResponse the server gave (None: not committed)
    #: replay: the first attempt is cut after this many messages after the header
    #: (UNAVAILABLE), and a request resuming it gets ``resumed_stream``
    cut_after: int | None = None
    resumed_request: str | None = None
    resumed_stream: str | None = None
    #: replay: the first attempt is refused RESOURCE_EXHAUSTED with this retry-after hint (ms)
    refuse_first_ms: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class RankRecord:
    rank: int
    register: str
    pulls: list[PullRecord] = field(default_factory=list)


@dataclass
class Vector:
    """A loaded vector."""

    root: Path
    name: str
    manifest: dict[str, Any]
    ranks: list[RankRecord]

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    @property
    def hostile(self) -> bool:
        return any(p["outcome"] == "refused" for p in self.manifest["pulls"])

    def bytes_of(self, rel: str) -> bytes:
        return (self.root / rel).read_bytes()

    def stream(self, rel: str) -> list[bytes]:
        return read_stream(self.root / rel)


def load(root: Path) -> Vector:
    """The vector in directory ``root``."""
    m = json.loads((root / MANIFEST).read_text())
    if m.get("format") != FORMAT_VERSION:
        raise ValueError(f"{root}: vector format {m.get('format')}, expected {FORMAT_VERSION}")
    ranks = [
        RankRecord(r["rank"], r["register"], [PullRecord(**p) for p in r["pulls"]])
        for r in m["ranks"]
    ]
    return Vector(root, m["name"], m, ranks)


def load_all(root: Path) -> dict[str, Vector]:
    """Every vector under ``root`` (a directory of vector directories), by name."""
    out = {}
    for d in sorted(root.iterdir()):
        if (d / MANIFEST).is_file():
            v = load(d)
            out[v.name] = v
    return out


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
