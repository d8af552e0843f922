#include "base/launcher_channel.h"
#include "base/clock.h"

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
#include <cohort/parameter_server.h>
#include <cohort/models.h>

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <future>
#include <thread>

namespace cohort {

namespace {

// What the worker side needs to know beyond the options.
struct PsContext {
  ParameterServerOptions options;
  int rank = 0;
  int workers = 1;
  std::vector<std::string> shards;  // host:port of every shard
  double timeoutSeconds = 60;
  Env* env = nullptr;  // the job's
};

void check(const ps::Status& s, const std::string& shard, const char* call) {
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

}  // namespace

struct ParameterServerClient::Impl {
  explicit Impl(PsContext c) : c_(std::move(c)) {
    COHORT_CHECK(!c_.shards.empty(), InvalidArgument,
                 "--strategy ps needs parameter servers: run it under `cohort launch --ps M`, with a TF_CONFIG "
                 "that lists a \"ps\" job, or give --ps-hosts HOST:PORT,...");
    const auto& o = c_.options;
    checkPolicyOptions(o, c_.workers);
    codec_ = compress::CodecSpec::parse(c_.options.codec);
    for (size_t i = 0; i < c_.shards.size(); ++i) {
      {
        clients_.push_back(ps::makeGrpcClient(
            c_.shards[i], ps::ClientOptions{.authToken = o.authToken,
                                            .tlsCaFile = o.tlsCa,
                                            .timeoutSeconds = c_.timeoutSeconds,
                                            .quiet = false,
                                            .onRetry = {},
                                            .pushChunkBytes = size_t(o.pushChunkMb * double(1 << 20)),
                                            .env = c_.env}));
      }
    }
    versions_.assign(c_.shards.size(), 0);
    if (c_.options.keepFreedMemory) ps::keepFreedMemory();  // process-wide: only when asked
  }

  void attach(torch::nn::Module& model, torch::optim::Optimizer* optimizer) {
    COHORT_CHECK(c_.options.push != PsPush::kUpdates || optimizer != nullptr, InvalidArgument,
                 "cohort::ParameterServerClient: push = updates runs the worker's own optimizer: pass it");
    std::vector<ps::ParamInfo> infos;
    for (const auto& [name, p] : uniqueParameters(model)) {
      COHORT_CHECK(p.scalar_type() == torch::kFloat32 && p.is_contiguous(), InvalidArgument,
                   "parameter ", name, " is not a contiguous float32 tensor: the parameter server holds float32");
      const bool rowSparse = p.dim() == 2 && hasRowSparseGradient(model, p);
      infos.push_back({name, uint64_t(p.numel()), rowSparse ? uint64_t(p.size(1)) : 0});
      params_.push_back(p);
      rowSparse_.push_back(rowSparse);
      anyRowSparse_ = anyRowSparse_ || rowSparse;
    }
    COHORT_CHECK(!anyRowSparse_ || c_.options.push == PsPush::kGradients, InvalidArgument,
                 "--push updates is not supported for a model with a sparse embedding table (its rows travel as "
                 "gradients): use --push gradients");
    nextRows_.assign(params_.size(), torch::Tensor());
    COHORT_CHECK(!params_.empty(), InvalidArgument,
                 "cohort::ParameterServerClient: the module has no parameters; there is nothing to serve");
    modelParams_ = params_;
    mirror_ = mirrorIfOnDevice(modelParams_, *c_.env);
    if (mirror_) {
      // On a device: the shards' values come into pinned host views of the parameters, and the
      // gradients leave the device into a pinned buffer of their own, each allocated once.
      params_ = mirror_->views();
      mirror_->toHost();  // the chief's Init sends them
      if (c_.options.push == PsPush::kGradients) gradMirror_ = std::make_unique<HostMirror>(modelParams_, *c_.env);
    }
    pieces_ = ps::planLayout(infos, int(c_.shards.size()));
    specs_.assign(c_.shards.size(), {});
    shardPieces_.assign(c_.shards.size(), {});
    for (const auto& p : pieces_) {
      ps::wire::PieceSpec spec;
      spec.set_key(p.key);
      spec.set_name(p.name);
      spec.set_numel(p.numel);
      spec.set_row_dim(p.rowDim);
      specs_[size_t(p.shard)].push_back(spec);
      shardPieces_[size_t(p.shard)].push_back(&p);
      // Row-sparse pushes carry the dense pieces as values and the tables' pieces as rows.
      if (!anyRowSparse_ || p.rowDim == 0) {
        denseSpecs_.resize(c_.shards.size());
        denseSpecs_[size_t(p.shard)].push_back(spec);
      }
    }
    denseSpecs_.resize(c_.shards.size());
    if (codec_.kind != compress::CodecKind::None) {
      for (const auto& pieces : denseSpecs_) {
        size_t total = 0;
        for (const auto& spec : pieces) total += size_t(spec.numel());
        encoders_.emplace_back(codec_, std::max<size_t>(total, 1));
        flat_.emplace_back(total);
      }
    }
    if (c_.rank == 0) initShards();
    pullAll(/*initial=*/true);
    snapshot();
    if (c_.options.resume) {
      ps::wire::StatsReply reply = statsOf(0);
      if (c_.rank < reply.clocks_size()) {
        resumeStep_ = reply.clocks(c_.rank);
        clock_ = *resumeStep_;
      }
    }
  }

