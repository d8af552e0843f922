// The names of the parameter server's policy choices, their wire form, and the checks of a
// client's options (see ps_policy.h and include/cohort/parameter_server.h).
#include "schemes/ps_policy.h"

#include "base/host_port.h"

#include <cohort/error.h>

#include <algorithm>
#include <array>
#include <utility>

namespace cohort {

namespace {

template <typename E, size_t N>
using Names = std::array<std::pair<E, const char*>, N>;

constexpr Names<PsMode, 4> kModes{
    {{PsMode::kSync, "sync"}, {PsMode::kAsync, "async"}, {PsMode::kSoftsync, "softsync"}, {PsMode::kSsp, "ssp"}}};
constexpr Names<PsStalenessLr, 2> kStalenessLrs{{{PsStalenessLr::kNone, "none"}, {PsStalenessLr::kInverse, "inverse"}}};
constexpr Names<PsPush, 2> kPushes{{{PsPush::kGradients, "gradients"}, {PsPush::kUpdates, "updates"}}};
constexpr Names<PsOptimizer, 4> kOptimizers{{{PsOptimizer::kSgd, "sgd"},
                                             {PsOptimizer::kMomentum, "momentum"},
                                             {PsOptimizer::kAdam, "adam"},
                                             {PsOptimizer::kAdagrad, "adagrad"}}};

template <typename E, size_t N>
const char* nameIn(const Names<E, N>& names, E value) {
  for (const auto& [e, name] : names) {
    if (e == value) return name;
  }
  return "?";
}

template <typename E, size_t N>
std::optional<E> parseIn(const Names<E, N>& names, std::string_view text) {
  for (const auto& [e, name] : names) {
    if (text == name) return e;
  }
  return std::nullopt;
}

ps::wire::Mode wireMode(PsMode mode) {
  switch (mode) {
    case PsMode::kSync: return ps::wire::MODE_SYNC;
    case PsMode::kAsync: return ps::wire::MODE_ASYNC;
    case PsMode::kSoftsync: return ps::wire::MODE_SOFTSYNC;
    case PsMode::kSsp: return ps::wire::MODE_SSP;
  }
  return ps::wire::MODE_UNSPECIFIED;
}

ps::wire::Optimizer wireOptimizer(PsOptimizer optimizer) {
  switch (optimizer) {
    case PsOptimizer::kSgd: return ps::wire::OPTIMIZER_SGD;
    case PsOptimizer::kMomentum: return ps::wire::OPTIMIZER_MOMENTUM;
    case PsOptimizer::kAdam: return ps::wire::OPTIMIZER_ADAM;
    case PsOptimizer::kAdagrad: return ps::wire::OPTIMIZER_ADAGRAD;
  }
  return ps::wire::OPTIMIZER_UNSPECIFIED;
}

}  // namespace

const char* psModeName(PsMode mode) { return nameIn(kModes, mode); }
const char* psStalenessLrName(PsStalenessLr rule) { return nameIn(kStalenessLrs, rule); }
const char* psPushName(PsPush push) { return nameIn(kPushes, push); }
const char* psOptimizerName(PsOptimizer optimizer) { return nameIn(kOptimizers, optimizer); }

std::optional<PsMode> parsePsMode(std::string_view name) { return parseIn(kModes, name); }
std::optional<PsStalenessLr> parsePsStalenessLr(std::string_view name) { return parseIn(kStalenessLrs, name); }
std::optional<PsPush> parsePsPush(std::string_view name) { return parseIn(kPushes, name); }
std::optional<PsOptimizer> parsePsOptimizer(std::string_view name) { return parseIn(kOptimizers, name); }

void checkShardHosts(const std::vector<std::string>& hosts, const std::string& what) {
  std::vector<HostPort> seen;
  for (const std::string& entry : hosts) {
    const std::optional<HostPort> address = parseHostPort(entry);
    COHORT_CHECK(address.has_value(), InvalidArgument, what, ": '", entry,
                 "' is not a shard address: give HOST:PORT (an IPv6 host as [HOST]:PORT) with a port in 1..65535");
    COHORT_CHECK(std::find(seen.begin(), seen.end(), *address) == seen.end(), InvalidArgument, what, ": '", entry,
                 "' is named twice: list each shard once");
    seen.push_back(*address);
  }
}

void checkPolicyOptions(const ParameterServerOptions& o, int workers) {
  COHORT_CHECK(o.backupWorkers >= 0 && o.backupWorkers < workers, InvalidArgument, "--backup-workers must be in 0..",
               workers - 1, " with ", workers, " workers, got ", o.backupWorkers);
  COHORT_CHECK(o.backupWorkers == 0 || o.mode == PsMode::kSync, InvalidArgument,
               "--backup-workers applies to --ps-mode sync only");
  COHORT_CHECK(o.mode != PsMode::kSoftsync || (o.softsync >= 1 && o.softsync <= workers), InvalidArgument,
               "--softsync must be in 1..", workers, " (the number of workers), got ", o.softsync);
  COHORT_CHECK(o.stalenessBound >= 0, InvalidArgument, "--staleness-bound must not be negative");
  COHORT_CHECK(
      o.mode != PsMode::kSync || (o.stalenessLr == PsStalenessLr::kNone && o.maxStaleness < 0 && o.warmupSteps == 0),
      InvalidArgument,
      "--staleness-lr, --max-staleness and --warmup-steps are remedies for the asynchronous modes "
      "(async, softsync, ssp); sync gradients are never stale");
  COHORT_CHECK(o.warmupSteps >= 0, InvalidArgument, "--warmup-steps must not be negative");
}

ps::wire::Policy wirePolicy(const ParameterServerOptions& o, int workers, double timeoutSeconds) {
  ps::wire::Policy p;
  p.set_mode(wireMode(o.mode));
  p.set_workers(uint32_t(workers));
  p.set_backup_workers(uint32_t(o.backupWorkers));
  p.set_softsync(uint32_t(o.softsync));
  p.set_staleness_bound(uint32_t(o.stalenessBound));
  p.set_staleness_lr(o.stalenessLr == PsStalenessLr::kInverse ? ps::wire::STALENESS_LR_INVERSE
                                                              : ps::wire::STALENESS_LR_NONE);
  p.set_max_staleness(o.maxStaleness);
  p.set_warmup_steps(o.warmupSteps);
  p.set_push(o.push == PsPush::kUpdates ? ps::wire::PUSH_UPDATES : ps::wire::PUSH_GRADIENTS);
  p.set_optimizer(wireOptimizer(o.optimizer));
  p.set_lr(o.lr);
  p.set_momentum(o.momentum);
  p.set_checkpoint_every(o.checkpointEvery);
  p.set_timeout_s(timeoutSeconds);
  return p;
}

}  // namespace cohort
