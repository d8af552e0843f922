#include "cli/simulate_probes.h"
#include "base/clock.h"
#include "base/stats.h"

#include <cohort/cluster.h>
#include <cohort/communicator.h>
#include <cohort/error.h>

#include "ps/client.h"
#include "ps/wire.h"
#include "sim/probe.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>

namespace cohort::cli {

namespace {


double ownCpuSeconds() {
  timespec t{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + double(t.tv_nsec) * 1e-9;
}

Clock::time_point after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace

Child::Child(std::string what, const std::vector<std::string>& args) : what_(std::move(what)) {
  SubprocessOptions options;
  options.argv = {"cohort"};
  options.argv.insert(options.argv.end(), args.begin(), args.end());
  options.program = "/proc/self/exe";
  options.in = ChildStream::pipe();
  options.out = ChildStream::pipe();
  try {
    process_ = Subprocess::spawn(options);
  } catch (const SubprocessError& e) {
    throw CommError("calibration: cannot start " + what_ + ": " + e.what());
  }
}

std::string Child::readLine(double timeoutSeconds) {
  const auto deadline = after(timeoutSeconds);
  for (;;) {
    const auto eol = buffer_.find('\n');
    if (eol != std::string::npos) {
      std::string line = buffer_.substr(0, eol);
      buffer_.erase(0, eol + 1);
      return line;
    }
    const IoStatus status = process_.readSome(buffer_, deadline);
    COHORT_CHECK(status != IoStatus::kTimeout, TimeoutError, "calibration: ", what_, " did not answer within ",
                 timeoutSeconds, " s");
    COHORT_CHECK(status == IoStatus::kOk, CommError, "calibration: ", what_,
                 " ended without answering (see its error above)");
  }
}

void Child::write(const std::string& text) {
  COHORT_CHECK(::write(process_.fd(STDIN_FILENO), text.data(), text.size()) == ssize_t(text.size()), CommError,
               "calibration: cannot write to ", what_, ": ", std::strerror(errno));
}

void Child::wait(double timeoutSeconds) {
  const auto deadline = after(timeoutSeconds);
  // Its stdout closes when it exits: read (and drop) until then.
  for (std::string dropped;; dropped.clear()) {
    const IoStatus status = process_.readOutput(dropped, deadline, size_t(1) << 20);
    COHORT_CHECK(status != IoStatus::kTimeout, TimeoutError, "calibration: ", what_, " did not end within ",
                 timeoutSeconds, " s");
    if (status != IoStatus::kOk) break;
  }
  const ExitStatus status = process_.wait();
  COHORT_CHECK(status.ok(), CommError, "calibration: ", what_, " failed (exit status ", status.shellCode(), ")");
}

// ---- Gloo ----

namespace {
constexpr int64_t kGlooBig = 1 << 20;
constexpr int kGlooSmallRounds = 300;
constexpr int kGlooBigRounds = 15;
}  // namespace

int runGlooProbeChild(int rank, int port) {
  ClusterSpec spec;
  spec.rank = rank;
  spec.worldSize = 2;
  spec.master = {"127.0.0.1", port};
  spec.source = "calibration";
  // Rank 0 is given port 0: its store binds a free port and it tells the parent which (the first
  // line it prints), which only then starts rank 1 with it. No port is chosen by one process and
  // bound by another.
  CommOptions options;
  options.timeout = std::chrono::milliseconds(30000);
  if (rank == 0) {
    options.onListening = [](int listening) {
      std::printf("port %d\n", listening);
      std::fflush(stdout);
    };
  }
  auto comm = Communicator::connect(spec, options);
  auto small = torch::zeros({1}, torch::kInt64);
  auto big = torch::zeros({kGlooBig}, torch::kUInt8);
  for (int i = 0; i < 20; ++i) comm->allgather(small);
  std::vector<double> smallTimes, bigTimes;
  for (int i = 0; i < kGlooSmallRounds; ++i) {
    const auto t0 = Clock::now();
    comm->allgather(small);
    smallTimes.push_back(secondsSince(t0));
  }
  for (int i = 0; i < 3; ++i) comm->allgather(big);
  for (int i = 0; i < kGlooBigRounds; ++i) {
    const auto t0 = Clock::now();
    comm->allgather(big);
    bigTimes.push_back(secondsSince(t0));
  }
  comm->barrier();
  if (rank == 0) {
    const nlohmann::json j = {{"small", median(smallTimes)}, {"big", median(bigTimes)}, {"big_bytes", kGlooBig}};
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  }
  return 0;
}

GlooProbe probeGloo(double timeoutSeconds) {
  Child rank0("the Gloo probe's rank 0", {"simulate", "--probe", "gloo", "--probe-rank", "0", "--probe-port", "0"});
  const std::string told = rank0.readLine(timeoutSeconds);
  int port = 0;
  COHORT_CHECK(std::sscanf(told.c_str(), "port %d", &port) == 1 && port > 0 && port < 65536, CommError,
               "calibration: the Gloo probe's rank 0 said \"", told, "\", expected \"port P\"");
  Child rank1("the Gloo probe's rank 1",
              {"simulate", "--probe", "gloo", "--probe-rank", "1", "--probe-port", std::to_string(port)});
  const std::string line = rank0.readLine(timeoutSeconds);
  rank0.wait(timeoutSeconds);
  rank1.wait(timeoutSeconds);
  const auto j = nlohmann::json::parse(line);
  GlooProbe probe;
  probe.allgatherSeconds = j.at("small").get<double>();
  probe.secondsPerByte = std::max(0.0, (j.at("big").get<double>() - probe.allgatherSeconds) / j.at("big_bytes").get<double>());
  return probe;
}

// ---- gRPC ----

namespace {

ps::wire::PieceSpec pieceOf(size_t floats) {
  ps::wire::PieceSpec piece;
  piece.set_key(1);
  piece.set_name("w");
  piece.set_numel(floats);
  return piece;
}

ps::wire::InitRequest initRequest(const ps::wire::PieceSpec& piece, const std::vector<float>& values) {
  ps::wire::Policy policy;
  policy.set_mode(ps::wire::MODE_ASYNC);
  policy.set_workers(1);
  policy.set_softsync(1);
  policy.set_staleness_lr(ps::wire::STALENESS_LR_NONE);
  policy.set_max_staleness(-1);
  policy.set_push(ps::wire::PUSH_GRADIENTS);
  policy.set_optimizer(ps::wire::OPTIMIZER_SGD);
  policy.set_lr(0.01);
  policy.set_momentum(0.9);
  policy.set_timeout_s(30);
  ps::wire::InitRequest init;
  init.set_protocol(ps::kProtocolVersion);
  *init.mutable_policy() = policy;
  *init.add_pieces() = piece;
  ps::setTensor(init.add_values(), piece, values.data());
  return init;
}

void check(const ps::Status& s, const char* what) {
  COHORT_CHECK(s.ok(), CommError, "calibration: the probe shard refused ", what, ": ", s.message);
}

constexpr int kRpcCalls = 50;
constexpr int kRpcWarmup = 3;
constexpr int kRpcPushes = 12;

}  // namespace

RpcProbe probeRpc(size_t floats, double timeoutSeconds) {
  const std::string token = "calibration-" + std::to_string(::getpid());
  Child shard("the probe shard (cohort ps)", {"ps", "--host", "127.0.0.1", "--port", "0", "--auth-token", token});
  const std::string line = shard.readLine(timeoutSeconds);
  const std::string prefix = "cohort ps: listening on ";
  COHORT_CHECK(line.rfind(prefix, 0) == 0, CommError, "calibration: the probe shard said \"", line,
               "\", expected \"", prefix, "HOST:PORT\"");
  ps::ClientOptions options;
  options.authToken = token;
  options.timeoutSeconds = timeoutSeconds;
  options.quiet = true;
  auto client = ps::makeGrpcClient(line.substr(prefix.size()), options);
  const ps::wire::PieceSpec piece = pieceOf(floats);
  std::vector<float> params(floats, 0.5f), grad(floats, 1e-3f), back;
  ps::wire::InitReply initReply;
  check(client->init(initRequest(piece, params), &initReply), "its Init");

  RpcProbe probe;
  std::vector<double> calls;
  for (int i = 0; i < kRpcCalls; ++i) {
    ps::wire::StatsRequest request;
    request.set_protocol(ps::kProtocolVersion);
    request.set_worker(0);
    ps::wire::StatsReply reply;
    const auto t0 = Clock::now();
    check(client->stats(request, &reply), "a Stats call");
    calls.push_back(secondsSince(t0));
  }
  probe.callSeconds = median(calls);

  // A worker's step as ParameterServerClient makes it: the gradient into a request, the push, the
  // parameters out of the reply.
  uint64_t version = 0;
  double ownStart = 0, shardStart = 0;
  for (int i = 0; i < kRpcWarmup + kRpcPushes; ++i) {
    if (i == kRpcWarmup) {
      ownStart = ownCpuSeconds();
      shardStart = sim::processCpuSeconds(shard.pid());
    }
    ps::wire::PushRequest request;
    request.set_protocol(ps::kProtocolVersion);
    request.set_worker(0);
    request.set_clock(i);
    request.set_pulled_version(version);
    request.set_samples(1);
    request.set_want_values(true);
    ps::setTensor(request.add_values(), piece, grad.data());
    ps::wire::PushReply reply;
    check(client->push(request, &reply), "a push");
    COHORT_CHECK(reply.values_size() == 1, CommError, "calibration: the probe shard's reply has no parameters");
    back.clear();
    ps::appendFloats(reply.values(0), back);
    version = reply.version();
  }
  const double bytes = double(kRpcPushes) * double(floats) * 4;
  probe.workerSecondsPerByte = (ownCpuSeconds() - ownStart) / bytes;
  probe.shardSecondsPerByte = (sim::processCpuSeconds(shard.pid()) - shardStart) / bytes;

  ps::wire::DoneRequest done;
  done.set_protocol(ps::kProtocolVersion);
  done.set_worker(0);
  ps::wire::DoneReply doneReply;
  check(client->done(done, &doneReply), "Done");
  client.reset();
  shard.wait(timeoutSeconds);
  return probe;
}

// ---- compute in a real job ----

double jobComputeSecondsPerExample(const std::string& metricsPath, int batch) {
  std::ifstream in(metricsPath);
  std::vector<double> compute;
  std::string line;
  while (std::getline(in, line)) {
    const auto e = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!e.is_object() || e.value("event", "") != "step" || e.value("step", 0) <= kJobWarmupSteps) continue;
    compute.push_back(e.value("compute_s", 0.0));
  }
  COHORT_CHECK(!compute.empty(), CommError, "calibration: the job's metrics ", metricsPath,
               " hold no step after the warm-up (see the job's error above)");
  return median(compute) / batch;
}

double probeJobCompute(const JobProbeOptions& o, int ranks, double timeoutSeconds) {
  COHORT_CHECK(o.steps >= kJobWarmupSteps + 5, InvalidArgument, "--job-steps must be >= ", kJobWarmupSteps + 5,
               ", got ", o.steps);
  char dir[] = "/tmp/cohort-calibration-XXXXXX";
  COHORT_CHECK(::mkdtemp(dir) != nullptr, IoError, "calibration: cannot make a directory in /tmp: ", std::strerror(errno));
  const std::string metrics = std::string(dir) + "/metrics.jsonl";
  char exe[4096] = {};
  const ssize_t len = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  COHORT_CHECK(len > 0, IoError, "calibration: cannot read /proc/self/exe: ", std::strerror(errno));
  double result = 0;
  try {
    Child job("the calibration job of " + std::to_string(ranks) + " ranks (cohort launch)",
              {"launch", "-n", std::to_string(ranks), "--host", "127.0.0.1", "--", std::string(exe, size_t(len)),
               "train", "--strategy", "allreduce", "--model", o.model, "--data", o.data, "--batch",
               std::to_string(o.batch), "--threads", "1", "--steps", std::to_string(o.steps), "--progress", "off",
               "--timeout", std::to_string(int(timeoutSeconds)), "--metrics", metrics});
    job.wait(timeoutSeconds);
    result = jobComputeSecondsPerExample(metrics, o.batch);
  } catch (...) {
    std::remove(metrics.c_str());
    ::rmdir(dir);
    throw;
  }
  std::remove(metrics.c_str());
  ::rmdir(dir);
  return result;
}

}  // namespace cohort::cli
