#include "sim/cost.h"

#include <algorithm>
#include <cmath>

namespace cohort::sim {

double ringAllreduceSeconds(int p, double n, double a, double b, double g) {
  if (p <= 1) return 0.0;
  const double share = double(p - 1) / p * n;
  return 2.0 * (p - 1) * a + 2.0 * share * b + share * g;
}

double halvingDoublingSeconds(int p, double n, double a, double b, double g) {
  if (p <= 1) return 0.0;
  int lower = 1;
  int rounds = 0;
  while (lower * 2 <= p) {
    lower *= 2;
    ++rounds;
  }
  const double share = double(lower - 1) / lower * n;
  double seconds = 2.0 * rounds * a + 2.0 * share * b + share * g;
  if (lower != p) seconds += (a + n * b + n * g) + (a + n * b);
  return seconds;
}

double ringAllgatherSeconds(int p, double m, double a, double b) {
  if (p <= 1) return 0.0;
  return (p - 1) * (a + m * b);
}

double psTransferSeconds(int workers, int shards, double m, double workerBandwidth, double serverBandwidth) {
  return std::max(m / workerBandwidth, double(workers) * m / (double(shards) * serverBandwidth));
}

double pipelineBubble(int stages, int microBatches) {
  return double(stages - 1) / double(microBatches + stages - 1);
}

double pipelineStepSeconds(int stages, int microBatches, double computeSeconds, double activationBytes, double a,
                           double b) {
  const double slot = computeSeconds / (double(stages) * microBatches);
  return (microBatches + stages - 1) * slot + 2.0 * (stages - 1) * (a + activationBytes * b);
}

std::vector<double> bucketSizes(double n, double firstBucket, double bucket) {
  std::vector<double> sizes;
  double left = n;
  double cap = firstBucket > 0 ? firstBucket : bucket;
  while (left > 0) {
    const double x = std::min(left, cap);
    sizes.push_back(x);
    left -= x;
    cap = bucket;
  }
  return sizes;
}

}  // namespace cohort::sim
