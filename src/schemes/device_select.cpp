#include "schemes/device_select.h"

#include <cohort/error.h>

#include <torch/torch.h>

namespace cohort {

using compress::CodecKind;

DeviceSelect::DeviceSelect(compress::CodecSpec spec, int64_t length, c10::Device device) : spec_(spec) {
  COHORT_CHECK(spec_.kind == CodecKind::TopK || spec_.kind == CodecKind::Threshold, InvalidArgument, "--codec ",
               spec_.text(), ": only topk and threshold select their entries on the device");
  residual_ = torch::zeros({length}, torch::TensorOptions().dtype(torch::kFloat32).device(device));
}

DeviceSelect::Selected DeviceSelect::select(const torch::Tensor& flat) {
  torch::NoGradGuard noGrad;
  residual_.add_(flat);  // acc, as the CPU's residual[i] + input[i]
  const torch::Tensor& acc = residual_;
  const bool topk = spec_.kind == CodecKind::TopK;
  const torch::Tensor indices = (topk ? topkSent(acc) : thresholdSent(acc)).nonzero().squeeze(1);
  const torch::Tensor values = acc.index_select(0, indices);
  residual_.index_copy_(0, indices, topk ? torch::zeros_like(values) : thresholdResidual(values));
  return {indices.to(torch::kCPU), values.to(torch::kCPU)};
}

// !(|acc| < tau): NaN too.
torch::Tensor DeviceSelect::thresholdSent(const torch::Tensor& acc) const {
  return acc.abs().lt(spec_.tau).logical_not();
}

// compress::thresholdEntry's residual, element-wise, in float32 as there.
torch::Tensor DeviceSelect::thresholdResidual(const torch::Tensor& a) const {
  const float tau = spec_.tau;
  const torch::Tensor r = torch::where(a.lt(0.0f), a + tau, a - tau);
  const torch::Tensor exact = a.abs().lt(tau * 65536.0f);                   // a sign entry: acc -+ tau
  const torch::Tensor rounded = torch::isfinite(a).logical_and(r.ne(a));    // a value entry keeping r
  return torch::where(exact.logical_or(rounded), r, torch::zeros_like(a));  // else sent whole: 0
}

// The k largest finite |acc| (ties in index order, zeros never) and every non-finite entry.
torch::Tensor DeviceSelect::topkSent(const torch::Tensor& acc) const {
  const torch::Tensor finite = torch::isfinite(acc);
  const auto count = size_t(finite.sum().item<int64_t>());
  const auto k = int64_t(compress::topKCount(spec_.ratio, count));
  const torch::Tensor magnitudes = torch::where(finite, acc.abs(), torch::full_like(acc, -1.0f));
  // The k-th largest finite magnitude; 0 when every finite entry goes (or none).
  torch::Tensor kth = torch::zeros({}, acc.options());
  if (k > 0 && k < int64_t(count)) kth = std::get<0>(magnitudes.topk(k, 0, /*largest=*/true, /*sorted=*/false)).min();
  const torch::Tensor above = magnitudes.gt(kth);
  const torch::Tensor ties = magnitudes.eq(kth).logical_and(kth.gt(0.0f));
  const torch::Tensor room = above.sum().neg().add(k);  // ties fill up to k, first come first
  return finite.logical_not().logical_or(above).logical_or(ties.logical_and(ties.cumsum(0).le(room)));
}

}  // namespace cohort
