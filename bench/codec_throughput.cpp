// Encode and decode throughput of every codec on one core, beside memcpy's, in GB/s of float32
// input: (4 bytes x length) / seconds per call. Torch-free.
//
//   codec_throughput [--length N] [--reps R] [--sigma S] [CODEC...]
//
// The buffer has the cnn's gradient size by default (1,111,946 floats), filled with normal values
// of standard deviation S (1e-3: the scale of the cnn's gradients). Four such buffers are encoded
// in turn by one encoder, so that its residual evolves as in training rather than growing in one
// direction. Each repetition times one call on each path (Fast, then Reference, which must write
// the same message); the table gives the median over R repetitions and the spread (lowest and
// highest GB/s), and the ratio of the two paths' medians.
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

  std::printf("length %zu floats (%.2f MB), sigma %g, %d repetitions, vector conversions: %s\n", o.length,
              4e-6 * double(o.length), double(o.sigma), o.reps, vectorConversions() ? "yes" : "no");
  std::printf("GB/s of float32 input per core, median (lowest-highest); fast: the default path, reference:\n"
              "COHORT_CODEC_PATH=reference (scalar conversions, unfused passes, full topk selection), timed\n"
              "alternately in the same repetitions; x: fast median / reference median\n\n");
  std::printf("| codec | encode fast | encode reference | x | decode fast | decode reference | x | entries sent |"
              " message bytes |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");

  std::vector<double> copy;
  for (int r = 0; r < o.reps; ++r) {
    copy.push_back(timeOnce([&] { std::memcpy(out.data(), inputs[size_t(r) % 4].data(), 4 * o.length); }));
  }
  std::printf("| memcpy | %s | | | | | | | |\n", cell(rateOf(copy, o.length)).c_str());

  for (const std::string& text : o.codecs) {
    // One encoder per path: their residuals stay equal, since both paths compute the same bits.
    struct Run {
      CodecPath path;
      Encoder encoder;
      std::vector<uint8_t> message;
      std::vector<double> encodes, decodes;
    };
    const CodecSpec spec = CodecSpec::parse(text);
    Run runs[2] = {{CodecPath::Fast, Encoder(spec, o.length), {}, {}, {}},
                   {CodecPath::Reference, Encoder(spec, o.length), {}, {}, {}}};
    double sent = 0, bytes = 0;
    for (int r = -4; r < o.reps; ++r) {  // 4 warm-up steps
      const std::vector<float>& input = inputs[size_t(r + 4) % 4];
      for (Run& run : runs) {
        setCodecPath(run.path);
        const double encode = timeOnce([&] { run.encoder.encode(input, run.message); });
        const double decode = timeOnce([&] { decodeAdd(run.message, out); });
        if (r < 0) continue;
        run.encodes.push_back(encode);
        run.decodes.push_back(decode);
      }
      setCodecPath(CodecPath::Fast);
      if (runs[0].message != runs[1].message) {
        std::fprintf(stderr, "codec_throughput: %s: the fast and reference messages differ\n", text.c_str());
        return 1;
      }
      if (r < 0) continue;
      sent += double(runs[0].encoder.lastSent());
      bytes += double(runs[0].message.size());
    }
    const Rate encodeFast = rateOf(runs[0].encodes, o.length), encodeRef = rateOf(runs[1].encodes, o.length);
    const Rate decodeFast = rateOf(runs[0].decodes, o.length), decodeRef = rateOf(runs[1].decodes, o.length);
    std::printf("| %s | %s | %s | %.1f | %s | %s | %.1f | %.0f | %.0f |\n", text.c_str(), cell(encodeFast).c_str(),
                cell(encodeRef).c_str(), encodeFast.median / encodeRef.median, cell(decodeFast).c_str(),
                cell(decodeRef).c_str(), decodeFast.median / decodeRef.median, sent / o.reps, bytes / o.reps);
  }
  return 0;
}
