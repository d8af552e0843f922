#include <cohort/autocast.h>
#include <cohort/error.h>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include <limits>
#include <map>
#include <vector>

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

GradScaler::GradScaler(GradScalerOptions options) : options_(options) {
  COHORT_CHECK(options_.initScale > 0 && options_.growthFactor > 1 && options_.backoffFactor > 0 &&
                   options_.backoffFactor < 1 && options_.growthInterval >= 1,
               InvalidArgument,
               "cohort::GradScaler: needs initScale > 0, growthFactor > 1, 0 < backoffFactor < 1 and "
               "growthInterval >= 1");
  scale_ = at::full({}, options_.initScale, at::kFloat);
  growthTracker_ = at::zeros({1}, at::kInt);
}

at::Tensor GradScaler::scale(const at::Tensor& loss) {
  if (scale_.device() != loss.device()) {
    scale_ = scale_.to(loss.device());
    growthTracker_ = growthTracker_.to(loss.device());
  }
  scaled_ = true;
  return loss * scale_.to(loss.scalar_type());
}

bool GradScaler::unscale(const std::vector<at::Tensor>& parameters) {
  COHORT_CHECK(scaled_, Error, "cohort::GradScaler::unscale: no scale() since the last unscale(), so these ",
               "gradients are not scaled or are unscaled already: call scale(loss).backward() before each unscale()");
  at::NoGradGuard noGrad;
  // ATen's check takes dense tensors of one dtype at a time; a sparse gradient's values are its part.
  std::map<c10::ScalarType, std::vector<at::Tensor>> byDtype;
  for (const auto& p : parameters) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    COHORT_CHECK(g.device() == scale_.device(), InvalidArgument, "cohort::GradScaler: a gradient on ", g.device(),
                 ", the scaled loss on ", scale_.device(), ": scale() the loss of this model");
    const at::Tensor dense = g.is_sparse() ? g._values() : g;
    COHORT_CHECK(dense.scalar_type() != at::kHalf, InvalidArgument, "cohort::GradScaler: a float16 gradient ",
                 "(of a float16 parameter): unscaled in float16 it would underflow; keep the parameters float32 ",
                 "(module->to(torch::kFloat32)) and let autocast compute in float16");
    byDtype[dense.scalar_type()].push_back(dense);
  }
  const at::Tensor inverse = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  at::Tensor foundInf = at::zeros({1}, scale_.options());
  for (auto& [dtype, grads] : byDtype) at::_amp_foreach_non_finite_check_and_unscale_(grads, foundInf, inverse);
  at::_amp_update_scale_(scale_, growthTracker_, foundInf, options_.growthFactor, options_.backoffFactor,
                         options_.growthInterval);
  scaled_ = false;
  const bool finite = foundInf.item<float>() == 0.0f;
  if (!finite) ++skipped_;
  return finite;
}

double GradScaler::currentScale() const { return scale_.item<double>(); }

GradScalerState GradScaler::state() const {
  return {scale_.item<double>(), int64_t(growthTracker_.item<int32_t>()), skipped_};
}

void GradScaler::loadState(const GradScalerState& state) {
  // In float32, where it lives: a normal number whose reciprocal is finite.
  COHORT_CHECK(state.scale >= std::numeric_limits<float>::min() && state.scale <= std::numeric_limits<float>::max() &&
                   state.growthTracker >= 0 && state.growthTracker < options_.growthInterval && state.skippedSteps >= 0,
               InvalidArgument, "cohort::GradScaler::loadState: scale ", state.scale, ", growth tracker ",
               state.growthTracker, " (interval ", options_.growthInterval, "), skipped steps ", state.skippedSteps,
               ": not a scaler's state");
  scale_.fill_(state.scale);
  growthTracker_.fill_(state.growthTracker);
  skipped_ = state.skippedSteps;
}

std::optional<c10::ScalarType> parseAutocast(const std::string& text) {
  if (text == "off") return std::nullopt;
  if (text == "bf16" || text == "bfloat16") return c10::kBFloat16;
  if (text == "fp16" || text == "float16") return c10::kHalf;
  throw InvalidArgument("--autocast " + text + ": expected off, bf16 or fp16");
}

std::string autocastName(std::optional<c10::ScalarType> dtype) {
  if (!dtype) return "off";
  if (*dtype == c10::kBFloat16) return "bf16";
  COHORT_CHECK(*dtype == c10::kHalf, InvalidArgument, "autocastName: ", *dtype, " is not one --autocast takes");
  return "fp16";
}

}  // namespace cohort
