#include "strategy/pipeline_plan.h"

#include <cohort/error.h>

#include <algorithm>
#include <limits>

namespace cohort {

PipeSchedule parseSchedule(const std::string& name) {
  if (name == "gpipe") return PipeSchedule::kGpipe;
  if (name == "1f1b") return PipeSchedule::kOneFOneB;
  throw InvalidArgument("unknown --schedule '" + name + "': expected gpipe or 1f1b");
}

std::vector<PipeOp> makeSchedule(PipeSchedule schedule, int stages, int stage, int micro) {
  std::vector<PipeOp> ops;
  int forwards = 0;
  int backwards = 0;
  if (schedule == PipeSchedule::kGpipe) {
    while (forwards < micro) ops.push_back({true, forwards++});
    while (backwards < micro) ops.push_back({false, backwards++});
    return ops;
  }
  const int warmup = std::min(stages - stage - 1, micro);
  while (forwards < warmup) ops.push_back({true, forwards++});
  while (forwards < micro) {
    ops.push_back({true, forwards++});
    ops.push_back({false, backwards++});
  }
  while (backwards < micro) ops.push_back({false, backwards++});
  return ops;
}

int peakInFlight(const std::vector<PipeOp>& ops) {
  int live = 0;
  int peak = 0;
  for (const auto& op : ops) {
    live += op.forward ? 1 : -1;
    peak = std::max(peak, live);
  }
  return peak;
}

std::string joinCounts(const std::vector<int>& counts) {
  std::string out;
  for (int c : counts) out += (out.empty() ? "" : ",") + std::to_string(c);
  return out;
}

std::vector<int> parsePartition(const std::string& text, int stages, int layers) {
  std::vector<int> counts;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    size_t used = 0;
    int value = 0;
    try {
      value = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    COHORT_CHECK(used == item.size() && !item.empty() && value > 0, InvalidArgument, "--partition '", text,
                 "': '", item, "' is not a positive number of layers (expected auto or L1,L2,... layers per stage)");
    counts.push_back(value);
    at = comma + 1;
  }
  COHORT_CHECK(int(counts.size()) == stages, InvalidArgument, "--partition ", text, " has ", counts.size(),
               " stages but --stages is ", stages, ": give one layer count per stage");
  int sum = 0;
  for (int c : counts) sum += c;
  COHORT_CHECK(sum == layers, InvalidArgument, "--partition ", text, " covers ", sum, " layers but the model has ",
               layers, ": the counts must add up to ", layers);
  return counts;
}

std::vector<int> balanceStages(const std::vector<double>& costs, int stages, const std::vector<bool>& cutAfter) {
  const int n = int(costs.size());
  COHORT_CHECK(stages >= 1 && stages <= n, InvalidArgument, "cannot cut ", n, " layers into ", stages, " stages");
  auto mayCut = [&](int j) { return cutAfter.empty() || cutAfter[size_t(j)]; };  // after layer j
  std::vector<double> prefix(size_t(n) + 1, 0.0);
  for (int j = 0; j < n; ++j) prefix[size_t(j) + 1] = prefix[size_t(j)] + costs[size_t(j)];
  constexpr double kNone = std::numeric_limits<double>::infinity();
  // best[s][j]: the smallest largest-stage cost of layers [0, j) in s stages; from[s][j]: where
  // the last of those stages begins.
  std::vector<std::vector<double>> best(size_t(stages) + 1, std::vector<double>(size_t(n) + 1, kNone));
  std::vector<std::vector<int>> from(size_t(stages) + 1, std::vector<int>(size_t(n) + 1, -1));
  best[0][0] = 0;
  for (int s = 1; s <= stages; ++s) {
    for (int j = s; j <= n; ++j) {
      if (j < n && !mayCut(j - 1)) continue;
      for (int i = s - 1; i < j; ++i) {
        if (best[size_t(s) - 1][size_t(i)] == kNone) continue;
        const double cost = std::max(best[size_t(s) - 1][size_t(i)], prefix[size_t(j)] - prefix[size_t(i)]);
        if (cost < best[size_t(s)][size_t(j)]) {
          best[size_t(s)][size_t(j)] = cost;
          from[size_t(s)][size_t(j)] = i;
        }
      }
    }
  }
  COHORT_CHECK(best[size_t(stages)][size_t(n)] != kNone, InvalidArgument, "the model cannot be cut into ", stages,
               " stages: too few layers whose output has the batch as its first dimension");
  std::vector<int> counts(static_cast<size_t>(stages));
  for (int s = stages, j = n; s >= 1; --s) {
    const int i = from[size_t(s)][size_t(j)];
    counts[size_t(s) - 1] = j - i;
    j = i;
  }
  return counts;
}

int parseMicroBatches(const std::string& text, int64_t batch) {
  if (text == "auto") return kAutoMicroBatches;
  long long value = 0;
  size_t used = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  COHORT_CHECK(used == text.size() && !text.empty(), InvalidArgument, "--micro-batches '", text,
               "' is not a number: give a count of micro-batches per batch (1 to --batch) or auto");
  COHORT_CHECK(value >= 1, InvalidArgument, "--micro-batches ", text,
               ": a batch needs at least 1 micro-batch: give 1 to --batch, or auto");
  COHORT_CHECK(value <= batch, InvalidArgument, "--micro-batches ", text, " is more than --batch ", batch,
               ": every micro-batch needs an example: give at most ", batch, ", or auto");
  return int(value);
}

MicroBatchChoice predictStep(const MicroBatchCosts& costs, int64_t batch, int stages, const std::vector<int>& counts,
                             int microBatches) {
  const int64_t m = (batch + microBatches - 1) / microBatches;  // the largest micro-batch
  double slowest = 0;
  double fixed = 0;
  for (size_t s = 0, j = 0; s < counts.size(); ++s) {
    double cost = 0;
    double overhead = 0;
    for (int k = 0; k < counts[s]; ++k, ++j) {
      cost += costs.perMicroBatch[j] + costs.perExample[j] * double(m);
      overhead += costs.perMicroBatch[j];
    }
    if (cost > slowest) {
      slowest = cost;
      fixed = overhead;
    }
  }
  const double message = stages > 1 ? costs.messageSeconds : 0.0;
  const double slot = slowest + message;
  return {microBatches, counts, double(microBatches + stages - 1) * slot, slot, fixed + message};
}

MicroBatchChoice chooseMicroBatches(const MicroBatchCosts& costs, int64_t batch, int stages,
                                    const std::vector<int>& counts, const std::vector<bool>& cutAfter) {
  const size_t layers = costs.perExample.size();
  COHORT_CHECK(batch >= 1 && costs.perMicroBatch.size() == layers, InvalidArgument,
               "chooseMicroBatches: a batch of ", batch, " and costs of ", costs.perMicroBatch.size(), " and ", layers,
               " layers");
  MicroBatchChoice best;
  best.stepSeconds = std::numeric_limits<double>::infinity();
  std::vector<double> layerCost(layers);
  for (int64_t M = 1; M <= batch; ++M) {
    const int64_t m = (batch + M - 1) / M;
    for (size_t j = 0; j < layers; ++j) layerCost[j] = costs.perMicroBatch[j] + costs.perExample[j] * double(m);
    const MicroBatchChoice c =
        predictStep(costs, batch, stages, counts.empty() ? balanceStages(layerCost, stages, cutAfter) : counts, int(M));
    if (c.stepSeconds < best.stepSeconds) best = c;
  }
  return best;
}

}  // namespace cohort
