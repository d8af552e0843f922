// `cohort simulate`: every cost formula against hand-computed cases, the event simulation against
// the closed forms where they are exact (no stragglers), its straggler, backup-worker and
// staleness behaviour, the calibration file, and the command's bad input.
#include "sim/calibration.h"
#include "sim/cost.h"
#include "sim/probe.h"
#include "sim/simulate.h"

#include "test_util.h"

#include <cohort/error.h>

#include <gtest/gtest.h>

#include <cmath>
#include <chrono>
#include <limits>
#include <thread>

#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

namespace cohort::sim {
namespace {

constexpr double kMiB = 1048576.0;
// A link's rate counts Ethernet frames: 1514 bytes on the wire per 1448 of TCP payload.
constexpr double kFrame = 1514.0 / 1448.0;
constexpr double kB = kFrame / 1e8;  // seconds per payload byte at the tests' 1e8 bytes/s

// A calibration whose link costs are all in --bandwidth / --latency-us (no kernel CPU), so the
// closed forms can be written with the test's own numbers.
Calibration plain() {
  Calibration c;
  c.machine = "test";
  c.date = "2026-11-23";
  c.model = "test";
  c.batch = 64;
  c.computeSecondsPerExample = 1e-3;
  c.sharedCores = 2;
  c.jobCompute = {{.ranks = 2, .secondsPerExample = 1e-3}};
  c.backwardFraction = 0.5;
  c.parameterCount = 1e6;
  c.parameterBytes = 4e6;
  c.layers = 8;
  c.gradientDensity = 1;
  c.latencySeconds = 0;
  c.secondsPerByte = 0;
  c.reduceSecondsPerByte = 1e-10;
  c.glooAllgatherSeconds = 0;
  c.glooSecondsPerByte = 0;
  c.rpcCallSeconds = 0;
  c.rpcWorkerSecondsPerByte = 0;
  c.shardSecondsPerByte = 0;
  c.codecs = {{.codec = "fp16", .encodeSecondsPerByte = 1e-10, .decodeSecondsPerByte = 1e-10, .sentFraction = 0.5},
              {.codec = "threshold:0.001", .encodeSecondsPerByte = 1e-9, .decodeSecondsPerByte = 5e-10,
               .sentFraction = 0.05}};
  return c;
}

Scenario scenarioOf(Scheme scheme) {
  Scenario s;
  s.calibration = plain();
  s.scheme = scheme;
  s.network.bandwidth = 1e8;   // 800 Mbit/s
  s.network.latency = 50e-6;
  s.batch = 64;
  s.steps = 40;
  return s;
}

TEST(SimCost, RingAllreduce) {
  // 2 (p-1) a + 2 (p-1)/p n b + (p-1)/p n g with p=4, n=1e6, a=1e-5, b=1e-8, g=1e-9:
  // 6e-5 + 0.015 + 7.5e-4.
  EXPECT_NEAR(ringAllreduceSeconds(4, 1e6, 1e-5, 1e-8, 1e-9), 0.01581, 1e-12);
  EXPECT_EQ(ringAllreduceSeconds(1, 1e6, 1e-5, 1e-8, 1e-9), 0.0);
  // p=2: 2a + n b + n/2 g.
  EXPECT_NEAR(ringAllreduceSeconds(2, 1000, 1, 0.01, 0.002), 2 + 10 + 1, 1e-12);
}

TEST(SimCost, HalvingDoubling) {
  // p=8 (a power of two): 2 lg p a + 2 (7/8) n b + (7/8) n g = 6e-4 + 0.014 + 7e-4.
  EXPECT_NEAR(halvingDoublingSeconds(8, 8e6, 1e-4, 1e-9, 1e-10), 0.0153, 1e-12);
  // p=6: p'=4 (2 rounds): 4e-4 + 0.012 + 6e-4, plus the fold (a + n b + n g) = 1e-4 + 8e-3 + 8e-4
  // and the unfold (a + n b) = 1e-4 + 8e-3.
  EXPECT_NEAR(halvingDoublingSeconds(6, 8e6, 1e-4, 1e-9, 1e-10), 0.013 + 0.0089 + 0.0081, 1e-12);
  // Fewer latency terms than the ring at many ranks, the same bandwidth term at powers of two.
  EXPECT_LT(halvingDoublingSeconds(1024, 4e6, 1e-4, 1e-9, 0), ringAllreduceSeconds(1024, 4e6, 1e-4, 1e-9, 0));
}

TEST(SimCost, AllgatherAndParameterServer) {
  EXPECT_NEAR(ringAllgatherSeconds(5, 1000, 1e-3, 1e-6), 4 * (1e-3 + 1e-3), 1e-15);
  // max(M / B_worker, N M / (k B_server)): the worker's link when few workers, the shards' when many.
  EXPECT_NEAR(psTransferSeconds(10, 2, 4e6, 1e8, 1e9), 0.04, 1e-15);
  EXPECT_NEAR(psTransferSeconds(100, 2, 4e6, 1e8, 1e9), 0.2, 1e-15);
  EXPECT_NEAR(psTransferSeconds(100, 20, 4e6, 1e8, 1e9), 0.04, 1e-15);
}

// Gossip sends each update to every other peer unless --gossip-peers says fewer, as cohort train
// does (the simulator's default was one peer, predicting a tenth of train's bytes at 11 workers).
TEST(SimScenario, GossipGoesToAllOthersByDefault) {
  Scenario s = scenarioOf(Scheme::kGossip);
  const double all = simulateWorkers(s, 11).bytesPerStep;
  s.gossipPeers = 1;
  const double one = simulateWorkers(s, 11).bytesPerStep;
  EXPECT_GT(one, 0);
  EXPECT_NEAR(all, 10 * one, 1e-9 * all);
  s.gossipPeers = 30;  // more than there are: all of them
  EXPECT_NEAR(simulateWorkers(s, 11).bytesPerStep, all, 1e-9 * all);
}

TEST(SimCost, Pipeline) {
  EXPECT_NEAR(pipelineBubble(4, 12), 3.0 / 15, 1e-15);
  EXPECT_EQ(pipelineBubble(1, 8), 0.0);
  // slot 1.2 / 48 = 0.025, 15 slots = 0.375, plus 2 (S-1) (a + act b) = 6 (1e-4 + 1e-3).
  EXPECT_NEAR(pipelineStepSeconds(4, 12, 1.2, 1000, 1e-4, 1e-6), 0.375 + 0.0066, 1e-12);
}

TEST(SimCost, BucketsAndOverlap) {
  EXPECT_EQ(bucketSizes(10 * kMiB, 1 * kMiB, 4 * kMiB), (std::vector<double>{kMiB, 4 * kMiB, 4 * kMiB, kMiB}));
  EXPECT_EQ(bucketSizes(kMiB / 2, 1 * kMiB, 4 * kMiB), (std::vector<double>{kMiB / 2}));
  // Four equal buckets ready at 1, 2, 3, 4 s of a 4 s backward. At 2 s each the chain runs
  // 1-3, 3-5, 5-7, 7-9: 5 s after backward. At 0.5 s each every bucket is done before the next is
  // ready: only the last one's 0.5 s shows.
  const std::vector<double> four{1, 1, 1, 1};
  EXPECT_NEAR(exposedAfterBackward(four, 4.0, [](double) { return 2.0; }), 5.0, 1e-12);
  EXPECT_NEAR(exposedAfterBackward(four, 4.0, [](double) { return 0.5; }), 0.5, 1e-12);
}

// The allreduce of every bucket of --bucket-mb (the first of --first-bucket-mb), one after another.
template <typename Cost>
double bucketsInTurn(double bytes, const Scenario& s, Cost cost) {
  double seconds = 0;
  for (double x : bucketSizes(bytes, s.firstBucketMb * kMiB, s.bucketMb * kMiB)) seconds += cost(x);
  return seconds;
}

TEST(SimEvents, AllreduceWithoutStragglersIsTheClosedForm) {
  Scenario s = scenarioOf(Scheme::kAllreduce);
  s.overlap = false;
  const double c = 64 * 1e-3;
  for (int p : {2, 3, 8, 100}) {
    const double a = 50e-6, b = kB, g = 1e-10;
    // Without overlap DataParallel still allreduces bucket by bucket, all after backward.
    const double step = c + bucketsInTurn(4e6, s, [&](double x) { return ringAllreduceSeconds(p, x, a, b, g); });
    const Prediction got = simulateWorkers(s, p);
    EXPECT_NEAR(got.stepSeconds, step, 1e-12 * step) << p;
    EXPECT_NEAR(got.samplesPerSecond, p * 64 / step, 1e-9 * p * 64 / step) << p;
    EXPECT_NEAR(got.waitSeconds, 0.0, 1e-15);
    EXPECT_NEAR(got.bytesPerStep, 2.0 * (p - 1) / p * 4e6, 1e-6);
  }
  // Overlapped: the exposed part after the backward half of the step.
  s.overlap = true;
  s.bucketMb = 1;
  s.firstBucketMb = 1;
  const std::vector<double> buckets = bucketSizes(4e6, kMiB, kMiB);
  const double exposed = exposedAfterBackward(buckets, 0.5 * c, [](double x) {
    return ringAllreduceSeconds(4, x, 50e-6, kB, 1e-10);
  });
  EXPECT_NEAR(simulateWorkers(s, 4).stepSeconds, c + exposed, 1e-12);
  // Halving-doubling.
  s.overlap = false;
  s.algorithm = Algorithm::HalvingDoubling;
  EXPECT_NEAR(simulateWorkers(s, 6).stepSeconds,
              c + bucketsInTurn(4e6, s, [](double x) { return halvingDoublingSeconds(6, x, 50e-6, kB, 1e-10); }),
              1e-12);
}

// Turning overlap off only takes away what the buckets hid behind backward: with 16 buckets of
// 0.25 MiB on 64 workers each bucket's ring pays 2 x 63 latencies, and --no-overlap predicted one
// ring over the whole model, faster than overlapping (153 ms a step against 218 ms).
TEST(SimEvents, NoOverlapIsNeverFasterThanOverlap) {
  Scenario s = scenarioOf(Scheme::kAllreduce);
  s.bucketMb = 0.25;
  s.firstBucketMb = 0.25;
  for (int p : {2, 8, 64}) {
    s.overlap = true;
    const double overlapped = simulateWorkers(s, p).stepSeconds;
    s.overlap = false;
    const double after = simulateWorkers(s, p).stepSeconds;
    EXPECT_GE(after, overlapped) << p;
    const double step =
        64e-3 + bucketsInTurn(4e6, s, [&](double x) { return ringAllreduceSeconds(p, x, 50e-6, kB, 1e-10); });
    EXPECT_NEAR(after, step, 1e-12) << p;
  }
}

TEST(SimEvents, SparseCodecIsEncodeAllgatherDecode) {
  Scenario s = scenarioOf(Scheme::kAllreduce);
  s.codec = compress::CodecSpec::parse("threshold:0.001");
  const int p = 4;
  // Two buckets (1 MiB, then the rest), each: encode, an allgather of the 8-byte lengths and one of
  // the messages (5 % of the bucket), each of p-1 = 3 steps of a (50 us) plus the bytes at kB, and p
  // decodes (CompressedSum decodes its own message too): encode 4e6 * 1e-9 = 4 ms, decode
  // 4 * 4e6 * 5e-10 = 8 ms, 2 buckets * 2 allgathers * 3 steps * 50 us = 0.6 ms, and
  // 3 (2 * 8 + 0.05 * 4e6) bytes at kB.
  const double step = 64e-3 + 4e-3 + 8e-3 + 0.6e-3 + 3 * (16 + 2e5) * kB;
  EXPECT_NEAR(simulateWorkers(s, p).stepSeconds, step, 1e-12);
  // A measured Gloo allgather call (2 ms) replaces the calibrated latency in each step; its CPU per
  // byte (1e-9) adds to the link's.
  s.calibration.glooAllgatherSeconds = 2e-3;
  s.calibration.glooSecondsPerByte = 1e-9;
  const double gloo = 64e-3 + 4e-3 + 8e-3 + 12 * (2e-3 + 50e-6) + 3 * (16 + 2e5) * (kB + 1e-9);
  EXPECT_NEAR(simulateWorkers(s, p).stepSeconds, gloo, 1e-12);
}

TEST(SimEvents, AveragingEveryKSteps) {
  Scenario s = scenarioOf(Scheme::kAverage);
  s.period = 5;
  const double perStep = 64e-3 + ringAllreduceSeconds(8, 4e6, 50e-6, kB, 1e-10) / 5;
  EXPECT_NEAR(simulateWorkers(s, 8).stepSeconds, perStep, 1e-12);
}

TEST(SimEvents, SyncParameterServerWithoutStragglersIsTheClosedForm) {
  Scenario s = scenarioOf(Scheme::kPs);
  s.psMode = PsMode::Sync;
  s.network.serverBandwidth = 4e8;
  for (int shards : {1, 2}) {
    for (int p : {1, 2, 4, 16, 64}) {
      s.shards = shards;
      // compute, then every push in (worker link or the shards' links), then every reply out, one
      // latency each way: exact while the worker links are the bottleneck (N M / (k Bs) <= M / Bw).
      // The shards' links are shared by the transfers under way (TCP's fair share), so when they
      // are the bottleneck the N pushes all end together at N M / (k Bs), and so do the replies:
      // exact in both regimes.
      const double step = 64e-3 + psTransferSeconds(p, shards, 4e6, 1e8 / kFrame, 4e8 / kFrame) * 2 + 2 * 50e-6;
      const Prediction got = simulateWorkers(s, p);
      const double rate = p * 64 / step;
      EXPECT_NEAR(got.samplesPerSecond, rate, 1e-9 * rate) << p << " workers " << shards;
    }
  }
  // The shards' CPU, when it is the slowest resource: N pushes of n/k bytes each.
  s.shards = 1;
  s.network.bandwidth = 0;
  s.network.serverBandwidth = 0;
  s.calibration.shardSecondsPerByte = 1e-9;
  const int p = 8;
  const double step = 64e-3 + p * 4e6 * 1e-9 + 2 * 50e-6;
  EXPECT_NEAR(simulateWorkers(s, p).samplesPerSecond, p * 64 / step, 1e-9 * p * 64 / step);
}

TEST(SimEvents, AsyncStalenessIsTheOtherWorkersPushes) {
  Scenario s = scenarioOf(Scheme::kPs);
  s.psMode = PsMode::Async;
  s.steps = 200;
  // One worker: compute, push, reply; nothing stale.
  const Prediction one = simulateWorkers(s, 1);
  EXPECT_NEAR(one.samplesPerSecond, 64 / (64e-3 + 2 * 4e6 * kB + 2 * 50e-6), 1e-6);
  EXPECT_EQ(one.staleness, 0.0);
  // Two workers on one shard whose link is as fast as theirs. Pushes that start d apart share the
  // shard's link and still end d apart (the first alone for d, both at half rate, the second alone
  // for d), and so do the replies: a worker's cycle is the lone cycle L0 plus 2 (P - d) when d < P
  // (P: one push alone), d being the distance between the workers' phases on the circle of L0.
  // The simulation spreads worker 1's starting phase over R = 32 runs at (r + 1/2) / R of L0 and
  // pools them: 2 x 64 samples per mean cycle.
  const double P = 4e6 * kB, L0 = 64e-3 + 2 * P + 2 * 50e-6;
  double cycles = 0;
  for (int r = 0; r < 32; ++r) {
    const double phase = (r + 0.5) / 32 * L0;
    const double d = std::min(phase, L0 - phase);
    cycles += L0 + 2 * std::max(0.0, P - d);
  }
  const double spread = 2 * 64 / (cycles / 32);
  const Prediction two = simulateWorkers(s, 2);
  EXPECT_NEAR(two.samplesPerSecond, spread, 5e-3 * spread);
  // Between the two extremes: workers in step (each push and reply at half the link, the
  // version-2 model's single run) and workers alternating (each alone on the link).
  EXPECT_GT(two.samplesPerSecond, 1.1 * 2 * 64 / (64e-3 + 4 * P + 2 * 50e-6));
  EXPECT_LT(two.samplesPerSecond, 0.95 * 2 * 64 / L0);
  // N workers that never wait for each other see the other N-1 pushes between pull and push.
  for (int p : {4, 10}) {
    const Prediction got = simulateWorkers(s, p);
    EXPECT_NEAR(got.staleness, p - 1, 0.05) << p;
  }
}

TEST(SimEvents, StragglersBackupWorkersAndBoundedStaleness) {
  Scenario s = scenarioOf(Scheme::kPs);
  s.network.bandwidth = 0;  // compute-bound: the stragglers are what matters
  s.steps = 300;
  s.tail = Tail::parse("pareto:1.5:0.1");
  s.psMode = PsMode::Sync;
  const Prediction sync = simulateWorkers(s, 50);
  s.backupWorkers = 4;
  const Prediction backup = simulateWorkers(s, 50);
  s.backupWorkers = 0;
  s.psMode = PsMode::Async;
  const Prediction async = simulateWorkers(s, 50);
  s.psMode = PsMode::Ssp;
  s.staleness = 1000;
  const Prediction looseSsp = simulateWorkers(s, 50);
  s.staleness = 0;
  const Prediction tightSsp = simulateWorkers(s, 50);
  // Synchronous steps wait for the slowest of 50 draws; 4 spare workers cut the step time;
  // asynchronous workers never wait.
  EXPECT_GT(sync.waitSeconds, 0.5 * sync.computeSeconds);
  EXPECT_LT(backup.stepSeconds, 0.8 * sync.stepSeconds);
  EXPECT_GT(async.samplesPerSecond, sync.samplesPerSecond * 1.2);
  EXPECT_NEAR(looseSsp.samplesPerSecond, async.samplesPerSecond, 1e-9 * async.samplesPerSecond);
  EXPECT_LT(tightSsp.samplesPerSecond, async.samplesPerSecond);
  EXPECT_EQ(sync.staleness, 0.0);

  // The same in synchronous allreduce: the waiting shows as wait, and grows with the workers.
  Scenario a = scenarioOf(Scheme::kAllreduce);
  a.tail = Tail::parse("lognormal:0.3");
  a.steps = 200;
  const Prediction few = simulateWorkers(a, 4), many = simulateWorkers(a, 256);
  EXPECT_GT(few.waitSeconds, 0.0);
  EXPECT_GT(many.waitSeconds, 2 * few.waitSeconds);
}

TEST(SimEvents, SharedCoresComputeAtTheJobsMeasuredSpeed) {
  Scenario s = scenarioOf(Scheme::kAllreduce);
  s.network.bandwidth = 0;
  s.cores = 2;
  s.overlap = false;
  // Jobs of 2 and 4 ranks on the calibrating machine's 2 cores computed 1.25 and 2.6 ms per
  // example; one rank alone computes at the quiet 1 ms.
  s.calibration.jobCompute = {{.ranks = 4, .secondsPerExample = 2.6e-3}, {.ranks = 2, .secondsPerExample = 1.25e-3}};
  auto ring = [&](int p) {
    return bucketsInTurn(4e6, s, [p](double x) { return ringAllreduceSeconds(p, x, 50e-6, 0, 1e-10); });
  };
  EXPECT_NEAR(simulateWorkers(s, 1).stepSeconds, 64e-3, 1e-12);
  // A measured rank count: its job's compute.
  EXPECT_NEAR(simulateWorkers(s, 2).stepSeconds, 64 * 1.25e-3 + ring(2), 1e-12);
  EXPECT_NEAR(simulateWorkers(s, 4).stepSeconds, 64 * 2.6e-3 + ring(4), 1e-12);
  // 3: the nearest counts tie, the smaller (2) is taken, slowed by 3 ranks on 2 cores.
  EXPECT_NEAR(simulateWorkers(s, 3).stepSeconds, 1.5 * 64 * 1.25e-3 + ring(3), 1e-12);
  // 8: the 4-rank job's speed per core (2.6 / 2 ms), slowed by 8 ranks on 2 cores.
  EXPECT_NEAR(simulateWorkers(s, 8).computeSeconds, 4 * 64 * 1.3e-3, 1e-12);
  // Asynchronous ps workers interleave compute with waiting: the speed per core, not slowed.
  Scenario ps = s;
  ps.scheme = Scheme::kPs;
  EXPECT_NEAR(simulateWorkers(ps, 4).computeSeconds, 64 * 1.3e-3, 1e-12);
}

TEST(SimEvents, ParameterServerPaysTheMeasuredGrpcCosts) {
  Scenario s = scenarioOf(Scheme::kPs);
  s.calibration.rpcCallSeconds = 1e-4;          // an empty call's round trip
  s.calibration.rpcWorkerSecondsPerByte = 2e-9;  // the worker's CPU per pushed float32 byte
  s.calibration.shardSecondsPerByte = 1e-9;      // the shard process's
  // One worker: compute, its side of the call (4e6 * 2e-9 = 8 ms), the push and the reply on the
  // wire, the shard's CPU (4 ms), and the round trip of the call plus the link's latency each way.
  const double step = 64e-3 + 8e-3 + 2 * 4e6 * kB + 4e-3 + 1e-4 + 2 * 50e-6;
  EXPECT_NEAR(simulateWorkers(s, 1).samplesPerSecond, 64 / step, 1e-6);
}

// "Stops paying at" is where every further count adds under 10 % of one worker per added worker:
// a small step followed by counts that pay again (1 -> 2: +5 %, 2 -> 3: +35 %) is not it.
TEST(SimEvents, TheKneeIsWhereNoFurtherCountPays) {
  std::vector<Prediction> points;
  for (const auto& [workers, rate] :
       std::vector<std::pair<int, double>>{{1, 100}, {2, 105}, {3, 140}, {4, 142}, {6, 145}}) {
    Prediction p;
    p.workers = workers;
    p.samplesPerSecond = rate;
    p.speedup = rate / 100;
    points.push_back(p);
  }
  EXPECT_EQ(findKnee(points).stopsPaying, 3);
  points.back().samplesPerSecond = 200;  // the last step pays again: it has not stopped
  EXPECT_EQ(findKnee(points).stopsPaying, 0);
}

TEST(SimEvents, SweepAndKnee) {
  Scenario s = scenarioOf(Scheme::kAllreduce);
  s.network.latency = 2e-3;  // the latency term 2 (p-1) a eventually dominates
  s.overlap = false;
  const std::vector<Prediction> points = sweep(s, defaultWorkerCounts());
  ASSERT_EQ(points.front().workers, 1);
  EXPECT_NEAR(points.front().speedup, 1.0, 1e-12);
  EXPECT_EQ(points.back().workers, 1000);
  const Knee knee = findKnee(points);
  // p / (A + B p) saturates: each added worker adds less and less.
  EXPECT_GT(knee.stopsPaying, 1);
  EXPECT_LT(knee.stopsPaying, 1000);
  EXPECT_GT(knee.halfEfficiency, 1);
  const std::string svg = svgPlot({{"allreduce", points}}, "t");
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  EXPECT_NE(svg.find("<polyline"), std::string::npos);
  EXPECT_NE(svg.find("linear"), std::string::npos);
}

TEST(SimCalibration, RoundTripAndErrorsNameTheField) {
  const Calibration c = plain();
  const Calibration back = fromJson(toJson(c), "x.json");
  EXPECT_EQ(back.computeSecondsPerExample, c.computeSecondsPerExample);
  EXPECT_EQ(back.codecs.size(), 2u);
  EXPECT_EQ(back.codecs[1].codec, "threshold:0.001");
  auto expectError = [](const std::string& text, const std::string& field) {
    try {
      fromJson(text, "x.json");
      ADD_FAILURE() << "accepted " << field;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  std::string other = toJson(c);
  other.replace(other.find("\"version\": 3"), 12, "\"version\": 2");
  expectError(other, "\"version\"");
  std::string negative = toJson(c);
  negative.replace(negative.find("\"compute_seconds_per_example\": "), 31, "\"compute_seconds_per_example\": -");
  expectError(negative, "compute_seconds_per_example");
  expectError("{\"version\": 3}", "\"machine\"");
  Calibration twice = c;
  twice.jobCompute.push_back(twice.jobCompute.front());
  expectError(toJson(twice), "job_compute");
  Calibration none = c;
  none.jobCompute.clear();
  expectError(toJson(none), "job_compute");
  expectError("[1]", "JSON object");
}

TEST(SimSetup, BadInputNamesTheOption) {
  auto expectError = [](Scenario s, int workers, const std::string& flag) {
    try {
      simulateWorkers(s, workers);
      ADD_FAILURE() << "accepted " << flag;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(flag), std::string::npos) << e.what();
    }
  };
  Scenario s = scenarioOf(Scheme::kPs);
  s.network.bandwidth = -1;
  expectError(s, 2, "--bandwidth");
  s = scenarioOf(Scheme::kPs);
  s.shards = 2000000;
  expectError(s, 2, "--shards");
  s = scenarioOf(Scheme::kPipeline);
  s.stages = 9;
  expectError(s, 9, "--stages");
  s = scenarioOf(Scheme::kAllreduce);
  s.codec = compress::CodecSpec::parse("onebit");
  expectError(s, 2, "--codec onebit");
  // The flags as the command names them, and no infinity taken for a number.
  s = scenarioOf(Scheme::kGossip);
  s.gossipPeers = -1;
  expectError(s, 2, "--gossip-peers must be >= 0 (0: all the others), got -1");
  s = scenarioOf(Scheme::kPs);
  s.psMode = PsMode::Ssp;
  s.staleness = -1;
  expectError(s, 2, "--staleness-bound must be >= 0, got -1");
  s = scenarioOf(Scheme::kAllreduce);
  s.density = 0;  // dense
  EXPECT_GT(simulateWorkers(s, 2).samplesPerSecond, 0);
  s.density = 1.5;
  expectError(s, 2, "--density must be in [0, 1] (0: dense, every row)");
  s = scenarioOf(Scheme::kAllreduce);
  s.speed = std::numeric_limits<double>::infinity();
  expectError(s, 2, "--speed must be a finite number > 0");
  s = scenarioOf(Scheme::kAllreduce);
  s.network.latency = std::numeric_limits<double>::infinity();
  expectError(s, 2, "--latency-us must be a finite number >= 0");
  s = scenarioOf(Scheme::kPipeline);
  s.activationBytes = std::numeric_limits<double>::infinity();
  expectError(s, 4, "--activation-bytes must be a finite number >= 0");
  // 4 MB in buckets of 1e-9 MiB: 2.8e9 of them (std::bad_alloc); 40 bytes make 100000, the most.
  s = scenarioOf(Scheme::kAllreduce);
  s.bucketMb = 1e-9;
  expectError(s, 2, "--bucket-mb 1e-09: cuts the model's 4 MB into 2.81e+09 buckets; the simulator takes at most 100000");
  s.firstBucketMb = 0;
  s.bucketMb = 40 / kMiB;
  EXPECT_GT(simulateWorkers(s, 2).samplesPerSecond, 0);
  for (const char* tail : {"lognormal:inf", "pareto:inf", "lognormal:nan"}) {
    try {
      Tail::parse(tail);
      ADD_FAILURE() << "accepted --stragglers " << tail;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("must be a finite number"), std::string::npos) << e.what();
    }
  }
}

// --stages 0 is refused before the sweep sorts the counts by it (w % 0 ended the process with
// SIGFPE).
TEST(SimSetup, StagesBelowOneIsRefusedBeforeTheSweep) {
  Scenario s = scenarioOf(Scheme::kPipeline);
  s.stages = 0;
  try {
    sweep(s, {2, 4});
    ADD_FAILURE() << "accepted --stages 0";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("--stages must be >= 1, got 0"), std::string::npos) << e.what();
  }
}

// A list with no count the scheme takes is refused naming the counts and the rule (the empty
// curve reached the table's points.back()); one with some is swept over those.
TEST(SimSetup, SweepWithNoCountTheSchemeTakesIsRefused) {
  auto expectError = [](const Scenario& s, const std::vector<int>& workers, const std::string& text) {
    try {
      const std::vector<Prediction> points = sweep(s, workers);
      ADD_FAILURE() << "swept " << points.size() << " points; expected: " << text;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  Scenario pipeline = scenarioOf(Scheme::kPipeline);
  expectError(pipeline, {1}, "--workers 1: no count is a multiple of --stages 2");
  pipeline.stages = 4;
  expectError(pipeline, {1, 2, 3}, "--workers 1,2,3: no count is a multiple of --stages 4, as --strategy pipeline");
  Scenario ps = scenarioOf(Scheme::kPs);
  ps.psMode = PsMode::Sync;
  ps.backupWorkers = 1;
  expectError(ps, {1}, "--workers 1: no count is above --backup-workers 1, as --ps-mode sync needs");
  pipeline.stages = 2;
  const std::vector<Prediction> points = sweep(pipeline, {1, 2, 3, 4});
  ASSERT_EQ(points.size(), 2u);
  EXPECT_EQ(points[0].workers, 2);
  EXPECT_EQ(points[1].workers, 4);
}

// A calibration whose model is too large to simulate (1e308 bytes: the simulator would list its
// buckets without end) is refused naming the file and the field.
TEST(SimCalibration, ParameterBytesAboveTheLimitNamesTheFileAndField) {
  Calibration huge = plain();
  huge.parameterBytes = 1e308;
  try {
    fromJson(toJson(huge), "cal.json");
    ADD_FAILURE() << "accepted parameter_bytes 1e308";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("cal.json: field \"parameter_bytes\" is 1e+308, above the limit of 1e+13"),
              std::string::npos)
        << e.what();
  }
}

// More workers than the simulator takes (2^31 - 1 ran for minutes) are refused with the range.
TEST(SimSetup, WorkersBeyondTheLimitAreRefusedWithTheRange) {
  for (const int workers : {4097, std::numeric_limits<int>::max()}) {
    try {
      simulateWorkers(scenarioOf(Scheme::kAllreduce), workers);
      ADD_FAILURE() << "accepted --workers " << workers;
      return;  // the larger count would run for minutes
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("--workers: every count must be in 1..4096, got " + std::to_string(workers)),
                std::string::npos)
          << e.what();
    }
  }
}

// As cohort train: a pipeline exchanges nothing a codec compresses.
TEST(SimSetup, PipelineRefusesACodec) {
  Scenario s = scenarioOf(Scheme::kPipeline);
  s.codec = compress::CodecSpec::parse("fp16");  // measured by plain()
  try {
    simulateWorkers(s, 4);
    ADD_FAILURE() << "accepted --strategy pipeline --codec fp16";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("--codec fp16 applies to allreduce, average, ps and gossip"), std::string::npos)
        << e.what();
  }
}