  // The parameters as last pulled, for push = updates: the change since is what is pushed.
  void snapshot() {
    if (c_.options.push != PsPush::kUpdates) return;
    torch::NoGradGuard noGrad;
    if (before_.empty()) {
      for (const auto& p : params_) before_.push_back(p.detach().clone());
    } else {
      for (size_t i = 0; i < params_.size(); ++i) before_[i].copy_(params_[i]);
    }
  }

  // What one step pushes: per parameter, the gradient or the change the local optimizer made
  // (send; CPU, contiguous), or for a row-sparse table its touched rows (rows: ids and values).
  struct Outgoing {
    std::vector<torch::Tensor> send;
    std::vector<std::pair<torch::Tensor, torch::Tensor>> rows;
  };

  ParameterServerStep push(int64_t samples) {
    checkCanPush();
    const Outgoing out = outgoing();
    const auto commStart = Clock::now();
    std::vector<ps::wire::PushReply> replies(clients_.size());
    std::vector<int64_t> sent(clients_.size(), 0);
    const bool compress = !encoders_.empty() && steps_ >= c_.options.codecWarmupSteps;
    // The next step's rows, when every table's are known; otherwise the reply brings every row.
    bool wantRows = anyRowSparse_;
    for (size_t i = 0; i < params_.size(); ++i) wantRows = wantRows && (!rowSparse_[i] || nextRows_[i].defined());
    messages_.resize(clients_.size());
    forEachShard(clients_.size(), [&](size_t s) {
      ps::wire::PushRequest request;
      request.set_protocol(ps::kProtocolVersion);
      request.set_worker(uint32_t(c_.rank));
      request.set_pulled_version(versions_[s]);
      request.set_clock(clock_);
      request.set_samples(samples);
      request.set_want_values(true);
      request.set_row_sparse(anyRowSparse_);
      request.set_want_all_rows(anyRowSparse_ && !wantRows);
      if (!compress && !anyRowSparse_) {
        sent[s] = pushFramed(s, request, out.send, &replies[s]);
        return;
      }
      sent[s] = addValues(s, out.send, compress, request) + addRows(s, out.rows, compress, wantRows, request);
      check(clients_[s]->push(request, &replies[s]), c_.shards[s], "Push");
      if (anyRowSparse_ && wantRows) {
        loadRows(s, replies[s].version(), replies[s].values(), replies[s].rows());
      } else {
        load(s, replies[s].version(), replies[s].values());
      }
    });
    for (auto& next : nextRows_) next = torch::Tensor();
    if (mirror_) mirror_->toDevice();  // the next step's parameters, without blocking the host
    snapshot();
    const double commWaitSeconds = secondsSince(commStart);
    ++clock_;
    ++steps_;
    ParameterServerStep stats = stepOf(replies, sent);
    stats.commWaitSeconds = commWaitSeconds;
    return stats;
  }

  void checkCanPush() const {
    COHORT_CHECK(!finished_, InvalidArgument, "cohort::ParameterServerClient::step() after finish()");
    if (c_.options.push == PsPush::kUpdates) return;
    bool any = false;
    for (const auto& p : modelParams_) any = any || p.grad().defined();
    COHORT_CHECK(any, InvalidArgument,
                 "cohort::ParameterServerClient::step() before backward(): no parameter has a gradient to push");
  }

