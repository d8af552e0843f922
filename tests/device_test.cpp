// Device names and the checks that run without a GPU (tests/gpu_test.cpp has those that need one).
#include <cohort/communicator.h>
#include <cohort/data_parallel.h>
#include <cohort/device.h>
#include <cohort/error.h>
#include <cohort/job.h>
#include <cohort/replicas.h>
#include <cohort/tensor_parallel.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <future>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"

namespace cohort::device_test {
namespace {

std::string errorOf(const std::string& name) {
  try {
    resolveDevice(name);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(Device, CpuIsTheCpuAndAutoIsTheGpuOnlyWhereThereIsOne) {
  EXPECT_EQ(resolveDevice("cpu"), c10::Device(c10::kCPU));
  const c10::Device automatic = resolveDevice("auto", /*localRank=*/3);
  if (cudaDeviceCount() == 0) {
    EXPECT_EQ(automatic, c10::Device(c10::kCPU));
    EXPECT_EQ(resolveDevice(""), c10::Device(c10::kCPU));
  } else {
    EXPECT_EQ(automatic, c10::Device(c10::kCUDA, c10::DeviceIndex(3 % cudaDeviceCount())));
  }
}

TEST(Device, NamesThatAreNoDeviceAreRefusedWithTheForms) {
  for (const std::string name :
       {"gpu", "cuda:", "cuda:x", "cuda:-1", "cuda0", "cudaX1", "cuda_12", "CPU", "cuda:123456"}) {
    EXPECT_NE(errorOf(name).find("expected cpu, cuda, cuda:N (N a GPU index) or auto"), std::string::npos)
        << name << ": " << errorOf(name);
  }
}

TEST(Device, AGpuThisProcessDoesNotSeeIsNamedWithWhatItSees) {
  const std::string message = errorOf("cuda:99");
  if (cudaDeviceCount() == 0) {
    EXPECT_NE(message.find("device \"cuda:99\": this process sees no CUDA device"), std::string::npos) << message;
    EXPECT_NE(message.find("use --device cpu"), std::string::npos) << message;
  } else {
    EXPECT_NE(message.find("this process sees " + std::to_string(cudaDeviceCount()) + " CUDA device"),
              std::string::npos)
        << message;
  }
}

TEST(Device, CudaWhereThereIsNoGpuIsOneLineNamingTheFix) {
  if (cudaDeviceCount() > 0) {
    EXPECT_EQ(resolveDevice("cuda", 0), c10::Device(c10::kCUDA, 0));
    return;
  }
  const std::string message = errorOf("cuda");
  EXPECT_NE(message.find("this process sees no CUDA device"), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
}

TEST(Device, AJobResolvesItsDeviceWhenMadeAndRefusesABadOne) {
  EXPECT_EQ(Job::fromSpec(ClusterSpec{}, {.device = "cpu"}).device(), c10::Device(c10::kCPU));
  EXPECT_THROW(Job::fromSpec(ClusterSpec{}, {.device = "tpu"}), InvalidArgument);
}

// The process's GPU is cuda:(LOCAL_RANK mod the GPU count) however its Job is made: from a spec,
// or around a communicator whose rank in its group is not the process's local rank (two ranks as
// threads with local ranks 1 and 0; each alone in a group split off). Job::fromCommunicator chose
// by the group's rank: both groups' Jobs took cuda:0, and rank 1's whole-job Job cuda:1 where its
// local rank is 0. Without a GPU every device is the CPU; the local rank each Job reports is the one
// its device was resolved for.
TEST(Device, AJobAroundACommunicatorChoosesItsGpuByTheLocalRank) {
  const auto fromSpec = Job::fromSpec(ClusterSpec{.rank = 0, .worldSize = 1, .localRank = 3});
  EXPECT_EQ(fromSpec.cluster().localRank, 3);
  EXPECT_EQ(fromSpec.device(), resolveDevice("auto", 3));
  std::promise<int> listening;
  std::shared_future<int> port = listening.get_future().share();
  std::vector<std::thread> ranks;
  std::vector<std::string> failures(2);
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        ClusterSpec spec{.rank = r, .worldSize = 2, .localRank = 1 - r, .master = {"127.0.0.1", 0}};
        CommOptions options{.timeout = std::chrono::seconds(30)};
        if (r == 0) {
          options.onListening = [&](int p) { listening.set_value(p); };
        } else if (port.wait_for(std::chrono::seconds(30)) == std::future_status::ready) {
          spec.master.port = port.get();
        }
        const std::shared_ptr<Communicator> comm = Communicator::connect(spec, options);
        const std::shared_ptr<Communicator> alone = comm->split({r}, "alone-" + std::to_string(r));
        for (const Job& job : {Job::fromCommunicator(comm), Job::fromCommunicator(alone)}) {
          if (job.cluster().localRank != 1 - r || job.device() != resolveDevice("auto", 1 - r)) {
            failures[size_t(r)] += "rank " + std::to_string(job.rank()) + " of " + std::to_string(job.worldSize()) +
                                   ": local rank " + std::to_string(job.cluster().localRank) + ", device " +
                                   job.device().str() + "; ";
          }
        }
        comm->barrier();
      } catch (const std::exception& e) {
        failures[size_t(r)] += e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(failures[0], "");
  EXPECT_EQ(failures[1], "");
}

// The meta device stands in for a second device on a machine without one.
struct OnTwoDevices : torch::nn::Module {
  OnTwoDevices() {
    register_parameter("host", torch::zeros({3}));
    register_parameter("elsewhere", torch::zeros({3}, torch::TensorOptions().device(torch::kMeta)));
  }
};

TEST(Device, DataParallelRefusesAModelOnTwoDevices) {
  OnTwoDevices net;
  try {
    DataParallel dp(Job::single(), net);
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("needs the whole model on one device"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("meta"), std::string::npos) << e.what();
  }
}

// A layer whose one parameter is on the meta device (Module::to cannot move a parameter there).
struct MetaLayerImpl : torch::nn::Module {
  MetaLayerImpl() { register_parameter("weight", torch::zeros({3}, torch::TensorOptions().device(torch::kMeta))); }
  torch::Tensor forward(const torch::Tensor& x) { return x; }
};
TORCH_MODULE(MetaLayer);

// The replica handles take a model on one device (the CPU or a GPU), Hogwild the CPU only: each
// refusal is one line naming the fix.
std::string replicaError(bool hogwild, torch::nn::Module& net) {
  auto module = std::shared_ptr<torch::nn::Module>(&net, [](torch::nn::Module*) {});
  torch::optim::SGD opt(net.parameters(), 0.1);
  try {
    if (hogwild) {
      Hogwild h(module, opt, {.replicas = 2});
    } else {
      Mirrored m(module, opt, {.replicas = 2});
    }
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(Device, ReplicasRefuseAModelOnTwoDevicesAndHogwildOneOffTheCpu) {
  OnTwoDevices net;
  const std::string two = replicaError(false, net);
  EXPECT_NE(two.find("parameter elsewhere is on meta and host on cpu; move the whole model to one device"),
            std::string::npos) << two;
  EXPECT_EQ(two.find('\n'), std::string::npos) << two;
  MetaLayer away;
  const std::string hogwild = replicaError(true, *away);
  EXPECT_NE(hogwild.find("a CPU scheme: call module->to(torch::kCPU) (--device cpu)"), std::string::npos) << hogwild;
  EXPECT_EQ(hogwild.find('\n'), std::string::npos) << hogwild;
}

TEST(Device, TensorParallelRefusesAModelOnTwoDevices) {
  torch::nn::Sequential net(torch::nn::Linear(4, 6), MetaLayer());
  try {
    TensorParallel tp(Job::single(), net, torch::zeros({2, 4}));
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("move the whole model to one device"), std::string::npos) << e.what();
  }
}

TEST(DeviceCli, AnUnknownOrAbsentDeviceEndsTheRunWithOneLine) {
  const std::string base = test::cohortBinary() + " train --model mlp --data synthetic:200 --steps 2 --progress off";
  auto bad = test::runCommand(base + " --device tpu");
  EXPECT_EQ(bad.exitCode, 2) << bad.output;
  EXPECT_NE(bad.output.find("device \"tpu\": expected cpu, cuda, cuda:N"), std::string::npos) << bad.output;
  auto absent = test::runCommand(base + " --device cuda:99");
  EXPECT_EQ(absent.exitCode, 2) << absent.output;
  EXPECT_NE(absent.output.find("device \"cuda:99\": this process sees"), std::string::npos) << absent.output;
  auto cpu = test::runCommand(base + " --device cpu");
  EXPECT_EQ(cpu.exitCode, 0) << cpu.output;
}

}  // namespace
}  // namespace cohort::device_test