// The arithmetic of a prediction from the calibration recorded on the 2-core VM (committed under
// tests/data/): 2 workers on 2 cores at 100 Mbit/s, allreduce without overlap, is the recorded
// 2-rank job's compute plus the ring formula of each bucket with the recorded a, b, g.
TEST(SimCalibration, RecordedCalibrationFile) {
  const Calibration c = loadCalibration(std::string(COHORT_SOURCE_DIR) + "/tests/data/calibration_cnn.json");
  EXPECT_EQ(c.model, "cnn");
  ASSERT_EQ(c.sharedCores, 2);
  ASSERT_EQ(c.jobCompute.size(), 3u);
  ASSERT_EQ(c.jobCompute[0].ranks, 2);
  Scenario s;
  s.calibration = c;
  s.network.bandwidth = 100e6 / 8;
  s.overlap = false;
  s.cores = 2;
  s.batch = 64;
  s.steps = 20;
  const double b = 8 * kFrame / 100e6 + c.secondsPerByte;
  const double step = 64 * c.jobCompute[0].secondsPerExample + bucketsInTurn(c.parameterBytes, s, [&](double x) {
                        return ringAllreduceSeconds(2, x, c.latencySeconds, b, c.reduceSecondsPerByte);
                      });
  const Prediction got = simulateWorkers(s, 2);
  EXPECT_NEAR(got.stepSeconds, step, 1e-12);
  EXPECT_NEAR(got.samplesPerSecond, 128 / step, 1e-9);
}

