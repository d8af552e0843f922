// Mixed precision for the forward pass, as torch.autocast in Python: inside an Autocast's scope,
// the ops that autocast lists for the device's kind (convolutions, linear layers, matmuls) run in
// a 16-bit dtype and those that need float32's range (softmax, the losses, norms) in float32. The
// parameters, their gradients and the optimizer's state stay float32, so every cohort handle
// exchanges what it would without it (with float16's GradScaler, DataParallel averages the scaled
// gradients, which unscale() then divides).
//
//   {
//     cohort::Autocast autocast(torch::kCUDA);            // bfloat16
//     loss = torch::nn::functional::cross_entropy(net->forward(x), y);
//   }
//   loss.backward();                                      // outside: backward runs in the dtypes
//                                                         // the forward chose (torch's advice)
//
// bfloat16 has float32's exponent range, so its gradients need no loss scaling; float16's do
// (GradScaler, below). On CUDA, bfloat16's tensor-core kernels need an Ampere GPU or later
// (compute capability 8.0); this class does not check for one. The state is the calling thread's:
// a replica thread (cohort::Mirrored's step function) opens its own. Scopes nest; the outermost
// one's end drops the cache of cast weights, which an optimizer step would make stale.
#pragma once

#include <cohort/export.h>

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace cohort {

class COHORT_API Autocast {
 public:
  // Throws InvalidArgument when `dtype` is not bfloat16 or float16, or `device` has no autocast.
  explicit Autocast(c10::DeviceType device, c10::ScalarType dtype = c10::kBFloat16);
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  c10::DeviceType device_;
  bool wasEnabled_;
  c10::ScalarType previousDtype_;
};

// Dynamic loss scaling for float16, as torch.amp.GradScaler: float16 gradients underflow (its
// smallest normal number is 6e-5), so the loss is multiplied by a large scale before backward and
// the gradients divided by it after; a step whose gradients then hold an inf or NaN (the scale
// was too large) is skipped and the scale halved, and after `growthInterval` good steps in a row
// it doubles. The scale and the check live on the gradients' device (ATen's
// _amp_foreach_non_finite_check_and_unscale_ and _amp_update_scale_); unscale() reads one flag.
//
//   auto loss = ...;                              // under cohort::Autocast(device, torch::kHalf)
//   scaler.scale(loss).backward();                // DataParallel averages the scaled gradients
//   if (scaler.unscale(net->parameters())) optimizer.step();
//
// A step is one or more scale() (several losses, or gradients accumulated over micro-batches)
// and then one unscale(), which divides and updates the scale once: an unscale() with no scale()
// since the last one throws, where it would divide the same gradients again. The parameters stay
// float32 (autocast computes in float16 for you): a float16 gradient is refused, as Python's is.
// state() and loadState() carry the scale across a checkpoint (the Trainer saves it with the
// optimizer; under average, every rank's), so a resumed run skips and grows at the steps an
// uninterrupted one would.
struct COHORT_API GradScalerOptions {
  double initScale = 65536.0;
  double growthFactor = 2.0;
  double backoffFactor = 0.5;
  int64_t growthInterval = 2000;
};

struct COHORT_API GradScalerState {
  double scale = 65536.0;
  int64_t growthTracker = 0;  // good steps in a row since the scale last changed
  int64_t skippedSteps = 0;
};

class COHORT_API GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});
  // loss times the current scale.
  at::Tensor scale(const at::Tensor& loss);
  // Divides the gradient of every parameter that has one by the scale, in place, and says whether
  // all of them are finite (false: skip the optimizer step); then updates the scale. Every rank
  // of a DataParallel job sees the same averaged gradients, so all take the same decision.
  // Throws Error with no scale() since the last unscale(), InvalidArgument for a float16
  // gradient or one on another device than the scaled loss.
  bool unscale(const std::vector<at::Tensor>& parameters);
  double currentScale() const;
  int64_t skippedSteps() const { return skipped_; }

  GradScalerState state() const;
  // Throws InvalidArgument for a scale that is not a normal float32 (positive, finite, not so
  // small that its reciprocal overflows), a growth tracker outside [0, growthInterval), or a
  // negative count.
  void loadState(const GradScalerState& state);

 private:
  GradScalerOptions options_;
  at::Tensor scale_;          // 0-dim float32 on the gradients' device
  at::Tensor growthTracker_;  // int32 [1]: good steps in a row
  int64_t skipped_ = 0;
  bool scaled_ = false;  // scale() since the last unscale()
};

// --autocast's text: "off" (std::nullopt), "bf16" (bfloat16) or "fp16" (float16, with a
// GradScaler in the schemes that step their own optimizer). Throws InvalidArgument for anything
// else.
COHORT_API std::optional<c10::ScalarType> parseAutocast(const std::string& text);

// The text parseAutocast reads back: "off", "bf16" or "fp16".
COHORT_API std::string autocastName(std::optional<c10::ScalarType> dtype);

}  // namespace cohort