  // The gradients, or the change the local optimizer made; a row-sparse table's gradient as its
  // touched rows. From a device: through the host mirrors, each leaving the device once.
  Outgoing outgoing() {
    torch::NoGradGuard noGrad;
    Outgoing out;
    out.rows.resize(params_.size());
    if (mirror_ && c_.options.push == PsPush::kUpdates) {
      mirror_->toHost();  // the change the local optimizer made on the device
    } else if (mirror_) {
      // The dense gradients leave the device once, together; the tables' rows below.
      std::vector<torch::Tensor> grads;
      for (size_t i = 0; i < modelParams_.size(); ++i) {
        grads.push_back(rowSparse_[i] ? torch::Tensor() : modelParams_[i].grad());
      }
      gradMirror_->toHost(grads);
      mirror_->awaitDevice();  // the reply is written into the parameters' host views
    }
    for (size_t i = 0; i < params_.size(); ++i) {
      if (rowSparse_[i]) {
        const auto& g = modelParams_[i].grad();
        if (g.defined()) {
          auto [ids, values] = gradientRows(g);
          out.rows[i] = {ids.to(torch::kCPU), values.to(torch::kCPU)};  // the same tensors on the CPU
        } else {
          out.rows[i] = {torch::empty({0}, torch::kInt64), torch::empty({0, params_[i].size(1)})};
        }
        out.send.emplace_back();
      } else if (c_.options.push == PsPush::kUpdates) {
        out.send.push_back((params_[i].detach() - before_[i]).contiguous());
      } else if (gradMirror_) {
        out.send.push_back(gradMirror_->views()[i]);
      } else {
        const auto& g = params_[i].grad();
        out.send.push_back(g.defined() ? g.contiguous() : torch::zeros_like(params_[i]));
      }
    }
    return out;
  }

  // Shard s's dense pieces into its push: side by side through its encoder (and its residual)
  // when compressing, else as float32 tensors. Returns the bytes added.
  int64_t addValues(size_t s, const std::vector<torch::Tensor>& send, bool compress, ps::wire::PushRequest& request) {
    if (compress && !denseSpecs_[s].empty()) {
      float* flat = flat_[s].data();
      for (const ps::Piece* p : shardPieces_[s]) {
        if (anyRowSparse_ && p->rowDim > 0) continue;
        std::memcpy(flat, send[p->param].data_ptr<float>() + p->offset, p->numel * sizeof(float));
        flat += p->numel;
      }
      encoders_[s].encode(flat_[s], messages_[s]);
      request.set_compressed(messages_[s].data(), messages_[s].size());
      return int64_t(messages_[s].size());
    }
    for (size_t k = 0; k < shardPieces_[s].size(); ++k) {
      const ps::Piece& p = *shardPieces_[s][k];
      if (anyRowSparse_ && p.rowDim > 0) continue;
      ps::setTensor(request.add_values(), specs_[s][k], send[p.param].data_ptr<float>() + p.offset);
    }
    return payloadBytes(request.values());
  }

  // Shard s's part of each row-sparse table into its push: the touched rows, and (wantRows) the
  // rows the next step reads, asked back. Returns the bytes added.
  int64_t addRows(size_t s, const std::vector<std::pair<torch::Tensor, torch::Tensor>>& rows, bool compress,
                  bool wantRows, ps::wire::PushRequest& request) {
    int64_t bytes = 0;
    for (size_t k = 0; anyRowSparse_ && k < shardPieces_[s].size(); ++k) {
      const ps::Piece& p = *shardPieces_[s][k];
      if (p.rowDim == 0) continue;
      const auto [begin, end] = rowRange(rows[p.param].first, p);
      if (end > begin) {
        ps::wire::Rows* r = request.add_rows();
        setPushedRows(r, p, rows[p.param].first, rows[p.param].second, begin, end, compress);
        bytes += int64_t(r->ByteSizeLong());
      }
      if (wantRows) {
        const auto [from, to] = rowRange(nextRows_[p.param], p);
        ps::wire::Rows* want = request.add_want_rows();
        want->set_key(p.key);
        const int64_t* ids = nextRows_[p.param].data_ptr<int64_t>();
        const int64_t first = int64_t(p.offset / p.rowDim);
        for (int64_t j = from; j < to; ++j) want->add_rows(uint32_t(ids[j] - first));
        bytes += int64_t(want->ByteSizeLong());
      }
    }
    return bytes;
  }

