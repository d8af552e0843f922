// An emulated cluster network on one machine, as bench/bandwidth.py builds it: one network
// namespace per process, each with an `eth0` veth whose other end sits on a bridge in a hub
// namespace, and `tc tbf rate RATE` on both ends of every veth, so that every process has a
// full-duplex link of RATE to the switch. Process i has the address 10.77.0.(i+1)/24.
// Needs root (and iproute2); the namespaces are removed by the destructor.
#pragma once

#include <string>
#include <vector>

namespace cohort::experiment {

class EmulatedNetwork {
 public:
  // Throws InvalidArgument when not root or when rate is not like 100mbit / 1gbit / 500kbit, Error
  // when a namespace cannot be made (what was made is removed first).
  EmulatedNetwork(const std::string& rate, int processes);
  ~EmulatedNetwork();
  EmulatedNetwork(const EmulatedNetwork&) = delete;
  EmulatedNetwork& operator=(const EmulatedNetwork&) = delete;

  int size() const { return processes_; }
  const std::string& rate() const { return rate_; }
  std::string namespaceOf(int process) const;  // "cohort-NNN-i"
  std::string addressOf(int process) const;    // "10.77.0.(i+1)"
  // ip netns exec NS argv...
  std::vector<std::string> wrap(int process, const std::vector<std::string>& argv) const;

 private:
  void destroy();
  std::string tag_;
  std::string rate_;
  int processes_ = 0;
};

}  // namespace cohort::experiment
