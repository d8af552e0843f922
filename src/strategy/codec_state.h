// A codec's state in a checkpoint, for the strategies whose handle keeps one (allreduce's
// DataParallel, average's ParameterAveraging): the steps taken, which decide when
// --codec-warmup-steps ends, and every rank's residual of error feedback, stacked in rank order.
// The chief writes the checkpoint alone, so prepareCheckpoint() gathers the residuals first.
#pragma once

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace cohort {

// The archive's keys: the step count's and the stacked residuals'.
struct CodecStateKeys {
  const char* steps;
  const char* residuals;
};

// This rank's part of a saved codec state.
struct SavedCodecState {
  int64_t steps = 0;
  torch::Tensor residual;  // undefined: none to put back
};

// `residuals`: every rank's, in rank order (empty for a codec without one).
void writeCodecState(torch::serialize::OutputArchive& archive, const CodecStateKeys& keys, int64_t steps,
                     const std::vector<torch::Tensor>& residuals);

// This rank's state, or nullopt when the checkpoint holds none (written by an older cohort). What
// cannot be put back is said on stderr and left at its start: residuals of another job size, a
// residual the codec now given (`codec`, keeping one or not: `keepsResidual`) has no use for, or
// none where it keeps one.
std::optional<SavedCodecState> readCodecState(torch::serialize::InputArchive& archive, const CodecStateKeys& keys,
                                              int rank, int worldSize, const std::string& codec, bool keepsResidual);

}  // namespace cohort
