// A model on a CUDA device seen from host memory, for the schemes whose exchange works on host
// memory (ParameterAveraging, the parameter-server client, Gossip): a pinned host buffer, allocated
// once, whose views stand in for the device tensors while the exchange runs.
//
// Per exchange the data leaves the device once and comes back once:
//   toHost()    waits until the last toDevice() has finished reading the buffer, copies every
//               tensor device -> host on the device's current stream (ordered after the kernels
//               that computed it), and synchronizes that stream;
//   ...         the exchange reads and writes the host views (the code a CPU model runs);
//   toDevice()  copies host -> device without blocking, on the current stream (so the next
//               kernels see the new values), and records an event: the buffer is not written on
//               the host again until that event has completed (toHost() and awaitDevice() wait
//               for it; so does the destructor, which keeps the buffer alive until then).
// Calls come from one thread (the training thread).
#pragma once

#include <cohort/env.h>

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <torch/types.h>

#include <memory>
#include <optional>
#include <vector>

namespace cohort {

class HostMirror {
 public:
  // Mirrors `tensors` (of one dtype, all on one CUDA device): the pinned buffer holds their
  // elements side by side, in order, in their dtype or in `hostType` (copy_ converts both ways:
  // a bfloat16 model's float32 copy). With a hostType other than theirs the tensors may also be
  // on the CPU: the buffer is then plain host memory and both copies are synchronous. Throws
  // InvalidArgument for mixed dtypes or devices. env: where a failure in the destructor is
  // reported (it cannot throw).
  HostMirror(std::vector<torch::Tensor> tensors, Env& env, std::optional<c10::ScalarType> hostType = std::nullopt);
  ~HostMirror();
  HostMirror(const HostMirror&) = delete;
  HostMirror& operator=(const HostMirror&) = delete;

  // The host views, shaped as the mirrored tensors (contiguous views of the pinned buffer).
  const std::vector<torch::Tensor>& views() const { return views_; }
  // The whole pinned buffer, flat.
  const torch::Tensor& flat() const { return flat_; }
  const c10::Device& device() const { return device_; }

  // Copies the mirrored tensors into the views, and waits for the copy.
  void toHost();
  // The same from other device tensors shaped as the mirrored ones (a gradient per parameter);
  // an undefined one leaves zeros in its view.
  void toHost(const std::vector<torch::Tensor>& from);
  // Copies the views into the mirrored tensors without blocking the host (see above).
  void toDevice();
  // Blocks until the last toDevice() has finished reading the buffer: before the host writes it.
  void awaitDevice();

 private:
  std::vector<torch::Tensor> tensors_;  // on the device
  std::vector<torch::Tensor> views_;    // of flat_
  torch::Tensor flat_;                  // pinned host memory
  c10::Device device_;
  Env& env_;
  std::optional<c10::Event> copied_;    // recorded after the last toDevice()'s copies
  bool inFlight_ = false;               // copied_ has not been waited for yet
};

// For the schemes whose exchange works on float32 host memory (the parameter-server client,
// gossip): a float32 mirror of `tensors` when they are on a CUDA device or of another dtype, null
// when they are float32 on the CPU (the exchange then works on the tensors themselves).
std::unique_ptr<HostMirror> float32Mirror(const std::vector<torch::Tensor>& tensors, Env& env);

}  // namespace cohort