  // The step as shard 0 saw it (samples, staleness, drops), with every shard's bytes.
  ParameterServerStep stepOf(const std::vector<ps::wire::PushReply>& replies, const std::vector<int64_t>& sent) {
    ParameterServerStep stats;
    const auto& first = replies[0];
    stats.samples = std::max<int64_t>(0, first.samples_total() - samplesSeen_);
    samplesSeen_ = std::max(samplesSeen_, first.samples_total());
    for (size_t s = 0; s < replies.size(); ++s) {
      stats.bytesSent += sent[s];
      stats.bytesReceived += payloadBytes(replies[s].values());
      for (const auto& r : replies[s].rows()) stats.bytesReceived += int64_t(r.ByteSizeLong());
    }
    stats.staleness = int64_t(first.staleness());
    stats.applied = first.applied();
    stats.serverWaitSeconds = first.wait_s();
    if (!first.applied()) stats.dropped = first.dropped();
    for (const auto& reply : replies) stopJob_ = stopJob_ || reply.stop_job();
    stats.stopJob = stopJob_;
    return stats;
  }

  // After finish() the shards may be gone: the parameters then are the last ones pulled.
  void synchronize() {
    if (!finished_) {
      pullAll();
      snapshot();
    }
  }

  std::optional<int64_t> resumeStep() const { return resumeStep_; }

