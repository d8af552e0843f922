// topk's and threshold's pass on the buffer's own device (compressed.h, "device selection"): acc =
// residual + input, the entries the codec sends, and the residual acc - sent, all on the device;
// only the selected entries (indices and acc values) cross to the host, where
// compress::Encoder::encodeSelected writes the message. The selection is the CPU pass's, entry for
// entry (compress/encoder_internal.h), so the messages and residuals are the CPU's bit for bit:
//   threshold  every entry with !(|acc| < tau); its residual as thresholdEntry says (acc -+ tau
//              below 2^16 tau, the rounding of acc -+ tau beyond, 0 for NaN and infinities)
//   topk       the k = topKCount(ratio, finite) largest finite |acc| (ties in index order, zeros
//              never) and every non-finite entry; residual 0 where sent
// Torch operations only, so the same code runs on CPU tensors (tests/device_select_test.cpp checks
// it against the CPU encoder there). Synchronizes the current stream (the count of finite entries,
// nonzero, the copies to the host): run it on a thread that may wait, not the training thread.
#pragma once

#include "compress/codec.h"

#include <c10/core/Device.h>
#include <torch/types.h>

#include <cstdint>

namespace cohort {

class DeviceSelect {
 public:
  // Throws InvalidArgument for a codec other than topk and threshold.
  DeviceSelect(compress::CodecSpec spec, int64_t length, c10::Device device);

  struct Selected {
    torch::Tensor indices;  // int64 on the CPU, increasing
    torch::Tensor values;   // float32 on the CPU: acc at those indices
  };
  // `flat`: contiguous float32 of `length` on the device; read, not written. Queued on the current
  // stream, which it waits for.
  Selected select(const torch::Tensor& flat);

  // The residual (error feedback), on the device.
  const torch::Tensor& residual() const { return residual_; }
  torch::Tensor& residual() { return residual_; }

 private:
  torch::Tensor thresholdSent(const torch::Tensor& acc) const;
  torch::Tensor topkSent(const torch::Tensor& acc) const;
  torch::Tensor thresholdResidual(const torch::Tensor& values) const;

  compress::CodecSpec spec_;
  torch::Tensor residual_;
};

}  // namespace cohort
