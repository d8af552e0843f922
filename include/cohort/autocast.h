// Mixed precision for the forward pass, as torch.autocast in Python: inside an Autocast's scope,
// the ops that autocast lists for the device's kind (convolutions, linear layers, matmuls) run in
// a 16-bit dtype and those that need float32's range (softmax, the losses, norms) in float32. The
// parameters, their gradients and the optimizer's state stay float32, so every cohort handle
// exchanges exactly what it would without it.
//
//   {
//     cohort::Autocast autocast(torch::kCUDA);            // bfloat16
//     loss = torch::nn::functional::cross_entropy(net->forward(x), y);
//   }
//   loss.backward();                                      // outside: backward runs in the dtypes
//                                                         // the forward chose (torch's advice)
//
// bfloat16 has float32's exponent range, so its gradients need no loss scaling; float16's do (a
// scaler the caller brings: this class only casts). On CUDA, bfloat16's tensor-core kernels need
// an Ampere GPU or later (compute capability 8.0); this class does not check for one. The state is the calling thread's: a replica
// thread (cohort::Mirrored's step function) opens its own. Scopes nest; the outermost one's end
// drops the cache of cast weights, which an optimizer step would make stale.
#pragma once

#include <cohort/export.h>

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <optional>
#include <string>

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

// --autocast's text: "off" (std::nullopt) or "bf16" (bfloat16). "fp16" is refused, naming why:
// float16 gradients underflow without the loss scaling that cohort's training loop does not do.
// Throws InvalidArgument for anything else.
COHORT_API std::optional<c10::ScalarType> parseAutocast(const std::string& text);

// The text parseAutocast reads back: "off" or "bf16".
COHORT_API std::string autocastName(std::optional<c10::ScalarType> dtype);

}  // namespace cohort
