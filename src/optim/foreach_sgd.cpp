#include <cohort/optim.h>

#include <torch/torch.h>

#include <vector>

namespace cohort {

namespace {

// Every parameter of `group` that has a gradient, and its gradient; false when one is sparse.
bool gather(torch::optim::OptimizerParamGroup& group, std::vector<torch::Tensor>& params,
            std::vector<torch::Tensor>& grads) {
  for (const torch::Tensor& p : group.params()) {
    if (!p.grad().defined()) continue;
    if (p.grad().is_sparse()) return false;
    params.push_back(p);
    grads.push_back(p.grad());
  }
  return true;
}

}  // namespace

// torch::optim::SGD::step's arithmetic, operator for operator, over lists:
//   d_p = grad (+ weight_decay * p)
//   buf = clone(d_p) the first time, else buf * momentum + (1 - dampening) * d_p
//   d_p = nesterov ? d_p + momentum * buf : buf
//   p  += -lr * d_p
torch::Tensor ForeachSGD::step(LossClosure closure) {
  std::vector<std::vector<torch::Tensor>> params(param_groups_.size());
  std::vector<std::vector<torch::Tensor>> grads(param_groups_.size());
  bool dense = true;
  for (size_t g = 0; g < param_groups_.size() && dense; ++g) dense = gather(param_groups_[g], params[g], grads[g]);
  if (closure != nullptr || !dense) return torch::optim::SGD::step(std::move(closure));
  torch::NoGradGuard noGrad;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    if (params[g].empty()) continue;
    const auto& o = static_cast<const torch::optim::SGDOptions&>(param_groups_[g].options());
    std::vector<torch::Tensor> steps =
        o.weight_decay() != 0 ? at::_foreach_add(grads[g], params[g], o.weight_decay()) : grads[g];
    if (o.momentum() != 0) {
      std::vector<torch::Tensor> buffers;
      std::vector<torch::Tensor> older;  // the buffers that existed before this step, and their steps
      std::vector<torch::Tensor> olderSteps;
      for (size_t i = 0; i < params[g].size(); ++i) {
        auto* key = params[g][i].unsafeGetTensorImpl();
        auto found = state_.find(key);
        if (found == state_.end()) {
          auto state = std::make_unique<torch::optim::SGDParamState>();
          state->momentum_buffer(torch::clone(steps[i]).detach());
          buffers.push_back(state->momentum_buffer());
          state_[key] = std::move(state);
        } else {
          buffers.push_back(static_cast<torch::optim::SGDParamState&>(*found->second).momentum_buffer());
          older.push_back(buffers.back());
          olderSteps.push_back(steps[i]);
        }
      }
      if (!older.empty()) {
        at::_foreach_mul_(older, o.momentum());
        at::_foreach_add_(older, olderSteps, 1 - o.dampening());
      }
      steps = o.nesterov() ? at::_foreach_add(steps, buffers, o.momentum()) : buffers;
    }
    at::_foreach_add_(params[g], steps, -1 * o.lr());
  }
  return {};
}

}  // namespace cohort
