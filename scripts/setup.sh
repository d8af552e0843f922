#!/usr/bin/env bash
# Installs what cohort needs to build, test, benchmark and run its demo, and only what is missing
# (the CUDA 13.0 toolkit it checks for, below, and leaves to you):
#  - Debian packages (apt-get; as root or through sudo);
#  - LibTorch 2.11: PyPI's torch==2.11.0 wheel (built for CUDA 13.0) with its CUDA libraries, in a
#    virtual environment the project owns (COHORT_VENV, default .venv beside this folder), never in
#    the system Python. The build finds LibTorch there (CMake asks that Python for
#    torch.utils.cmake_prefix_path) and the benchmarks' Python peer is the same torch.
# Idempotent: a second run checks and exits.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${COHORT_VENV:-$root/.venv}"
torch_version="2.11.0"

# The CUDA 13.0 toolkit, checked first and not installed here: the wheel's CMake package enables CUDA
# (enable_language(CUDA), find_package(CUDAToolkit REQUIRED)), so configuring against it needs nvcc
# and the toolkit's headers, though no GPU. CMake takes nvcc from CUDACXX, else from PATH.
# A build against a CPU LibTorch (CMAKE_FLAGS=-DCMAKE_PREFIX_PATH=...) needs none: COHORT_NO_CUDA=1.
if [ "${COHORT_NO_CUDA:-0}" != 1 ]; then
  nvcc="$(command -v "${CUDACXX:-nvcc}" || true)"
  if [ -z "$nvcc" ]; then
    fix="install NVIDIA's cuda-toolkit-13-0 and put its bin/ on PATH, or set CUDACXX to its nvcc"
    if [ -x /usr/local/cuda/bin/nvcc ]; then fix="put /usr/local/cuda/bin on PATH, or set CUDACXX=/usr/local/cuda/bin/nvcc"; fi
    echo "setup: no CUDA toolkit (nvcc${CUDACXX:+ at CUDACXX=$CUDACXX}), which the CUDA 13.0 LibTorch's CMake needs: $fix (COHORT_NO_CUDA=1 for a CPU LibTorch)" >&2
    exit 1
  fi
  cuda_release="$("$nvcc" --version | sed -n 's/.*release \([0-9][0-9.]*\),.*/\1/p')"
  case "$cuda_release" in
    13.*) echo "setup: CUDA toolkit $cuda_release ($nvcc)" ;;
    *) echo "setup: warning: $nvcc is CUDA ${cuda_release:-of an unknown release}; torch $torch_version's wheel is built for 13.0" >&2 ;;
  esac
fi

# gloo's headers (libgloo-dev) only: ProcessGroupGloo.hpp includes them and the wheel does not ship
# them. cohort never links Debian's libgloo; the Gloo it runs is the one inside libtorch_cpu.
# clang: every build checks the locks with clang's thread-safety analysis (cmake/CohortCheckLocks.cmake);
# with libclang-rt-14-dev it also builds the fuzz targets.
# tcsh: `cohort compare --hosts` runs its scripts through the hosts' login shells; a test runs them
# under csh's rules.
packages=(
  cmake ninja-build ccache g++ make pkg-config
  libopenblas0-pthread libgloo-dev
  libgrpc++-dev libprotobuf-dev libssl-dev protobuf-compiler protobuf-compiler-grpc
  libcli11-dev nlohmann-json3-dev libspdlog-dev zlib1g-dev libzstd-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev openssl
  dataset-fashion-mnist
  python3 python3-venv
  openmpi-bin iproute2
  libtomlplusplus-dev chromium librsvg2-bin slurm-wlm munge
  openssh-server openssh-client tcsh
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} Debian packages are installed"
else
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
fi

# The Python the venv is made from: Debian's (python3-venv above), unless COHORT_BASE_PYTHON says.
base_python="${COHORT_BASE_PYTHON:-/usr/bin/python3}"
have=""
if [ -x "$venv/bin/python" ]; then
  have="$("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
fi
case "$have" in
  "$torch_version"*) echo "setup: torch $have is in $venv" ;;
  *)
    if [ -n "$have" ]; then echo "setup: $venv has torch $have, want $torch_version: reinstalling"; fi
    echo "setup: installing torch==$torch_version (LibTorch, CUDA 13.0 build) and numpy into $venv"
    "$base_python" -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check "torch==$torch_version" numpy
    "$venv/bin/python" -c 'import torch; print("setup: torch", torch.__version__, "in", torch.__file__)'
    ;;
esac
