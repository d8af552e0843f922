// The process-wide choice between the Fast and Reference paths, and the CPU check.
#include "compress/path.h"

#include "compress/codec.h"

#if defined(COHORT_HAVE_AVX2_KERNELS)
#include <cpuid.h>
#endif

#include <atomic>
#include <cstdlib>
#include <string>
#include <string_view>

namespace cohort::compress {

namespace {

CodecPath pathFromEnvironment() {
  const char* value = std::getenv("COHORT_CODEC_PATH");
  if (value == nullptr || std::string_view(value) == "fast") return CodecPath::Fast;
  if (std::string_view(value) == "reference") return CodecPath::Reference;
  throw InvalidArgument("COHORT_CODEC_PATH=" + std::string(value) + ": accepted values are fast and reference");
}

std::atomic<CodecPath>& pathSetting() {
  static std::atomic<CodecPath> path{pathFromEnvironment()};
  return path;
}

std::atomic<double> topkSampleSigmas{FastPathTuning{}.topkSampleSigmas};
std::atomic<size_t> topkMinSampledLength{FastPathTuning{}.topkMinSampledLength};

bool cpuHasAvx2F16c() {
#if defined(COHORT_HAVE_AVX2_KERNELS)
  // __builtin_cpu_supports("avx2") includes the OS's support for the AVX registers; clang 14 knows
  // no "f16c" there, so that bit comes from CPUID leaf 1 directly.
  __builtin_cpu_init();
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __builtin_cpu_supports("avx2") && __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
#else
  return false;
#endif
}

}  // namespace

CodecPath codecPath() { return pathSetting().load(std::memory_order_relaxed); }
void setCodecPath(CodecPath path) { pathSetting().store(path, std::memory_order_relaxed); }

bool vectorConversions() {
  static const bool has = cpuHasAvx2F16c();
  return has;
}

bool useAvx2() { return codecPath() == CodecPath::Fast && vectorConversions(); }

FastPathTuning fastPathTuning() {
  return {.topkSampleSigmas = topkSampleSigmas.load(std::memory_order_relaxed),
          .topkMinSampledLength = topkMinSampledLength.load(std::memory_order_relaxed)};
}

void setFastPathTuning(FastPathTuning tuning) {
  topkSampleSigmas.store(tuning.topkSampleSigmas, std::memory_order_relaxed);
  topkMinSampledLength.store(tuning.topkMinSampledLength, std::memory_order_relaxed);
}

}  // namespace cohort::compress
