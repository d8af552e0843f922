// Strom's table on real gradients: trains a model briefly on Fashion-MNIST (plain SGD on the
// uncompressed gradient, one process) and, at every step, encodes that step's gradient with each
// codec, each encoder keeping its own residual across the steps as a worker would. Prints one JSON
// line per codec: mean bytes per update (one message for the whole flattened gradient), entries
// sent, and the encode time. bench/compression.py runs it and prints the table.
//   build/bench/codec_table MODEL STEPS CODEC... (MODEL: cnn, mlp, or mlp14m: 784-2510-2510-2510-10)
#include <cohort/data.h>
#include <cohort/models.h>

#include "compress/codec.h"
#include "train/threads.h"

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>

using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: codec_table MODEL STEPS CODEC...\n");
    return 2;
  }
  const std::string modelName = argv[1];
  const int steps = std::atoi(argv[2]);
  std::vector<cohort::compress::CodecSpec> specs;
  for (int i = 3; i < argc; ++i) specs.push_back(cohort::compress::CodecSpec::parse(argv[i]));
  cohort::setComputeThreads(2);
  torch::manual_seed(1);
  auto data = cohort::loadData("fashion-mnist", 1);
  torch::nn::Sequential model{nullptr};
  if (modelName == "mlp14m") {
    model = torch::nn::Sequential(torch::nn::Flatten(), torch::nn::Linear(784, 2510), torch::nn::ReLU(),
                                  torch::nn::Linear(2510, 2510), torch::nn::ReLU(), torch::nn::Linear(2510, 2510),
                                  torch::nn::ReLU(), torch::nn::Linear(2510, 10));
  } else {
    model = cohort::makeModel(modelName, {});
  }
  int64_t numel = 0;
  for (auto& p : model->parameters()) numel += p.numel();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));

  std::vector<cohort::compress::Encoder> encoders;
  for (const auto& s : specs) encoders.emplace_back(s, size_t(numel));
  std::vector<double> bytes(specs.size(), 0), sent(specs.size(), 0), seconds(specs.size(), 0);
  std::vector<int64_t> idx(64);
  std::vector<float> flat(static_cast<size_t>(numel), 0.0f);
  double lossFirst = 0, lossLast = 0;
  for (int s = 0; s < steps; ++s) {
    std::iota(idx.begin(), idx.end(), int64_t(s * 64) % 59000);
    auto batch = cohort::makeBatch(data.train, idx);
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(batch.inputs), batch.targets);
    loss.backward();
    (s == 0 ? lossFirst : lossLast) = loss.item<double>();
    size_t offset = 0;
    for (auto& p : model->parameters()) {
      auto g = p.grad().contiguous();
      std::memcpy(flat.data() + offset, g.data_ptr<float>(), size_t(g.numel()) * sizeof(float));
      offset += size_t(g.numel());
    }
    for (size_t c = 0; c < specs.size(); ++c) {
      const auto t0 = Clock::now();
      const auto message = encoders[c].encode(flat);
      seconds[c] += std::chrono::duration<double>(Clock::now() - t0).count();
      bytes[c] += double(message.size());
      sent[c] += double(encoders[c].lastSent());
    }
    opt.step();
    std::fprintf(stderr, "\rstep %d/%d loss %.4f", s + 1, steps, loss.item<double>());
  }
  std::fprintf(stderr, "\n");
  for (size_t c = 0; c < specs.size(); ++c) {
    std::printf(
        "{\"model\": \"%s\", \"parameters\": %lld, \"steps\": %d, \"codec\": \"%s\", \"bytes_per_update\": %.1f, "
        "\"entries_sent_per_update\": %.1f, \"encode_ms\": %.2f, \"loss_first\": %.4f, \"loss_last\": %.4f}\n",
        modelName.c_str(), (long long)numel, steps, specs[c].text().c_str(), bytes[c] / steps, sent[c] / steps,
        1e3 * seconds[c] / steps, lossFirst, lossLast);
  }
  return 0;
}
