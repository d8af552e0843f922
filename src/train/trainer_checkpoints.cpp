// The Trainer's checkpoints: the archive of a process's training state (model, optimizer, the
// scheme's own state, the position in the data, the generator and a fingerprint of the run), its
// periodic and final saves, and resuming from the newest one that verifies.
#include "models/cpu_generator.h"
#include "schemes/model_sync.h"
#include "train/trainer_internal.h"
#include <cohort/error.h>

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace cohort {

namespace {

// What a checkpoint must agree on with the run that resumes it.
std::string fingerprint(const TrainOptions& o, const ReplicaInfo& r, const std::string& layout) {
  std::ostringstream out;
  out << "model=" << o.model << " data=" << o.data << " batch=" << o.batch
      << " optimizer=" << optimizerName(o.optimizer) << " strategy=" << schemeName(o.strategy.scheme)
      << " workers=" << r.worldSize << " seed=" << o.seed;
  if (o.validation > 0) out << " validation=" << o.validation << ":" << o.validationSeed;
  if (!layout.empty()) out << " " << layout;
  return out.str();
}

}  // namespace

std::vector<uint8_t> Trainer::State::serialize() {
  torch::serialize::OutputArchive archive;
  torch::serialize::OutputArchive modelArchive;
  model->save(modelArchive);
  archive.write("model", modelArchive);
  torch::serialize::OutputArchive optimizerArchive;
  optimizer->save(optimizerArchive);
  archive.write("optimizer", optimizerArchive);
  if (const GradScaler* scaler = strategy->scaler()) {
    // float16's loss scale goes with the optimizer, the writer's for every rank: allreduce's ranks
    // unscale the same gradients, gossip's resume from the writer's model. (average, whose ranks
    // unscale their own, saves every rank's in its own state.)
    archive.write("grad_scaler", scalerStateTensor(*scaler));
  }
  torch::serialize::OutputArchive strategyArchive;
  strategy->saveState(strategyArchive);
  archive.write("strategy", strategyArchive);
  archive.write("step", c10::IValue(step));
  archive.write("epoch", c10::IValue(epoch));
  archive.write("step_in_epoch", c10::IValue(stepInEpoch));
  archive.write("wall_s", c10::IValue(secondsSince(clockStart)));
  archive.write("fingerprint", c10::IValue(fingerprint(options, replica, strategy->layout())));
  archive.write("rng", cpuGeneratorState());
  std::vector<uint8_t> bytes;
  archive.save_to([&](const void* data, size_t size) {
    auto p = static_cast<const uint8_t*>(data);
    bytes.insert(bytes.end(), p, p + size);
    return size;
  });
  return bytes;
}

// A checkpoint that verifies can still hold data that is not what cohort wrote (damaged before
// its checksum was made, or written by hand): every failure to read it is an IoError naming it.
void Trainer::State::restore(const LoadedCheckpoint& ckpt) {
  const std::string& path = ckpt.file.path;
  // Not only c10::Error: TorchScript's reader of the archive's code throws its own exceptions.
  auto firstLine = [](const std::exception& e) {
    const std::string what = e.what();
    return what.substr(0, what.find('\n'));
  };
  torch::serialize::InputArchive archive;
  c10::IValue value;
  std::string found;
  try {
    // Onto this run's device, whichever device wrote it (a GPU run resumes on a CPU and back).
    archive.load_from(reinterpret_cast<const char*>(ckpt.payload.data()), ckpt.payload.size(), device);
    archive.read("fingerprint", value);
    found = value.toStringRef();
  } catch (const std::exception& e) {
    throw IoError(path + ": checkpoint payload is unreadable: " + firstLine(e));
  }
  const std::string expected = fingerprint(options, replica, strategy->layout());
  COHORT_CHECK(found == expected, InvalidArgument, path, ": checkpoint is from a different run (", found,
               "; this run: ", expected, "): use another --checkpoint-dir or the same settings");
  try {
    torch::serialize::InputArchive modelArchive;
    archive.read("model", modelArchive);
    model->load(modelArchive);
    torch::serialize::InputArchive optimizerArchive;
    archive.read("optimizer", optimizerArchive);
    // The run's --lr and --momentum (the optimizer was made with them) win over the checkpoint's,
    // as the command line does over --config; a change is said.
    for (const auto& saved : loadOptimizerKeepingOptions(*optimizer, optimizerArchive)) {
      if (!replica.isChief()) break;
      if (saved->get_lr() != options.lr) {
        std::fprintf(stderr, "cohort: the checkpoint's learning rate was %g; this run's --lr %g applies\n",
                     saved->get_lr(), options.lr);
      }
      const auto* sgd = dynamic_cast<const torch::optim::SGDOptions*>(saved.get());
      if (sgd != nullptr && options.optimizer == OptimizerKind::kMomentum && sgd->momentum() != options.momentum) {
        std::fprintf(stderr, "cohort: the checkpoint's momentum was %g; this run's --momentum %g applies\n",
                     sgd->momentum(), options.momentum);
      }
    }
    // Absent from a checkpoint written without --autocast fp16: the scaler starts as a new run's.
    if (torch::Tensor saved; strategy->scaler() != nullptr && archive.try_read("grad_scaler", saved)) {
      strategy->scaler()->loadState(scalerStateFromTensor(saved, path));
    }
    // Given to the strategy after attach() (which makes its state); absent in older checkpoints.
    strategyState.emplace();
    strategyStateSource = path;
    archive.try_read("strategy", *strategyState);
    archive.read("step", value);
    step = value.toInt();
    archive.read("epoch", value);
    epoch = value.toInt();
    archive.read("step_in_epoch", value);
    stepInEpoch = value.toInt();
    // Absent from checkpoints of earlier versions: the clock then starts at 0, as it did.
    wallSecondsBefore = archive.try_read("wall_s", value) ? value.toDouble() : 0.0;
    torch::Tensor rng;
    archive.read("rng", rng);
    setCpuGeneratorState(rng.to(torch::kCPU));  // the CPU generator's state, mapped to the device with the rest
  } catch (const std::exception& e) {
    throw IoError(path + ": checkpoint does not fit this model: " + firstLine(e));
  }
  COHORT_CHECK(
      step >= 0 && step <= kMaxSteps && epoch >= 0 && epoch <= kMaxSteps && stepInEpoch >= 0 && stepInEpoch <= step,
      IoError, path, ": corrupt checkpoint: step ", step, ", epoch ", epoch, ", step_in_epoch ", stepInEpoch,
      " are not a training position");
  constexpr double kYear = 366.0 * 24 * 3600;
  COHORT_CHECK(wallSecondsBefore >= 0 && wallSecondsBefore <= 100 * kYear, IoError, path,
               ": corrupt checkpoint: wall_s ", wallSecondsBefore, " is not the seconds of a run");
}

// The writer (the chief) reads the checkpoint and sends it to the processes that restore the
// same model (every worker), so all resume alike even when only it can see the directory: over
// the communicator, or for a scheme without one (gossip) through the scheme.
void Trainer::State::resume() {
  std::vector<uint8_t> payload;
  std::string path;
  // Processes that restore different checkpoints (pipeline stages, tensor ways) take the newest
  // step that every one of them has: a kill inside one part's write leaves the others ahead.
  int64_t upTo = INT64_MAX;
  if (comm && checkpointPlan.group) {
    int64_t newest = INT64_MAX;
    if (checkpointPlan.writes) {
      const auto files = checkpoints->list();
      newest = files.empty() ? -1 : files.front().step;
    }
    for (const auto& t : comm->allgather(torch::tensor({newest}, torch::kInt64))) {
      upTo = std::min(upTo, t.item<int64_t>());
    }
    if (checkpointPlan.writes && upTo >= 0 && upTo < newest) {
      warn(
          "--resume: the newest checkpoint of this rank's part of the model (a pipeline stage, a tensor way) is step " +
          std::to_string(newest) + ", another part's step " + std::to_string(upTo) +
          " (a save was interrupted): resuming every part from step " + std::to_string(upTo));
    }
  }
  if (checkpointPlan.writes && upTo >= 0) {
    if (auto loaded = loadChiefCheckpoint(upTo)) {
      payload = std::move(loaded->payload);
      path = loaded->file.path;
    }
  }
  Communicator* group = checkpointPlan.group ? checkpointPlan.group.get() : comm.get();
  payload = group != nullptr ? group->broadcastBytes(payload, 0) : strategy->shareCheckpoint(std::move(payload));
  if (!payload.empty()) {
    restore(LoadedCheckpoint{{path.empty() ? "the chief's checkpoint" : path, 0}, std::move(payload)});
    if (checkpointPlan.writes) {
      std::fprintf(stderr, "cohort: resumed from %s (step %lld, epoch %lld)\n", path.c_str(), (long long)step,
                   (long long)epoch + 1);
    }
  }
  // Processes that restored different checkpoints (pipeline stages) must be at the same step.
  if (comm && checkpointPlan.group) {
    auto steps = comm->allgather(torch::tensor({step}, torch::kInt64));
    for (size_t r = 0; r < steps.size(); ++r) {
      COHORT_CHECK(steps[r].item<int64_t>() == step, InvalidArgument, "--resume: rank ", r, " restored step ",
                   steps[r].item<int64_t>(), " but rank ", replica.rank, " step ", step, " (checkpoints under ",
                   options.checkpointDir,
                   " were written at different steps, e.g. a save was interrupted): "
                   "remove the newer files so that every part ends at the same step");
    }
  }
}

// The newest checkpoint that verifies, at or before step `upTo`.
std::optional<LoadedCheckpoint> Trainer::State::loadChiefCheckpoint(int64_t upTo) {
  std::vector<std::string> corrupt;
  std::optional<LoadedCheckpoint> loaded;
  for (const auto& file : checkpoints->list([&](const std::string& m) { warn(m); })) {
    if (file.step > upTo) continue;
    try {
      loaded = LoadedCheckpoint{file, CheckpointStore::readVerified(file.path)};
      break;
    } catch (const IoError& e) {
      corrupt.push_back(std::string(e.what()) + "; trying the next older one");
    }
  }
  if (!loaded) {
    std::string all;
    for (const auto& m : corrupt) all += (all.empty() ? "" : " | ") + m.substr(0, m.find("; trying"));
    COHORT_CHECK(corrupt.empty(), IoError, "no readable checkpoint in ", checkpoints->dir(), ": ", all);
    warn("--resume: no checkpoint in " + checkpoints->dir() + " yet; starting from scratch");
    return std::nullopt;
  }
  for (const auto& m : corrupt) warn(m);
  return loaded;
}

// A periodic checkpoint that cannot be written (a full disk) is reported and training goes on
// from the previous one, as on the shards. The final one (`final`) that cannot be written is
// returned as an error for the end of the run: the run's result still reaches its done event,
// and the previous checkpoints are kept (a save removes older ones only after it succeeded).
std::optional<std::string> Trainer::State::saveCheckpoint(bool final) {
  strategy->synchronize();
  strategy->prepareCheckpoint();
  if (!checkpoints) return std::nullopt;
  try {
    checkpoints->save(step, serialize());
  } catch (const IoError& e) {
    if (!final) {
      warn(std::string("checkpoint failed, training goes on: ") + e.what());
      return std::nullopt;
    }
    const auto kept = checkpoints->list();
    std::string error = "the final checkpoint (step " + std::to_string(step) + ") could not be written to " +
                        checkpoints->dir() + ": " + e.what() + "; ";
    error += kept.empty() ? "no earlier checkpoint is there"
                          : "the newest checkpoint kept there is " + kept.front().path + " (step " +
                                std::to_string(kept.front().step) + ")";
    error += "; the run's result is in its done event: free space on that disk or give another --checkpoint-dir";
    return error;
  }
  return std::nullopt;
}

}  // namespace cohort
