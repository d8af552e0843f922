#include "base/clock.h"
#include "base/crypto.h"
#include "base/host_port.h"
#include "base/text.h"

#include "gossip/peer.h"
#include "schemes/host_mirror.h"
#include "schemes/model_sync.h"

#include <cohort/error.h>
#include <cohort/gossip.h>
#include <cohort/job.h>
#include <cohort/rendezvous.h>

#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstring>
#include <numeric>
#include <random>

namespace cohort {

namespace {

struct GossipContext {
  GossipOptions options;
  ClusterSpec cluster;  // rank, world size, and the rendezvous store's address
  double timeoutSeconds = 60;
  Env* env = nullptr;  // the job's
};

constexpr size_t kHistogramBins = 64;  // staleness >= 63 counts in the last bin

// The store's keys (the chief's store, see attach()).
constexpr const char* kInitKey = "cohort/gossip/init";      // the chief's parameters; empty once every peer joined
constexpr const char* kLayoutKey = "cohort/gossip/layout";  // the chief's parameters' names and shapes
std::string addressKey(int rank) { return "cohort/gossip/addr/" + std::to_string(rank); }
// A peer that failed to attach publishes this and its reason where its address would be.
constexpr std::string_view kFailedPrefix = "failed: ";

// Per sender: what this replica applied from it.
struct Received {
  int64_t messages = 0;
  int64_t stalenessSum = 0;
  int64_t stalenessMax = 0;
};

}  // namespace

struct COHORT_LOCAL Gossip::Impl {
  explicit Impl(GossipContext c) : c_(std::move(c)), rng_(c_.options.seed * 7919 + uint64_t(c_.cluster.rank)) {
    const int others = c_.cluster.worldSize - 1;
    COHORT_CHECK(c_.cluster.worldSize >= 2, InvalidArgument,
                 "--strategy gossip needs at least 2 workers: run it under `cohort launch -n N` (or another launcher)");
    COHORT_CHECK(c_.options.peers >= 0 && c_.options.peers <= others, InvalidArgument,
                 "--gossip-peers must be in 0..", others, " (0: all ", others, " other peers), got ", c_.options.peers);
    COHORT_CHECK(c_.options.codecWarmupSteps >= 0, InvalidArgument, "--codec-warmup-steps must not be negative");
    COHORT_CHECK(c_.options.firstStep >= 0, InvalidArgument, "GossipOptions::firstStep must not be negative, got ",
                 c_.options.firstStep);
    steps_ = c_.options.firstStep;
    fanout_ = c_.options.peers == 0 ? others : c_.options.peers;
    received_.resize(size_t(c_.cluster.worldSize));
    histogram_.assign(kHistogramBins, 0);
  }

  // `rendezvous`: one the caller connected already (GossipStrategy, to share a checkpoint), or null.
  void attach(torch::nn::Module& model, std::unique_ptr<Rendezvous> rendezvous) {
    layOutParameters(model);
    const ClusterSpec& cl = c_.cluster;
    const auto timeout = std::chrono::milliseconds(int64_t(c_.timeoutSeconds * 1000));
    std::string token = c_.options.authToken.empty() ? cl.secret : c_.options.authToken;
    // No shared secret: only on loopback, where the store and the peers are this machine's.
    COHORT_CHECK(!token.empty() || isLoopbackHost(cl.master.host), InvalidArgument,
                 "gossip between machines needs the job's secret, or any host that reaches the store could "
                 "join: set COHORT_AUTH_TOKEN (or --auth-token) to the same random value on every process "
                 "(cohort launch makes one)");
    rendezvous_ = rendezvous ? std::move(rendezvous) : Rendezvous::connect(cl, timeout);
    if (token.empty()) {
      // A random one for this job that the chief publishes, so streams are at least bound to it.
      if (cl.isChief()) rendezvous_->set("cohort/gossip/job", crypto::randomToken());
      token = rendezvous_->get("cohort/gossip/job");
    }
    std::string advertise;
    try {
      advertise = startPeer(token);
      startFromChiefParameters();
    } catch (const Error& e) {
      // Said where this peer's address would be, so that the others fail now, naming it and
      // why, instead of waiting out the timeout for an address that never comes.
      rendezvous_->set(addressKey(cl.rank), std::string(kFailedPrefix) + firstLine(e.what()));
      throw;
    }
    connectPeers(advertise);
    copyOut(before_);
  }