// The compute of ranks sharing the cores, from the recorded calibration's jobs (2, 3 and 4 ranks
// of an allreduce job on the VM's 2 cores): a synchronous run of a measured rank count computes
// exactly what that job's chief computed per step; 6 ranks, the 4-rank job's speed per core slowed
// by 6 ranks on 2 cores; asynchronous ps workers that speed per core alone; one worker the quiet
// profile.
TEST(SimCalibration, RecordedJobComputeAtEachRankCount) {
  const Calibration c = loadCalibration(std::string(COHORT_SOURCE_DIR) + "/tests/data/calibration_cnn.json");
  ASSERT_EQ(c.sharedCores, 2);
  ASSERT_EQ(c.jobCompute.size(), 3u);
  Scenario s;
  s.calibration = c;
  s.network.bandwidth = 1e9 / 8;
  s.cores = 2;
  s.batch = 64;
  s.steps = 20;
  for (const JobCompute& job : c.jobCompute) {
    EXPECT_NEAR(simulateWorkers(s, job.ranks).computeSeconds, 64 * job.secondsPerExample, 1e-12) << job.ranks;
  }
  EXPECT_EQ(c.jobCompute[2].ranks, 4);
  EXPECT_NEAR(simulateWorkers(s, 6).computeSeconds, 64 * c.jobCompute[2].secondsPerExample * 6 / 4, 1e-12);
  EXPECT_NEAR(simulateWorkers(s, 1).computeSeconds, 64 * c.computeSecondsPerExample, 1e-12);
  s.scheme = Scheme::kPs;
  s.shards = 2;
  EXPECT_NEAR(simulateWorkers(s, 4).computeSeconds, 64 * c.jobCompute[2].secondsPerExample / 2, 1e-12);
}