  // Ends this worker's conversation with the shards: the non-chief workers pull the final
  // parameters and say Done; the chief first waits for the others, then pulls, reads the shards'
  // record for its report, and says Done last. After this nothing is asked of the shards, so a
  // final evaluation that takes longer than the timeout cannot make a shard count the chief lost
  // and leave before the chief's questions.
  void finish() {
    COHORT_CHECK(!finished_, InvalidArgument, "cohort::ParameterServerClient::finish() called twice");
    if (c_.rank != 0) {
      pullAll();
      finished_ = true;
      sayDone();
      return;
    }
    // The chief reports for the job, so it waits until every other worker is done or lost. It
    // tells every shard, on every round (a shard restarted meanwhile learns it too), that it will
    // push no more: a sync step then closes without its gradient, or a worker still behind (its
    // clock put apart by a kill or a restart) would wait for it in vain.
    const auto start = Clock::now();
    while (true) {
      std::vector<ps::wire::StatsReply> replies(clients_.size());
      forEachShard(clients_.size(), [&](size_t s) { replies[s] = statsOf(s, false, /*finishing=*/true); });
      const ps::wire::StatsReply& reply = replies[0];
      bool others = true;
      for (int w = 1; w < reply.done_size(); ++w) others = others && (reply.done(w) || reply.lost(w));
      if (others) break;
      COHORT_CHECK(secondsSince(start) < 2 * c_.timeoutSeconds, TimeoutError,
                   "the other workers did not finish within ", 2 * c_.timeoutSeconds, " s of the chief");
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    pullAll();
    report_ = gatherReport();
    finished_ = true;
    sayDone();
  }

  std::optional<std::string> finalCheckpointError() const { return finalCheckpointError_; }

  MetricFields report() {
    // A periodic checkpoint that failed while a later one (the final one) was written is a
    // warning: the shard can resume, from an older state than it could have.
    for (size_t s = 0; s < checkpointFailures_.size() && !finalCheckpointError_; ++s) {
      if (checkpointFailures_[s].first == 0) continue;
      c_.env->log(LogLevel::kWarning, "ps " + std::to_string(s) + ": " + std::to_string(checkpointFailures_[s].first) +
                                          " periodic checkpoint write(s) failed, training went on (the last: " +
                                          checkpointFailures_[s].second + "); its final checkpoint was written");
    }
    if (!lostWorkers_.empty()) {
      std::string list;
      for (auto w : lostWorkers_) list += (list.empty() ? "" : ", ") + std::to_string(w);
      c_.env->log(LogLevel::kWarning, "worker " + list + " stopped before the end; the others finished without it");
    }
    return report_;
  }

  MetricFields gatherReport() {
    MetricFields fields;
    std::vector<int64_t> histogram, pushed, pulled, lostWorkers, checkpointsFailed;
    checkpointFailures_.clear();
    int64_t appliedAll = 0, late = 0, stale = 0, warmup = 0, rejected = 0, partial = 0, unauth = 0, gap = 0;
    double stalenessSum = 0, waitS = 0;
    int64_t stalenessMax = 0;
    for (size_t s = 0; s < clients_.size(); ++s) {
      ps::wire::StatsReply r = statsOf(s);
      pushed.push_back(r.bytes_pushed());
      pulled.push_back(r.bytes_pulled());
      checkpointsFailed.push_back(r.checkpoints_failed());
      checkpointFailures_.emplace_back(r.checkpoints_failed(), r.checkpoint_error());
      rejected += r.rejected();
      partial += r.partial_pushes();
      unauth += r.unauthenticated();
      if (s != 0) continue;
      // Every shard sees every push; shard 0 speaks for the staleness of all.
      histogram.assign(r.staleness_histogram().begin(), r.staleness_histogram().end());
      while (histogram.size() > 1 && histogram.back() == 0) histogram.pop_back();
      appliedAll = r.applied();
      late = r.dropped_late();
      stale = r.dropped_stale();
      warmup = r.dropped_warmup();
      stalenessSum = r.staleness_mean();
      stalenessMax = r.staleness_max();
      gap = r.max_clock_gap();
      waitS = r.wait_s();
      for (int w = 0; w < r.lost_size(); ++w) {
        if (r.lost(w) && !(w < r.done_size() && r.done(w))) lostWorkers.push_back(w);
      }
    }
    fields = {{"ps_mode", std::string(psModeName(c_.options.mode))},
              {"ps_shards", int64_t(clients_.size())},
              {"staleness_mean", stalenessSum},
              {"staleness_max", stalenessMax},
              {"staleness_histogram", histogram},
              {"gradients_applied", appliedAll},
              {"dropped_late", late},
              {"dropped_stale", stale},
              {"dropped_warmup", warmup},
              {"rejected", rejected},
              {"partial_pushes", partial},
              {"unauthenticated", unauth},
              {"max_clock_gap", gap},
              {"server_wait_s", waitS},
              {"bytes_pushed_per_shard", pushed},
              {"bytes_pulled_per_shard", pulled},
              {"whole_model_pull_bytes", int64_t(wholePullBytes_)},
              {"workers_lost", lostWorkers},
              {"ps_checkpoints_failed", checkpointsFailed}};
    lostWorkers_ = lostWorkers;
    return fields;
  }

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
  int64_t pushFramed(size_t s, const ps::wire::PushRequest& header, const std::vector<torch::Tensor>& send,
                     ps::wire::PushReply* reply) {
    ps::FramedPush push;
    push.request = header;
    std::vector<ps::FrameTarget> into;
    int64_t bytes = 0;
    for (size_t k = 0; k < shardPieces_[s].size(); ++k) {
      const ps::Piece& p = *shardPieces_[s][k];
      ps::wire::Tensor* t = push.request.add_values();
      t->set_key(p.key);
      t->set_numel(p.numel);
      t->set_dtype(ps::wire::FLOAT32);
      push.payload.emplace_back(send[p.param].data_ptr<float>() + p.offset, size_t(p.numel));
      into.push_back({.key = p.key, .values = std::span<float>(params_[p.param].data_ptr<float>() + p.offset,
                                                               size_t(p.numel))});
      bytes += int64_t(p.numel * sizeof(float));
    }
    push.keepAlive = std::make_shared<const std::vector<torch::Tensor>>(send);
    check(clients_[s]->pushFramed(push, into, reply), c_.shards[s], "Push");
    versions_[s] = reply->version();
    return bytes;
  }

  ps::wire::StatsReply statsOf(size_t s, bool stopJob = false, bool finishing = false) {
    ps::wire::StatsRequest request;
    request.set_protocol(ps::kProtocolVersion);
    request.set_worker(uint32_t(c_.rank));
    request.set_stop_job(stopJob);
    request.set_finishing(finishing);
    ps::wire::StatsReply reply;
    check(clients_[s]->stats(request, &reply), c_.shards[s], "Stats");
    return reply;
  }

  void sayDone() {
    if (saidDone_) return;
    saidDone_ = true;
    std::vector<std::string> errors(clients_.size());  // one slot per shard: the calls run in parallel
    forEachShard(clients_.size(), [&](size_t s) {
      ps::wire::DoneRequest request;
      request.set_protocol(ps::kProtocolVersion);
      request.set_worker(uint32_t(c_.rank));
      ps::wire::DoneReply reply;
      check(clients_[s]->done(request, &reply), c_.shards[s], "Done");
      errors[s] = reply.final_checkpoint_error();
    });
    // The last worker's Done (the chief's) ends the run on the shards: each writes its final
    // checkpoint before answering, and says so when it could not.
    for (const std::string& e : errors) {
      if (e.empty()) continue;
      finalCheckpointError_ = finalCheckpointError_ ? *finalCheckpointError_ + "; also " + e : e;
    }
  }

  void initShards() {
    forEachShard(clients_.size(), [&](size_t s) {
      ps::wire::InitRequest request;
      request.set_protocol(ps::kProtocolVersion);
      request.set_worker(0);
      request.set_resume(c_.options.resume);
      *request.mutable_policy() = wirePolicy(c_.options, c_.workers, c_.timeoutSeconds);
      for (size_t k = 0; k < shardPieces_[s].size(); ++k) {
        const ps::Piece& piece = *shardPieces_[s][k];
        *request.add_pieces() = specs_[s][k];
        ps::setTensor(request.add_values(), specs_[s][k], params_[piece.param].data_ptr<float>() + piece.offset);
      }
      ps::wire::InitReply reply;
      check(clients_[s]->init(request, &reply), c_.shards[s], "Init");
      if (reply.resumed()) {
        c_.env->log(LogLevel::kInfo,
                    "ps shard " + c_.shards[s] + " resumed at version " + std::to_string(reply.version()));
      }
    });
  }

  // Writes every parameter (on a device: through its host view, then back to the device).
  void pullAll(bool initial = false) {
    if (mirror_) mirror_->awaitDevice();
    forEachShard(clients_.size(), [&](size_t s) {
      ps::wire::PullRequest request;
      request.set_protocol(ps::kProtocolVersion);
      request.set_worker(uint32_t(c_.rank));
      request.set_initial(initial);
      ps::wire::PullReply reply;
      check(clients_[s]->pull(request, &reply), c_.shards[s], "Pull");
      wholePullBytes_ += payloadBytes(reply.values());
      load(s, reply.version(), reply.values());
      if (s == 0) samplesSeen_ = std::max(samplesSeen_, reply.samples_total());
      if (reply.stop_job()) stopJob_ = true;
    });
    if (mirror_) mirror_->toDevice();
  }

  // The positions [begin, end) in sorted global row ids that fall in piece p.
  static std::pair<int64_t, int64_t> rowRange(const torch::Tensor& ids, const ps::Piece& p) {
    const int64_t* data = ids.data_ptr<int64_t>();
    const int64_t n = ids.numel();
    const int64_t first = int64_t(p.offset / p.rowDim);
    const int64_t last = first + int64_t(p.numel / p.rowDim);
    return {std::lower_bound(data, data + n, first) - data, std::lower_bound(data, data + n, last) - data};
  }

  // The rows [begin, end) of a table's gradient rows that fall in piece p, as the piece's local
  // rows; their values as float32, or through the 16-bit codec (fp16, bf16) when it applies.
  void setPushedRows(ps::wire::Rows* out, const ps::Piece& p, const torch::Tensor& ids, const torch::Tensor& values,
                     int64_t begin, int64_t end, bool compress) const {
    out->set_key(p.key);
    const int64_t* id = ids.data_ptr<int64_t>();
    const int64_t first = int64_t(p.offset / p.rowDim);
    for (int64_t j = begin; j < end; ++j) out->add_rows(uint32_t(id[j] - first));
    const size_t count = size_t(end - begin) * p.rowDim;
    const std::span<const float> v(values.data_ptr<float>() + size_t(begin) * p.rowDim, count);
    if (compress && codec_.sixteenBit()) {
      std::vector<uint16_t> bits(count);
      if (codec_.kind == compress::CodecKind::Fp16) {
        compress::floatsToHalf(v, bits);
        out->set_dtype(ps::wire::FLOAT16);
      } else {
        compress::floatsToBf16(v, bits);
        out->set_dtype(ps::wire::BFLOAT16);
      }
      out->set_data(reinterpret_cast<const char*>(bits.data()), count * sizeof(uint16_t));
      return;
    }
    out->set_dtype(ps::wire::FLOAT32);
    out->set_data(reinterpret_cast<const char*>(v.data()), count * sizeof(float));
  }

  // A row-sparse reply: shard s's dense pieces in values, the rows asked for in rows.
  void loadRows(size_t s, uint64_t version, const google::protobuf::RepeatedPtrField<ps::wire::Tensor>& values,
                const google::protobuf::RepeatedPtrField<ps::wire::Rows>& rows) {
    check(ps::checkTensors(values, denseSpecs_[s], false, "reply"), c_.shards[s], "Push");
    check(ps::checkRows(rows, specs_[s], true, false, "reply"), c_.shards[s], "Push");
    torch::NoGradGuard noGrad;
    int next = 0;
    std::vector<float> scratch;
    for (size_t k = 0; k < shardPieces_[s].size(); ++k) {
      const ps::Piece& p = *shardPieces_[s][k];
      float* param = params_[p.param].data_ptr<float>() + p.offset;
      if (p.rowDim == 0) {
        std::memcpy(param, values.Get(next++).data().data(), p.numel * sizeof(float));
        continue;
      }
      for (const auto& r : rows) {
        if (r.key() != p.key) continue;
        ps::rowFloats(r, scratch);
        for (int j = 0; j < r.rows_size(); ++j) {
          std::memcpy(param + size_t(r.rows(j)) * p.rowDim, scratch.data() + size_t(j) * p.rowDim,
                      p.rowDim * sizeof(float));
        }
      }
    }
    versions_[s] = version;
  }

  // The rows of table `param` the next step reads (sorted, distinct global row ids).
  void prefetchRows(const torch::Tensor& param, const torch::Tensor& ids) {
    for (size_t i = 0; i < modelParams_.size(); ++i) {
      if (!modelParams_[i].is_same(param)) continue;
      COHORT_CHECK(rowSparse_[i], InvalidArgument,
                   "cohort::ParameterServerClient::prefetchRows: the parameter is not a sparse embedding table");
      // On the CPU: the push names them (a no-op for ids there already).
      torch::Tensor rows =
          std::get<0>(torch::_unique(ids.reshape({-1}).to(torch::kInt64), /*sorted=*/true)).to(torch::kCPU);
      COHORT_CHECK(rows.numel() == 0 || (rows[0].item<int64_t>() >= 0 && rows[-1].item<int64_t>() < param.size(0)),
                   InvalidArgument, "cohort::ParameterServerClient::prefetchRows: row ids outside the table of ",
                   param.size(0), " rows");
      nextRows_[i] = rows.contiguous();
      return;
    }
    throw InvalidArgument("cohort::ParameterServerClient::prefetchRows: the tensor is not a parameter of the module");
  }

  // The chief's early stop: every shard lets its held pushes go and tells every worker to stop.
  void requestStop() {
    if (finished_) return;
    forEachShard(clients_.size(), [&](size_t s) { statsOf(s, /*stopJob=*/true); });
    stopJob_ = true;
  }

  // Copies shard s's values into the parameters.
  void load(size_t s, uint64_t version, const google::protobuf::RepeatedPtrField<ps::wire::Tensor>& values) {
    if (values.empty()) return;
    const std::span<const ps::wire::PieceSpec> specs(specs_[s]);
    ps::Status valid = ps::checkTensors(values, specs, false, "reply");
    check(valid, c_.shards[s], "Pull");
    torch::NoGradGuard noGrad;
    for (size_t k = 0; k < shardPieces_[s].size(); ++k) {
      const ps::Piece& p = *shardPieces_[s][k];
      std::memcpy(params_[p.param].data_ptr<float>() + p.offset, values.Get(int(k)).data().data(),
                  p.numel * sizeof(float));
    }
    versions_[s] = version;
  }

  PsContext c_;
  std::vector<std::unique_ptr<ps::ShardClient>> clients_;
  // What the exchange reads and writes: the module's parameters on the CPU; on a CUDA device,
  // views of mirror_'s pinned host buffer (the module's own are modelParams_).
  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> modelParams_;  // the module's parameters, where the model is
  std::unique_ptr<HostMirror> mirror_;      // on a device: the parameters in pinned host memory
  std::unique_ptr<HostMirror> gradMirror_;  // on a device, push = gradients: the gradients there
  std::vector<torch::Tensor> before_;  // push = updates: the parameters as last pulled
  std::vector<ps::Piece> pieces_;
  std::vector<std::vector<ps::wire::PieceSpec>> specs_;     // per shard, in key order
  std::vector<std::vector<const ps::Piece*>> shardPieces_;  // the same pieces
  std::vector<std::vector<ps::wire::PieceSpec>> denseSpecs_;  // per shard: what pushes carry as values
  std::vector<bool> rowSparse_;     // per parameter: a table whose gradient is row-sparse
  bool anyRowSparse_ = false;       // pushes are row_sparse
  std::vector<torch::Tensor> nextRows_;  // per table: the rows the next step reads (prefetchRows)
  std::vector<uint64_t> versions_;  // per shard: the version the parameters were pulled at
  int64_t clock_ = 0;               // steps this worker has pushed
  compress::CodecSpec codec_;
  std::vector<compress::Encoder> encoders_;         // per shard, with a codec
  std::vector<std::vector<float>> flat_;            // per shard: the pushed values side by side
  std::vector<std::vector<uint8_t>> messages_;      // per shard: the last encoded push
  int64_t steps_ = 0;                               // steps taken by this process (for the warm-up)
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

ParameterServerClient::ParameterServerClient(const Job& job, torch::nn::Module& module,
                                             torch::optim::Optimizer* optimizer, ParameterServerOptions options) {
  modelDevice(module, "cohort::ParameterServerClient");  // one device: the CPU or a CUDA one
  PsContext c;
  c.rank = job.rank();
  c.workers = job.worldSize();
  c.timeoutSeconds = double(job.timeout().count()) / 1000.0;
  c.env = &job.env();
  c.shards = options.hosts;
  if (c.shards.empty()) {
    for (const auto& h : job.cluster().parameterServers) {
      COHORT_CHECK(h.port != 0, InvalidArgument, "the shard at ", h.str(), " has no port yet (port 0 is for the "
                   "shard itself, which listens on any free port): give the workers the port it listens on");
      c.shards.push_back(h.str());
    }
  }
  c.options = std::move(options);
  // The chief of a ps job hosts no rendezvous store: cohort launch (which waits for rank 0 to tell
  // the port its store listens on) may start the other workers. A program that hosts one as well
  // connects its communicator before this.
  if (job.cluster().isChief()) launcher::tellNoPort();
  impl_ = std::make_unique<Impl>(std::move(c));
  impl_->attach(module, optimizer);
}

ParameterServerClient::~ParameterServerClient() = default;
ParameterServerStep ParameterServerClient::step(int64_t samples) { return impl_->push(samples); }
void ParameterServerClient::prefetchRows(const torch::Tensor& table, const torch::Tensor& rows) {
  impl_->prefetchRows(table, rows);
}
void ParameterServerClient::synchronize() { impl_->synchronize(); }
void ParameterServerClient::finish() { impl_->finish(); }
void ParameterServerClient::requestStop() { impl_->requestStop(); }
std::optional<int64_t> ParameterServerClient::resumeStep() const { return impl_->resumeStep(); }
MetricFields ParameterServerClient::report() { return impl_->report(); }
std::optional<std::string> ParameterServerClient::finalCheckpointError() const {
  return impl_->finalCheckpointError();
}

int serveParameterServerShard(const Job& job, const ParameterServerOptions& options, const std::string& checkpointDir) {
  const ClusterSpec& cluster = job.cluster();
  COHORT_CHECK(cluster.role == Role::kParameterServer, InvalidArgument,
               "serveParameterServerShard: this process is not a ps task (", describe(cluster), ")");
  COHORT_CHECK(size_t(cluster.rank) < cluster.parameterServers.size(), InvalidArgument,
               "this ps task has no address in the cluster spec (TF_CONFIG's \"ps\" list)");
  ps::ServerOptions server;
  server.address = cluster.parameterServers[size_t(cluster.rank)].str();
  server.authToken = options.authToken;
  server.tlsCertFile = options.tlsCert;
  server.tlsKeyFile = options.tlsKey;
  server.shard.name = "ps " + std::to_string(cluster.rank);
  server.shard.env = &job.env();
  if (!checkpointDir.empty()) server.shard.checkpointDir = checkpointDir + "/ps-" + std::to_string(cluster.rank);
  // cohort launch restarted this shard alone: the workers and the chief run on (ShardOptions::
  // restartedInJob). Not after a group restart, where the chief's resume Init comes first.
  if (const char* alone = std::getenv("COHORT_RESTARTED_ALONE")) server.shard.restartedInJob = std::string(alone) == "1";
  if (options.authToken.empty()) {
    job.env().log(LogLevel::kWarning, "no auth token: this shard accepts requests from anyone who can reach it");
  }
  return ps::runShardServer(server);
}

}  // namespace cohort
