#include "base/scheme.h"

#include <array>
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

bool isInProcess(Scheme scheme) {
  return scheme == Scheme::kMirrored || scheme == Scheme::kCentral || scheme == Scheme::kHogwild;
}

}  // namespace cohort
