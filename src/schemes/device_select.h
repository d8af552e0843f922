// The sparse codecs' pass on the buffer's own device (compressed.h, "device selection"): acc =
// residual + input, what the codec sends, and the residual acc - sent, all on the device; only
// what the message needs crosses to the host, where compress::Encoder writes the message. The
// pass is the CPU's, entry for entry (compress/encoder_internal.h), so the messages and residuals
// are the CPU's bit for bit:
//   threshold  every entry with !(|acc| < tau); its residual as thresholdEntry says (acc -+ tau
//              below 2^16 tau, the rounding of acc -+ tau beyond, 0 for NaN and infinities);
//              the selected entries (indices and acc values) cross
//   topk       the k = topKCount(ratio, finite) largest finite |acc| (ties in index order, zeros
//              never) and every non-finite entry; residual 0 where sent; the same crosses
//   onebit     the scales from sums in double on the device (compress::oneBitScalesFromSums; in
//              the rare call where the device's order of summing could round a mean otherwise,
//              acc crosses and the CPU's order decides), the residual acc -+ scale (0 where not
//              finite); the sign bitmap (one bit an entry) and the non-finite entries cross
// On CUDA, arithmetic on a NaN gives the canonical NaN (0x7fffffff) where the CPU keeps the
// operand's payload, so a message whose entry is a NaN of another payload (a planted one: a
// kernel's NaN is canonical already) carries CUDA's where the CPU's carries its own; only the NaN's
// bits differ. The double sums read float64 copies of kSumChunk entries at a time.
// Torch operations only, so the same code runs on CPU tensors (tests/device_select_test.cpp checks
// it against the CPU encoder there). Synchronizes the current stream (the counts, nonzero, the
// copies to the host): run it on a thread that may wait, not the training thread.
#pragma once

#include "compress/codec.h"

#include <c10/core/Device.h>
#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace cohort {

class DeviceSelect {
 public:
  // onebit sums the magnitudes in double this many entries at a time (the float64 copy a sum reads).
  static constexpr int64_t kSumChunk = int64_t(1) << 22;

  // Throws InvalidArgument for a codec other than topk, threshold and onebit.
  DeviceSelect(compress::CodecSpec spec, int64_t length, c10::Device device);

  // The pass over `flat` (contiguous float32 of `length` on the device; read, not written), and
  // `encoder`'s message for it in `message` (encodeSelected, encodeOneBit). Queued on the current
  // stream, which it waits for.
  void encode(const torch::Tensor& flat, compress::Encoder& encoder, std::vector<uint8_t>& message);

  struct Selected {
    torch::Tensor indices;  // int64 on the CPU, increasing
    torch::Tensor values;   // float32 on the CPU: acc at those indices
  };
  // topk and threshold: the pass over `flat`, as encode() makes it, and what crosses.
  Selected select(const torch::Tensor& flat);

  // The residual (error feedback), on the device.
  const torch::Tensor& residual() const { return residual_; }
  torch::Tensor& residual() { return residual_; }

 private:
  torch::Tensor thresholdSent(const torch::Tensor& acc) const;
  torch::Tensor topkSent(const torch::Tensor& acc) const;
  torch::Tensor thresholdResidual(const torch::Tensor& values) const;
  void encodeOneBit(const torch::Tensor& flat, compress::Encoder& encoder, std::vector<uint8_t>& message);

  compress::CodecSpec spec_;
  torch::Tensor residual_;
  torch::Tensor bitWeights_;  // onebit: 1, 2, 4 ... 128 on the device, the bitmap's packing
};

}  // namespace cohort