TEST(SimCommand, BadInputIsOneLineNamingTheField) {
  test::TempDir dir;
  const std::string cal = std::string(COHORT_SOURCE_DIR) + "/tests/data/calibration_cnn.json";
  auto expectError = [&](const std::string& args, const std::string& field) {
    const test::CommandResult r = test::runCommand(test::cohortBinary() + " simulate --calibration " + cal + " " + args, 60);
    EXPECT_EQ(r.exitCode, 2) << args << ": " << r.output;
    EXPECT_EQ(test::lines(r.output).size(), 1u) << r.output;
    EXPECT_NE(r.output.find("cohort: error: "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(field), std::string::npos) << r.output;
  };
  expectError("--bandwidth 0", "--bandwidth");
  expectError("--bandwidth=-5mbit", "--bandwidth");
  expectError("--strategy ps --shards 5000000", "--shards");
  expectError("--strategy pipeline --stages 40 --workers 40", "--stages");
  expectError("--strategy pipeline --stages 0 --workers 2,4", "--stages must be >= 1");
  expectError("--strategy pipeline --workers 1", "--workers 1: no count is a multiple of --stages 2");
  expectError("--strategy allreduce,pipeline --stages 4 --workers 1,2,3", "no count is a multiple of --stages 4");
  expectError("--strategy ps --ps-mode sync --backup-workers 1 --workers 1", "no count is above --backup-workers 1");
  expectError("--strategy gossip --gossip-peers -1", "--gossip-peers must be >= 0");
  expectError("--strategy ps --ps-mode ssp --staleness-bound -1", "--staleness-bound must be >= 0");
  expectError("--density 2", "--density must be in [0, 1] (0: dense");
  expectError("--stragglers lognormal:inf", "--stragglers lognormal:inf: SIGMA must be a finite number >= 0");
  expectError("--speed inf", "--speed must be a finite number > 0");
  expectError("--example-ms inf", "--example-ms must be a finite number > 0");
  expectError("--latency-us inf", "--latency-us must be a finite number >= 0");
  expectError("--bucket-mb 1e-9", "--bucket-mb 1e-09: cuts the model's 4.448 MB into");
  expectError("--workers 2.9,4x", "--workers 2.9,4x: expected counts such as 1,2,4");
  expectError("--workers 1..8x", "--workers 1..8x: expected counts");
  expectError("--calibrate --calibration " + dir.file("c.json") + " --job-ranks 3x", "--job-ranks 3x: expected rank");
  const test::CommandResult skipped = test::runCommand(
      test::cohortBinary() + " simulate --calibration " + cal + " --strategy pipeline --workers 1,2,4", 60);
  EXPECT_EQ(skipped.exitCode, 0) << skipped.output;
  EXPECT_NE(skipped.output.find("pipeline 2 stages: skipped --workers 1 (not a multiple of --stages 2)"),
            std::string::npos)
      << skipped.output;
  expectError("--plot " + dir.path(), "--plot " + dir.path() + ": is a directory");
  // Said before the minutes of measuring, and --workers before the calibration is read.
  expectError("--calibrate --calibration " + dir.file("none/c.json"), "the directory " + dir.file("none"));
  EXPECT_NE(
      test::runCommand(test::cohortBinary() + " simulate --calibration " + dir.file("none.json") + " --workers 0", 60)
          .output.find("--workers: every count must be >= 1"),
      std::string::npos);
  std::string text = test::readFile(cal);
  text.replace(text.find("\"version\": 3"), 12, "\"version\": 2");
  test::writeFile(dir.file("old.json"), text);
  const test::CommandResult r =
      test::runCommand(test::cohortBinary() + " simulate --calibration " + dir.file("old.json"), 60);
  EXPECT_EQ(r.exitCode, 2) << r.output;
  EXPECT_NE(r.output.find("\"version\""), std::string::npos) << r.output;

  // And a good run: the table, the JSON lines, the plot.
  const test::CommandResult ok = test::runCommand(test::cohortBinary() + " simulate --calibration " + cal +
                                                      " --strategy allreduce,ps --workers 1..1000 --json --plot " +
                                                      dir.file("p.svg"),
                                                  60);
  ASSERT_EQ(ok.exitCode, 0) << ok.output;
  int rows = 0, knees = 0;
  for (const std::string& line : test::lines(ok.output)) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("event")) ++knees;
    else ++rows;
  }
  EXPECT_EQ(knees, 2);
  EXPECT_GE(rows, 2 * 15);
  EXPECT_NE(test::readFile(dir.file("p.svg")).find("<svg"), std::string::npos);
}

