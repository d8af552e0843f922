// Encode and decode throughput of every codec on one core, beside memcpy's, in GB/s of float32
// input: (4 bytes x length) / seconds per call. Torch-free.
//
//   codec_throughput [--length N] [--reps R] [--sigma S] [CODEC...]
//
// The buffer has the cnn's gradient size by default (1,111,946 floats), filled with normal values
// of standard deviation S (1e-3: the scale of the cnn's gradients). Four such buffers are encoded
// in turn by one encoder, so that its residual evolves as in training rather than growing in one
// direction. Each repetition times one call; the table gives the median over R repetitions and
// the spread (lowest and highest GB/s).
#include "compress/codec.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace cohort::compress;
using Clock = std::chrono::steady_clock;

struct Options {
  size_t length = 1111946;
  int reps = 31;
  float sigma = 1e-3f;
  std::vector<std::string> codecs = {"none",           "fp16", "bf16", "topk:0.01", "topk:0.001", "threshold:0.001",
                                     "threshold:0.01", "onebit"};
};

Options parseArgs(int argc, char** argv) {
  Options o;
  std::vector<std::string> codecs;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "codec_throughput: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--length") {
      o.length = std::strtoull(value(), nullptr, 10);
    } else if (arg == "--reps") {
      o.reps = std::max(1, std::atoi(value()));
    } else if (arg == "--sigma") {
      o.sigma = std::strtof(value(), nullptr);
    } else {
      codecs.push_back(arg);
    }
  }
  if (!codecs.empty()) o.codecs = codecs;
  return o;
}

// GB/s of float32 input over the repetitions: median, lowest, highest.
struct Rate {
  double median = 0, low = 0, high = 0;
};

Rate rateOf(std::vector<double> seconds, size_t length) {
  std::sort(seconds.begin(), seconds.end());
  const double bytes = 4.0 * double(length);
  return {bytes / seconds[seconds.size() / 2] / 1e9, bytes / seconds.back() / 1e9, bytes / seconds.front() / 1e9};
}

double timeOnce(const std::function<void()>& call) {
  const auto t0 = Clock::now();
  call();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string cell(const Rate& r) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f (%.2f-%.2f)", r.median, r.low, r.high);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parseArgs(argc, argv);
  std::vector<std::vector<float>> inputs(4, std::vector<float>(o.length));
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, o.sigma);
  for (auto& in : inputs) {
    for (float& v : in) v = normal(rng);
  }
  std::vector<float> out(o.length, 0.0f);

  std::printf("length %zu floats (%.2f MB), sigma %g, %d repetitions; GB/s of float32 input, median (low-high)\n\n",
              o.length, 4e-6 * double(o.length), double(o.sigma), o.reps);
  std::printf("| codec | encode GB/s | decode GB/s | entries sent | message bytes |\n|---|---:|---:|---:|---:|\n");

  std::vector<double> copy;
  for (int r = 0; r < o.reps; ++r) {
    copy.push_back(timeOnce([&] { std::memcpy(out.data(), inputs[size_t(r) % 4].data(), 4 * o.length); }));
  }
  std::printf("| memcpy | %s | | | |\n", cell(rateOf(copy, o.length)).c_str());

  for (const std::string& text : o.codecs) {
    Encoder enc(CodecSpec::parse(text), o.length);
    std::vector<uint8_t> message;
    for (int warm = 0; warm < 4; ++warm) enc.encode(inputs[size_t(warm)], message);
    std::vector<double> encodes, decodes;
    double sent = 0, bytes = 0;
    for (int r = 0; r < o.reps; ++r) {
      encodes.push_back(timeOnce([&] { enc.encode(inputs[size_t(r) % 4], message); }));
      sent += double(enc.lastSent());
      bytes += double(message.size());
      decodes.push_back(timeOnce([&] { decodeAdd(message, out); }));
    }
    std::printf("| %s | %s | %s | %.0f | %.0f |\n", text.c_str(), cell(rateOf(encodes, o.length)).c_str(),
                cell(rateOf(decodes, o.length)).c_str(), sent / o.reps, bytes / o.reps);
  }
  return 0;
}
