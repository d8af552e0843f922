# Finds LibTorch 2.11 or later and makes its targets safe to use beside gRPC.
#
# Where LibTorch comes from, in order:
#  1. CMAKE_PREFIX_PATH or Torch_DIR, as for every LibTorch project (an unpacked LibTorch zip);
#  2. the torch wheel of COHORT_PYTHON (default: the .venv that scripts/setup.sh makes), through
#     torch.utils.cmake_prefix_path.
#
# The wheel's include/ carries its own protobuf headers (google/protobuf, version 3.13), which
# would shadow Debian's (3.21, what gRPC and the generated ps.pb.h are built with) in any
# translation unit that sees both: an #error at best, mismatched layouts at worst. So cohort's
# targets see LibTorch's include/ through a mirror of it without google/ (symbolic links, made
# at configure time), and torch's imported targets are pointed at the mirror. No cohort code uses
# torch's protobuf; the libraries export none of its symbols.

set(COHORT_TORCH_MIN_VERSION 2.11)
set(COHORT_PYTHON "${PROJECT_SOURCE_DIR}/.venv/bin/python" CACHE FILEPATH
    "The Python whose torch wheel provides LibTorch when CMAKE_PREFIX_PATH has none; also the benchmarks' and tests' Python")

# Caffe2's CUDA set-up would otherwise try to run a program on the GPUs of the build machine (CI has
# none) to pick the architectures. cohort compiles no CUDA kernels of its own; 9.0 is the H100.
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST "8.0;9.0")
endif()

find_package(Torch ${COHORT_TORCH_MIN_VERSION} QUIET)
if(NOT Torch_FOUND AND EXISTS "${COHORT_PYTHON}")
  execute_process(COMMAND "${COHORT_PYTHON}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
                  OUTPUT_VARIABLE wheel_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE wheel_status ERROR_VARIABLE wheel_error)
  if(wheel_status EQUAL 0)
    list(APPEND CMAKE_PREFIX_PATH "${wheel_prefix}")
    find_package(Torch ${COHORT_TORCH_MIN_VERSION} QUIET)
  else()
    message(STATUS "cohort: ${COHORT_PYTHON} has no torch: ${wheel_error}")
  endif()
endif()
if(NOT Torch_FOUND)
  message(FATAL_ERROR
    "cohort needs LibTorch ${COHORT_TORCH_MIN_VERSION} or later and found none.\n"
    "Either run `bash scripts/setup.sh` (it installs PyPI's torch==2.11.0 into .venv, which this build "
    "finds by itself), or point CMake at a LibTorch you unpacked: -DCMAKE_PREFIX_PATH=/path/to/libtorch, "
    "or at another Python's torch: -DCOHORT_PYTHON=/path/to/python."
    "${Torch_NOT_FOUND_MESSAGE}")
endif()
message(STATUS "cohort: LibTorch ${Torch_VERSION} from ${TORCH_INSTALL_PREFIX}")

# The mirror of LibTorch's include/ without google/.
set(torch_include "${TORCH_INSTALL_PREFIX}/include")
set(COHORT_TORCH_INCLUDE "${PROJECT_BINARY_DIR}/torch-include")
file(REMOVE_RECURSE "${COHORT_TORCH_INCLUDE}")
file(MAKE_DIRECTORY "${COHORT_TORCH_INCLUDE}")
file(GLOB torch_include_entries RELATIVE "${torch_include}" "${torch_include}/*")
foreach(entry IN LISTS torch_include_entries)
  if(NOT entry STREQUAL "google")
    file(CREATE_LINK "${torch_include}/${entry}" "${COHORT_TORCH_INCLUDE}/${entry}" SYMBOLIC)
  endif()
endforeach()
foreach(target IN ITEMS torch torch_library torch_cpu torch_cpu_library torch_cuda torch_cuda_library c10 c10_cuda)
  if(TARGET ${target})
    get_target_property(dirs ${target} INTERFACE_INCLUDE_DIRECTORIES)
    if(dirs)
      list(TRANSFORM dirs REPLACE "^${torch_include}" "${COHORT_TORCH_INCLUDE}")
      set_target_properties(${target} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${dirs}")
    endif()
  endif()
endforeach()

# Does this LibTorch have CUDA and NCCL? (The wheel has both; an unpacked CPU LibTorch has neither.)
set(COHORT_TORCH_CUDA OFF)
if(TARGET torch_cuda)
  set(COHORT_TORCH_CUDA ON)
endif()
set(COHORT_TORCH_NCCL OFF)
if(COHORT_TORCH_CUDA AND EXISTS "${torch_include}/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp")
  set(COHORT_TORCH_NCCL ON)
endif()

# cohort's NCCL backend (src/comm/nccl.cpp) needs c10d's ProcessGroupNCCL (libtorch_cuda.so of a
# LibTorch built with USE_C10D_NCCL exports it; its CMake package puts USE_C10D_NCCL on torch_cuda)
# and nccl.h, which c10d's headers include. nccl.h comes, in order, from NCCL_INCLUDE_DIR, the
# wheel's nvidia-nccl package beside torch (the headers of the libnccl.so.2 that libtorch_cuda.so
# loads through its RPATH), $NCCL_ROOT/include, then the CUDA toolkit's include directory. Without
# either, src/comm/nccl_none.cpp stands in: collectives over CUDA tensors go through Gloo, and
# `--backend nccl` is refused with a line that says so. -DCOHORT_NCCL=OFF leaves NCCL out on purpose.
find_path(NCCL_INCLUDE_DIR nccl.h
  HINTS "${TORCH_INSTALL_PREFIX}/../nvidia/nccl/include" ENV NCCL_ROOT
  PATH_SUFFIXES include
  PATHS ${CUDAToolkit_INCLUDE_DIRS} "${CUDA_TOOLKIT_ROOT_DIR}/include"
  NO_CACHE)
set(nccl_default OFF)
if(COHORT_TORCH_NCCL AND NCCL_INCLUDE_DIR)
  set(nccl_default ON)
endif()
option(COHORT_NCCL "Carry collectives over CUDA tensors through c10d's ProcessGroupNCCL" ${nccl_default})
if(COHORT_NCCL AND NOT (COHORT_TORCH_NCCL AND NCCL_INCLUDE_DIR))
  message(FATAL_ERROR "COHORT_NCCL is ON, but this LibTorch has no ProcessGroupNCCL (NCCL ${COHORT_TORCH_NCCL}) or "
                      "no nccl.h was found (NCCL_INCLUDE_DIR=${NCCL_INCLUDE_DIR}): pass -DNCCL_INCLUDE_DIR=DIR, "
                      "or -DCOHORT_NCCL=OFF (collectives over CUDA tensors then go through Gloo)")
endif()
message(STATUS "cohort: LibTorch CUDA ${COHORT_TORCH_CUDA}, NCCL ${COHORT_TORCH_NCCL}; cohort's NCCL backend "
               "${COHORT_NCCL} (nccl.h: ${NCCL_INCLUDE_DIR})")
