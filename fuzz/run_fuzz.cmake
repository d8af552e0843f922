# Runs a fuzz target for a while on a scratch copy of its seed corpus (libFuzzer adds what it
# finds to the corpus it is given, and the seeds stay as they are). Fails when the target crashes,
# leaving the input that did it in WORK/artifacts.
#   cmake -DFUZZER=path -DCORPUS=dir -DWORK=dir [-DFUZZ_SECONDS=20] -P run_fuzz.cmake
foreach(var FUZZER CORPUS WORK)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_fuzz.cmake: pass -D${var}=...")
  endif()
endforeach()
if(NOT DEFINED FUZZ_SECONDS)
  set(FUZZ_SECONDS 20)
endif()
if(NOT EXISTS ${FUZZER})
  message(FATAL_ERROR "${FUZZER} is not built: build the 'fuzz' target (it needs clang++ and libclang-rt-14-dev)")
endif()

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK}/corpus ${WORK}/artifacts)
file(GLOB seeds ${CORPUS}/*)
file(COPY ${seeds} DESTINATION ${WORK}/corpus)
execute_process(
  COMMAND ${FUZZER} -max_total_time=${FUZZ_SECONDS} -timeout=5 -rss_limit_mb=2048
          -artifact_prefix=${WORK}/artifacts/ ${WORK}/corpus
  RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "${FUZZER} failed (${result}); the input is in ${WORK}/artifacts: "
                      "reproduce with ${FUZZER} ${WORK}/artifacts/<file>")
endif()
