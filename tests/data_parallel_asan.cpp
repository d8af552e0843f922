// Under AddressSanitizer (the clang build of fuzz/): a DataParallel handle destroyed mid-run
// leaves a model that trains on alone without touching freed memory. Two ranks as threads over a
// TCPStore on 127.0.0.1; each trains 3 steps under the handle, destroys it, and trains 3 more
// (zero_grad on the .grad tensors the handle made, backward, step). ASan aborts the process on a
// use after free; the checks below fail it on wrong results. Exit status 0: passed.
#include <cohort/communicator.h>
#include <cohort/data_parallel.h>
#include <cohort/error.h>

#include <torch/torch.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <thread>
#include <vector>

namespace {

int freePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    throw std::runtime_error("no free port");
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

struct NetImpl : torch::nn::Module {
  NetImpl() : a(register_module("a", torch::nn::Linear(4, 8))), b(register_module("b", torch::nn::Linear(8, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::relu(a(x)) + torch::relu(a(x))); }
  torch::nn::Linear a, b;
};
TORCH_MODULE(Net);

void rank(int r, int port, std::vector<torch::Tensor>& grads) {
  cohort::ClusterSpec spec;
  spec.rank = r;
  spec.worldSize = 2;
  spec.master = {"127.0.0.1", port};
  auto comm = cohort::Communicator::connect(spec, {.timeout = std::chrono::seconds(30)});
  Net net;
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto x = torch::full({4, 4}, 0.5f + float(r));
  auto y = torch::zeros({4}, torch::kInt64);
  {
    auto dp = std::make_unique<cohort::DataParallel>(cohort::Job::fromCommunicator(comm), *net,
                                                     cohort::DataParallelOptions{.codec = "topk:0.5"});
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      torch::nn::functional::cross_entropy(net->forward(x), y).backward();
      opt.step();
    }
    dp.reset();  // mid-run: its hooks, buckets and encoders go
  }
  for (int s = 0; s < 3; ++s) {
    opt.zero_grad();  // on the .grad tensors over the handle's buckets
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    opt.step();
  }
  for (auto& p : net->parameters()) grads.push_back(p.grad().clone());
}

}  // namespace

int main() {
  try {
    const int port = freePort();
    std::vector<std::vector<torch::Tensor>> grads(2);
    std::vector<std::exception_ptr> errors(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        try {
          rank(r, port, grads[size_t(r)]);
        } catch (...) {
          errors[size_t(r)] = std::current_exception();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
    // Alone, each rank's last gradient is its own (different data): the handle no longer averages.
    bool differ = false;
    for (size_t i = 0; i < grads[0].size(); ++i) differ = differ || !torch::equal(grads[0][i], grads[1][i]);
    if (!differ) {
      std::fprintf(stderr, "FAIL: after the handle was destroyed the ranks' gradients are still equal\n");
      return 1;
    }
    std::printf("data_parallel_asan: passed\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAIL: %s\n", e.what());
    return 1;
  }
}
