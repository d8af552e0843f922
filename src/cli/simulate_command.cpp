// `cohort simulate`: predicts how a scheme scales with the number of workers (sim/), from a
// calibration measured on this machine (`--calibrate`, the one part that needs torch: profiling
// the model and a real gradient for the codecs).
#include <cohort/data.h>
#include <cohort/error.h>
#include <cohort/models.h>

#include "base/clock.h"
#include "base/files.h"
#include "base/stats.h"
#include "cli/commands.h"
#include "cli/simulate_probes.h"
#include "compress/codec.h"
#include "sim/calibration.h"
#include "sim/probe.h"
#include "sim/simulate.h"
#include "train/threads.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <numeric>
#include <sstream>

#include <unistd.h>

namespace cohort::cli {

namespace {


std::vector<std::string> splitList(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

// "100mbit", "1gbit", "10gbit", "500kbit", "125MB" (bytes/s), "unlimited" -> bytes/s (0: unlimited).
double parseRate(const std::string& text, const std::string& flag) {
  if (text == "unlimited") return 0;
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    throw InvalidArgument(flag + " " + text + ": expected a rate such as 100mbit, 1gbit, 125MB (bytes/s) or unlimited");
  }
  const std::string unit = text.substr(used);
  double scale = 0;
  if (unit == "bit") scale = 1.0 / 8;
  else if (unit == "kbit") scale = 1e3 / 8;
  else if (unit == "mbit") scale = 1e6 / 8;
  else if (unit == "gbit") scale = 1e9 / 8;
  else if (unit == "B" || unit.empty()) scale = 1;
  else if (unit == "KB") scale = 1e3;
  else if (unit == "MB") scale = 1e6;
  else if (unit == "GB") scale = 1e9;
  else throw InvalidArgument(flag + " " + text + ": unknown unit '" + unit + "' (bit, kbit, mbit, gbit, B, KB, MB, GB)");
  COHORT_CHECK(value > 0 && std::isfinite(value), InvalidArgument, flag, " ", text,
               ": the bandwidth must be positive (or `unlimited`)");
  return value * scale;
}

// A whole number, all of `text` ("4x" and "2.9" are not: std::stoi read them as 4 and 2).
int wholeCount(const std::string& text) {
  size_t used = 0;
  const int n = std::stoi(text, &used);
  if (used != text.size()) throw std::invalid_argument(text);
  return n;
}

std::vector<int> parseWorkers(const std::string& text) {
  if (text.empty()) return sim::defaultWorkerCounts();
  std::vector<int> out;
  for (const std::string& item : splitList(text)) {
    try {
      const auto dots = item.find("..");
      if (dots == std::string::npos) {
        out.push_back(wholeCount(item));
        continue;
      }
      const int lo = wholeCount(item.substr(0, dots)), hi = wholeCount(item.substr(dots + 2));
      COHORT_CHECK(lo >= 1 && hi >= lo, InvalidArgument, "--workers ", item, ": expected LO..HI with 1 <= LO <= HI");
      for (int w : sim::defaultWorkerCounts()) {
        if (w >= lo && w <= hi) out.push_back(w);
      }
      if (out.empty() || out.front() != lo) out.insert(out.begin(), lo);
      if (out.back() != hi) out.push_back(hi);
    } catch (const std::logic_error&) {
      throw InvalidArgument("--workers " + text + ": expected counts such as 1,2,4 or a range 1..1000");
    }
  }
  COHORT_CHECK(!out.empty(), InvalidArgument, "--workers ", text, ": expected counts such as 1,2,4 or a range 1..1000");
  for (int w : out) COHORT_CHECK(w >= 1, InvalidArgument, "--workers: every count must be >= 1, got ", w);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string today() {
  std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&now));
  return buf;
}

std::string machineName() {
  std::ifstream cpu("/proc/cpuinfo");
  std::string line, model = "unknown CPU";
  while (std::getline(cpu, line)) {
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return std::string(host) + ": " + std::to_string(::sysconf(_SC_NPROCESSORS_ONLN)) + " cores, " + model;
}

// The model's compute per example with one thread, its parameters, and a few real gradients.
void profileModel(sim::Calibration& c, const std::string& modelSpec, const std::string& dataSpec, int steps,
                  std::vector<std::vector<float>>& gradients) {
  setComputeThreads(1);
  torch::manual_seed(1);
  DataSplits data = loadData(dataSpec, 1);
  torch::nn::Sequential model = makeModel(modelSpec, inputShapeOf(data));
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  c.model = modelSpec;
  c.layers = int(model->size());
  c.parameterCount = 0;
  for (const auto& p : model->parameters()) {
    if (p.requires_grad()) c.parameterCount += double(p.numel());
  }
  c.parameterBytes = 4 * c.parameterCount;
  std::vector<double> total, backward;
  std::vector<int64_t> idx(c.batch);
  double nonzero = 0, entries = 0;
  const int64_t size = data.train.size();
  COHORT_CHECK(size >= c.batch, InvalidArgument, "--batch ", c.batch, ": larger than the data set (", size, ")");
  for (int s = 0; s < steps; ++s) {
    for (int i = 0; i < c.batch; ++i) idx[i] = (int64_t(s) * c.batch + i) % size;
    const auto t0 = Clock::now();
    Batch batch = makeBatch(data.train, idx);
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(batch.inputs), batch.targets);
    const auto t1 = Clock::now();
    loss.backward();
    const double bwd = secondsSince(t1);
    opt.step();
    loss.item<double>();
    const double all = secondsSince(t0);
    if (s >= 5) {
      total.push_back(all);
      backward.push_back(bwd);
    }
    if (s >= steps - 4) {
      std::vector<float> flat;
      for (const auto& p : model->parameters()) {
        if (!p.requires_grad() || !p.grad().defined()) continue;
        // A sparse model's embedding gradient (embed:sparse=1) counts its untouched rows as zeros.
        auto g = (p.grad().is_sparse() ? p.grad().to_dense() : p.grad()).contiguous().view(-1);
        const float* d = g.data_ptr<float>();
        for (int64_t i = 0; i < g.numel(); ++i) {
          flat.push_back(d[i]);
          nonzero += d[i] != 0.0f;
        }
        entries += double(g.numel());
      }
      gradients.push_back(std::move(flat));
    }
  }
  const double step = median(total);
  c.computeSecondsPerExample = step / c.batch;
  c.backwardFraction = std::clamp(median(backward) / step, 0.0, 1.0);
  c.gradientDensity = entries > 0 ? std::max(1e-6, nonzero / entries) : 1.0;
  std::vector<double> logs;
  for (double t : total) logs.push_back(std::log(t));
  const double mean = std::accumulate(logs.begin(), logs.end(), 0.0) / double(logs.size());
  double var = 0;
  for (double l : logs) var += (l - mean) * (l - mean);
  c.stepTimeSigma = logs.size() > 1 ? std::sqrt(var / double(logs.size() - 1)) : 0.0;
}

sim::CodecCost profileCodec(const std::string& name, const std::vector<std::vector<float>>& gradients) {
  const compress::CodecSpec spec = compress::CodecSpec::parse(name);
  const size_t n = gradients.front().size();
  compress::Encoder encoder(spec, n);
  std::vector<float> out(n, 0.0f);
  std::vector<double> enc, dec, sent;
  std::vector<uint8_t> message;
  for (int round = 0; round < 3; ++round) {
    for (const auto& g : gradients) {
      auto t0 = Clock::now();
      encoder.encode(g, message);
      enc.push_back(secondsSince(t0));
      t0 = Clock::now();
      compress::decodeAdd(message, out);
      dec.push_back(secondsSince(t0));
      sent.push_back(double(message.size()) / double(n * 4));
    }
  }
  return {.codec = spec.text(),
          .encodeSecondsPerByte = median(enc) / double(n * 4),
          .decodeSecondsPerByte = median(dec) / double(n * 4),
          .sentFraction = median(sent)};
}

struct Flags {
  bool calibrate = false;
  std::string calibration = "cohort-calibration.json";
  std::string model = "cnn";
  std::string data = "fashion-mnist";
  std::string codecs = "fp16,bf16,topk:0.01,threshold:0.001,onebit";
  int profileSteps = 40;
  std::string jobRanks;
  int jobSteps = 25;
  double params = 0, exampleMs = 0;
  std::string bandwidth = "1gbit", serverBandwidth;
  double latencyUs = 0;
  int ranksPerHost = 1;
  std::string strategy = "allreduce";
  std::string codec = "none";
  std::string algorithm = "ring";
  double bucketMb = 25, firstBucketMb = 1;
  bool noOverlap = false;
  int period = 1;
  std::string psMode = "async";
  int shards = 1, backupWorkers = 0, stalenessBound = 3, softsync = 1, gossipPeers = 0;
  int stages = 2, microBatches = 4;
  double activationBytes = 0;
  double density = 0, speed = 1;
  int batch = 64, cores = 0, steps = 200;
  uint64_t seed = 1;
  std::string stragglers = "none";
  std::string workers;
  bool json = false;
  std::string plot;
  // Hidden: the child side of a calibration probe (simulate_probes.h).
  std::string probe;
  int probeRank = 0, probePort = 0;
};

constexpr double kProbeTimeoutSeconds = 120;

// --job-ranks, or by default the machine's cores, one more, and twice as many (at least 2 each).
std::vector<int> jobRanks(const std::string& text, int cores) {
  std::vector<int> out;
  if (text.empty()) {
    out = {std::max(2, cores), std::max(2, cores + 1), std::max(2, 2 * cores)};
  } else {
    for (const std::string& item : splitList(text)) {
      int r = 0;
      try {
        r = wholeCount(item);
      } catch (const std::logic_error&) {
        throw InvalidArgument("--job-ranks " + text + ": expected rank counts such as 2,3,4");
      }
      COHORT_CHECK(r >= 2, InvalidArgument, "--job-ranks: every count must be >= 2, got ", r);
      out.push_back(r);
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  COHORT_CHECK(!out.empty(), InvalidArgument, "--job-ranks: expected rank counts such as 2,3,4");
  return out;
}

int runCalibrate(const Flags& f) {
  checkOutputPath("--calibration", f.calibration);  // before the minutes of measuring
  sim::Calibration c;
  c.machine = machineName();
  c.date = today();
  c.batch = f.batch;
  COHORT_CHECK(f.batch >= 1, InvalidArgument, "--batch must be >= 1, got ", f.batch);
  COHORT_CHECK(f.profileSteps >= 10, InvalidArgument, "--profile-steps must be >= 10, got ", f.profileSteps);
  COHORT_CHECK(f.jobSteps >= kJobWarmupSteps + 5, InvalidArgument, "--job-steps must be >= ", kJobWarmupSteps + 5,
               ", got ", f.jobSteps);
  c.sharedCores = std::max(1, int(::sysconf(_SC_NPROCESSORS_ONLN)));
  const std::vector<int> ranks = jobRanks(f.jobRanks, c.sharedCores);
  std::fprintf(stderr, "calibrating: loopback a, b (2 processes, TCP)...\n");
  const sim::LinkProbe link = sim::probeLoopback();  // first: fork before torch starts its threads
  c.latencySeconds = link.latencySeconds;
  c.secondsPerByte = link.secondsPerByte;
  c.reduceSecondsPerByte = sim::probeReduce();
  std::fprintf(stderr, "calibrating: Gloo allgather (2 processes)...\n");
  const GlooProbe gloo = probeGloo(kProbeTimeoutSeconds);
  c.glooAllgatherSeconds = gloo.allgatherSeconds;
  c.glooSecondsPerByte = gloo.secondsPerByte;
  std::fprintf(stderr, "calibrating: profiling %s, batch %d, 1 thread, %d steps...\n", f.model.c_str(), f.batch,
               f.profileSteps);
  std::vector<std::vector<float>> gradients;
  profileModel(c, f.model, f.data, f.profileSteps, gradients);
  std::fprintf(stderr, "calibrating: gRPC to a cohort ps process, and codecs...\n");
  const RpcProbe rpc = probeRpc(gradients.front().size(), kProbeTimeoutSeconds);
  c.rpcCallSeconds = rpc.callSeconds;
  c.rpcWorkerSecondsPerByte = rpc.workerSecondsPerByte;
  c.shardSecondsPerByte = rpc.shardSecondsPerByte;
  for (const std::string& name : splitList(f.codecs)) {
    if (name == "none") continue;
    c.codecs.push_back(profileCodec(name, gradients));
  }
  // Last, on a machine left to them: real jobs, whose ranks compute beside each other on the cores.
  const JobProbeOptions job{.model = f.model, .data = f.data, .batch = f.batch, .steps = f.jobSteps};
  for (int r : ranks) {
    std::fprintf(stderr, "calibrating: a %d-step allreduce job of %d ranks on the %d cores...\n", f.jobSteps, r,
                 c.sharedCores);
    c.jobCompute.push_back({.ranks = r, .secondsPerExample = probeJobCompute(job, r, kProbeTimeoutSeconds)});
  }
  sim::saveCalibration(c, f.calibration);
  std::printf("%s", sim::toJson(c).c_str());
  std::fprintf(stderr, "calibration written to %s\n", f.calibration.c_str());
  return 0;
}

Scheme schemeOf(const std::string& name) {
  const std::optional<Scheme> scheme = parseScheme(name);
  COHORT_CHECK(scheme == Scheme::kAllreduce || scheme == Scheme::kAverage || scheme == Scheme::kPs ||
                   scheme == Scheme::kGossip || scheme == Scheme::kPipeline,
               InvalidArgument, "--strategy ", name, ": expected allreduce, average, ps, gossip or pipeline");
  return *scheme;
}

sim::PsMode modeOf(const std::string& name) {
  if (name == "sync") return sim::PsMode::Sync;
  if (name == "async") return sim::PsMode::Async;
  if (name == "ssp") return sim::PsMode::Ssp;
  if (name == "softsync") return sim::PsMode::Softsync;
  throw InvalidArgument("--ps-mode " + name + ": expected sync, async, softsync or ssp");
}

std::string curveName(Scheme scheme, const Flags& f, const std::string& codec) {
  std::string name = schemeName(scheme);
  if (scheme == Scheme::kPs) {
    name += " " + f.psMode + " " + std::to_string(f.shards) + " shard" + (f.shards > 1 ? "s" : "");
    if (f.psMode == "sync" && f.backupWorkers > 0) name += " +" + std::to_string(f.backupWorkers) + " backup";
  }
  if (scheme == Scheme::kPipeline) name += " " + std::to_string(f.stages) + " stages";
  if (codec != "none") name += " " + codec;
  return name;
}

// The model's calibration, with --params and --example-ms applied.
sim::Calibration calibrationOf(const Flags& f) {
  sim::Calibration calibration = sim::loadCalibration(f.calibration);
  if (f.params != 0) {
    COHORT_CHECK(f.params > 0 && f.params <= sim::kMaxParameterBytes / 4, InvalidArgument, "--params must be in (0, ",
                 sim::kMaxParameterBytes / 4, "], got ", f.params);
    calibration.parameterCount = f.params;
    calibration.parameterBytes = 4 * f.params;
  }
  if (f.exampleMs != 0) {
    COHORT_CHECK(f.exampleMs > 0 && std::isfinite(f.exampleMs), InvalidArgument,
                 "--example-ms must be a finite number > 0, got ", f.exampleMs);
    // The jobs' compute with the cores shared scales with the model's.
    const double scale = f.exampleMs / 1000 / calibration.computeSecondsPerExample;
    for (sim::JobCompute& j : calibration.jobCompute) j.secondsPerExample *= scale;
    calibration.computeSecondsPerExample = f.exampleMs / 1000;
  }
  return calibration;
}

// The setup every curve shares: the calibration, the network and the schemes' options.
sim::Scenario scenarioOf(const Flags& f) {
  sim::Scenario base;
  base.calibration = calibrationOf(f);
  base.network.bandwidth = parseRate(f.bandwidth, "--bandwidth");
  base.network.serverBandwidth = f.serverBandwidth.empty() ? 0 : parseRate(f.serverBandwidth, "--server-bandwidth");
  COHORT_CHECK(f.latencyUs >= 0 && std::isfinite(f.latencyUs), InvalidArgument,
               "--latency-us must be a finite number >= 0, got ", f.latencyUs);
  base.network.latency = f.latencyUs * 1e-6;
  base.network.ranksPerHost = f.ranksPerHost;
  base.algorithm = f.algorithm == "ring" ? sim::Algorithm::Ring : sim::Algorithm::HalvingDoubling;
  base.bucketMb = f.bucketMb;
  base.firstBucketMb = f.firstBucketMb;
  base.overlap = !f.noOverlap;
  base.period = f.period;
  base.psMode = modeOf(f.psMode);
  base.shards = f.shards;
  base.backupWorkers = f.backupWorkers;
  base.staleness = f.stalenessBound;
  base.softsync = f.softsync;
  base.gossipPeers = f.gossipPeers;
  base.stages = f.stages;
  base.microBatches = f.microBatches;
  base.activationBytes = f.activationBytes;
  base.density = f.density;
  base.speed = f.speed;
  base.batch = f.batch;
  base.cores = f.cores;
  base.steps = f.steps;
  base.seed = f.seed;
  base.tail = sim::Tail::parse(f.stragglers);
  return base;
}

// One curve per strategy and codec, over the worker counts.
std::vector<sim::Curve> simulateCurves(const Flags& f, const sim::Scenario& base, const std::vector<int>& workers) {
  std::vector<sim::Curve> curves;
  for (const std::string& strategy : splitList(f.strategy)) {
    for (const std::string& codec : splitList(f.codec)) {
      sim::Scenario s = base;
      s.scheme = schemeOf(strategy);
      s.codec = compress::CodecSpec::parse(codec);
      curves.push_back({curveName(s.scheme, f, codec), sim::sweep(s, workers)});
      std::vector<int> skipped;
      for (int w : workers) {
        if (!sim::takesWorkerCount(s, w)) skipped.push_back(w);
      }
      if (!skipped.empty()) {
        std::fprintf(stderr, "cohort simulate: %s: skipped --workers %s (not %s)\n", curves.back().name.c_str(),
                     sim::countsText(skipped).c_str(), sim::workerCountRule(s).c_str());
      }
    }
  }
  return curves;
}

// --json: one line per point, then one "knee" line per curve.
void printJson(const std::vector<sim::Curve>& curves) {
  for (const sim::Curve& c : curves) {
    const sim::Knee knee = sim::findKnee(c.points);
    for (const sim::Prediction& p : c.points) {
      nlohmann::json j = {{"scheme", c.name},
                          {"workers", p.workers},
                          {"samples_per_s", p.samplesPerSecond},
                          {"speedup", p.speedup},
                          {"step_s", p.stepSeconds},
                          {"compute_s", p.computeSeconds},
                          {"comm_s", p.commSeconds},
                          {"wait_s", p.waitSeconds},
                          {"server_s", p.serverSeconds},
                          {"bytes_per_step", p.bytesPerStep},
                          {"staleness", p.staleness},
                          {"cpu_bound", p.cpuBound}};
      std::printf("%s\n", j.dump().c_str());
    }
    nlohmann::json k = {{"scheme", c.name},
                        {"event", "knee"},
                        {"stops_paying_workers", knee.stopsPaying},
                        {"peak_workers", knee.peak},
                        {"still_growing", knee.stillGrowing},
                        {"half_efficiency_workers", knee.halfEfficiency}};
    std::printf("%s\n", k.dump().c_str());
  }
}

// The table: the model's line, then per curve its points and where adding workers stops paying.
void printTable(const Flags& f, const sim::Scenario& base, const std::vector<sim::Curve>& curves) {
  const sim::Calibration& c = base.calibration;
  std::printf(
      "model %s: %.0f parameters (%.2f MB), %.3f ms per example (speed x%g), rows sent %.3g; link %s, "
      "latency +%g us; batch %d per worker\n",
      c.model.c_str(), c.parameterCount, c.parameterBytes / 1e6, c.computeSecondsPerExample * 1e3, f.speed,
      base.density > 0 ? base.density : 1.0, f.bandwidth.c_str(), f.latencyUs, f.batch);
  for (const sim::Curve& curve : curves) {
    std::printf("\n%s\n", curve.name.c_str());
    std::printf("%8s %12s %9s %10s %10s %10s %10s %10s %12s %9s\n", "workers", "samples/s", "speed-up", "step ms",
                "compute", "comm", "wait", "server", "MB/step", "stale");
    for (const sim::Prediction& p : curve.points) {
      std::printf("%8d %12.1f %9.2f %10.2f %10.2f %10.2f %10.2f %10.2f %12.3f %9.2f%s\n", p.workers, p.samplesPerSecond,
                  p.speedup, p.stepSeconds * 1e3, p.computeSeconds * 1e3, p.commSeconds * 1e3, p.waitSeconds * 1e3,
                  p.serverSeconds * 1e3, p.bytesPerStep / 1e6, p.staleness, p.cpuBound ? "  (CPU-bound)" : "");
    }
    const sim::Knee knee = sim::findKnee(curve.points);
    if (knee.stopsPaying == 0) {
      std::printf("adding workers still pays at %d (the largest count simulated)", curve.points.back().workers);
    } else {
      std::printf("adding workers stops paying at %d (each one more adds < %.0f%% of a worker)", knee.stopsPaying,
                  sim::kPaysShare * 100);
    }
    std::printf("; most samples/s at %d%s", knee.peak, knee.stillGrowing ? " (the largest count)" : "");
    if (knee.halfEfficiency > 0) std::printf("; below 50%% efficiency from %d", knee.halfEfficiency);
    std::printf("\n");
  }
}

int runSimulate(const Flags& f) {
  // The flags before any file is read, the --plot path before the simulation.
  for (const std::string& strategy : splitList(f.strategy)) schemeOf(strategy);
  const std::vector<int> workers = parseWorkers(f.workers);
  if (!f.plot.empty()) checkOutputPath("--plot", f.plot);
  const sim::Scenario base = scenarioOf(f);
  const std::vector<sim::Curve> curves = simulateCurves(f, base, workers);
  if (f.json) {
    printJson(curves);
  } else {
    printTable(f, base, curves);
  }
  if (!f.plot.empty()) {
    replaceFileWithText(f.plot,
                        sim::svgPlot(curves, "cohort simulate: " + base.calibration.model + ", " + f.bandwidth));
  }
  return 0;
}

}  // namespace

Run addSimulateCommand(CLI::App& app) {
  auto flags = std::make_shared<Flags>();
  Flags& f = *flags;
  CLI::App* cmd = app.add_subcommand("simulate", "Predict samples/s and speed-up from 1 to 1000 workers");
  cmd->footer(
      "First measure this machine: cohort simulate --calibrate [--model M] (writes --calibration FILE).\n"
      "Then e.g.: cohort simulate --strategy allreduce,ps --bandwidth 1gbit --plot scaling.svg\n"
      "Cost models and their sources: docs/ARCHITECTURE.md, \"cohort simulate\".");
  cmd->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  cmd->add_flag("--calibrate", f.calibrate, "Measure this machine and the model, write --calibration FILE");
  cmd->add_option("--calibration", f.calibration, "The calibration file (JSON)")->capture_default_str();
  cmd->add_option("--model", f.model,
                  "--calibrate: the model, as cohort train --model: mlp, mlp:WIDTH, cnn, lstm, embed[:...] (with "
                  "--data synthetic-bags or libsvm) or FILE.pt")
      ->capture_default_str();
  cmd->add_option("--data", f.data, "--calibrate: the data the model is profiled on")->capture_default_str();
  cmd->add_option("--codecs", f.codecs, "--calibrate: the codecs to measure")->capture_default_str();
  cmd->add_option("--profile-steps", f.profileSteps, "--calibrate: steps profiled (at least 10)")
      ->capture_default_str();
  cmd->add_option("--job-ranks", f.jobRanks,
                  "--calibrate: ranks of the short allreduce jobs that measure what ranks sharing the cores "
                  "compute at (default: the cores, one more, twice the cores)");
  cmd->add_option("--job-steps", f.jobSteps, "--calibrate: steps of each of those jobs (at least 10)")
      ->capture_default_str();
  const std::string model = "Model (override the calibration)";
  cmd->add_option("--params", f.params, "Parameters of the model")->group(model);
  cmd->add_option("--example-ms", f.exampleMs, "Compute per example, ms (forward, backward, step)")->group(model);
  cmd->add_option("--density", f.density, "Share of gradient rows touched per step (sparse models)")->group(model);
  cmd->add_option("--speed", f.speed, "Compute this many times faster than the calibration's")->group(model)
      ->capture_default_str();
  const std::string net = "Network";
  cmd->add_option("--bandwidth", f.bandwidth, "Each host's link: 100mbit, 1gbit, 125MB, unlimited")->group(net)
      ->capture_default_str();
  cmd->add_option("--server-bandwidth", f.serverBandwidth, "A shard's link (default: --bandwidth)")->group(net);
  cmd->add_option("--latency-us", f.latencyUs, "Added to every message, microseconds")->group(net)->capture_default_str();
  cmd->add_option("--ranks-per-host", f.ranksPerHost, "Ranks sharing one host link")->group(net)->capture_default_str();
  cmd->add_option("--cores", f.cores, "All ranks share this many cores (emulated clusters); 0: own cores")
      ->group(net)->capture_default_str();
  const std::string scheme = "Scheme";
  cmd->add_option("--strategy", f.strategy, "allreduce, average, ps, gossip, pipeline (a comma list: one curve each)")
      ->group(scheme)->capture_default_str();
  cmd->add_option("--codec", f.codec, "none or a codec the calibration measured (a comma list: one curve each)")
      ->group(scheme)->capture_default_str();
  cmd->add_option("--algorithm", f.algorithm, "allreduce: ring or halving-doubling")
      ->check(CLI::IsMember({"ring", "halving-doubling"}))->group(scheme)->capture_default_str();
  cmd->add_option("--bucket-mb", f.bucketMb, "allreduce: bucket size")->group(scheme)->capture_default_str();
  cmd->add_option("--first-bucket-mb", f.firstBucketMb, "allreduce: first bucket")->group(scheme)->capture_default_str();
  cmd->add_flag("--no-overlap", f.noOverlap, "allreduce: exchange after backward")->group(scheme);
  cmd->add_option("--period", f.period, "average: steps between averages")->group(scheme)->capture_default_str();
  cmd->add_option("--ps-mode", f.psMode, "sync, async, softsync or ssp")->group(scheme)->capture_default_str();
  cmd->add_option("--shards", f.shards, "ps: shards")->group(scheme)->capture_default_str();
  cmd->add_option("--backup-workers", f.backupWorkers, "ps sync: a step closes without the last B")->group(scheme)
      ->capture_default_str();
  cmd->add_option("--staleness-bound", f.stalenessBound, "ssp: the bound (train's default too)")
      ->group(scheme)
      ->capture_default_str();
  cmd->add_option("--softsync", f.softsync, "softsync: gradients per update")->group(scheme)->capture_default_str();
  cmd->add_option("--gossip-peers", f.gossipPeers, "gossip: peers each update goes to; 0: all the others (as train)")
      ->group(scheme)
      ->capture_default_str();
  cmd->add_option("--stages", f.stages, "pipeline: stages")->group(scheme)->capture_default_str();
  cmd->add_option("--micro-batches", f.microBatches, "pipeline: micro-batches")->group(scheme)->capture_default_str();
  cmd->add_option("--activation-bytes", f.activationBytes, "pipeline: bytes per example crossing a cut")
      ->group(scheme)->capture_default_str();
  cmd->add_option("--batch", f.batch, "Batch per worker (and --calibrate's)")->capture_default_str();
  cmd->add_option("--stragglers", f.stragglers, "none, lognormal:SIGMA or pareto:ALPHA[:P] (compute-time factor)")
      ->capture_default_str();
  cmd->add_option("--steps", f.steps, "Simulated steps per worker count")->capture_default_str();
  cmd->add_option("--seed", f.seed, "Seed of the straggler draws and of async ps workers' starting phases")->capture_default_str();
  cmd->add_option("--workers", f.workers, "Worker counts: 1,2,4 or 1..1000 (default: 1 to 1000)");
  cmd->add_flag("--json", f.json, "JSON lines instead of the table");
  cmd->add_option("--plot", f.plot, "Write speed-up against workers as an SVG file");
  cmd->add_option("--probe", f.probe)->group("");  // a calibration probe's child (simulate_probes.h)
  cmd->add_option("--probe-rank", f.probeRank)->group("");
  cmd->add_option("--probe-port", f.probePort)->group("");
  return [flags]() {
    if (flags->probe == "gloo") return runGlooProbeChild(flags->probeRank, flags->probePort);
    COHORT_CHECK(flags->probe.empty(), InvalidArgument, "--probe ", flags->probe, ": expected gloo");
    return flags->calibrate ? runCalibrate(*flags) : runSimulate(*flags);
  };
}

}  // namespace cohort::cli
