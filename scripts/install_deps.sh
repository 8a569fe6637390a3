#!/usr/bin/env bash
# Installs the Debian packages BlockFlow needs, only those missing. Idempotent.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libtorch-dev python3-torch python3-torchvision
  libzmq3-dev cppzmq-dev libabsl-dev libfmt-dev catch2 libbenchmark-dev nlohmann-json3-dev
  python3-zmq python3-numpy iproute2 python3-matplotlib
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#packages[@]} Debian packages present"
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then  # a fresh Debian 12 has no sudo: say what to do
    echo "install_deps: missing Debian packages: ${missing[*]}" >&2
    echo "install_deps: not root and no sudo here: run 'apt-get install ${missing[*]}' as root, then this again" >&2
    exit 1
  fi
  sudo="sudo"
fi
echo "install_deps: installing ${missing[*]}"
$sudo apt-get update -q
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
