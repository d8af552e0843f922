// ParameterServerClient (include/cohort/parameter_server.h), the worker's side of a ps job:
// attaching the model, the chief's Init and the first pull, synchronize, finish and the chief's
// report; a step's push is in parameter_server_push.cpp, the class they share in
// parameter_server_internal.h. serveParameterServerShard runs a shard in a training program.
#include "schemes/parameter_server_internal.h"
#include "schemes/ps_shard_task.h"

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

using parameter_server_internal::check;
using parameter_server_internal::forEachShard;
using parameter_server_internal::PsContext;

ParameterServerClient::Impl::Impl(PsContext c) : c_(std::move(c)) {
  COHORT_CHECK(!c_.shards.empty(), InvalidArgument,
               "--strategy ps needs parameter servers: run it under `cohort launch --ps M`, with a TF_CONFIG "
               "that lists a \"ps\" job, or give --ps-hosts HOST:PORT,...");
  const auto& o = c_.options;
  checkPolicyOptions(o, c_.workers);
  codec_ = compress::CodecSpec::parse(c_.options.codec);
  for (size_t i = 0; i < c_.shards.size(); ++i) {
    {
      clients_.push_back(
          ps::makeGrpcClient(c_.shards[i], ps::ClientOptions{.authToken = o.authToken,
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

// Parameter `name` is one the shards can hold: float32, float64, float16 or bfloat16 (the shards
// keep float32) and contiguous; float32 as a row-sparse table and with push = updates.
void ParameterServerClient::Impl::checkParameter(const std::string& name, const torch::Tensor& p,
                                                 bool rowSparse) const {
  COHORT_CHECK(isAveragedDtype(p.scalar_type()) && p.is_contiguous(), InvalidArgument, "parameter ", name, " is ",
               p.dtype(), p.is_contiguous() ? "" : " and not contiguous",
               ": the parameter server takes contiguous float32, float64, float16 and bfloat16 parameters");
  const bool float32 = p.scalar_type() == torch::kFloat32;
  COHORT_CHECK(float32 || !rowSparse, InvalidArgument, "embedding table ", name, " is ", p.dtype(),
               ": its rows travel as float32; make the table float32");
  COHORT_CHECK(float32 || c_.options.push == PsPush::kGradients, InvalidArgument, "parameter ", name, " is ", p.dtype(),
               ": --push updates sends the change a float32 model made; with a ", p.dtype(),
               " model push gradients (the shards keep float32 parameters)");
}

void ParameterServerClient::Impl::attach(torch::nn::Module& model, torch::optim::Optimizer* optimizer) {
  COHORT_CHECK(c_.options.push != PsPush::kUpdates || optimizer != nullptr, InvalidArgument,
               "cohort::ParameterServerClient: push = updates runs the worker's own optimizer: pass it");
  std::vector<ps::ParamInfo> infos;
  for (const auto& [name, p] : uniqueParameters(model)) {
    const bool rowSparse = p.dim() == 2 && hasRowSparseGradient(model, p);
    checkParameter(name, p, rowSparse);
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
  mirror_ = float32Mirror(modelParams_, *c_.env);
  if (mirror_) {
    // On a device, or of another dtype than float32: the shards' values come into float32 host
    // views of the parameters (pinned, for a device), and the gradients leave the model into a
    // float32 buffer of their own, each allocated once. The shards keep float32 parameters: a
    // bfloat16 model's updates accumulate there at float32's precision (master weights).
    params_ = mirror_->views();
    mirror_->toHost();  // the chief's Init sends them
    if (c_.options.push == PsPush::kGradients) gradMirror_ = float32Mirror(modelParams_, *c_.env);
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
      steps_ = clock_;  // the codec's warm-up counts the run's steps, not this process's
    }
  }
}

void ParameterServerClient::Impl::synchronize() {
  if (!finished_) {
    pullAll();
    snapshot();
  }
}

void ParameterServerClient::Impl::finish() {
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
  // A worker still training (its clock on shard 0 moving) is waited for however long it takes:
  // under async and ssp the others may be far behind the chief. One that makes no step for the
  // timeout (and a second, so that a dead one is first seen lost by the shards, which go on
  // without it) fails the job, naming it.
  auto progress = Clock::now();
  std::vector<int64_t> clocks;
  while (true) {
    std::vector<ps::wire::StatsReply> replies(clients_.size());
    forEachShard(clients_.size(), [&](size_t s) { replies[s] = statsOf(s, false, /*finishing=*/true); });
    const ps::wire::StatsReply& reply = replies[0];
    bool others = true;
    std::string behind;
    for (int w = 1; w < reply.done_size(); ++w) {
      if (reply.done(w) || reply.lost(w)) continue;
      others = false;
      const int64_t clock = w < reply.clocks_size() ? reply.clocks(w) : 0;
      if (size_t(w) >= clocks.size() || clocks[size_t(w)] != clock) progress = Clock::now();
      behind += (behind.empty() ? "" : ", ") + std::to_string(w) + " (at step " + std::to_string(clock) + ")";
    }
    if (others) break;
    clocks.assign(reply.clocks().begin(), reply.clocks().end());
    COHORT_CHECK(secondsSince(progress) < c_.timeoutSeconds + 1, TimeoutError, "the chief finished, but worker ",
                 behind, " made no step for ", c_.timeoutSeconds + 1,
                 " s and has not finished (a worker stuck, or slower than --timeout a step)");
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  pullAll();
  report_ = gatherReport();
  finished_ = true;
  sayDone();
}

MetricFields ParameterServerClient::Impl::report() {
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

MetricFields ParameterServerClient::Impl::gatherReport() {
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

ps::wire::StatsReply ParameterServerClient::Impl::statsOf(size_t s, bool stopJob, bool finishing) {
  ps::wire::StatsRequest request;
  request.set_protocol(ps::kProtocolVersion);
  request.set_worker(uint32_t(c_.rank));
  request.set_stop_job(stopJob);
  request.set_finishing(finishing);
  ps::wire::StatsReply reply;
  check(clients_[s]->stats(request, &reply), c_.shards[s], "Stats");
  return reply;
}

void ParameterServerClient::Impl::sayDone() {
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

void ParameterServerClient::Impl::initShards() {
  std::vector<int64_t> resumedAt(clients_.size(), -1);  // each shard's version, when it resumed
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
      resumedAt[s] = int64_t(reply.version());
      c_.env->log(LogLevel::kInfo,
                  "ps shard " + c_.shards[s] + " resumed at version " + std::to_string(reply.version()));
    }
  });
  // A resume that only some shards could take up (one's checkpoints gone) would train the resumed
  // parts of the model with the others' fresh values (the chief's Init), in every mode.
  if (c_.options.resume) {
    std::string resumed, fresh;
    for (size_t s = 0; s < resumedAt.size(); ++s) {
      std::string& list = resumedAt[s] >= 0 ? resumed : fresh;
      list += (list.empty() ? "" : ", ") + c_.shards[s];
      if (resumedAt[s] >= 0) list += " (at version " + std::to_string(resumedAt[s]) + ")";
    }
    COHORT_CHECK(resumed.empty() || fresh.empty(), InvalidArgument,
                 "cohort::ParameterServerClient: --resume, but only some shards had a checkpoint to resume from: ",
                 resumed, " resumed; ", fresh,
                 " had none and started from the chief's fresh values, which would train with the others' resumed "
                 "ones. Put the missing shards' checkpoints back in their --checkpoint-dir (ps-N), or move every "
                 "shard's checkpoints aside and start afresh without --resume");
  }
  // sync steps every shard together: shards at different versions are parts of different models
  // (one's newest checkpoint lost, say), which the workers would mix without a word.
  if (c_.options.mode != PsMode::kSync) return;
  std::string versions;
  bool differ = false;
  for (size_t s = 0; s < resumedAt.size(); ++s) {
    versions += (s == 0 ? "" : ", ") + c_.shards[s] + " at " + std::to_string(resumedAt[s]);
    differ = differ || resumedAt[s] != resumedAt[0];
  }
  COHORT_CHECK(!differ, InvalidArgument, "cohort::ParameterServerClient: the shards resumed at different versions (",
               versions,
               "; -1: not resumed), so their parts of the model are of different steps: a shard's newest "
               "checkpoint is missing or unreadable. Move every shard's checkpoints of the newer versions aside "
               "so that all resume from the same one, or start afresh without --resume");
}

void ParameterServerClient::Impl::pullAll(bool initial) {
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

void ParameterServerClient::Impl::requestStop() {
  if (finished_) return;
  forEachShard(clients_.size(), [&](size_t s) { statsOf(s, /*stopJob=*/true); });
  stopJob_ = true;
}

void ParameterServerClient::Impl::load(size_t s, uint64_t version,
                                       const google::protobuf::RepeatedPtrField<ps::wire::Tensor>& values) {
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
    checkShardHosts(c.shards, "the cluster spec's ps list");
  } else {
    checkShardHosts(c.shards, "cohort::ParameterServerOptions::hosts");
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

ps::ServerOptions shardTaskOptions(const Job& job, const ParameterServerOptions& options,
                                   const std::string& checkpointDir) {
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
  return server;
}

int serveParameterServerShard(const Job& job, const ParameterServerOptions& options, const std::string& checkpointDir) {
  const ps::ServeOutcome outcome = ps::serveShard(shardTaskOptions(job, options, checkpointDir));
  if (outcome.end == ps::ServeOutcome::End::kFailed) job.env().log(LogLevel::kError, outcome.message);
  return outcome.exitStatus();
}

}  // namespace cohort
