// The parameter-server client for a user's own loop (DistBelief, TensorFlow's
// ParameterServerStrategy): the model's parameters live on M shards (`cohort ps`, or the ps tasks
// of `cohort launch --ps M` / TF_CONFIG); each worker computes a gradient on its batch and pushes
// it, the shards apply the optimizer under the chosen policy, and the reply brings the parameters
// back (the next step's pull rides on this step's push).
//
//   cohort::ParameterServerClient ps(job, *net, nullptr, {.mode = cohort::PsMode::kAsync, .lr = 0.05});
//   for (...) {
//     net->zero_grad();
//     criterion(net->forward(x), y).backward();
//     ps.step(x.size(0));        // push the gradient, pull the parameters (instead of opt.step())
//   }
//   ps.finish();                 // every worker, at the end: pull the final parameters, say Done
//
// With push = PsPush::kUpdates the worker runs its own optimizer (pass it) and calls step() after
// optimizer.step(): the change its optimizer made is pushed and added on the shards.
//
// A model on a CUDA device trains there (the shards stay CPU processes): the client keeps pinned
// host copies of the parameters and, with push = gradients, of the gradients, each allocated once
// (the size of the parameters). Per step the gradients (with push = updates, the parameters) leave
// the device once, the push and the reply run as on the CPU, and the parameters the reply brings
// go back to the device without blocking the host, ordered before the next step's kernels.
// Sparse tables' gradient rows leave the device as rows, but the tables travel back to the
// device whole at each step.
//
// The shards hold float32. A model of another floating dtype (float64, float16, bfloat16; with
// push = gradients, dense parameters) gets a float32 host copy the same way: its gradients are
// pushed as float32 and the shards' float32 parameters come back rounded to the model's dtype, so
// the shards keep master weights at float32's precision (updates smaller than a bfloat16 unit
// still accumulate there).
//
// Contract: the chief (rank 0) initializes the shards with its parameters; every worker's model
// must have the same parameters (names and shapes). Calls come from the training thread.
// Every call to a shard is bounded by the job's timeout: UNAVAILABLE is retried with back-off
// for up to the timeout after the shard went silent (or began refusing), which is how a worker
// rides out a shard restart, and for at most 3 x the timeout per call. Errors are cohort::Error
// subclasses: InvalidArgument for options and models that do not fit, CommError/TimeoutError for
// shards that do not answer.
#pragma once

#include <cohort/export.h>

#include <cohort/job.h>
#include <cohort/metrics.h>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace cohort {

// The policy's choices, one vocabulary from the command line to the shards (which get them as the
// wire's enums). A name is parsed once, where it comes in (--ps-mode, --staleness-lr, --push,
// --optimizer); inside, the code compares these.
enum class PsMode { kSync, kAsync, kSoftsync, kSsp };
enum class PsStalenessLr { kNone, kInverse };  // inverse: lr / staleness
enum class PsPush { kGradients, kUpdates };    // updates: the workers run the optimizer
enum class PsOptimizer { kSgd, kMomentum, kAdam, kAdagrad };

// The names the command line gives them: "sync", "async", "softsync", "ssp"; "none", "inverse";
// "gradients", "updates"; "sgd", "momentum", "adam", "adagrad".
COHORT_API const char* psModeName(PsMode mode);
COHORT_API const char* psStalenessLrName(PsStalenessLr rule);
COHORT_API const char* psPushName(PsPush push);
COHORT_API const char* psOptimizerName(PsOptimizer optimizer);

// The choice a name means; nullopt for any other text (the caller names what it read and where).
COHORT_API std::optional<PsMode> parsePsMode(std::string_view name);
COHORT_API std::optional<PsStalenessLr> parsePsStalenessLr(std::string_view name);
COHORT_API std::optional<PsPush> parsePsPush(std::string_view name);
COHORT_API std::optional<PsOptimizer> parsePsOptimizer(std::string_view name);

struct COHORT_API ParameterServerOptions {
  // The update policy on the shards (see docs/ARCHITECTURE.md "The parameter server").
  PsMode mode = PsMode::kAsync;
  int backupWorkers = 0;       // sync: the step closes after N - b gradients
  int softsync = 1;            // softsync: gradients averaged per update
  int stalenessBound = 3;      // ssp: the largest clock gap
  PsStalenessLr stalenessLr = PsStalenessLr::kNone;
  int64_t maxStaleness = -1;         // drop gradients staler than this; < 0: keep all
  int64_t warmupSteps = 0;           // workers other than 0 wait until version W
  PsPush push = PsPush::kGradients;
  // The shards' optimizer (gradients mode).
  PsOptimizer optimizer = PsOptimizer::kSgd;  // row-sparse tables: lazy
  double lr = 0.01;
  double momentum = 0.9;
  // Where the shards are: host:port each ([v6 host]:port), a port in 1..65535, each shard once
  // (InvalidArgument otherwise); empty: the job's cluster spec ("ps" tasks).
  std::vector<std::string> hosts;
  std::string authToken;  // the job's secret (cohort launch sets COHORT_AUTH_TOKEN)
  std::string tlsCa;      // PEM roots for TLS to the shards
  std::string tlsCert;    // when this process serves a shard
  std::string tlsKey;
  int64_t checkpointEvery = 0;  // shard versions between shard checkpoints
  bool resume = false;          // continue from the shards' checkpoints
  // A float32 push (no codec, no row-sparse table) to one shard of more than this many MB travels
  // as a stream of chunks of whole pieces of at most this size (a larger piece alone), each checked
  // by the shard as it arrives; a smaller push, or every push when 0, as one message.
  double pushChunkMb = 4;
  std::string codec = "none";   // what pushes travel as (any --codec)
  int64_t codecWarmupSteps = 0;
  // Pushes and pulls allocate and free buffers of tens of MB every step, which glibc serves from
  // fresh mmaps (a page fault per page, twice a step). true: tune glibc (mallopt) to keep freed
  // memory in the heap. A process-wide setting, so the library makes it only when asked;
  // `cohort train` asks.
  bool keepFreedMemory = false;
};

