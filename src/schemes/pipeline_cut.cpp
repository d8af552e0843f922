// Where the pipeline cuts the model (Pipeline::Impl::chooseCut, schemes/pipeline_internal.h): from
// the resumed checkpoints' manifest, from the partition given, or balanced by each layer's
// forward+backward timed on rank 0; with kAutoMicroBatches, the micro-batch count with it
// (chooseMicroBatches, schemes/pipeline_plan.h). Rank 0 decides and says why (the job's Env); every
// rank takes its choice, since timings differ between processes.
#include <cohort/env.h>
#include <cohort/error.h>

#include "schemes/pipeline_internal.h"
#include "schemes/pipeline_manifest.h"

#include <algorithm>
#include <cstdio>

namespace cohort {

namespace {

// The cost of each stage under a cut (a split layer's cost shared by its channels), and which
// split layer each split computes.
std::string stageCosts(const std::vector<double>& costs, const std::vector<int>& counts, const std::vector<int>& splits,
                       const std::vector<int64_t>& channels, double* slowest, double* total) {
  std::string stages;
  double carried = 0;  // the second part of a split layer, on the next stage
  for (int s = 0, j = 0; s < int(counts.size()); ++s) {
    double cost = carried;
    carried = 0;
    const bool tail = s > 0 && size_t(s) - 1 < splits.size() && splits[size_t(s) - 1] > 0;
    for (int k = 0; k < counts[size_t(s)]; ++k, ++j) cost += (k == 0 && tail) ? 0.0 : costs[size_t(j)];
    if (size_t(s) < splits.size() && splits[size_t(s)] > 0) {
      const double share = double(splits[size_t(s)]) / double(channels[size_t(j)]);
      cost += costs[size_t(j)] * share;
      carried = costs[size_t(j)] * (1 - share);
    }
    *slowest = std::max(*slowest, cost);
    *total += cost;
    char item[64];
    std::snprintf(item, sizeof(item), "%s%.2f ms", s == 0 ? "" : ", ", cost * 1e3);
    stages += item;
  }
  return stages;
}

// The cut, and the predicted time per stage, to `env`.
void printCut(Env& env, const std::vector<std::string>& layerNames, const std::vector<double>& costs,
              const std::vector<int>& counts, const std::vector<int>& splits = {},
              const std::vector<int64_t>& channels = {}) {
  double slowest = 0;
  double total = 0;
  const std::string stages = stageCosts(costs, counts, splits, channels, &slowest, &total);
  std::string how = "layers per stage";
  for (int s = 0, j = 0; s + 1 < int(counts.size()) && size_t(s) < splits.size(); ++s) {
    j += counts[size_t(s)];
    if (splits[size_t(s)] == 0) continue;
    how += "; stage " + std::to_string(s) + " also computes " + std::to_string(splits[size_t(s)]) + " of the " +
           std::to_string(channels[size_t(j)]) + " output channels of layer " + std::to_string(j) + " (" +
           layerNames[size_t(j)] + "), stage " + std::to_string(s + 1) + " the others";
  }
  char balance[32];
  std::snprintf(balance, sizeof(balance), "%.2fx", slowest / (total / double(counts.size())));
  env.log(LogLevel::kInfo, "pipeline: cut " + joinCut(counts, splits) + " (" + how + "); predicted time per stage " +
                               stages + "; slowest stage " + balance + " the mean (1.00 is perfect balance)");
}

// kAutoMicroBatches, on rank 0: every layer timed on 1 example and on the whole batch gives its
// cost per micro-batch and per example (a straight line through the two), and chooseMicroBatches
// picks M and, with the partition auto (empty `counts`), the cut at that M.
MicroBatchChoice chooseMicroBatchCount(Env& env, torch::nn::Sequential& model, const torch::Tensor& sample, int stages,
                                       const LayerProfile& profile, const std::vector<int>& counts,
                                       double messageSeconds, const std::vector<std::string>& layerNames) {
  const int64_t B = sample.size(0);
  const std::vector<double> one = timeLayers(model, sample.narrow(0, 0, 1));
  const std::vector<double> all = B > 1 ? timeLayers(model, sample) : one;
  MicroBatchCosts costs;
  costs.messageSeconds = messageSeconds;
  for (size_t j = 0; j < one.size(); ++j) {
    const double perExample = B > 1 ? std::max(0.0, (all[j] - one[j]) / double(B - 1)) : 0.0;
    costs.perExample.push_back(perExample);
    costs.perMicroBatch.push_back(std::max(0.0, one[j] - perExample));
  }
  const MicroBatchChoice choice = chooseMicroBatches(costs, B, stages, counts, profile.cutAfter);
  const int64_t m = (B + choice.microBatches - 1) / choice.microBatches;
  char line[512];
  std::snprintf(line, sizeof(line),
               "pipeline: --micro-batches auto chose M = %d (micro-batches of %lld examples or fewer): the "
               "slowest stage's fixed cost per micro-batch is %.3f ms (per-op overheads %.3f ms, messages %.3f ms "
               "measured), its work per micro-batch %.2f ms; predicted step %.1f ms (M = 1: %.1f ms)",
               choice.microBatches, (long long)m, choice.fixedSeconds * 1e3,
               (choice.fixedSeconds - (stages > 1 ? messageSeconds : 0.0)) * 1e3, messageSeconds * 1e3,
               (choice.slotSeconds - choice.fixedSeconds) * 1e3, choice.stepSeconds * 1e3,
               predictStep(costs, B, stages, choice.counts, 1).stepSeconds * 1e3);
  env.log(LogLevel::kInfo, line);
  std::vector<double> atChoice;
  for (size_t j = 0; j < one.size(); ++j) atChoice.push_back(costs.perMicroBatch[j] + costs.perExample[j] * double(m));
  printCut(env, layerNames, atChoice, choice.counts);
  return choice;
}

// The partition auto or split, on rank 0: the cut balanced by each layer's time on a micro-batch.
void measuredCut(Env& env, torch::nn::Sequential& model, const torch::Tensor& sample, const PipelineOptions& options,
                 const LayerProfile& profile, const std::vector<std::string>& layerNames, std::vector<int>* counts,
                 std::vector<int>* splits) {
  const int64_t micro = std::max<int64_t>(1, (sample.size(0) + options.microBatches - 1) / options.microBatches);
  const std::vector<double> costs = timeLayers(model, sample.narrow(0, 0, std::min(micro, sample.size(0))));
  if (options.partition.kind == PipelinePartition::Kind::kSplit) {
    const SplitCut cut = balanceStagesSplit(costs, options.stages, profile.cutAfter, profile.channels);
    *counts = cut.counts;
    *splits = cut.splits;
  } else {
    *counts = balanceStages(costs, options.stages, profile.cutAfter);
  }
  std::string text = "pipeline: --partition " + options.partition.text() +
                     " measured forward+backward per layer on a micro-batch of " + std::to_string(micro) + ":";
  for (size_t j = 0; j < costs.size(); ++j) {
    char item[96];
    std::snprintf(item, sizeof(item), " %s %.2f ms", layerNames[j].c_str(), costs[j] * 1e3);
    text += item;
  }
  env.log(LogLevel::kInfo, text);
  printCut(env, layerNames, costs, *counts, *splits, profile.channels);
}

// On rank 0 with `resume`: the checkpoints' manifest, when there is one, decides. `automatic`:
// the partition was auto or split (the manifest's cut is taken), else it must be the given one.
void cutFromManifest(Env& env, const PipelineOptions& options, bool automatic, int layers, std::vector<int>* counts,
                     std::vector<int>* splits) {
  const std::string path = options.checkpointDir + "/" + kPipelineManifest;
  const std::optional<PipelineManifest> manifest = readPipelineManifest(path);
  if (!manifest) return;
  const std::string theirs = joinCut(manifest->counts, manifest->splits);
  // A cut of another model would index past this one's layers (another --model on resume).
  COHORT_CHECK(manifest->counts.size() == size_t(manifest->stages), InvalidArgument, path, ": its cut ", theirs,
               " has ", manifest->counts.size(), " stages, its header ", manifest->stages,
               ": not a manifest cohort wrote; start in a new --checkpoint-dir");
  int total = 0;
  for (const int c : manifest->counts) total += c;
  COHORT_CHECK(total == layers, InvalidArgument, path, ": the checkpoints are of a model of ", total, " layers (cut ",
               theirs, "), and this run's model has ", layers,
               ": resume with the --model the checkpoints were written with, or start in a new --checkpoint-dir");
  COHORT_CHECK(manifest->stages == options.stages, InvalidArgument, path, ": the checkpoints are of a ",
               manifest->stages, "-stage pipeline (cut ", theirs, "), but this run has --stages ", options.stages,
               ": resume with --stages ", manifest->stages, " --partition ", theirs,
               ", or start in a new --checkpoint-dir");
  if (automatic) {
    *counts = manifest->counts;
    *splits = manifest->splits;
    env.log(LogLevel::kInfo, "pipeline: resuming with the checkpoints' cut " + theirs + " (" + path + ")");
  }
  COHORT_CHECK(*counts == manifest->counts && *splits == manifest->splits, InvalidArgument, path,
               ": the checkpoints cut the model as ", theirs, " (layers per stage), but this run asks for --partition ",
               joinCut(*counts, *splits), ": resume with --partition ", theirs,
               " (or auto), or start in a new --checkpoint-dir");
}

// Throws InvalidArgument when the cut meets the layers where it may not.
void checkCut(const std::vector<int>& counts, const std::vector<int>& splits, const LayerProfile& profile,
              const std::vector<std::string>& names) {
  const std::string cut = joinCut(counts, splits);
  for (int s = 0, j = 0; s + 1 < int(counts.size()); ++s) {
    j += counts[size_t(s)];
    COHORT_CHECK(profile.cutAfter[size_t(j - 1)], InvalidArgument, "--partition ", cut, " cuts after layer ", j - 1,
                 " (", names[size_t(j - 1)],
                 "), whose output does not have the batch as its first dimension: cut "
                 "elsewhere");
    const int c = splits[size_t(s)];
    const int64_t channels = profile.channels[size_t(j)];
    COHORT_CHECK(c == 0 || channels > 0, InvalidArgument, "--partition ", cut, " splits layer ", j, " (",
                 names[size_t(j)],
                 "), but only a Conv2d or a Linear on [batch, features] can be split by "
                 "output channels");
    COHORT_CHECK(c < channels || c == 0, InvalidArgument, "--partition ", cut, " gives stage ", s, " ", c,
                 " output channels of layer ", j, " (", names[size_t(j)], "), which has ", channels, ": give 1 to ",
                 channels - 1);
  }
}

}  // namespace

void Pipeline::Impl::chooseCut(torch::nn::Sequential& model, const torch::Tensor& sample, const LayerProfile& profile) {
  Env& env = envOrStandard(comm->options().env);
  const int S = options.stages;
  const bool automatic = options.partition.kind != PipelinePartition::Kind::kLayers;
  std::vector<int> cut;
  std::vector<int> split(size_t(S), 0);
  if (!automatic) cut = partitionCut(options.partition, S, int(model->size()), &split);
  const bool autoMicroBatches = options.microBatches == kAutoMicroBatches;
  // Ranks 0 and 1 time the messages first (every rank calls chooseCut).
  const double messageSeconds = autoMicroBatches ? probeMessages(*comm, S) : 0.0;
  // Layers per stage, the splits, then M: rank 0's are everyone's.
  std::vector<int64_t> shared(2 * size_t(S) + 1, 0);
  shared[2 * size_t(S)] = options.microBatches;
  if (comm->rank() == 0) {
    if (options.resume && !options.checkpointDir.empty())
      cutFromManifest(env, options, automatic, int(model->size()), &cut, &split);
    if (autoMicroBatches) {
      autoChoice = chooseMicroBatchCount(env, model, sample, S, profile, cut, messageSeconds, layerNames);
      cut = autoChoice->counts;
      shared[2 * size_t(S)] = autoChoice->microBatches;
    } else if (cut.empty()) {
      measuredCut(env, model, sample, options, profile, layerNames, &cut, &split);
    }
    std::copy(cut.begin(), cut.end(), shared.begin());
    std::copy(split.begin(), split.end(), shared.begin() + S);
  }
  auto wire = torch::tensor(shared, torch::kInt64);
  comm->broadcast(wire, 0);
  counts.assign(size_t(S), 0);
  splits.assign(size_t(S), 0);
  for (int s = 0; s < S; ++s) {
    counts[size_t(s)] = int(wire[s].item<int64_t>());
    splits[size_t(s)] = int(wire[S + s].item<int64_t>());
  }
  options.microBatches = int(wire[2 * S].item<int64_t>());
  checkCut(counts, splits, profile, layerNames);
}

}  // namespace cohort
