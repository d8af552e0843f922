#!/usr/bin/env bash
# Installs every Debian package cohort needs to build, test, benchmark and run its demo.
# Idempotent: installs only what is missing. Works as root or through sudo.
set -euo pipefail

packages=(
  cmake ninja-build ccache g++ make pkg-config
  libtorch-dev libopenblas0-pthread libgloo-dev
  libgrpc++-dev libprotobuf-dev libssl-dev protobuf-compiler protobuf-compiler-grpc
  libcli11-dev nlohmann-json3-dev libspdlog-dev zlib1g-dev libzstd-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev openssl
  dataset-fashion-mnist
  python3 python3-torch
  openmpi-bin iproute2
  libtomlplusplus-dev chromium librsvg2-bin slurm-wlm munge
  openssh-server openssh-client
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} Debian packages are installed"
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    sudo="sudo"
  else
    echo "setup: these packages are missing and I am neither root nor have sudo: ${missing[*]}" >&2
    exit 1
  fi
fi
echo "setup: installing ${missing[*]}"
$sudo apt-get update -q
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