// One push and pull.
struct COHORT_API ParameterServerStep {
  int64_t samples = 0;  // examples trained on by the job since the previous step (shard 0's count)
  int64_t bytesSent = 0;
  int64_t bytesReceived = 0;
  double commWaitSeconds = 0.0;
  int64_t staleness = 0;  // of this push, on shard 0
  bool applied = true;    // false: dropped (see dropped)
  std::string dropped;    // why: late, stale, warmup, duplicate
  double serverWaitSeconds = 0.0;
  bool stopJob = false;   // the chief called requestStop(): end the training loop after this step
};

class COHORT_API ParameterServerClient {
 public:
  // Connects to the shards; the chief initializes them (or, with resume, has them keep their
  // checkpointed state); every worker pulls the initial parameters into the model.
  ParameterServerClient(const Job& job, torch::nn::Module& module, torch::optim::Optimizer* optimizer,
                        ParameterServerOptions options);
  ~ParameterServerClient();
  ParameterServerClient(const ParameterServerClient&) = delete;
  ParameterServerClient& operator=(const ParameterServerClient&) = delete;

  // After backward (gradients) or after optimizer.step() (updates): pushes to every shard and
  // writes the parameters they send back into the model. `samples`: this step's batch size.
  ParameterServerStep step(int64_t samples);
  // Sparse embedding tables (nn::Embedding / nn::EmbeddingBag with sparse(true)) travel by rows:
  // a push carries the rows the gradient touched, and the shards hold each table partitioned by
  // rows. Before step(), name the rows of `table` the *next* step will read: the push then asks
  // for those rows back, after its update, instead of the whole table (the next step's pull rides
  // on this push). A step without them brings back every row; with none (an empty `rows`), no
  // row: what a caller does before its last step, or before synchronize() pulls everything.
  void prefetchRows(const torch::Tensor& table, const torch::Tensor& rows);
  // Pulls the current parameters (before evaluating); no-op after finish().
  void synchronize();
  // The end of this worker's work: pulls the final parameters and says Done. The chief first
  // waits for the other workers, as long as they make steps (TimeoutError, naming them, when one
  // makes none for the timeout; a dead one is counted lost). Call it once, on every worker.
  void finish();
  // The chief, stopping early (its target accuracy is reached): every other worker's next step
  // returns stopJob, and pushes the shards hold (a sync step, the ssp bound) are let go. Then
  // finish() as usual.
  void requestStop();
  // With resume: the step this worker had reached (its clock on the shards).
  std::optional<int64_t> resumeStep() const;
  // The chief's report after finish(): staleness histogram, drops, bytes per shard, lost workers,
  // the periodic checkpoint writes each shard failed (ps_checkpoints_failed; training went on).
  MetricFields report();
  // On the chief after finish(): why a shard's final checkpoint (written when the chief's Done
  // ends the run) could not be written, naming the shard, its directory and the cause (a full
  // disk); nullopt when every shard wrote it or none writes checkpoints. The model holds the final
  // parameters either way, but the shards cannot resume from them: treat it as the job failing.
  std::optional<std::string> finalCheckpointError() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// For a process whose role is ps (TF_CONFIG's "ps" tasks; `cohort launch --ps M` runs the same
// command on the shards, as TensorFlow does): serves this task's shard at its address in the
// cluster spec until every worker has said Done or is lost, then returns the exit status (0: all
// done). The policy and optimizer come from the chief's Init. `checkpointDir` (optional): the
// shard checkpoints there and resumes from it when restarted. A failure is logged through the
// job's Env (1). It touches nothing of the caller's process: no signal handlers (`cohort ps` and
// the command line's ps tasks add SIGTERM/SIGINT, which checkpoint and stop the shard), no
// allocator settings, no output but the Env's. Throws InvalidArgument when this process is not a
// ps task or has no address.
COHORT_API int serveParameterServerShard(const Job& job, const ParameterServerOptions& options,
                              const std::string& checkpointDir = "");

}  // namespace cohort
