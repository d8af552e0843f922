#include "schemes/pipeline_plan.h"

#include <cohort/error.h>

#include <algorithm>
#include <limits>

namespace cohort {

PipeSchedule parseSchedule(const std::string& name) {
  if (name == "gpipe") return PipeSchedule::kGpipe;
  if (name == "1f1b") return PipeSchedule::kOneFOneB;
  throw InvalidArgument("unknown --schedule '" + name + "': expected gpipe or 1f1b");
}

std::string scheduleName(PipeSchedule schedule) { return schedule == PipeSchedule::kGpipe ? "gpipe" : "1f1b"; }

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

std::string joinCut(const std::vector<int>& counts, const std::vector<int>& splits) {
  std::string out;
  for (size_t s = 0; s < counts.size(); ++s) {
    out += (s ? "," : "") + std::to_string(counts[s]);
    if (s < splits.size() && splits[s] > 0) out += "+" + std::to_string(splits[s]);
  }
  return out;
}

namespace {

// "L1,L2,..." with each item L or L+C: the counts and the Cs (0 where none). Throws naming `text`.
void parseLayerList(const std::string& text, std::vector<int>* counts, std::vector<int>* channels) {
  auto number = [&](const std::string& item, const std::string& part, const char* what) {
    size_t used = 0;
    int value = 0;
    try {
      value = std::stoi(part, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    COHORT_CHECK(used == part.size() && !part.empty() && part[0] != '+' && part[0] != '-' && value > 0,
                 InvalidArgument, "--partition '", text, "': '", item, "' is not a positive number of ", what,
                 " (expected auto, split or L1,L2,... layers per stage, each optionally +C channels of the next layer)");
    return value;
  };
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    const size_t plus = item.find('+');
    counts->push_back(number(item, item.substr(0, plus), "layers"));
    channels->push_back(plus == std::string::npos ? 0 : number(item, item.substr(plus + 1), "channels"));
    at = comma + 1;
  }
}

// What a given cut must be whatever the model: a layer count and a channel count per stage, the
// layers positive, the channels not negative, none on the last stage (it has no next layer).
void checkLayerList(const std::string& text, const std::vector<int>& layers, const std::vector<int>& channels) {
  const size_t n = layers.size();
  COHORT_CHECK(n > 0 && channels.size() == n, InvalidArgument, "partition ", text, ": ", n, " layer counts and ",
               channels.size(), " channel counts (give one of each per stage)");
  for (size_t s = 0; s < n; ++s) {
    COHORT_CHECK(layers[s] > 0 && channels[s] >= 0, InvalidArgument, "partition ", text, ": stage ", s, " has ",
                 layers[s], " layers and ", channels[s],
                 " channels of the next layer (layers must be positive, channels not negative)");
  }
  COHORT_CHECK(channels.back() == 0, InvalidArgument, "--partition ", text,
               ": the last stage has no next layer to split (+C goes on a stage before another)");
}

}  // namespace

PipelinePartition::PipelinePartition(const char* text) : PipelinePartition(std::string(text)) {}

PipelinePartition::PipelinePartition(const std::string& text) {
  if (text == "auto") return;
  if (text == "split") {
    kind = Kind::kSplit;
    return;
  }
  kind = Kind::kLayers;
  parseLayerList(text, &layers, &channels);
  checkLayerList(text, layers, channels);
}

std::string PipelinePartition::text() const {
  switch (kind) {
    case Kind::kAuto:
      return "auto";
    case Kind::kSplit:
      return "split";
    case Kind::kLayers:
      return joinCut(layers, channels);
  }
  return "auto";
}

bool PipelinePartition::splitsALayer() const {
  return kind == Kind::kSplit || std::any_of(channels.begin(), channels.end(), [](int c) { return c > 0; });
}

std::vector<int> partitionCut(const PipelinePartition& partition, int stages, int layers, std::vector<int>* splits) {
  const std::string text = partition.text();
  COHORT_CHECK(partition.kind == PipelinePartition::Kind::kLayers, InvalidArgument, "--partition ", text,
               " is measured, not given: expected L1,L2,... layers per stage");
  // Its fields are public: what the text would have refused is refused here too.
  checkLayerList(text, partition.layers, partition.channels);
  const size_t n = partition.layers.size();
  COHORT_CHECK(int(n) == stages, InvalidArgument, "--partition ", text, " has ", n, " stages but --stages is ",
               stages, ": give one layer count per stage");
  int sum = 0;
  for (int c : partition.layers) sum += c;
  COHORT_CHECK(sum == layers, InvalidArgument, "--partition ", text, " covers ", sum, " layers but the model has ",
               layers, ": the counts must add up to ", layers);
  if (splits != nullptr) {
    *splits = partition.channels;
  } else {
    for (size_t s = 0; s < partition.channels.size(); ++s) {
      COHORT_CHECK(partition.channels[s] == 0, InvalidArgument, "--partition '", text, "': '",
                   partition.layers[s], "+", partition.channels[s], "' splits a layer, which is not allowed here");
    }
  }
  return partition.layers;
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

SplitCut balanceStagesSplit(const std::vector<double>& costs, int stages, const std::vector<bool>& cutAfter,
                            const std::vector<int64_t>& channels, double gain) {
  const int n = int(costs.size());
  SplitCut whole;
  whole.counts = balanceStages(costs, stages, cutAfter);
  whole.splits.assign(size_t(stages), 0);
  for (size_t s = 0, j = 0; s < whole.counts.size(); ++s) {
    double cost = 0;
    for (int k = 0; k < whole.counts[s]; ++k) cost += costs[j++];
    whole.slowest = std::max(whole.slowest, cost);
  }
  auto mayCut = [&](int j) { return cutAfter.empty() || cutAfter[size_t(j)]; };  // after layer j
  std::vector<double> prefix(size_t(n) + 1, 0.0);
  for (int j = 0; j < n; ++j) prefix[size_t(j) + 1] = prefix[size_t(j)] + costs[size_t(j)];
  // The points where a stage may end: before layer j with its first c channels (c = 0: a cut
  // between layers), in model order.
  struct Point {
    int layer;
    int64_t channel;
    double at;
  };
  std::vector<Point> points;
  for (int j = 0; j <= n; ++j) {
    const bool inputHasBatch = j == 0 || mayCut(j - 1);
    if (j == 0 || j == n || inputHasBatch) points.push_back({j, 0, prefix[size_t(j)]});
    if (j == n || !inputHasBatch || j >= int(channels.size()) || channels[size_t(j)] < 2) continue;
    const int64_t out = channels[size_t(j)];
    const int64_t steps = std::min<int64_t>(out - 1, 64);
    int64_t previous = 0;
    for (int64_t i = 1; i <= steps; ++i) {
      const int64_t c = out - 1 <= 64 ? i : std::max<int64_t>(1, (out * i) / (steps + 1));
      if (c <= previous || c >= out) continue;
      previous = c;
      points.push_back({j, c, prefix[size_t(j)] + costs[size_t(j)] * double(c) / double(out)});
    }
  }
  const int P = int(points.size());
  constexpr double kNone = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(size_t(stages) + 1, std::vector<double>(size_t(P), kNone));
  std::vector<std::vector<int>> from(size_t(stages) + 1, std::vector<int>(size_t(P), -1));
  best[0][0] = 0;
  for (int s = 1; s <= stages; ++s) {
    for (int p = 1; p < P; ++p) {
      for (int q = 0; q < p; ++q) {
        if (best[size_t(s) - 1][size_t(q)] == kNone) continue;
        // At least one layer whole, or a split layer's second part: never a middle slice.
        if (points[size_t(p)].layer - points[size_t(q)].layer < 1) continue;
        const double cost = std::max(best[size_t(s) - 1][size_t(q)], points[size_t(p)].at - points[size_t(q)].at);
        if (cost < best[size_t(s)][size_t(p)]) {
          best[size_t(s)][size_t(p)] = cost;
          from[size_t(s)][size_t(p)] = q;
        }
      }
    }
  }
  const double split = best[size_t(stages)][size_t(P) - 1];
  if (!(split < gain * whole.slowest)) return whole;
  SplitCut out;
  out.slowest = split;
  out.counts.assign(size_t(stages), 0);
  out.splits.assign(size_t(stages), 0);
  for (int s = stages, p = P - 1; s >= 1; --s) {
    const int q = from[size_t(s)][size_t(p)];
    out.counts[size_t(s) - 1] = points[size_t(p)].layer - points[size_t(q)].layer;
    out.splits[size_t(s) - 1] = int(points[size_t(p)].channel);
    p = q;
  }
  return out;
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
