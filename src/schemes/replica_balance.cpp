// How a batch is split over the replicas: evenly, or with options.balance by each replica's measured
// speed (see replicas_impl.h).
#include "schemes/replicas_impl.h"

#include <algorithm>
#include <vector>

namespace cohort {

// The examples of each replica in a batch of n (fewer than R: some get none). Even (sizes differing by at most one),
// or with options.balance, once every replica has been measured, in proportion to its speed
// (1 / secondsPerExample) in units of g = max(1, n / 32) examples, each at least max(1, n / 4R)
// examples. Every new shard size costs oneDNN a new primitive (its kernels generated at the
// first call), so the split changes only when its predicted step (the slowest shard's time)
// is more than kGain shorter than the current split's: for a steady speed gap it settles on one.
std::vector<int64_t> ReplicaGroup::Impl::shardSizes(int64_t n) {
  constexpr double kGain = 0.03;
  const size_t R = replicas.size();
  std::vector<int64_t> even(R);
  for (size_t r = 0; r < R; ++r) even[r] = n / int64_t(R) + (int64_t(r) < n % int64_t(R) ? 1 : 0);
  if (!options.balance || n < int64_t(R)) return even;  // the floor below needs an example a replica
  double speedSum = 0;
  for (double s : secondsPerExample) {
    if (s <= 0) return even;
    speedSum += 1.0 / s;
  }
  const int64_t g = std::max<int64_t>(1, n / 32), units = n / g, rest = n % g;
  const int64_t least = std::max<int64_t>(1, units / (4 * int64_t(R)));
  std::vector<double> target(R);
  std::vector<int64_t> count(R);
  int64_t total = 0;
  for (size_t r = 0; r < R; ++r) {
    target[r] = double(units) / secondsPerExample[r] / speedSum;
    count[r] = std::max(least, int64_t(target[r]));
    total += count[r];
  }
  // Rounding and the floor: give to whoever is furthest below its target, take from whoever
  // is furthest above it (never below the floor).
  while (total != units) {
    size_t pick = R;
    for (size_t r = 0; r < R; ++r) {
      if (total > units && count[r] <= least) continue;
      const double gap = target[r] - double(count[r]);
      if (pick == R ||
          (total < units ? gap > target[pick] - double(count[pick]) : gap < target[pick] - double(count[pick]))) {
        pick = r;
      }
    }
    const int64_t change = total < units ? 1 : -1;
    count[pick] += change;
    total += change;
  }
  // The rest (n mod g, up to g - 1: more than R when g > R) spread evenly over the replicas.
  std::vector<int64_t> candidate(R);
  for (size_t r = 0; r < R; ++r) {
    candidate[r] = count[r] * g + rest / int64_t(R) + (int64_t(r) < rest % int64_t(R) ? 1 : 0);
  }
  auto predicted = [&](const std::vector<int64_t>& sizes) {
    double slowest = 0;
    for (size_t r = 0; r < R; ++r) slowest = std::max(slowest, double(sizes[r]) * secondsPerExample[r]);
    return slowest;
  };
  if (balancedFor == 0) {
    balancedFor = n;
    balanced = even;
  }
  if (n != balancedFor) {  // another batch size (an epoch's last batch): the split kept is for balancedFor
    return predicted(candidate) < (1 - kGain) * predicted(even) ? candidate : even;
  }
  if (predicted(candidate) < (1 - kGain) * predicted(balanced)) balanced = candidate;
  return balanced;
}

// After a step with options.balance: smooths each replica's measured time per example.
void ReplicaGroup::Impl::measureSpeeds() {
  constexpr double kWeight = 0.3;  // of the newest step
  for (size_t r = 0; r < replicas.size(); ++r) {
    const int64_t examples = shardInputs[r].size(0);
    if (examples == 0 || replicas[r].computeSeconds <= 0) continue;
    const double measured = replicas[r].computeSeconds / double(examples);
    double& s = secondsPerExample[r];
    s = s <= 0 ? measured : (1 - kWeight) * s + kWeight * measured;
  }
}

}  // namespace cohort
