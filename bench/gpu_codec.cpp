// fp16 compression of a gradient bucket on the GPU against the device's own copy bandwidth, in the
// same run (issue 28's figure: the encode at least half the copy's rate).
//
//   gpu_codec [--mb 25] [--reps 20] [--device cuda:0]
//   gpu_codec --device cpu [--mb 4]    # the sparse comparison alone, on CPU tensors: a check of this
//                                      # program where there is no GPU
//
// The encode is what DataParallel does to a bucket on a device with codec fp16 (CompressedSum's
// staging): the float32 bucket cast into a preallocated float16 tensor of the same length
// (copy_, one kernel). The copy is a device-to-device copy of the same float32 bytes into another
// float32 tensor (cudaMemcpyAsync). Each sample times 10 back-to-back calls between two CUDA events
// on the current stream (one call of 25 MB takes some 10 us on an H100: a sample per call would
// time the launch); the figure is the median of --reps samples after 5 warm-up samples. GB/s count
// the float32 bucket's bytes per second for both (the encode reads them and writes half as many;
// the copy reads and writes them all): how fast a bucket gets through each.
//
// Then topk:0.01, threshold:0.002 and onebit on the same bucket (threshold sends 5 % of it at
// first, more as the residual grows: the same bucket is added every sample), as CompressedSum runs
// them on a device either way (compressed.h): on the host (the bucket copied to pinned memory,
// then the CPU encoder) against on the device (DeviceSelect's pass, then the message from what
// crossed: the selected entries, or onebit's scales, sign bitmap and non-finite entries),
// alternating, each timed on the wall clock from the call to the message (both wait for
// the device); medians of --reps after the warm-up. The two write the same messages (checked on
// every sample: "identical").
//
// One JSON line per measurement, then one with the ratio. Without a CUDA GPU: one line on stderr,
// exit status 2.
#include "compress/codec.h"
#include "schemes/device_select.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace {

constexpr int kWarmup = 5;
constexpr int kCallsPerSample = 10;

struct Options {
  double mb = 25.0;
  int reps = 20;
  std::string device = "cuda:0";
};

Options parseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr,
                   "gpu_codec: %s needs a value (usage: gpu_codec [--mb MB] [--reps N] [--device cuda:N|cpu])\n",
                   arg.c_str());
      std::exit(2);
    }
    const char* value = argv[++i];
    if (arg == "--mb") {
      o.mb = std::strtod(value, nullptr);
    } else if (arg == "--reps") {
      o.reps = std::max(1, std::atoi(value));
    } else if (arg == "--device") {
      o.device = value;
    } else {
      std::fprintf(stderr,
                   "gpu_codec: unknown option %s (usage: gpu_codec [--mb MB] [--reps N] [--device cuda:N|cpu])\n",
                   arg.c_str());
      std::exit(2);
    }
  }
  if (!(o.mb > 0)) {
    std::fprintf(stderr, "gpu_codec: --mb must be positive\n");
    std::exit(2);
  }
  return o;
}

