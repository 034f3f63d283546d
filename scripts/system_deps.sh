#!/usr/bin/env bash
# Installs the Debian packages deltad's full test suite needs beyond Python (as root; `make
# system-deps`, and .ci/run): the C++ client's toolchain (scripts/build_cpp.sh) and promtool
# (tests/test_alerts.py). Installs only what is missing; prints what it installs. Without root
# or apt-get it says what to install and exits 1. `make setup` builds the C++ client only where
# these are present (skipping it otherwise, with one line); `make test` then skips its tests.
set -euo pipefail
need=()
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
for pkg in cmake g++ pkg-config protobuf-compiler-grpc libgrpc++-dev libprotobuf-dev \
           nlohmann-json3-dev prometheus; do
  have_pkg "$pkg" || need+=("$pkg")
done
if [ ${#need[@]} -eq 0 ]; then
  echo "system_deps: every package is installed"
  exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null; then
  echo "system_deps: install (as root, Debian/Ubuntu): apt-get install ${need[*]}" >&2
  exit 1
fi
echo "system_deps: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
