#!/usr/bin/env bash
# Build deltad's C++ client (clients/cpp/: library deltad_client, binary deltad-predictor-cpp) into
# build/cpp. Idempotent (an up-to-date build does nothing). Where the toolchain or packages are
# missing it prints one "skipped: missing X" line and exits 0, unless DELTAD_REQUIRE_CPP=1
# (then exit 1). Needs: cmake >= 3.25, g++, pkg-config, protoc + grpc_cpp_plugin, gRPC C++ and
# protobuf headers, nlohmann-json (Debian: cmake g++ pkg-config protobuf-compiler-grpc
# libgrpc++-dev libprotobuf-dev nlohmann-json3-dev), and the venv's torch and fbgemm_gpu.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${DELTAD_PYTHON:-$ROOT/${DELTAD_VENV:-.venv}/bin/python}"
BUILD="${DELTAD_CPP_BUILD:-$ROOT/build/cpp}"
JOBS="${DELTAD_CPP_JOBS:-2}"

skip() {
  echo "build_cpp: skipped: missing $1"
  if [ "${DELTAD_REQUIRE_CPP:-0}" = "1" ]; then exit 1; fi
  exit 0
}

for tool in cmake g++ pkg-config protoc grpc_cpp_plugin; do
  command -v "$tool" >/dev/null 2>&1 || skip "$tool"
done
pkg-config --exists grpc++ protobuf || skip "gRPC C++ / protobuf development packages (libgrpc++-dev libprotobuf-dev)"
[ -f /usr/include/nlohmann/json.hpp ] || [ -f /usr/local/include/nlohmann/json.hpp ] || skip "nlohmann-json3-dev"
[ -x "$PY" ] || skip "python venv ($PY; run make setup)"
# one interpreter (importing torch takes seconds): torch's CMake prefix, its C++ ABI, fbgemm's dir
INFO="$("$PY" - <<'PYEOF' 2>/dev/null
import importlib.util, os
import torch
spec = importlib.util.find_spec("fbgemm_gpu")
print(torch.utils.cmake_prefix_path)
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(os.path.dirname(spec.origin) if spec is not None and spec.origin else "")
PYEOF
)" || skip "torch in $PY"
TORCH_PREFIX="$(sed -n 1p <<<"$INFO")"
ABI="$(sed -n 2p <<<"$INFO")"
FBGEMM_DIR="$(sed -n 3p <<<"$INFO")"
[ -n "$TORCH_PREFIX" ] || skip "torch in $PY"
[ "$ABI" = "1" ] || skip "a torch built with the C++11 ABI (Debian's gRPC uses it; this torch has ABI $ABI)"
[ -n "$FBGEMM_DIR" ] || skip "fbgemm_gpu in $PY"

mkdir -p "$BUILD"
if [ ! -f "$BUILD/CMakeCache.txt" ] || ! grep -q "FBGEMM_DIR:PATH=$FBGEMM_DIR\$" "$BUILD/CMakeCache.txt"; then
  cmake -S "$ROOT/clients/cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DFBGEMM_DIR="$FBGEMM_DIR" >"$BUILD/configure.log" 2>&1 \
    || { tail -n 20 "$BUILD/configure.log"; echo "build_cpp: cmake configure failed (see $BUILD/configure.log)"; exit 1; }
fi
cmake --build "$BUILD" -j "$JOBS"
"$PY" -c 'import torch; print(torch.__version__)' >"$BUILD/torch-version.txt"  # (its tests check)
echo "build_cpp: built $BUILD/deltad-predictor-cpp"
