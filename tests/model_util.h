// Helpers for tests that compare trained models saved by `cohort train --save-model`.
#pragma once

#include <cohort/models.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

namespace cohort::test {

inline std::vector<torch::Tensor> loadParameters(const std::string& path, const std::string& model = "mlp") {
  auto net = makeModel(model, {});
  torch::load(net, path);
  std::vector<torch::Tensor> out;
  // On the CPU, whichever device wrote them (a GPU run's file loads its tensors onto that GPU), so
  // that runs on different devices compare.
  for (auto& p : net->parameters()) out.push_back(p.detach().to(torch::kCPU).clone());
  return out;
}

// The largest element-wise difference between two parameter lists of the same shapes.
inline double maxDifference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  return worst;
}

// The fraction of elements whose difference exceeds `tolerance`.
inline double fractionDifferent(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                                double tolerance) {
  EXPECT_EQ(a.size(), b.size());
  double over = 0, all = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    over += (a[i] - b[i]).abs().gt(tolerance).sum().item<double>();
    all += double(a[i].numel());
  }
  return all > 0 ? over / all : 0.0;
}

}  // namespace cohort::test
