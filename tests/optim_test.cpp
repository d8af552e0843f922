// cohort::ForeachSGD against torch::optim::SGD, on the CPU: the same parameters, bit for bit, and
// the same state, in both directions.
#include <cohort/optim.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sstream>

namespace cohort::optim_test {
namespace {

// Two parameter groups (the second with its own lr), a parameter that never gets a gradient.
struct Params {
  std::vector<torch::Tensor> first, second;
  torch::Tensor unused;
};

Params makeParams() {
  torch::manual_seed(3);
  Params p;
  for (auto shape : {std::vector<int64_t>{5, 4}, std::vector<int64_t>{4}}) {
    p.first.push_back(torch::randn(shape).requires_grad_());
  }
  p.second.push_back(torch::randn({3, 2, 2}).requires_grad_());
  p.unused = torch::randn({6}).requires_grad_();
  p.first.push_back(p.unused);
  return p;
}

std::vector<torch::optim::OptimizerParamGroup> groupsOf(const Params& p, const torch::optim::SGDOptions& o) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(p.first);
  auto second = std::make_unique<torch::optim::SGDOptions>(o);
  second->lr(o.lr() / 2);
  groups.emplace_back(p.second, std::move(second));
  return groups;
}

// Gradients of step s: a deterministic function of the parameters and s.
void backward(const Params& p, int s) {
  torch::Tensor loss = torch::zeros({});
  for (size_t i = 0; i < p.first.size(); ++i) {
    if (p.first[i].is_same(p.unused)) continue;
    loss = loss + (p.first[i] * p.first[i]).sum() * (0.3 + 0.1 * s) + p.first[i].sin().sum();
  }
  for (const auto& t : p.second) loss = loss + (t.cos() * float(s + 1)).sum();
  loss.backward();
}

std::vector<torch::Tensor> all(const Params& p) {
  std::vector<torch::Tensor> out = p.first;
  out.insert(out.end(), p.second.begin(), p.second.end());
  return out;
}

void train(torch::optim::Optimizer& opt, const Params& p, int from, int to) {
  for (int s = from; s < to; ++s) {
    opt.zero_grad();
    backward(p, s);
    opt.step();
  }
}

void expectSame(const Params& a, const Params& b, const std::string& what) {
  const auto x = all(a);
  const auto y = all(b);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_TRUE(torch::equal(x[i], y[i])) << what << ": parameter " << i;
}

class ForeachSGDEquals : public ::testing::TestWithParam<int> {};

torch::optim::SGDOptions optionsFor(int variant) {
  torch::optim::SGDOptions o(0.05);
  switch (variant) {
    case 0: break;                   // plain SGD
    case 1: o.momentum(0.9); break;  // the Trainer's momentum
    case 2: o.momentum(0.9).nesterov(true); break;
    case 3: o.momentum(0.8).dampening(0.25).weight_decay(1e-2); break;
    case 4: o.weight_decay(1e-3); break;
  }
  return o;
}

TEST_P(ForeachSGDEquals, TorchOptimSGDBitForBit) {
  const auto o = optionsFor(GetParam());
  Params a = makeParams();
  Params b = makeParams();
  torch::optim::SGD reference(groupsOf(a, o), o);
  ForeachSGD foreach (groupsOf(b, o), o);
  train(reference, a, 0, 6);
  train(foreach, b, 0, 6);
  expectSame(a, b, "after 6 steps");
  EXPECT_FALSE(b.unused.grad().defined());
}

// The state is torch::optim::SGD's: a checkpoint of either goes on in the other.
TEST_P(ForeachSGDEquals, ItsStateLoadsIntoTorchOptimSGDAndBack) {
  const auto o = optionsFor(GetParam());
  Params a = makeParams();
  Params b = makeParams();
  ForeachSGD first(groupsOf(a, o), o);
  torch::optim::SGD second(groupsOf(b, o), o);
  train(first, a, 0, 3);
  train(second, b, 0, 3);
  // Swap: each one's state goes to an optimizer of the other class over the same parameters.
  auto roundTrip = [&](torch::optim::Optimizer& from, torch::optim::Optimizer& to) {
    std::stringstream bytes;
    torch::serialize::OutputArchive out;
    from.save(out);
    out.save_to(bytes);
    torch::serialize::InputArchive in;
    in.load_from(bytes);
    to.load(in);
  };
  torch::optim::SGD aAsTorch(groupsOf(a, o), o);
  ForeachSGD bAsForeach(groupsOf(b, o), o);
  roundTrip(first, aAsTorch);
  roundTrip(second, bAsForeach);
  train(aAsTorch, a, 3, 6);
  train(bAsForeach, b, 3, 6);
  expectSame(a, b, "resumed across the classes");
}

INSTANTIATE_TEST_SUITE_P(Options, ForeachSGDEquals, ::testing::Range(0, 5));

// A parameter listed twice (tied weights, as model.parameters() lists a shared module's under both
// names) is updated as torch::optim::SGD updates it: once per listing. And step() leaves the
// parameters' version counters alone, as SGD's update through .data() does, so a graph saved
// before step() still runs backward after it.
TEST(ForeachSGD, TiedParametersAndVersionCountersAreSGDs) {
  torch::manual_seed(4);
  auto a = torch::randn({4, 3}).requires_grad_();
  auto b = a.detach().clone().requires_grad_();
  const auto o = torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01);
  torch::optim::SGD reference(std::vector<torch::Tensor>{a, a}, o);
  ForeachSGD foreach (std::vector<torch::Tensor>{b, b}, o);
  for (int s = 0; s < 3; ++s) {
    reference.zero_grad();
    foreach
      .zero_grad();
    (a * a).sum().backward();
    (b * b).sum().backward();
    reference.step();
    foreach
      .step();
  }
  EXPECT_TRUE(torch::equal(a, b));

  auto c = torch::randn({3}).requires_grad_();
  ForeachSGD momentum(std::vector<torch::Tensor>{c}, torch::optim::SGDOptions(0.1).momentum(0.9));
  (c * 2).sum().backward();
  auto saved = (c * c).sum();  // saves c for its backward
  const auto version = c._version();
  momentum.step();
  EXPECT_EQ(c._version(), version);
  EXPECT_NO_THROW(saved.backward());
}

// A sparse gradient (an embedding table made sparse) takes torch::optim::SGD's own step.
TEST(ForeachSGD, ASparseGradientTakesTorchOptimSGDsStep) {
  torch::manual_seed(2);
  torch::nn::Embedding a(torch::nn::EmbeddingOptions(10, 3).sparse(true));
  torch::nn::Embedding b(torch::nn::EmbeddingOptions(10, 3).sparse(true));
  {
    torch::NoGradGuard noGrad;
    b->weight.copy_(a->weight);
  }
  torch::optim::SGD reference(a->parameters(), torch::optim::SGDOptions(0.1));
  ForeachSGD foreach (b->parameters(), torch::optim::SGDOptions(0.1));
  const auto ids = torch::tensor({1, 4, 4, 7}, torch::kInt64);
  for (int s = 0; s < 3; ++s) {
    reference.zero_grad();
    foreach
      .zero_grad();
    a->forward(ids).pow(2).sum().backward();
    b->forward(ids).pow(2).sum().backward();
    ASSERT_TRUE(b->weight.grad().is_sparse());
    reference.step();
    foreach
      .step();
  }
  EXPECT_TRUE(torch::equal(a->weight, b->weight));
}

}  // namespace
}  // namespace cohort::optim_test