  // Parameter `name` is one gossip can send: contiguous, of the model's one dtype, which float32
  // holds exactly (float32, float16, bfloat16: the exchange runs on float32 copies, and a float64
  // model would be rounded to float32 at every exchange), and float32 when it is a row-sparse table.
  void checkParameter(const std::string& name, const torch::Tensor& p, bool rowSparse) const {
    const c10::ScalarType type = p.scalar_type();
    COHORT_CHECK(type == torch::kFloat32 || type == torch::kFloat16 || type == torch::kBFloat16, InvalidArgument,
                 "parameter ", name, " is ", p.dtype(),
                 ": gossip takes float32, float16 and bfloat16 parameters (its changes travel as float32, which "
                 "would round a float64 model at every exchange); convert the model (module->to(torch::kFloat32))");
    COHORT_CHECK(p.is_contiguous(), InvalidArgument, "parameter ", name,
                 " is not contiguous: gossip takes contiguous "
                 "parameters");
    COHORT_CHECK(p.scalar_type() == modelType_, InvalidArgument, "parameter ", name, " is ", p.dtype(),
                 ", the first one ", c10::toString(modelType_),
                 ": gossip takes a model of one dtype; convert it to one (module->to(dtype))");
    COHORT_CHECK(!rowSparse || modelType_ == torch::kFloat32, InvalidArgument, "embedding table ", name, " is ",
                 p.dtype(), ": gossip sends a table's rows from float32; make the model float32");
  }

  // Lays the model's parameters out as one flat update (row tables for the sparse embeddings)
  // and sizes the buffers. On a device, or of another dtype than float32, the exchange works on a
  // float32 host mirror (pinned for a device): the wire carries float32 changes.
  void layOutParameters(torch::nn::Module& model) {
    numel_ = 0;
    for (const auto& [name, p] : uniqueParameters(model)) {
      if (params_.empty()) modelType_ = p.scalar_type();
      const bool rowSparse = p.dim() == 2 && hasRowSparseGradient(model, p);
      checkParameter(name, p, rowSparse);
      tableOf_.push_back(-1);
      if (rowSparse) {
        COHORT_CHECK(p.size(0) <= int64_t(UINT32_MAX), InvalidArgument, "parameter ", name, " has ", p.size(0),
                     " rows: gossip numbers rows with 32 bits");
        tableOf_.back() = int(tables_.size());
        tables_.push_back({.offset = numel_, .rows = uint32_t(p.size(0)), .dim = uint32_t(p.size(1))});
      }
      offsets_.push_back(numel_);
      layout_ += c10::str(p.sizes()) + "\n";
      names_.push_back(name);
      numel_ += size_t(p.numel());
      params_.push_back(p);
    }
    COHORT_CHECK(numel_ > 0, InvalidArgument, "cohort::Gossip: the module has no parameters; there is nothing to send");
    modelParams_ = params_;
    mirror_ = float32Mirror(modelParams_, *c_.env);
    if (mirror_) {
      params_ = mirror_->views();  // the exchange works on float32 host views (see params_)
      mirror_->toHost();
    }
    before_.assign(numel_, 0.0f);
    update_.assign(numel_, 0.0f);
    arrived_.assign(numel_, 0.0f);
  }

  // Starts this process's peer listening; returns the host the others should reach it at.
  std::string startPeer(const std::string& token) {
    const ClusterSpec& cl = c_.cluster;
    // Where to listen, and the address to publish: the cluster spec's, loopback on one machine,
    // else every interface of the published address's family under the address the store's host
    // is reached from (addressTowards; an IPv6 one is reached only on "::", never on "0.0.0.0").
    std::string bind, advertise;
    if (!cl.workers.empty()) {
      bind = advertise = cl.workers[size_t(cl.rank)].host;
    } else if (isLoopbackHost(cl.master.host)) {
      bind = advertise = "127.0.0.1";
    } else {
      advertise = addressTowards(cl.master.host, cl.master.port);
      bind = advertise.find(':') != std::string::npos ? "::" : "0.0.0.0";
    }
    peer_ = std::make_unique<gossip::Peer>(gossip::PeerOptions{.rank = cl.rank,
                                                               .worldSize = cl.worldSize,
                                                               .token = token,
                                                               .bindHost = bind,
                                                               .timeoutSeconds = c_.timeoutSeconds,
                                                               .numel = numel_,
                                                               .codec = c_.options.codec,
                                                               .codecWarmupSteps = c_.options.codecWarmupSteps,
                                                               .tables = tables_,
                                                               .env = c_.env});
    return advertise;
  }

