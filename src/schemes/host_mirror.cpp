#include "schemes/host_mirror.h"

#include <cohort/error.h>

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/torch.h>

#include <cstdio>

namespace cohort {

namespace {

c10::Stream currentStream(const c10::Device& device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

}  // namespace

HostMirror::HostMirror(std::vector<torch::Tensor> tensors, Env& env, std::optional<c10::ScalarType> hostType)
    : tensors_(std::move(tensors)), device_(c10::kCPU), env_(env) {
  COHORT_CHECK(!tensors_.empty(), InvalidArgument, "HostMirror: nothing to mirror");
  device_ = tensors_.front().device();
  const c10::ScalarType type = hostType.value_or(tensors_.front().scalar_type());
  COHORT_CHECK(device_.is_cuda() || type != tensors_.front().scalar_type(), InvalidArgument,
               "HostMirror: the tensors are on ", device_, ", not on a CUDA device, and already ", type);
  int64_t total = 0;
  for (const auto& t : tensors_) {
    COHORT_CHECK(t.device() == device_, InvalidArgument, "HostMirror: a tensor is on ", t.device(), ", another on ",
                 device_, ": the model must be on one device");
    COHORT_CHECK(t.scalar_type() == tensors_.front().scalar_type(), InvalidArgument, "HostMirror: a tensor is ",
                 t.dtype(), ", another ", tensors_.front().dtype(),
                 ": a model on a GPU is mirrored in one dtype; convert it to one (module->to(dtype))");
    total += t.numel();
  }
  flat_ = torch::empty({total}, torch::TensorOptions().dtype(type).pinned_memory(device_.is_cuda()));
  int64_t at = 0;
  for (const auto& t : tensors_) {
    views_.push_back(flat_.narrow(0, at, t.numel()).view(t.sizes()));
    at += t.numel();
  }
}

HostMirror::~HostMirror() {
  try {
    awaitDevice();
  } catch (const std::exception& e) {
    // A failed device (its copy never completes) must not end the process from a destructor.
    env_.log(LogLevel::kWarning, std::string("waiting for a host-to-device copy failed: ") + e.what());
  }
}

void HostMirror::toHost() { toHost(tensors_); }

void HostMirror::toHost(const std::vector<torch::Tensor>& from) {
  COHORT_CHECK_EQ(from.size(), views_.size(), Error, "HostMirror::toHost: the tensors to copy");
  awaitDevice();
  torch::NoGradGuard noGrad;
  for (size_t i = 0; i < views_.size(); ++i) {
    if (!from[i].defined()) {
      views_[i].zero_();
      continue;
    }
    COHORT_CHECK(from[i].device() == device_ && from[i].sizes() == views_[i].sizes(), InvalidArgument,
                 "HostMirror::toHost: tensor ", i, " is ", from[i].sizes(), " on ", from[i].device(), ", its mirror ",
                 views_[i].sizes(), " of ", device_, " (the model moved after the handle was made?)");
    views_[i].copy_(from[i].detach(), /*non_blocking=*/device_.is_cuda());
  }
  if (device_.is_cuda()) currentStream(device_).synchronize();
}

void HostMirror::toDevice() {
  awaitDevice();  // one copy in flight at a time; the views were written since
  torch::NoGradGuard noGrad;
  for (size_t i = 0; i < views_.size(); ++i) {
    // Through copy_ on the parameter itself: its version counter moves, as a CPU model's does.
    tensors_[i].detach().copy_(views_[i], /*non_blocking=*/device_.is_cuda());
  }
  if (!device_.is_cuda()) return;  // a host copy in another dtype: copied, nothing in flight
  const c10::Stream stream = currentStream(device_);
  if (!copied_) copied_.emplace(device_.type());
  copied_->record(stream);
  inFlight_ = true;
}

void HostMirror::awaitDevice() {
  if (!inFlight_) return;
  copied_->synchronize();
  inFlight_ = false;
}

std::unique_ptr<HostMirror> float32Mirror(const std::vector<torch::Tensor>& tensors, Env& env) {
  if (tensors.empty()) return nullptr;
  const bool float32 = tensors.front().scalar_type() == torch::kFloat32;
  if (tensors.front().device().is_cpu() && float32) return nullptr;
  return std::make_unique<HostMirror>(tensors, env, c10::kFloat);
}

}  // namespace cohort
