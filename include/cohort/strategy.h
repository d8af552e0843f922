// A Strategy owns how one training step on this replica turns into new parameters: the forward
// and backward pass, and whatever exchange with other processes its scheme does. The Trainer owns
// everything else (data, epochs, evaluation, checkpoints, metrics).
#pragma once

#include <cohort/data.h>
#include <cohort/metrics.h>

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace cohort {

using LossFn = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

// What one step did, as seen from this replica.
struct StepStats {
  double loss = 0.0;               // this replica's loss on its batch
  int64_t samples = 0;             // examples trained on by all replicas together in this step
  int64_t bytesSent = 0;           // payload bytes this replica sent
  int64_t bytesReceived = 0;       // payload bytes this replica received
  double computeSeconds = 0.0;     // forward + backward + optimizer
  double commWaitSeconds = 0.0;    // time blocked on communication (not hidden by overlap)
  MetricFields extra;              // scheme-specific fields for the step event (ps: staleness)
};

// Where this process stands among the replicas.
struct ReplicaInfo {
  int rank = 0;
  int worldSize = 1;
  bool isChief() const { return rank == 0; }
};

class Strategy {
 public:
  virtual ~Strategy() = default;

  virtual std::string name() const = 0;
  virtual ReplicaInfo replica() const = 0;

  // Once, before training: make every replica start from the same parameters.
  virtual void attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) = 0;

  // One step on this replica's batch: forward, backward, and this scheme's exchange.
  virtual StepStats step(const Batch& batch, const LossFn& loss) = 0;

  // Brings the local model to the state to evaluate or checkpoint.
  virtual void synchronize() = 0;

  // Where training should resume, when the scheme keeps that itself (ps: the servers count each
  // worker's steps); known after attach().
  virtual std::optional<int64_t> resumeStep() const { return std::nullopt; }

  // After the last step, before the final evaluation (ps: the chief waits for the other workers).
  virtual void finish() {}

  // The chief's scheme-specific fields for the done event, once evaluation is over (ps: the
  // servers' staleness and byte counts).
  virtual MetricFields report() { return {}; }
};

// Options of every scheme; each strategy reads the ones it needs.
struct StrategyOptions {
  std::string name = "local";  // local | allreduce | average | ps | gossip
  // Compression of what is exchanged (allreduce, average, ps, gossip): the --codec text (see
  // src/compress/codec.h), and the steps trained uncompressed first.
  std::string codec = "none";
  int64_t codecWarmupSteps = 0;
  // allreduce
  double bucketMb = 25.0;
  double firstBucketMb = 1.0;
  bool overlap = true;
  // average
  int64_t period = 1;
  bool averageOptimizerState = false;
  // ps (see ps/shard.h for what each does)
  struct Ps {
    std::string mode = "async";  // sync | async | softsync | ssp
    int backupWorkers = 0;
    int softsync = 1;
    int stalenessBound = 3;
    std::string stalenessLr = "none";  // none | inverse
    int64_t maxStaleness = -1;         // < 0: no bound
    int64_t warmupSteps = 0;
    std::string push = "gradients";  // gradients | updates
    std::vector<std::string> hosts;  // shard addresses; empty: from the cluster spec
    std::string authToken;
    std::string tlsCa;    // PEM roots for TLS to the shards
    std::string tlsCert;  // when this process serves a shard
    std::string tlsKey;
  } ps;
  // gossip (see strategy/gossip.h)
  struct Gossip {
    int peers = 0;  // send to this many random peers per step; 0: all
  } gossip;
  // Test hook for every scheme: worker slowRank sleeps slowSeconds in every step.
  int slowRank = -1;
  double slowSeconds = 0;
};

class Communicator;

// `comm` is the job's communicator, null for a single process. Throws InvalidArgument for an
// unknown scheme, or one that cannot run with this communicator.
std::unique_ptr<Strategy> makeStrategy(const StrategyOptions& options, std::shared_ptr<Communicator> comm);

// Whether the scheme exchanges anything between processes (and so needs a communicator).
bool isDistributed(const std::string& strategyName);

// Throws InvalidArgument when --codec or --codec-warmup-steps is malformed or does not fit the
// scheme; the message names the accepted codecs.
void checkCodecOptions(const StrategyOptions& options);

}  // namespace cohort