  // Every replica starts from the chief's parameters (TorchScript models are not seeded alike).
  // Throws InvalidArgument for a model whose parameters' shapes differ from the chief's, and for a
  // peer that joins a group already training (restarted alone, as Kubernetes restarts a failed pod):
  // its peers hold a stream from its rank and would refuse it, and it would train alone.
  void startFromChiefParameters() {
    if (c_.cluster.isChief()) {
      copyOut(before_);
      rendezvous_->set(kLayoutKey, layout_);
      rendezvous_->set(kInitKey,
                       std::string(reinterpret_cast<const char*>(before_.data()), before_.size() * sizeof(float)));
      return;
    }
    const std::string init = rendezvous_->get(kInitKey);
    COHORT_CHECK(!init.empty(), InvalidArgument, "gossip: rank ", c_.cluster.rank,
                 " joins a group that is already training: a gossip peer cannot rejoin a running group; restart the "
                 "whole job with --resume from the chief's checkpoint (as cohort launch --max-restarts does)");
    checkSameLayout(rendezvous_->get(kLayoutKey));
    COHORT_CHECK(init.size() == numel_ * sizeof(float), InvalidArgument, "gossip: the chief's model has ",
                 init.size() / sizeof(float), " parameters, this one ", numel_, ": run the same model everywhere");
    std::memcpy(before_.data(), init.data(), init.size());
    COHORT_CHECK(std::all_of(before_.begin(), before_.end(), [](float v) { return std::isfinite(v); }), CommError,
                 "gossip: the chief's initial parameters hold a NaN or Inf: refusing to start from them");
    copyIn(before_);
    if (mirror_) mirror_->toDevice();
  }

  // Throws InvalidArgument naming the first parameter whose shape differs from the chief's
  // (`chief`: its layout_), or the first one the other model lacks.
  void checkSameLayout(const std::string& chief) const {
    if (chief == layout_) return;
    const std::vector<std::string> theirs = lines(chief), mine = lines(layout_);
    for (size_t i = 0; i < std::max(theirs.size(), mine.size()); ++i) {
      const std::string a = i < theirs.size() ? theirs[i] : "missing", b = i < mine.size() ? mine[i] : "missing";
      COHORT_CHECK(a == b, InvalidArgument, "gossip: parameter ", i,
                   i < names_.size() ? " (" + names_[i] + ")" : std::string(), " is ", b, " here but ", a,
                   " on the chief (of ", theirs.size(), " parameters, here ", mine.size(),
                   "): run the same model on every worker");
    }
  }

  static std::vector<std::string> lines(const std::string& text) {
    std::vector<std::string> out;
    for (size_t at = 0; at < text.size();) {
      const size_t end = text.find('\n', at);
      out.push_back(text.substr(at, end - at));
      at = end == std::string::npos ? text.size() : end + 1;
    }
    return out;
  }

  // A peer publishes its address only once it holds the chief's parameters, and every peer
  // waits for all addresses: so no one takes its first step before every replica is ready to
  // take its own. (Published before the copy, the chief trained alone while the others read
  // its parameters from the store: 1 s for the embed model's 128 MB, most of a short run, and
  // the chief received most of their updates only after its last step.)
  void connectPeers(const std::string& advertise) {
    const ClusterSpec& cl = c_.cluster;
    rendezvous_->set(addressKey(cl.rank), HostPort{advertise, peer_->address().port}.str());
    std::vector<HostPort> addresses;
    for (int r = 0; r < cl.worldSize; ++r) {
      if (r == cl.rank) {
        addresses.push_back(peer_->address());
        continue;
      }
      const std::string address = rendezvous_->get(addressKey(r));
      COHORT_CHECK(!address.starts_with(kFailedPrefix), CommError, "gossip: rank ", r,
                   " could not join: ", address.substr(kFailedPrefix.size()));
      addresses.push_back(gossip::parsePeerAddress(address));
    }
    // Every peer has copied the chief's parameters (each published its address after): the store
    // drops them, and a peer restarted alone finds the group running (startFromChiefParameters).
    if (cl.isChief()) rendezvous_->set(kInitKey, "");
    peer_->connect(addresses);
  }

