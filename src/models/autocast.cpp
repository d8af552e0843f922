#include <cohort/autocast.h>
#include <cohort/error.h>

#include <ATen/autocast_mode.h>

namespace cohort {

Autocast::Autocast(c10::DeviceType device, c10::ScalarType dtype) : device_(device) {
  COHORT_CHECK(dtype == c10::kBFloat16 || dtype == c10::kHalf, InvalidArgument, "cohort::Autocast: ", dtype,
               " is not a dtype autocast computes in: use bfloat16 (or float16, with a loss scaler)");
  COHORT_CHECK(at::autocast::is_autocast_available(device), InvalidArgument, "cohort::Autocast: this LibTorch has no ",
               "autocast for ", c10::DeviceTypeName(device), " tensors");
  wasEnabled_ = at::autocast::is_autocast_enabled(device);
  previousDtype_ = at::autocast::get_autocast_dtype(device);
  at::autocast::set_autocast_dtype(device, dtype);
  at::autocast::set_autocast_enabled(device, true);
  at::autocast::increment_nesting();
}

Autocast::~Autocast() {
  // As torch.autocast's __exit__: the outermost scope drops the cast weights.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_, wasEnabled_);
  at::autocast::set_autocast_dtype(device_, previousDtype_);
}

std::optional<c10::ScalarType> parseAutocast(const std::string& text) {
  if (text == "off") return std::nullopt;
  if (text == "bf16" || text == "bfloat16") return c10::kBFloat16;
  COHORT_CHECK(text != "fp16" && text != "float16", InvalidArgument, "--autocast ", text,
               ": float16 gradients underflow without loss scaling, which cohort's training loop does not do; "
               "use --autocast bf16 (float32's range, no scaling needed)");
  throw InvalidArgument("--autocast " + text + ": expected off or bf16");
}

std::string autocastName(std::optional<c10::ScalarType> dtype) {
  if (!dtype) return "off";
  COHORT_CHECK(*dtype == c10::kBFloat16, InvalidArgument, "autocastName: ", *dtype, " is not one --autocast takes");
  return "bf16";
}

}  // namespace cohort
