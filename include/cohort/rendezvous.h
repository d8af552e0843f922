// A small key-value exchange among the workers of a job, through the rendezvous store that the chief
// hosts at the cluster's master address: for schemes whose peers talk over their own sockets
// (gossip) and need each other's addresses, without forming a Gloo group.
#pragma once

#include <cohort/export.h>

#include <cohort/cluster.h>

#include <chrono>
#include <memory>
#include <string>

namespace cohort {

class COHORT_API Rendezvous {
 public:
  // The chief (rank 0) hosts the store at spec.master; the others connect to it, retrying until
  // the timeout. Throws CommError naming the address when that fails, InvalidArgument naming the
  // processes when this one's rank is claimed already or its world size is not the chief's.
  static std::unique_ptr<Rendezvous> connect(const ClusterSpec& spec, std::chrono::milliseconds timeout);
  ~Rendezvous();

  void set(const std::string& key, const std::string& value);
  // Waits (up to the timeout) until the key is set; throws TimeoutError naming it otherwise, and
  // InvalidArgument with its line when another process refused the job while it waited (a rank
  // claimed twice, another world size).
  std::string get(const std::string& key);

 private:
  struct Impl;
  explicit Rendezvous(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace cohort