  GossipStep step(int64_t samples) {
    COHORT_CHECK(!finished_, InvalidArgument, "cohort::Gossip::step() after finish()");
    GossipStep stats;
    const auto start = Clock::now();
    if (mirror_) mirror_->toHost();  // the parameters leave the device once per step
    // The update is what the optimizer did to the parameters since the last call; a sparse
    // table's, its rows this step's gradient touched (the only ones its optimizer changed).
    std::vector<std::vector<uint32_t>> rows;
    if (tables_.empty()) {
      copyOut(update_);
      for (size_t i = 0; i < numel_; ++i) update_[i] -= before_[i];
    } else {
      rows = takeChange();
    }
    ++steps_;
    ++version_;
    failIfNeverJoined(peer_->livePeers());
    std::vector<int> live = peer_->trainingPeers();  // a finished peer gets the rest at our finish()
    std::shuffle(live.begin(), live.end(), rng_);
    live.resize(std::min(live.size(), size_t(fanout_)));
    peer_->publish(update_, gossip::UpdateMeta{.version = version_, .step = steps_, .steps = 1, .samples = samples},
                   live, rows);
    const Applied applied = applyArrived();
    backToModel(applied.messages);
    if (tables_.empty()) copyOut(before_);

    stats.samples = samples + applied.samples;
    // The peer's threads send and receive while the next step computes: a step is charged what
    // went over the wire since the previous step's charge, so that the steps add up to the total.
    const int64_t sent = peer_->bytesSent(), received = peer_->bytesReceived();
    stats.bytesSent = sent - chargedSent_;
    stats.bytesReceived = received - chargedReceived_;
    chargedSent_ = sent;
    chargedReceived_ = received;
    stats.commWaitSeconds = secondsSince(start);  // hand-offs only: nothing here waits for a peer
    stats.messagesApplied = applied.messages;
    stats.stalenessMean = applied.messages > 0 ? double(applied.stalenessSum) / double(applied.messages) : 0.0;
    stats.stalenessMax = applied.stalenessMax;
    stats.peersLive = int64_t(peer_->livePeers().size());
    if (c_.cluster.rank != 0 && !chiefStopped_) {
      const auto peers = peer_->counters();
      chiefStopped_ = !peers.empty() && peers[0].report && peers[0].report->stopJob != 0;
    }
    stats.stopJob = chiefStopped_;
    return stats;
  }

  // Adds what has arrived; a local change made since the last step() stays unpublished until the
  // next one (applyArrived moves before_ along with the parameters).
  void synchronize() {
    if (mirror_) mirror_->toHost();
    backToModel(applyArrived().messages);
  }

  // With a mirror, the views go back into the model, rounded to its dtype, only when others'
  // changes were added (`messages` of them; nothing else writes the views after toHost()).
  void backToModel(int64_t messages) {
    if (!mirror_ || messages == 0) return;
    roundToModel();
    mirror_->toDevice();
  }

  // A model of another dtype than float32 gets the float32 views rounded to its dtype: round them
  // here first, and move before_ with them, so that the next change read from the model holds
  // this replica's own change and not the rounding (which the peers would get as if it were one).
  // What a peer sent below half a unit of the model's dtype is lost, as in that dtype's own SGD.
  void roundToModel() {
    if (modelType_ == torch::kFloat32) return;
    torch::NoGradGuard noGrad;
    for (size_t i = 0; i < params_.size(); ++i) {
      torch::Tensor view = params_[i];
      const torch::Tensor rounded = view.to(modelType_).to(torch::kFloat32);
      torch::from_blob(before_.data() + offsets_[i], view.sizes(), torch::kFloat32).add_(rounded - view);
      view.copy_(rounded);
    }
  }

