// Where an allreduce step's communication time goes with each codec, on the cnn's two buckets
// (11,274 and 1,100,672 floats: DataParallel's buckets of the cnn with the default sizes). Run
// under a launcher, 2 ranks:
//   build/cohort launch -n 2 -- build/bench/allreduce_phases [--reps R] [CODEC...]
//
// For each codec, R repetitions (after 3 warm-ups, each started by a barrier) of:
//   - the whole exchange as DataParallel runs it: CompressedSum::start on every bucket, then
//     finish on every bucket; its own phase counters (encode, exchange, decode) beside it;
//   - for fp16, the pieces of the path before issue 18's ring: conversion to binary16, c10d Gloo's
//     allreduce of at::kHalf (summed in 16 bits by Gloo), conversion back; and Gloo's float32
//     allreduce of the same buffer;
//   - for the sparse codecs, the pieces of the exchange: encode, allgatherVariable, decode of every
//     rank's message.
// Rank 0 prints medians in milliseconds and the spread (lowest-highest) of each.
#include <cohort/cluster.h>
#include <cohort/communicator.h>

#include "compress/codec.h"
#include "schemes/compressed.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using cohort::Communicator;
using cohort::CompressedSum;
namespace compress = cohort::compress;

const std::vector<int64_t> kBuckets = {11274, 1100672};

double since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

struct Series {
  std::vector<double> ms;
  void add(double v) { ms.push_back(v); }
  std::string text() {
    if (ms.empty()) return "-";
    std::sort(ms.begin(), ms.end());
    char buf[96];
    std::snprintf(buf, sizeof buf, "%.3f (%.3f-%.3f)", ms[ms.size() / 2], ms.front(), ms.back());
    return buf;
  }
};

std::span<float> floats(torch::Tensor& t) { return {t.data_ptr<float>(), size_t(t.numel())}; }
std::span<uint16_t> bits16(torch::Tensor& t) {
  return {reinterpret_cast<uint16_t*>(t.data_ptr()), size_t(t.numel())};
}

}  // namespace

int main(int argc, char** argv) {
  torch::set_num_threads(1);
  int reps = 21;
  std::vector<std::string> codecs;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--reps" && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else {
      codecs.push_back(arg);
    }
  }
  if (codecs.empty()) codecs = {"none", "fp16", "bf16", "threshold:0.001", "topk:0.01", "onebit"};
  auto comm = cohort::Communicator::connect(cohort::resolveClusterFromEnvironment());
  const int rank = comm->rank();
  torch::manual_seed(100 + rank);
  std::vector<torch::Tensor> inputs;
  for (int64_t n : kBuckets) inputs.push_back(torch::randn({n}) * 1e-3);
  if (rank == 0) {
    std::printf("ranks %d, buckets of %lld and %lld floats, %d repetitions; ms: median (lowest-highest)\n",
                comm->worldSize(), (long long)kBuckets[0], (long long)kBuckets[1], reps);
  }
  for (const std::string& text : codecs) {
    const auto spec = compress::CodecSpec::parse(text);
    CompressedSum sum(comm, spec, kBuckets);
    std::vector<torch::Tensor> flats;
    for (auto& in : inputs) flats.push_back(in.clone());
    std::map<std::string, Series> series;
    for (int r = 0; r < reps + 3; ++r) {
      const bool timed = r >= 3;
      auto record = [&](const std::string& name, double v) {
        if (timed) series[name].add(v);
      };
      // The whole exchange, as DataParallel drives it.
      for (size_t b = 0; b < flats.size(); ++b) flats[b].copy_(inputs[b]);
      comm->barrier();
      const CompressedSum::Phases before = sum.phases();
      auto t = Clock::now();
      for (size_t b = 0; b < flats.size(); ++b) sum.start(b, flats[b]);
      for (size_t b = 0; b < flats.size(); ++b) sum.finish(b, flats[b]);
      record("whole exchange", since(t));
      const CompressedSum::Phases after = sum.phases();
      record("  of which encode", 1e3 * (after.encodeSeconds - before.encodeSeconds));
      record("  of which on the wire", 1e3 * (after.wireSeconds - before.wireSeconds));
      record("  of which decode+sum", 1e3 * (after.decodeSeconds - before.decodeSeconds));
      // The pieces, on the big bucket.
      torch::Tensor big = inputs[1].clone();
      if (spec.kind == compress::CodecKind::Fp16 || spec.kind == compress::CodecKind::None) {
        auto half = torch::empty({big.numel()}, torch::kHalf);
        comm->barrier();
        t = Clock::now();
        compress::floatsToHalf(floats(big), bits16(half));
        record("big: to binary16", since(t));
        comm->barrier();
        t = Clock::now();
        comm->allreduce(half);
        record("big: Gloo allreduce of kHalf", since(t));
        t = Clock::now();
        compress::halfToFloats(bits16(half), floats(big));
        record("big: from binary16", since(t));
        comm->barrier();
        t = Clock::now();
        comm->allreduce(big);
        record("big: Gloo allreduce of kFloat", since(t));
      } else if (!spec.dense()) {
        compress::Encoder encoder(spec, size_t(big.numel()));
        std::vector<uint8_t> message;
        comm->barrier();
        t = Clock::now();
        encoder.encode(floats(big), message);
        record("big: encode", since(t));
        auto bytes = torch::from_blob(message.data(), {int64_t(message.size())}, torch::kUInt8);
        comm->barrier();
        t = Clock::now();
        auto all = comm->allgatherVariable(bytes);
        record("big: allgatherVariable", since(t));
        t = Clock::now();
        big.zero_();
        for (auto& m : all) compress::decodeAdd({m.data_ptr<uint8_t>(), size_t(m.numel())}, floats(big));
        record("big: decode every rank's message", since(t));
        if (timed && r == 3) series["big: message bytes"].add(double(message.size()));
      }
    }
    if (rank == 0) {
      std::printf("--codec %s\n", text.c_str());
      for (auto& [name, s] : series) std::printf("  %-36s %s\n", name.c_str(), s.text().c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}
