#include "schemes/device_select.h"

#include <cohort/error.h>

#include <torch/torch.h>

#include <algorithm>
#include <optional>

namespace cohort {

using compress::CodecKind;

DeviceSelect::DeviceSelect(compress::CodecSpec spec, int64_t length, c10::Device device) : spec_(spec) {
  COHORT_CHECK(!spec_.dense(), InvalidArgument, "--codec ", spec_.text(),
               ": only the sparse codecs (topk, threshold, onebit) have a pass on the device");
  residual_ = torch::zeros({length}, torch::TensorOptions().dtype(torch::kFloat32).device(device));
  if (spec_.kind == CodecKind::OneBit) {
    bitWeights_ = torch::tensor({1, 2, 4, 8, 16, 32, 64, 128}, torch::kUInt8).to(device);
  }
}

void DeviceSelect::encode(const torch::Tensor& flat, compress::Encoder& encoder, std::vector<uint8_t>& message) {
  if (spec_.kind == CodecKind::OneBit) {
    encodeOneBit(flat, encoder, message);
    return;
  }
  const Selected chosen = select(flat);
  encoder.encodeSelected({chosen.indices.data_ptr<int64_t>(), size_t(chosen.indices.numel())},
                         {chosen.values.data_ptr<float>(), size_t(chosen.values.numel())}, message);
}

DeviceSelect::Selected DeviceSelect::select(const torch::Tensor& flat) {
  COHORT_CHECK(spec_.kind != CodecKind::OneBit, InvalidArgument,
               "DeviceSelect::select: onebit selects nothing; "
               "encode() makes its pass");
  torch::NoGradGuard noGrad;
  residual_.add_(flat);  // acc, as the CPU's residual[i] + input[i]
  const torch::Tensor& acc = residual_;
  const bool topk = spec_.kind == CodecKind::TopK;
  const torch::Tensor indices = (topk ? topkSent(acc) : thresholdSent(acc)).nonzero().squeeze(1);
  const torch::Tensor values = acc.index_select(0, indices);
  residual_.index_copy_(0, indices, topk ? torch::zeros_like(values) : thresholdResidual(values));
  return {indices.to(torch::kCPU), values.to(torch::kCPU)};
}

// The CPU pass's order (encoder_onebit.cpp): the scales from acc, then the bitmap and the escapes
// from acc, then the residual. Every part is computed from acc before the residual (acc itself)
// is replaced.
void DeviceSelect::encodeOneBit(const torch::Tensor& flat, compress::Encoder& encoder, std::vector<uint8_t>& message) {
  torch::NoGradGuard noGrad;
  residual_.add_(flat);
  const torch::Tensor& acc = residual_;
  const int64_t n = acc.numel();
  const torch::Tensor zero = torch::zeros({}, acc.options());
  const torch::Tensor finite = torch::isfinite(acc);
  const torch::Tensor negative = acc.lt(0.0f).logical_and(finite);
  const torch::Tensor positive = finite.logical_and(negative.logical_not());
  // |acc| per sign summed in double (abs: a -0.0 adds +0.0, as on the CPU), the counts, and the
  // non-finite entries' count: one copy to the host. A float64 sum of a float32 tensor reads a
  // float64 copy of it, so the magnitudes are summed kSumChunk at a time (32 MB of float64, where a
  // 25M-float bucket at once would take 200 MB); a sum of chunk sums in double is one more order
  // of summing, which oneBitScalesFromSums allows for.
  torch::Tensor magnitudeSums = torch::zeros({2}, acc.options().dtype(torch::kFloat64));
  for (int64_t from = 0; from < n; from += kSumChunk) {
    const int64_t length = std::min(kSumChunk, n - from);
    const torch::Tensor magnitude = acc.narrow(0, from, length).abs();
    magnitudeSums.add_(
        torch::stack({torch::where(positive.narrow(0, from, length), magnitude, zero).sum(torch::kFloat64),
                      torch::where(negative.narrow(0, from, length), magnitude, zero).sum(torch::kFloat64)}));
  }
  const torch::Tensor totals =
      torch::cat({magnitudeSums,
                  torch::stack({positive.sum(), negative.sum(), finite.logical_not().sum()}).to(torch::kFloat64)})
          .to(torch::kCPU);
  const double* t = totals.data_ptr<double>();
  std::optional<compress::OneBitScales> scales =
      compress::oneBitScalesFromSums(t[0], uint64_t(t[2]), t[1], uint64_t(t[3]));
  if (!scales) {  // the device's order of summing might round a mean otherwise: the CPU's order
    const torch::Tensor onHost = acc.to(torch::kCPU);
    scales = compress::oneBitScalesOf({onHost.data_ptr<float>(), size_t(n)});
  }
  // The sign bitmap: bit i % 8 of byte i / 8, the last byte's spare bits 0.
  const int64_t bytes = (n + 7) / 8;
  torch::Tensor bits = negative.to(torch::kUInt8);
  if (bytes * 8 > n) bits = torch::constant_pad_nd(bits, {0, bytes * 8 - n}, 0);
  const torch::Tensor bitmap = bits.view({bytes, 8}).mul(bitWeights_).sum(1, false, torch::kUInt8).to(torch::kCPU);
  torch::Tensor escapes = torch::empty({0}, torch::kInt64);
  torch::Tensor escapeValues = torch::empty({0}, torch::kFloat32);
  if (t[4] > 0) {
    const torch::Tensor at = finite.logical_not().nonzero().squeeze(1);
    escapes = at.to(torch::kCPU);
    escapeValues = acc.index_select(0, at).to(torch::kCPU);
  }
  // The residual, in place: acc - scale or acc - (-scale) (which IEEE defines as acc + scale) in
  // float32, 0 where not finite.
  residual_.sub_(torch::where(negative, torch::full({}, -scales->negative, acc.options()),
                              torch::full({}, scales->positive, acc.options())));
  residual_.masked_fill_(finite.logical_not(), 0.0f);
  encoder.encodeOneBit(*scales, {bitmap.data_ptr<uint8_t>(), size_t(bytes)},
                       {escapes.data_ptr<int64_t>(), size_t(escapes.numel())},
                       {escapeValues.data_ptr<float>(), size_t(escapeValues.numel())}, message);
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
