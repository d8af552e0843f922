#include "strategy/gossip.h"

#include "base/clock.h"
#include "strategy/local.h"

#include <torch/torch.h>

namespace cohort {

namespace {

constexpr const char* kCheckpointKey = "cohort/gossip/checkpoint";

// `--strategy gossip`: the CLI's adapter over the handle.
class GossipStrategy final : public Strategy {
 public:
  GossipStrategy(Job job, GossipOptions options) : job_(std::move(job)), options_(std::move(options)) {}

  Scheme scheme() const override { return Scheme::kGossip; }
  // Each peer's change leaves its device through pinned host memory (Gossip).
  bool trainsOnDevices() const override { return true; }
  ReplicaInfo replica() const override { return {job_.rank(), job_.worldSize()}; }

  // Every peer restores the chief's checkpoint (the rule of the other schemes): the chief puts
  // its bytes in the store it hosts, the others read them there. The replicas differed when the
  // checkpoint was written; the chief's is the one checkpointed, and the one every peer would
  // copy at the start anyway. Connects the store the Gossip handle then uses.
  std::vector<uint8_t> shareCheckpoint(std::vector<uint8_t> payload) override {
    rendezvous_ = Rendezvous::connect(job_.cluster(), job_.timeout());
    if (job_.isChief()) {
      rendezvous_->set(kCheckpointKey, std::string(payload.begin(), payload.end()));  // empty: none
      return payload;
    }
    const std::string bytes = rendezvous_->get(kCheckpointKey);
    return std::vector<uint8_t>(bytes.begin(), bytes.end());
  }

  void resumeAt(int64_t step) override { options_.firstStep = step; }

  void attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) override {
    model_ = model;
    optimizer_ = &optimizer;
    gossip_ = std::make_unique<Gossip>(job_, std::move(rendezvous_), *model, options_);
  }

  StepStats step(const Batch& batch, const LossFn& loss) override {
    const auto start = Clock::now();
    StepStats stats;
    stats.loss = forwardBackwardStep(model_, *optimizer_, batch, loss, autocast(), scaler()).item<double>();
    stats.computeSeconds = secondsSince(start);
    const GossipStep g = gossip_->step(batch.inputs.size(0));
    stats.samples = g.samples;
    stats.bytesSent = g.bytesSent;
    stats.bytesReceived = g.bytesReceived;
    stats.commWaitSeconds = g.commWaitSeconds;
    stats.stopJob = g.stopJob;
    stats.extra = {{"messages_applied", g.messagesApplied},
                   {"staleness_mean", g.stalenessMean},
                   {"staleness_max", g.stalenessMax},
                   {"peers_live", g.peersLive}};
    return stats;
  }

  void synchronize() override { gossip_->synchronize(); }
  void finish() override { gossip_->finish(); }
  void requestStop() override { gossip_->requestStop(); }
  MetricFields report() override { return gossip_->report(); }

 private:
  Job job_;
  GossipOptions options_;
  torch::nn::Sequential model_{nullptr};
  torch::optim::Optimizer* optimizer_ = nullptr;
  std::unique_ptr<Rendezvous> rendezvous_;  // from shareCheckpoint() until attach() hands it over
  std::unique_ptr<Gossip> gossip_;
};

}  // namespace

std::unique_ptr<Strategy> makeGossipStrategy(const Job& job, GossipOptions options) {
  return std::make_unique<GossipStrategy>(job, std::move(options));
}

}  // namespace cohort