  void finish() {
    COHORT_CHECK(!finished_, InvalidArgument, "cohort::Gossip::finish() called twice");
    finished_ = true;
    gossip::PeerReport report;
    report.steps = steps_;
    report.bytesSent = peer_->bytesSent();
    report.bytesReceived = peer_->bytesReceived();
    report.messagesApplied = messagesApplied_;
    report.stalenessSum = stalenessSum_;
    report.stalenessMax = stalenessMax_;
    report.peersLost = int64_t(c_.cluster.worldSize - 1) - int64_t(peer_->livePeers().size());
    report.stopJob = stopRequested_ ? 1 : 0;
    peer_->finish(report);
    failIfNeverJoined(peer_->livePeers());
  }

  // A peer that has lost every other one before a stream to or from any of them opened was never
  // part of the group (the addresses published cannot be reached, say): it fails here rather than
  // train alone and end as if the job had succeeded. `live`: the peers not lost.
  void failIfNeverJoined(const std::vector<int>& live) const {
    if (!live.empty()) return;
    for (const auto& p : peer_->counters()) {
      if (p.bytesSent > 0 || p.bytesReceived > 0) return;
    }
    throw CommError("gossip: rank " + std::to_string(c_.cluster.rank) + " lost every other peer before a stream to " +
                    "or from any of them opened (the warnings above say why), so it would train alone: make the " +
                    "addresses the peers publish reachable from each other (firewall, GLOO_SOCKET_IFNAME) and " +
                    "start the job again");
  }

  MetricFields report() {
    const int n = c_.cluster.worldSize;
    const auto peers = peer_->counters();
    std::vector<int64_t> steps(size_t(n), -1), sent(size_t(n), -1), got(size_t(n), -1), applied(size_t(n), -1),
        staleSum(size_t(n), -1), staleMax(size_t(n), -1), sentTo(size_t(n), 0), receivedFrom(size_t(n), 0),
        rowsTo(size_t(n), 0), rowBytesTo(size_t(n), 0), lost;
    // This peer's own numbers at index `rank`; the others' from their DONE.
    const int me = c_.cluster.rank;
    steps[size_t(me)] = steps_;
    sent[size_t(me)] = peer_->bytesSent();
    got[size_t(me)] = peer_->bytesReceived();
    applied[size_t(me)] = messagesApplied_;
    staleSum[size_t(me)] = stalenessSum_;
    staleMax[size_t(me)] = stalenessMax_;
    for (int r = 0; r < n; ++r) {
      const auto& p = peers[size_t(r)];
      sentTo[size_t(r)] = p.bytesSent;
      receivedFrom[size_t(r)] = p.bytesReceived;
      rowsTo[size_t(r)] = p.rowsSent;
      rowBytesTo[size_t(r)] = p.rowBytesSent;
      if (r == me) continue;
      if (p.lost || !p.report) {
        lost.push_back(r);
        continue;
      }
      steps[size_t(r)] = p.report->steps;
      sent[size_t(r)] = p.report->bytesSent;
      got[size_t(r)] = p.report->bytesReceived;
      applied[size_t(r)] = p.report->messagesApplied;
      staleSum[size_t(r)] = p.report->stalenessSum;
      staleMax[size_t(r)] = p.report->stalenessMax;
    }
    std::vector<int64_t> fromMessages, fromStaleMax;
    for (const auto& r : received_) {
      fromMessages.push_back(r.messages);
      fromStaleMax.push_back(r.stalenessMax);
    }
    std::vector<int64_t> histogram = histogram_;
    while (histogram.size() > 1 && histogram.back() == 0) histogram.pop_back();
    if (!lost.empty()) {
      std::string list;
      for (auto r : lost) list += (list.empty() ? "" : ", ") + std::to_string(r);
      c_.env->log(LogLevel::kWarning, "worker " + list +
                                          " stopped before the end; the others finished without it (its numbers are "
                                          "-1 in the done event)");
    }
    MetricFields fields{{"gossip_peers", int64_t(fanout_)},
            {"codec", c_.options.codec},
            {"staleness_mean", messagesApplied_ > 0 ? double(stalenessSum_) / double(messagesApplied_) : 0.0},
            {"staleness_max", stalenessMax_},
            {"staleness_histogram", histogram},
            {"messages_applied", messagesApplied_},
            {"updates_folded", version_},
            {"unauthenticated", peer_->refusedStreams()},
            {"messages_from_peer", fromMessages},
            {"staleness_max_from_peer", fromStaleMax},
            {"bytes_sent_to_peer", sentTo},
            {"bytes_received_from_peer", receivedFrom},
            {"peer_steps", steps},
            // What this peer's threads moved after its last step's charge (finish(): the last
            // sends, DONE, and the updates of peers still training): the step events' bytes plus
            // these are peer_bytes_sent and peer_bytes_received at index `rank`, exactly.
            {"bytes_sent_after_steps", sent[size_t(me)] - chargedSent_},
            {"bytes_received_after_steps", got[size_t(me)] - chargedReceived_},
            {"peer_bytes_sent", sent},
            {"peer_bytes_received", got},
            {"peer_messages_applied", applied},
            {"peer_staleness_sum", staleSum},
            {"peer_staleness_max", staleMax},
            {"workers_lost", lost}};
    if (!tables_.empty()) {
      // The sparse tables' share of bytes_sent_to_peer: the rows (a row once a message) and what
      // their ids and values took in the frames.
      fields.emplace_back("rows_sent_to_peer", rowsTo);
      fields.emplace_back("row_bytes_sent_to_peer", rowBytesTo);
    }
    return fields;
  }

