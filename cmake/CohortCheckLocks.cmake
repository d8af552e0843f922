# Clang's lock checking over every file of src/: each one is parsed once more by clang++ with
# -Wthread-safety -Werror=thread-safety (src/base/thread_annotations.h), syntax only, so that a
# member GUARDED_BY a mutex touched without it, or a REQUIRES/EXCLUDES broken, stops the build. The
# main build is g++'s; this is a second front end over the same sources, with each target's include
# directories and definitions, part of `all` (target check_locks), so every `make test` runs it.
#
# The torch layers' files are parsed with <torch/torch.h> precompiled once by clang (src/pch.h, as
# the g++ build force-includes it), which brings a file from ~15 s to 1.5-6.5 s: the whole pass
# (about 140 files and the PCH) costs about 350 s of CPU on a clean build (2026-11-28, ninja's
# log), and a rebuild re-checks only the files whose sources or headers changed (clang's
# depfiles). Each target's flags are in a response file, check_locks/<target>.rsp, so that
# tests/check_locks_test.sh runs the build's exact command.

find_program(COHORT_CLANGXX NAMES clang++ clang++-14)
if(NOT COHORT_CLANGXX)
  message(FATAL_ERROR "cohort checks its locks with clang's thread-safety analysis on every build and "
                      "found no clang++: run `bash scripts/setup.sh` (it installs Debian's clang), or "
                      "`apt-get install clang`, or name one with -DCOHORT_CLANGXX=/path/to/clang++.")
endif()

set(COHORT_LOCKS_DIR ${PROJECT_BINARY_DIR}/check_locks)
set(COHORT_LOCKS_PCH ${COHORT_LOCKS_DIR}/pch.h.pch)
set(COHORT_LOCKS_FLAGS -std=c++${CMAKE_CXX_STANDARD} -pthread -Wthread-safety -Werror=thread-safety)

# LibTorch's and CUDA's headers as system headers, as the g++ build sees them (imported targets):
# their own warnings are not cohort's.
set(COHORT_LOCKS_TORCH_FLAGS "")
set(system_dirs ${CMAKE_CXX_IMPLICIT_INCLUDE_DIRECTORIES})
foreach(dir IN ITEMS ${COHORT_TORCH_INCLUDE} ${COHORT_TORCH_INCLUDE}/torch/csrc/api/include ${CUDAToolkit_INCLUDE_DIRS})
  list(APPEND COHORT_LOCKS_TORCH_FLAGS -isystem "\"${dir}\"")
  list(APPEND system_dirs ${dir})
endforeach()
list(TRANSFORM system_dirs REPLACE "([][+.*()^$?|\\])" "\\\\\\1")
list(JOIN system_dirs "|" COHORT_LOCKS_SYSTEM)
set(COHORT_LOCKS_SYSTEM "^(${COHORT_LOCKS_SYSTEM})/?$")

# Writes check_locks/TARGET.rsp: COHORT_LOCKS_FLAGS, then ARGN, then TARGET's definitions and
# include directories, less those COHORT_LOCKS_SYSTEM matches (the compiler's own, and torch's,
# given as system directories).
function(cohort_locks_flags target)
  set(defs "$<FILTER:$<TARGET_PROPERTY:${target},COMPILE_DEFINITIONS>,INCLUDE,.>")
  set(incs "$<REMOVE_DUPLICATES:$<FILTER:$<TARGET_PROPERTY:${target},INCLUDE_DIRECTORIES>,EXCLUDE,${COHORT_LOCKS_SYSTEM}>>")
  list(JOIN COHORT_LOCKS_FLAGS "\n" flags)
  list(JOIN ARGN "\n" extra)
  file(GENERATE OUTPUT ${COHORT_LOCKS_DIR}/${target}.rsp CONTENT
       "${flags}\n${extra}\n$<$<BOOL:${defs}>:-D$<JOIN:${defs},\n-D>\n>$<$<BOOL:${incs}>:\"-I$<JOIN:${incs},\"\n\"-I>\"\n>")
endfunction()

# The precompiled <torch/torch.h>, with cohort_pch's flags. -fpch-instantiate-templates halves
# each file's time (the PCH's pending template instantiations are done once, here).
cohort_locks_flags(cohort_pch ${COHORT_LOCKS_TORCH_FLAGS})
add_custom_command(
  OUTPUT ${COHORT_LOCKS_PCH}
  COMMAND ${COHORT_CLANGXX} @${COHORT_LOCKS_DIR}/cohort_pch.rsp -x c++-header -fpch-instantiate-templates
          -MD -MF ${COHORT_LOCKS_PCH}.d -MT ${COHORT_LOCKS_PCH} -o ${COHORT_LOCKS_PCH} ${PROJECT_SOURCE_DIR}/src/pch.h
  DEPENDS ${PROJECT_SOURCE_DIR}/src/pch.h ${COHORT_LOCKS_DIR}/cohort_pch.rsp
  DEPFILE ${COHORT_LOCKS_PCH}.d
  COMMENT "Precompiling <torch/torch.h> for clang's lock checking"
  VERBATIM)

# cohort_check_locks(TARGET [TORCH] [ALSO FILE...]): one stamp per source file of src/ in TARGET,
# made when clang++ passes it. TORCH: TARGET's files see torch, and the g++ build force-includes
# src/pch.h. ALSO: files checked with TARGET's flags that this configuration does not compile in it
# (src/comm/nccl_none.cpp beside nccl.cpp).
function(cohort_check_locks target)
  cmake_parse_arguments(ARG "TORCH" "" "ALSO" ${ARGN})
  set(pch "")
  if(ARG_TORCH)
    set(pch ${COHORT_LOCKS_PCH})
    cohort_locks_flags(${target} -fsyntax-only ${COHORT_LOCKS_TORCH_FLAGS} -include-pch "\"${pch}\"")
  else()
    cohort_locks_flags(${target} -fsyntax-only)
  endif()
  get_target_property(sources ${target} SOURCES)
  list(APPEND sources ${ARG_ALSO})
  foreach(source IN LISTS sources)
    get_filename_component(path ${source} ABSOLUTE BASE_DIR ${PROJECT_SOURCE_DIR})
    file(RELATIVE_PATH name ${PROJECT_SOURCE_DIR} ${path})
    if(NOT name MATCHES "^src/.*\\.cpp$")
      continue()  # generated code
    endif()
    set(stamp ${COHORT_LOCKS_DIR}/${name}.stamp)
    add_custom_command(
      OUTPUT ${stamp}
      COMMAND ${COHORT_CLANGXX} @${COHORT_LOCKS_DIR}/${target}.rsp -MD -MF ${stamp}.d -MT ${stamp} ${path}
      COMMAND ${CMAKE_COMMAND} -E touch ${stamp}
      DEPENDS ${path} ${COHORT_LOCKS_DIR}/${target}.rsp ${pch}
      DEPFILE ${stamp}.d
      COMMENT "Checking the locks of ${name}"
      VERBATIM)
    set_property(GLOBAL APPEND PROPERTY COHORT_LOCKS_STAMPS ${stamp})
  endforeach()
endfunction()