// --calibrate measures for real (a forked peer over loopback TCP, the model on Fashion-MNIST, a
// shard, a codec) and writes a file that loads back; its numbers are machine-dependent, so only
// their sanity is checked here.
// The calibration's shard cost is the difference of two readings of the shard's CPU time; a
// thread that ended between them must not take its time away (the calibration once measured a
// negative cost, reading only the live threads).
TEST(SimProbe, AProcesssCpuTimeKeepsItsEndedThreads) {
  int ready[2], release[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(release), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(ready[0]);
    ::close(release[1]);
    std::thread([] {  // 0.2 s on a CPU, then the thread ends
      timespec t{};
      do ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
      while (t.tv_sec == 0 && t.tv_nsec < 200'000'000);
    }).join();
    const char byte = 1;
    if (::write(ready[1], &byte, 1) != 1) ::_exit(1);
    char back = 0;
    (void)!::read(release[0], &back, 1);  // until the parent closes its end
    ::_exit(0);
  }
  ::close(ready[1]);
  ::close(release[0]);
  pollfd p{ready[0], POLLIN, 0};
  const bool told = ::poll(&p, 1, 30'000) == 1;
  char byte = 0;
  const bool read = told && ::read(ready[0], &byte, 1) == 1;
  const double seconds = read ? processCpuSeconds(child) : 0;
  ::close(release[1]);
  ::close(ready[0]);
  if (!read) ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(read) << "the child did not end its busy thread within 30 s";
  EXPECT_GE(seconds, 0.19) << "the ended thread's CPU time is not counted";
  EXPECT_LT(seconds, 30);
  EXPECT_THROW(processCpuSeconds(child), CommError) << "a process that has been reaped";
}

TEST(SimCommand, CalibrateWritesAFileThatLoads) {
  test::TempDir dir;
  const std::string path = dir.file("cal.json");
  const test::CommandResult r = test::runCommand(test::cohortBinary() + " simulate --calibrate --model mlp --batch 16 " +
                                                     "--profile-steps 10 --codecs fp16 --job-ranks 2 --job-steps 10 --calibration " + path,
                                                 120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  // Any failure below shows what was measured, and what the command said.
  SCOPED_TRACE("the calibration: " + test::readFile(path) + "\nthe command's output:\n" + r.output);
  const Calibration c = loadCalibration(path);
  EXPECT_EQ(c.model, "mlp");
  EXPECT_EQ(c.parameterCount, 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10);
  EXPECT_EQ(c.parameterBytes, 4 * c.parameterCount);
  EXPECT_GT(c.computeSecondsPerExample, 0);
  // Upper bounds a unit mix-up would break (ms for s: 1000x) but no load can. CI failed this test
  // once (2026-11-26) with its output cut off; bounds 100x tighter were the only assertions a
  // loaded machine could break, so they were loosened, and the trace above now shows the figures.
  EXPECT_GT(c.latencySeconds, 0);
  EXPECT_LT(c.latencySeconds, 1);
  EXPECT_GT(c.secondsPerByte, 0);
  EXPECT_GT(c.reduceSecondsPerByte, 0);
  EXPECT_GT(c.shardSecondsPerByte, 0);
  EXPECT_GE(c.sharedCores, 1);
  ASSERT_EQ(c.jobCompute.size(), 1u);
  EXPECT_EQ(c.jobCompute[0].ranks, 2);
  EXPECT_GT(c.jobCompute[0].secondsPerExample, 0);
  EXPECT_GT(c.glooAllgatherSeconds, 0);
  EXPECT_LT(c.glooAllgatherSeconds, 5);
  EXPECT_GT(c.rpcCallSeconds, 0);
  EXPECT_GT(c.rpcWorkerSecondsPerByte, 0);
  ASSERT_EQ(c.codecs.size(), 1u);
  EXPECT_EQ(c.codecs[0].codec, "fp16");
  EXPECT_NEAR(c.codecs[0].sentFraction, 0.5, 0.01);
}

// A model of bags of ids is profiled on its own input (it was given an image's shape, and failed
// in torch: "Dimension out of range"), its sparse embedding gradient counted as the rows it touched.
TEST(SimCommand, CalibrateProfilesABagModel) {
  test::TempDir dir;
  const std::string path = dir.file("cal.json");
  const test::CommandResult r = test::runCommand(
      test::cohortBinary() +
          " simulate --calibrate --model embed:rows=1000,dim=8,sparse=1 --data synthetic-bags:500,1000 " +
          "--batch 16 --profile-steps 10 --codecs fp16 --job-ranks 2 --job-steps 10 --calibration " + path,
      120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  SCOPED_TRACE("the calibration: " + test::readFile(path) + "\nthe command's output:\n" + r.output);
  const Calibration c = loadCalibration(path);
  EXPECT_EQ(c.model, "embed:rows=1000,dim=8,sparse=1");
  EXPECT_GT(c.parameterCount, 1000 * 8);
  // 16 bags of a few ids each touch a share of the 1000 rows, and the dense layers all of theirs.
  EXPECT_GT(c.gradientDensity, 0.0);
  EXPECT_LT(c.gradientDensity, 0.9);
}

}  // namespace
}  // namespace cohort::sim