// The median GPU time of one call of `op`, in seconds, from CUDA events on the current stream.
double medianSeconds(const c10::Device& device, int reps, const std::function<void()>& op) {
  const c10::Stream stream = c10::impl::VirtualGuardImpl(device.type()).getStream(device);
  std::vector<double> samples;
  for (int r = 0; r < kWarmup + reps; ++r) {
    // BACKEND_DEFAULT: events that keep time (PyTorch's default ones do not).
    c10::Event start(device.type(), c10::EventFlag::BACKEND_DEFAULT);
    c10::Event end(device.type(), c10::EventFlag::BACKEND_DEFAULT);
    start.record(stream);
    for (int k = 0; k < kCallsPerSample; ++k) op();
    end.record(stream);
    end.synchronize();
    if (r >= kWarmup) samples.push_back(start.elapsedTime(end) / 1000.0 / kCallsPerSample);
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

double median(std::vector<double> samples) {
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

double secondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// The sparse codecs compared, on a GPU and in the CPU check alike.
constexpr const char* kSparseCodecs[] = {"topk:0.01", "threshold:0.002", "onebit"};

// A sparse codec's encode of `bucket` on the host and on the device (above); one JSON line.
void compareSparse(const Options& o, const c10::Device& device, const torch::Tensor& bucket, const std::string& codec) {
  using namespace cohort;
  const auto spec = compress::CodecSpec::parse(codec);
  const int64_t n = bucket.numel();
  compress::Encoder onHost(spec, size_t(n));
  compress::Encoder fromDevice(spec, size_t(n));
  DeviceSelect onDevice(spec, n, device);
  torch::Tensor pinned =
      torch::empty({n}, torch::TensorOptions().dtype(torch::kFloat32).pinned_memory(device.is_cuda()));
  std::vector<uint8_t> hostMessage, deviceMessage;
  std::vector<double> hostSeconds, deviceSeconds;
  bool identical = true;
  for (int r = 0; r < kWarmup + o.reps; ++r) {
    auto t = std::chrono::steady_clock::now();
    pinned.copy_(bucket, /*non_blocking=*/true);
    if (device.is_cuda()) c10::impl::VirtualGuardImpl(device.type()).getStream(device).synchronize();
    onHost.encode({pinned.data_ptr<float>(), size_t(n)}, hostMessage);
    const double host = secondsSince(t);
    t = std::chrono::steady_clock::now();
    onDevice.encode(bucket, fromDevice, deviceMessage);
    const double onGpu = secondsSince(t);
    identical = identical && hostMessage == deviceMessage;
    if (r >= kWarmup) {
      hostSeconds.push_back(host);
      deviceSeconds.push_back(onGpu);
    }
  }
  const double h = median(hostSeconds), d = median(deviceSeconds);
  std::printf(
      "{\"bench\": \"gpu_codec\", \"what\": \"sparse_encode\", \"codec\": \"%s\", \"device\": \"%s\", "
      "\"mb\": %g, \"host_median_s\": %.6f, \"device_median_s\": %.6f, \"host_over_device\": %.3f, "
      "\"sent\": %zu, \"message_bytes\": %zu, \"identical\": %s, \"reps\": %d}\n",
      codec.c_str(), o.device.c_str(), o.mb, h, d, h / d, onHost.lastSent(), hostMessage.size(),
      identical ? "true" : "false", o.reps);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parseArgs(argc, argv);
  if (o.device == "cpu") {  // the sparse comparison alone, as a check of this program where there is no GPU
    const torch::Tensor bucket = torch::randn({int64_t(o.mb * 1024 * 1024) / int64_t(sizeof(float))}) * 1e-3;
    for (const char* codec : kSparseCodecs) compareSparse(o, c10::Device(c10::kCPU), bucket, codec);
    return 0;
  }
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "gpu_codec: needs a CUDA GPU, and this process sees none (torch::cuda::device_count() = %d)\n",
                 int(torch::cuda::device_count()));
    return 2;
  }
  try {
    const c10::Device device(o.device);
    const int64_t n = int64_t(o.mb * 1024 * 1024) / int64_t(sizeof(float));
    const double bytes = double(n) * sizeof(float);
    const auto onDevice = torch::TensorOptions().device(device);
    torch::Tensor bucket = torch::randn({n}, onDevice.dtype(torch::kFloat32)) * 1e-3;
    torch::Tensor half = torch::empty({n}, onDevice.dtype(torch::kHalf));
    torch::Tensor copy = torch::empty({n}, onDevice.dtype(torch::kFloat32));

    const double encode = medianSeconds(device, o.reps, [&] { half.copy_(bucket); });
    const double d2d = medianSeconds(device, o.reps, [&] { copy.copy_(bucket); });
    // The encode must have done its work: the float16 values are the bucket's, rounded.
    const double worst = (half.to(torch::kFloat32) - bucket).abs().max().item<double>();
    const char* name = o.device.c_str();
    std::printf("{\"bench\": \"gpu_codec\", \"what\": \"fp16_encode\", \"device\": \"%s\", \"mb\": %g, "
                "\"median_s\": %.9f, \"gb_per_s\": %.2f, \"max_rounding\": %.3g}\n",
                name, o.mb, encode, bytes / encode / 1e9, worst);
    std::printf("{\"bench\": \"gpu_codec\", \"what\": \"d2d_copy\", \"device\": \"%s\", \"mb\": %g, "
                "\"median_s\": %.9f, \"gb_per_s\": %.2f}\n",
                name, o.mb, d2d, bytes / d2d / 1e9);
    std::printf("{\"bench\": \"gpu_codec\", \"what\": \"ratio\", \"device\": \"%s\", \"mb\": %g, "
                "\"encode_over_copy\": %.3f, \"reps\": %d}\n",
                name, o.mb, d2d / encode, o.reps);
    for (const char* codec : kSparseCodecs) compareSparse(o, device, bucket, codec);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_codec: %s\n", e.what());
    return 1;
  }
  return 0;
}
