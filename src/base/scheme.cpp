#include "base/scheme.h"

#include <algorithm>
#include <array>
#include <initializer_list>
#include <utility>

namespace cohort {

namespace {

constexpr std::array<std::pair<Scheme, const char*>, 10> kNames{{
    {Scheme::kLocal, "local"},
    {Scheme::kAllreduce, "allreduce"},
    {Scheme::kAverage, "average"},
    {Scheme::kPs, "ps"},
    {Scheme::kGossip, "gossip"},
    {Scheme::kPipeline, "pipeline"},
    {Scheme::kTensor, "tensor"},
    {Scheme::kMirrored, "mirrored"},
    {Scheme::kCentral, "central"},
    {Scheme::kHogwild, "hogwild"},
}};

// A flag and the schemes it acts under; for a ps flag of some modes only, those modes too.
struct FlagScope {
  const char* flag;
  std::initializer_list<Scheme> schemes;
  std::initializer_list<const char*> psModes;  // empty: every mode
};

using S = Scheme;
const FlagScope kFlagScopes[] = {
    {"--bucket-mb", {S::kAllreduce, S::kMirrored, S::kCentral}, {}},
    {"--first-bucket-mb", {S::kAllreduce}, {}},
    {"--no-overlap", {S::kAllreduce, S::kMirrored, S::kCentral}, {}},
    {"--balance-shards", {S::kMirrored, S::kCentral}, {}},
    {"--period", {S::kAverage}, {}},
    {"--average-optimizer-state", {S::kAverage}, {}},
    {"--outer-optimizer", {S::kAverage}, {}},
    {"--outer-lr", {S::kAverage}, {}},
    {"--outer-momentum", {S::kAverage}, {}},
    {"--stages", {S::kPipeline}, {}},
    {"--micro-batches", {S::kPipeline}, {}},
    {"--schedule", {S::kPipeline}, {}},
    {"--partition", {S::kPipeline}, {}},
    {"--replicas", {S::kPipeline, S::kMirrored, S::kCentral, S::kHogwild}, {}},
    {"--ways", {S::kTensor}, {}},
    {"--codec", {S::kAllreduce, S::kAverage, S::kPs, S::kGossip}, {}},
    {"--codec-warmup-steps", {S::kAllreduce, S::kAverage, S::kPs, S::kGossip}, {}},
    {"--gossip-peers", {S::kGossip}, {}},
    {"--ps-mode", {S::kPs}, {}},
    {"--push", {S::kPs}, {}},
    {"--ps-push-chunk-mb", {S::kPs}, {}},
    {"--ps-hosts", {S::kPs}, {}},
    {"--tls-ca", {S::kPs}, {}},
    {"--tls-cert", {S::kPs}, {}},
    {"--tls-key", {S::kPs}, {}},
    {"--backup-workers", {S::kPs}, {"sync"}},
    {"--softsync", {S::kPs}, {"softsync"}},
    {"--staleness-bound", {S::kPs}, {"ssp"}},
    {"--staleness-lr", {S::kPs}, {"async", "softsync", "ssp"}},
    {"--max-staleness", {S::kPs}, {"async", "softsync", "ssp"}},
    {"--warmup-steps", {S::kPs}, {"async", "softsync", "ssp"}},
};

// "a", "a or b", "a, b or c".
template <typename Names>
std::string orList(const Names& names) {
  std::string out;
  size_t i = 0;
  for (const auto& name : names) {
    out += i == 0 ? "" : i + 1 == names.size() ? " or " : ", ";
    out += name;
    ++i;
  }
  return out;
}

}  // namespace

const char* schemeName(Scheme scheme) {
  for (const auto& [s, name] : kNames) {
    if (s == scheme) return name;
  }
  return "?";
}

std::optional<Scheme> parseScheme(std::string_view name) {
  for (const auto& [s, n] : kNames) {
    if (name == n) return s;
  }
  return std::nullopt;
}

std::vector<Scheme> allSchemes() {
  std::vector<Scheme> out;
  for (const auto& [s, name] : kNames) out.push_back(s);
  return out;
}

std::string schemeNames() {
  std::string out;
  for (const auto& [s, name] : kNames) out += (out.empty() ? "" : ", ") + std::string(name);
  return out;
}

std::optional<std::string> whereFlagActs(std::string_view flag, Scheme scheme, std::string_view psMode) {
  for (const FlagScope& scope : kFlagScopes) {
    if (flag != scope.flag) continue;
    if (std::find(scope.schemes.begin(), scope.schemes.end(), scheme) == scope.schemes.end()) {
      std::vector<std::string> names;
      for (Scheme s : scope.schemes) names.emplace_back(schemeName(s));
      return "--strategy " + orList(names);
    }
    if (scope.psModes.size() == 0) return std::nullopt;
    for (const char* mode : scope.psModes) {
      if (psMode == mode) return std::nullopt;
    }
    return "--ps-mode " + orList(std::vector<std::string>(scope.psModes.begin(), scope.psModes.end()));
  }
  return std::nullopt;
}

std::vector<std::string> schemeSpecificFlags() {
  std::vector<std::string> out;
  for (const FlagScope& scope : kFlagScopes) out.emplace_back(scope.flag);
  return out;
}

bool isInProcess(Scheme scheme) {
  return scheme == Scheme::kMirrored || scheme == Scheme::kCentral || scheme == Scheme::kHogwild;
}

}  // namespace cohort
