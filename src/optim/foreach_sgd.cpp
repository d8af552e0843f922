#include <cohort/optim.h>

#include <torch/torch.h>

#include <unordered_set>
#include <vector>

namespace cohort {

namespace {

// Every parameter of `group` that has a gradient: its .data() (what SGD updates: the parameter's
// storage, without bumping its version counter, so a graph saved before step() still runs
// backward as under torch::optim::SGD), its gradient, and its state's key. False when a gradient
// is sparse, or when the group lists a parameter twice (tied weights through model.parameters()):
// SGD updates such a parameter once per listing, one after the other, which one multi-tensor
// operator over the list would not do.
bool gather(torch::optim::OptimizerParamGroup& group, std::vector<torch::Tensor>& params,
            std::vector<torch::Tensor>& grads, std::vector<c10::TensorImpl*>& keys) {
  std::unordered_set<c10::TensorImpl*> seen;
  for (const torch::Tensor& p : group.params()) {
    if (!p.grad().defined()) continue;
    if (p.grad().is_sparse() || !seen.insert(p.unsafeGetTensorImpl()).second) return false;
    params.push_back(p.data());
    grads.push_back(p.grad().data());
    keys.push_back(p.unsafeGetTensorImpl());
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
  std::vector<std::vector<c10::TensorImpl*>> keys(param_groups_.size());
  bool listable = true;
  for (size_t g = 0; g < param_groups_.size() && listable; ++g) {
    listable = gather(param_groups_[g], params[g], grads[g], keys[g]);
  }
  if (closure != nullptr || !listable) return torch::optim::SGD::step(std::move(closure));
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
        c10::TensorImpl* key = keys[g][i];
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