  struct Applied {
    int64_t messages = 0;
    int64_t samples = 0;
    int64_t stalenessSum = 0;
    int64_t stalenessMax = 0;
  };

  // A model with sparse tables: update_ := the change since the last step on the dense
  // parameters and on the rows the tables' gradients touched, and before_ := the parameters there.
  // Returns those rows per table; the cost follows them, not the tables' size.
  std::vector<std::vector<uint32_t>> takeChange() {
    torch::NoGradGuard noGrad;
    std::vector<std::vector<uint32_t>> rows(tables_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      float* data = params_[i].data_ptr<float>();
      const size_t at = offsets_[i];
      const int t = tableOf_[i];
      if (t < 0) {
        for (size_t j = 0; j < size_t(params_[i].numel()); ++j) {
          update_[at + j] = data[j] - before_[at + j];
          before_[at + j] = data[j];
        }
        continue;
      }
      const torch::Tensor& g = modelParams_[i].grad();
      auto& list = rows[size_t(t)];
      if (g.defined() && g.is_sparse()) {
        const torch::Tensor ids =
            std::get<0>(torch::_unique(g._indices().select(0, 0), /*sorted=*/true)).to(torch::kCPU).contiguous();
        const int64_t* id = ids.data_ptr<int64_t>();
        list.assign(id, id + ids.numel());
      } else if (g.defined()) {  // a dense gradient: any row may have changed
        list.resize(tables_[size_t(t)].rows);
        std::iota(list.begin(), list.end(), 0u);
      }
      const size_t dim = tables_[size_t(t)].dim;
      for (uint32_t r : list) {
        for (size_t k = size_t(r) * dim; k < size_t(r + 1) * dim; ++k) {
          update_[at + k] = data[k] - before_[at + k];
          before_[at + k] = data[k];
        }
      }
    }
    return rows;
  }

  // Adds what the other peers sent since the last call to the parameters.
  Applied applyArrived() {
    Applied a;
    const gossip::Drained d = peer_->drain(arrived_);
    if (d.messages == 0) return a;
    {
      torch::NoGradGuard noGrad;
      auto add = [&](float* data, size_t at, size_t from, size_t to) {
        for (size_t i = from; i < to; ++i) {
          data[i] += arrived_[at + i];
          before_[at + i] += arrived_[at + i];  // received, not this replica's own change
        }
      };
      if (tables_.empty()) {
        for (size_t i = 0; i < params_.size(); ++i) add(params_[i].data_ptr<float>(), offsets_[i], 0, size_t(params_[i].numel()));
        std::fill(arrived_.begin(), arrived_.end(), 0.0f);
      } else {  // only the dense parameters and the rows that arrived; arrived_ is zero again after
        for (size_t i = 0; i < params_.size(); ++i) {
          float* data = params_[i].data_ptr<float>();
          const size_t at = offsets_[i];
          const int t = tableOf_[i];
          if (t < 0) {
            add(data, at, 0, size_t(params_[i].numel()));
            std::fill(arrived_.begin() + ptrdiff_t(at), arrived_.begin() + ptrdiff_t(at + size_t(params_[i].numel())), 0.0f);
            continue;
          }
          const size_t dim = tables_[size_t(t)].dim;
          for (uint32_t r : d.rows[size_t(t)]) {
            add(data, at, size_t(r) * dim, size_t(r + 1) * dim);
            std::fill(arrived_.begin() + ptrdiff_t(at + size_t(r) * dim),
                      arrived_.begin() + ptrdiff_t(at + size_t(r + 1) * dim), 0.0f);
          }
        }
      }
    }
    for (const auto& m : d.metas) {
      const int64_t tau = std::max<int64_t>(0, version_ - m.version);
      a.stalenessSum += tau;
      a.stalenessMax = std::max(a.stalenessMax, tau);
      ++histogram_[std::min<size_t>(size_t(tau), kHistogramBins - 1)];
      Received& from = received_[m.sender];
      ++from.messages;
      from.stalenessSum += tau;
      from.stalenessMax = std::max(from.stalenessMax, tau);
    }
    a.messages = d.messages;
    a.samples = d.samples;
    version_ += d.steps;
    messagesApplied_ += d.messages;
    stalenessSum_ += a.stalenessSum;
    stalenessMax_ = std::max(stalenessMax_, a.stalenessMax);
    return a;
  }

