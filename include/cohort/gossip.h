// Decentralized asynchronous SGD without a server (Strom 2015) for a user's own loop: every
// worker trains its own replica on its shard, sends the change its optimizer step made to K other
// workers without waiting, and adds the changes it receives.
//
//   cohort::Gossip gossip(job, *net, {.peers = 1});   // every replica starts from the chief's
//   for (...) {
//     optimizer.zero_grad(); loss.backward(); optimizer.step();
//     gossip.step(batchSize);      // publish this step's change, add what has arrived
//   }
//   gossip.finish();               // send what is left, wait (at most the timeout) for the others
//
// A sparse embedding table (nn::Embedding / nn::EmbeddingBag with sparse(true)) travels by rows:
// step() reads the rows its gradient touched (so between two calls a table must change only
// through those rows, as an optimizer for sparse gradients does) and sends only the rows changed
// since the last message to a peer.
//
// A model on a CUDA device trains there: the handle keeps a pinned host copy of the parameters
// (allocated once, the size of the parameters), into which they leave the device once per step();
// the change is computed, sent and the arrived updates added in host memory as for a CPU model,
// and the parameters go back to the device (without blocking the host, ordered before the next
// kernels) only when updates from other peers were added. Peers may mix CPU and CUDA models.
//
// The changes travel as float32 (or as the codec makes them of float32). A float16 or bfloat16
// model (one dtype) gets a float32 host copy the same way; the arrived changes reach it rounded to
// its dtype, and that rounding is kept out of the next change it sends (tested: a bfloat16 replica
// sends its own changes exactly and no rounding). float64 is refused: the float32 copy would round
// it at every exchange. Sparse embedding tables must be float32.
//
// Peers meet through the rendezvous store at the chief's address; each listens on a socket of its own
// (without a workers list and off loopback: every interface of the family of the address it
// publishes, the one it reaches the store from). A dead peer is logged once and left behind; no
// step ever waits for another peer. But a peer that has lost every other one before a stream to or
// from any of them opened was never in the group (unreachable addresses): its step() or finish()
// throws CommError instead of training alone. Contract: the same model on every worker; calls from
// the training thread; finish() once, on every worker.
#pragma once

#include <cohort/export.h>

#include <cohort/job.h>
#include <cohort/metrics.h>
#include <cohort/rendezvous.h>

#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <string>

namespace cohort {

struct COHORT_API GossipOptions {
  // Each step's change goes now to this many random peers still training (0: all); the others'
  // share waits in their accumulators for their turn, or finish().
  int peers = 0;
  std::string codec = "none";    // what the changes travel as (any --codec)
  int64_t codecWarmupSteps = 0;  // the first steps travel uncompressed
  std::string authToken;         // the job's secret; empty: a random one the chief publishes
  uint64_t seed = 0;             // the choice of peers
  // The step this peer resumes at (every peer restored the chief's checkpoint of step S: S). Its
  // step count goes on from there: when the codec's warm-up ends, and its steps in report(). The
  // codec's residuals start empty: the chief's parameters hold the chief's unsent changes already.
  int64_t firstStep = 0;
};

struct COHORT_API GossipStep {
  int64_t samples = 0;  // this step's examples plus those behind the updates applied
  int64_t bytesSent = 0;
  int64_t bytesReceived = 0;
  double commWaitSeconds = 0.0;  // hand-offs only: nothing waits for a peer
  int64_t messagesApplied = 0;
  double stalenessMean = 0.0;
  int64_t stalenessMax = 0;
  int64_t peersLive = 0;
  bool stopJob = false;  // the chief called requestStop() and finished: end the training loop
};

class COHORT_API Gossip {
 public:
  // Joins the other workers (a collective through the chief's store), copies the chief's
  // parameters. Throws InvalidArgument for fewer than 2 workers, bad options, a model whose
  // parameters' shapes differ from the chief's, or a peer that joins a group already training (one
  // restarted alone: a gossip peer cannot rejoin; restart the whole job, with --resume). A peer
  // that fails after it reached the store says why there, and the others' constructors then throw
  // CommError naming its rank and reason at once.
  Gossip(const Job& job, torch::nn::Module& module, GossipOptions options = {});
  // The same through a rendezvous already connected to the job's store (Rendezvous::connect with
  // the job's cluster), for a caller that used the store before: e.g. the chief sending its
  // checkpoint to every worker before training resumes. Null: the handle connects one itself.
  Gossip(const Job& job, std::unique_ptr<Rendezvous> rendezvous, torch::nn::Module& module,
         GossipOptions options = {});
  ~Gossip();
  Gossip(const Gossip&) = delete;
  Gossip& operator=(const Gossip&) = delete;

  // After optimizer.step(): publishes the change since the last call, then adds the updates that
  // have arrived. `samples`: this step's batch size.
  GossipStep step(int64_t samples);
  // Adds what has arrived, without waiting (before evaluating).
  void synchronize();
  // Sends what is left and DONE; waits until every other peer finished or is lost (at most the
  // job's timeout).
  void finish();
  // The chief, stopping early (its target accuracy is reached): its DONE tells every other peer,
  // whose next step() then returns stopJob. Call before finish().
  void requestStop();
  // The chief's report after finish(): per-peer steps, bytes, staleness, lost peers.
  MetricFields report();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace cohort
