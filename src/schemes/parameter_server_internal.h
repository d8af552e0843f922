// What the files of the parameter-server client (parameter_server.cpp: attaching, the first
// Init and pull, synchronize, finish and the chief's report; parameter_server_push.cpp: a step's
// push and the rows it reads back) share: ParameterServerClient::Impl, the worker's side of the
// exchange, and the helpers its calls use. Private to src/schemes.
#pragma once

#include "base/clock.h"
#include "base/launcher_channel.h"

#include "compress/codec.h"
#include "ps/client.h"
#include "ps/layout.h"
#include "ps/service.h"
#include "ps/wire.h"
#include "schemes/host_mirror.h"
#include "schemes/model_sync.h"
#include "schemes/ps_policy.h"

#include <cohort/error.h>
#include <cohort/job.h>
#include <cohort/models.h>
#include <cohort/parameter_server.h>

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <future>
#include <thread>

namespace cohort {

namespace parameter_server_internal {

// What the worker side needs to know beyond the options.
struct PsContext {
  ParameterServerOptions options;
  int rank = 0;
  int workers = 1;
  std::vector<std::string> shards;  // host:port of every shard
  double timeoutSeconds = 60;
  Env* env = nullptr;  // the job's
};

inline void check(const ps::Status& s, const std::string& shard, const char* call) {
  if (s.ok()) return;
  const std::string what = "ps shard " + shard + ": " + call + " failed (" + ps::codeName(s.code) + "): " + s.message;
  if (s.code == ps::Code::kInvalidArgument || s.code == ps::Code::kFailedPrecondition) throw InvalidArgument(what);
  if (s.code == ps::Code::kDeadlineExceeded) throw TimeoutError(what);
  throw CommError(what);
}

// Runs f(i) for every shard, in parallel when there are several, and rethrows the first failure.
template <typename F>
void forEachShard(size_t shards, F f) {
  if (shards == 1) {
    f(size_t(0));
    return;
  }
  std::vector<std::future<void>> calls;
  for (size_t i = 0; i < shards; ++i) calls.push_back(std::async(std::launch::async, f, i));
  std::exception_ptr first;
  for (auto& c : calls) {
    try {
      c.get();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace parameter_server_internal

struct COHORT_LOCAL ParameterServerClient::Impl {
  explicit Impl(parameter_server_internal::PsContext c);

  void attach(torch::nn::Module& model, torch::optim::Optimizer* optimizer);

  // The parameters as last pulled, for push = updates: the change since is what is pushed.
  void snapshot();

  // What one step pushes: per parameter, the gradient or the change the local optimizer made
  // (send; CPU, contiguous), or for a row-sparse table its touched rows (rows: ids and values).
  // noGradient: per parameter, push gradients and its grad undefined this step (a frozen layer,
  // an unused branch): its pieces go as "no gradient" (ps::isNoGradient) and the shards leave them
  // alone, as torch's optimizers do; send holds zeros for it, which only a codec's message carries.
  struct Outgoing {
    std::vector<torch::Tensor> send;
    std::vector<std::pair<torch::Tensor, torch::Tensor>> rows;
    std::vector<bool> noGradient;
  };

  ParameterServerStep push(int64_t samples);

  void checkCanPush() const;

  // The gradients, or the change the local optimizer made; a row-sparse table's gradient as its
  // touched rows. From a device: through the host mirrors, each leaving the device once.
  Outgoing outgoing();

  // Shard s's dense pieces into its push: side by side through its encoder (and its residual)
  // when compressing, else as float32 tensors. Returns the bytes added.
  int64_t addValues(size_t s, const Outgoing& out, bool compress, ps::wire::PushRequest& request);

  // Shard s's part of each row-sparse table into its push: the touched rows, and (wantRows) the
  // rows the next step reads, asked back. Returns the bytes added.
  int64_t addRows(size_t s, const std::vector<std::pair<torch::Tensor, torch::Tensor>>& rows, bool compress,
                  bool wantRows, ps::wire::PushRequest& request);

  // The step as shard 0 saw it (samples, staleness, drops), with every shard's bytes.
  ParameterServerStep stepOf(const std::vector<ps::wire::PushReply>& replies, const std::vector<int64_t>& sent);

  // After finish() the shards may be gone: the parameters then are the last ones pulled.
  void synchronize();

  std::optional<int64_t> resumeStep() const { return resumeStep_; }

  // Ends this worker's conversation with the shards: the non-chief workers pull the final
  // parameters and say Done; the chief first waits for the others, then pulls, reads the shards'
  // record for its report, and says Done last. After this nothing is asked of the shards, so a
  // final evaluation that takes longer than the timeout cannot make a shard count the chief lost
  // and leave before the chief's questions.
  void finish();

  std::optional<std::string> finalCheckpointError() const { return finalCheckpointError_; }

  MetricFields report();

  MetricFields gatherReport();

  template <typename R>
  static int64_t payloadBytes(const R& tensors) {
    int64_t n = 0;
    // A framed reply's values carry their numel only; their floats went straight to the parameters.
    for (const auto& t : tensors) n += t.data().empty() ? int64_t(t.numel() * sizeof(float)) : int64_t(t.data().size());
    return n;
  }

  // A push of float32 gradients (or updates) to shard s on the zero-copy path: `send`'s memory goes
  // to the wire as it lies (the tensors kept alive until the transport lets go of it), and the
  // reply's parameters are written straight into params_. Returns the bytes pushed.
  int64_t pushFramed(size_t s, const ps::wire::PushRequest& header, const Outgoing& out, ps::wire::PushReply* reply);

  ps::wire::StatsReply statsOf(size_t s, bool stopJob = false, bool finishing = false);

  void sayDone();

  void initShards();

  // Writes every parameter (on a device: through its host view, then back to the device).
  void pullAll(bool initial = false);

  // The positions [begin, end) in sorted global row ids that fall in piece p.
  static std::pair<int64_t, int64_t> rowRange(const torch::Tensor& ids, const ps::Piece& p);

  // The rows [begin, end) of a table's gradient rows that fall in piece p, as the piece's local
  // rows; their values as float32, or through the 16-bit codec (fp16, bf16) when it applies.
  void setPushedRows(ps::wire::Rows* out, const ps::Piece& p, const torch::Tensor& ids, const torch::Tensor& values,
                     int64_t begin, int64_t end, bool compress) const;

  // A row-sparse reply: shard s's dense pieces in values, the rows asked for in rows.
  void loadRows(size_t s, uint64_t version, const google::protobuf::RepeatedPtrField<ps::wire::Tensor>& values,
                const google::protobuf::RepeatedPtrField<ps::wire::Rows>& rows);

  // The rows of table `param` the next step reads (sorted, distinct global row ids).
  void prefetchRows(const torch::Tensor& param, const torch::Tensor& ids);

  // The chief's early stop: every shard lets its held pushes go and tells every worker to stop.
  void requestStop();

  void checkParameter(const std::string& name, const torch::Tensor& p, bool rowSparse) const;

  // Copies shard s's values into the parameters.
  void load(size_t s, uint64_t version, const google::protobuf::RepeatedPtrField<ps::wire::Tensor>& values);

  parameter_server_internal::PsContext c_;
  std::vector<std::unique_ptr<ps::ShardClient>> clients_;
  // What the exchange reads and writes: the module's parameters when float32 on the CPU; else
  // (on a CUDA device, or of another dtype) float32 views of mirror_'s host buffer (the module's
  // own are modelParams_).
  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> modelParams_;  // the module's parameters, where the model is
  std::unique_ptr<HostMirror> mirror_;      // the parameters in float32 host memory (float32Mirror)
  std::unique_ptr<HostMirror> gradMirror_;  // the same for the gradients, with push = gradients
  std::vector<torch::Tensor> before_;       // push = updates: the parameters as last pulled
  std::vector<ps::Piece> pieces_;
  std::vector<std::vector<ps::wire::PieceSpec>> specs_;       // per shard, in key order
  std::vector<std::vector<const ps::Piece*>> shardPieces_;    // the same pieces
  std::vector<std::vector<ps::wire::PieceSpec>> denseSpecs_;  // per shard: what pushes carry as values
  std::vector<bool> rowSparse_;                               // per parameter: a table whose gradient is row-sparse
  bool anyRowSparse_ = false;                                 // pushes are row_sparse
  std::vector<torch::Tensor> nextRows_;                       // per table: the rows the next step reads (prefetchRows)
  std::vector<uint64_t> versions_;                            // per shard: the version the parameters were pulled at
  int64_t clock_ = 0;                                         // steps this worker has pushed
  compress::CodecSpec codec_;
  std::vector<compress::Encoder> encoders_;     // per shard, with a codec
  std::vector<std::vector<float>> flat_;        // per shard: the pushed values side by side
  std::vector<std::vector<uint8_t>> messages_;  // per shard: the last encoded push
  int64_t steps_ = 0;                           // steps taken (for the warm-up), from the resumed clock on
  int64_t samplesSeen_ = 0;
  // The bytes of this worker's whole-model pulls, outside its steps: the first, one per
  // synchronize() (the chief's evaluations), the last in finish(). Shards reply in parallel.
  std::atomic<int64_t> wholePullBytes_ = 0;
  std::optional<int64_t> resumeStep_;
  bool saidDone_ = false;
  bool stopJob_ = false;   // a shard said the chief stopped the job
  bool finished_ = false;  // finish() ran: the shards are no longer asked anything
  MetricFields report_;    // the chief's, gathered in finish()
  std::vector<int64_t> lostWorkers_;
  // The chief's: per shard, its periodic checkpoint writes that failed and the last error; and
  // the shards' final checkpoints that failed (the last Done's replies).
  std::vector<std::pair<int64_t, std::string>> checkpointFailures_;
  std::optional<std::string> finalCheckpointError_;
};

}  // namespace cohort