  void copyOut(std::vector<float>& flat) const { flattenParameters(params_, flat); }
  void copyIn(const std::vector<float>& flat) { unflattenParameters(params_, flat); }

  GossipContext c_;
  std::mt19937_64 rng_;
  int fanout_ = 1;
  // What the exchange reads and writes: the module's parameters for a float32 model on the CPU;
  // else float32 views of mirror_'s host buffer (pinned for a CUDA device), copied from the model
  // at each step and back when updates from the others were added.
  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> modelParams_;  // the module's parameters, where the model is
  std::unique_ptr<HostMirror> mirror_;      // null for a float32 model on the CPU
  c10::ScalarType modelType_ = torch::kFloat32;  // the dtype of every parameter
  std::vector<size_t> offsets_;  // of each parameter in the flat buffers
  std::vector<int> tableOf_;     // per parameter: its row table's index, -1 when dense
  std::vector<gossip::RowTable> tables_;  // the sparse embedding tables: their changed rows travel
  size_t numel_ = 0;
  std::string layout_;              // a line per parameter: its shape
  std::vector<std::string> names_;  // of the parameters
  bool finished_ = false;
  bool stopRequested_ = false;  // the chief: requestStop() was called
  bool chiefStopped_ = false;   // another peer: the chief's DONE said it stopped the job
  std::vector<float> before_, update_, arrived_;  // flat, in parameter order
  std::unique_ptr<Rendezvous> rendezvous_;        // kept: the chief hosts the store for the others
  std::unique_ptr<gossip::Peer> peer_;
  int64_t steps_ = 0;                              // this peer's own steps, from GossipOptions::firstStep
  int64_t chargedSent_ = 0, chargedReceived_ = 0;  // the peer's byte counters at the last step's charge
  int64_t version_ = 0;  // steps folded into this replica, own and received
  int64_t messagesApplied_ = 0;
  int64_t stalenessSum_ = 0;
  int64_t stalenessMax_ = 0;
  std::vector<int64_t> histogram_;
  std::vector<Received> received_;  // by sender rank
};

Gossip::Gossip(const Job& job, torch::nn::Module& module, GossipOptions options)
    : Gossip(job, nullptr, module, std::move(options)) {}

Gossip::Gossip(const Job& job, std::unique_ptr<Rendezvous> rendezvous, torch::nn::Module& module,
               GossipOptions options) {
  modelDevice(module, "cohort::Gossip");  // one device: the CPU or a CUDA one
  impl_ = std::make_unique<Impl>(GossipContext{.options = std::move(options),
                                               .cluster = job.cluster(),
                                               .timeoutSeconds = double(job.timeout().count()) / 1000.0,
                                               .env = &job.env()});
  impl_->attach(module, std::move(rendezvous));
}

Gossip::~Gossip() = default;
GossipStep Gossip::step(int64_t samples) { return impl_->step(samples); }
void Gossip::synchronize() { impl_->synchronize(); }
void Gossip::finish() { impl_->finish(); }
void Gossip::requestStop() { impl_->stopRequested_ = true; }
MetricFields Gossip::report() { return impl_->report(); }

}  // namespace cohort
