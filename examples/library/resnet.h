// A small ResNet for 28x28 images (He et al. 2016): a stem, three residual stages with
// BatchNorm and skip connections, global average pooling. An ordinary torch::nn::Module, not a
// Sequential: nothing in it knows about cohort.
#pragma once

#include <cohort/autocast.h>
#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>

struct ResidualBlockImpl : torch::nn::Module {
  ResidualBlockImpl(int64_t in, int64_t out, int64_t stride)
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false)))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(out))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(out, out, 3).padding(1).bias(false)))),
        bn2(register_module("bn2", torch::nn::BatchNorm2d(out))) {
    if (stride != 1 || in != out) {
      shortcut = register_module("shortcut", torch::nn::Sequential(
          torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)), torch::nn::BatchNorm2d(out)));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(bn1(conv1(x)));
    h = bn2(conv2(h));
    return torch::relu(h + (shortcut ? shortcut->forward(x) : x));
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::BatchNorm2d bn1, bn2;
  torch::nn::Sequential shortcut{nullptr};
};
TORCH_MODULE(ResidualBlock);

struct ResNetImpl : torch::nn::Module {
  explicit ResNetImpl(int64_t classes = 10)
      : stem(register_module("stem", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1).bias(false)))),
        bn(register_module("bn", torch::nn::BatchNorm2d(16))),
        stage1(register_module("stage1", ResidualBlock(16, 16, 1))),
        stage2(register_module("stage2", ResidualBlock(16, 32, 2))),
        stage3(register_module("stage3", ResidualBlock(32, 64, 2))),
        fc(register_module("fc", torch::nn::Linear(64, classes))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(bn(stem(x)));
    x = stage3(stage2(stage1(x)));
    x = torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1);
    return fc(x);
  }
  torch::nn::Conv2d stem;
  torch::nn::BatchNorm2d bn;
  ResidualBlock stage1, stage2, stage3;
  torch::nn::Linear fc;
};
TORCH_MODULE(ResNet);

// Accuracy of the model on the test set, in batches of 1000.
inline double testAccuracy(ResNet& net, const cohort::Dataset& test) {
  torch::NoGradGuard noGrad;
  net->eval();
  int64_t correct = 0;
  for (int64_t start = 0; start < test.size(); start += 1000) {
    std::vector<int64_t> idx;
    for (int64_t i = start; i < std::min(start + 1000, test.size()); ++i) idx.push_back(i);
    auto batch = cohort::makeBatch(test, idx);
    const auto device = net->parameters().front().device();
    correct += net->forward(batch.inputs.to(device)).argmax(1).cpu().eq(batch.targets).sum().item<int64_t>();
  }
  net->train();
  return double(correct) / double(test.size());
}

// --name value pairs; a flag that is not given keeps its default. --help prints the flags and
// exits; an unknown flag, or one without a value, is an error naming it.
struct Args {
  int64_t epochs = 1, steps = 0, batch = 64;
  double lr = 0.05;
  std::string codec = "none", scheme = "average";
  // --autocast bf16|fp16: the forward pass under cohort::Autocast in that dtype (fp16 with a
  // cohort::GradScaler); off: float32.
  std::optional<c10::ScalarType> autocast;
  int64_t period = 4;
  Args(int argc, char** argv) {
    for (int i = 1; i < argc; i += 2) {
      const std::string k = argv[i];
      if (k == "--help" || k == "-h") {
        std::printf(
            "usage: %s [--flag value]...\n"
            "  --epochs N      passes over the training set (default 1)\n"
            "  --steps N       stop after N steps, 0: no limit (default 0)\n"
            "  --batch N       examples per step and worker (default 64)\n"
            "  --lr X          learning rate (default 0.05)\n"
            "  --codec C       resnet_ddp: DataParallel's codec: none, fp16, bf16, topk:R, threshold:T, onebit\n"
            "                  (default none)\n"
            "  --autocast T    resnet_ddp: forward under cohort::Autocast, bf16 or fp16 (default off)\n"
            "  --scheme S      resnet_schemes: average or ps (default average)\n"
            "  --period K      resnet_schemes: average every K steps (default 4)\n",
            argc > 0 ? argv[0] : "resnet");
        std::exit(0);
      }
      const bool known = k == "--epochs" || k == "--steps" || k == "--batch" || k == "--lr" || k == "--codec" ||
                         k == "--scheme" || k == "--period" || k == "--autocast";
      if (!known) throw std::invalid_argument("unknown flag " + k + " (--help lists the flags)");
      if (i + 1 >= argc) throw std::invalid_argument("flag " + k + " needs a value (--help lists the flags)");
      const std::string v = argv[i + 1];
      try {
        if (k == "--epochs")
          epochs = std::stoll(v);
        else if (k == "--steps")
          steps = std::stoll(v);
        else if (k == "--batch")
          batch = std::stoll(v);
        else if (k == "--lr")
          lr = std::stod(v);
        else if (k == "--codec")
          codec = v;
        else if (k == "--scheme")
          scheme = v;
        else if (k == "--period")
          period = std::stoll(v);
        else
          autocast = cohort::parseAutocast(v);
      } catch (const std::logic_error&) {  // std::stoll's and std::stod's invalid_argument, out_of_range
        throw std::invalid_argument("flag " + k + ": '" + v + "' is not a number");
      }
    }
  }
};

// The job's secret for the parameter-server shards (cohort launch sets it).
inline std::string authToken() {
  const char* token = std::getenv("COHORT_AUTH_TOKEN");
  return token != nullptr ? token : "";
}
