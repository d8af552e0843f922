#include "strategy/codec_state.h"

#include <torch/torch.h>

#include <cstdio>

namespace cohort {

void writeCodecState(torch::serialize::OutputArchive& archive, const CodecStateKeys& keys, int64_t steps,
                     const std::vector<torch::Tensor>& residuals) {
  archive.write(keys.steps, torch::tensor(steps, torch::kInt64));
  if (!residuals.empty()) archive.write(keys.residuals, torch::stack(residuals));
}

std::optional<SavedCodecState> readCodecState(torch::serialize::InputArchive& archive, const CodecStateKeys& keys,
                                              int rank, int worldSize, const std::string& codec, bool keepsResidual) {
  torch::Tensor steps;
  const bool hasSteps = archive.try_read(keys.steps, steps);
  torch::Tensor residuals;  // [ranks, entries]
  bool hasResidual = archive.try_read(keys.residuals, residuals);
  if (hasResidual && (residuals.dim() != 2 || residuals.size(0) != worldSize)) {
    std::fprintf(stderr,
                 "cohort: warning: the checkpoint's codec residuals are of %lld ranks, this job has %d; the residual "
                 "starts at zero\n",
                 residuals.dim() == 2 ? (long long)residuals.size(0) : -1LL, worldSize);
    hasResidual = false;
  }
  if (!hasSteps) {
    if (codec != "none") {
      std::fprintf(stderr, "cohort: warning: the checkpoint holds no codec state (written by an older cohort); "
                           "--codec-warmup-steps counts again from 0 and the codec's residual starts at zero\n");
    }
    return std::nullopt;
  }
  SavedCodecState state{.steps = steps.item<int64_t>(), .residual = {}};
  if (hasResidual && !keepsResidual) {
    std::fprintf(stderr, "cohort: warning: the checkpoint holds a codec residual that --codec %s does not keep; it "
                         "is dropped\n", codec.c_str());
  } else if (!hasResidual && keepsResidual) {
    std::fprintf(stderr, "cohort: warning: the checkpoint holds no codec residual (written with another --codec); "
                         "the residual starts at zero\n");
  } else if (hasResidual) {
    state.residual = residuals[rank];
  }
  return state;
}

}  // namespace cohort
