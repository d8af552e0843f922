// The gradient buckets of Mirrored and CentralStorage and their sum over the replicas and, across
// processes, over the job (see replicas_impl.h).
#include "schemes/replicas_impl.h"

#include <cohort/communicator.h>
#include <cohort/error.h>

#include <torch/torch.h>

namespace cohort {

void ReplicaGroup::Impl::buildBuckets() {
  const auto& params = replicas[0].params;
  slotOf.resize(params.size());
  // A bucket holds one dtype, its sums taken in it: a parameter of another dtype than the one
  // before it (in a model that mixes them) starts a bucket, as a full bucket does.
  std::vector<std::vector<size_t>> groups(1);
  int64_t bytes = 0;
  for (size_t k = params.size(); k-- > 0;) {  // roughly the order backward produces them
    const int64_t size = params[k].numel() * int64_t(params[k].element_size());
    const bool otherDtype = !groups.back().empty() && params[groups.back().back()].dtype() != params[k].dtype();
    if (!groups.back().empty() && (otherDtype || double(bytes + size) > options.bucketMb * 1024 * 1024)) {
      groups.emplace_back();
      bytes = 0;
    }
    groups.back().push_back(k);
    bytes += size;
  }
  const size_t R = replicas.size();
  for (auto& group : groups) {
    auto bucket = std::make_unique<Bucket>();
    for (size_t k : group) bucket->numel += params[k].numel();
    const auto dtype = params[group.front()].scalar_type();
    bucket->sum = torch::zeros({bucket->numel}, torch::TensorOptions().dtype(dtype).device(replicas[0].device));
    bucket->local.resize(R);
    bucket->localSlots.resize(R);
    bucket->sumOnDevice.resize(R);
    bucket->sumOnDeviceSlots.resize(R);
    for (size_t r = 0; r < R; ++r) {
      const auto on = torch::TensorOptions().dtype(dtype).device(replicas[r].device);
      bucket->local[r] = torch::zeros({bucket->numel}, on);
      bucket->sumOnDevice[r] = elsewhere(r) ? torch::zeros({bucket->numel}, on) : bucket->sum;
    }
    int64_t offset = 0;
    for (size_t k : group) {
      slotOf[k] = {buckets.size(), bucket->params.size()};
      bucket->params.push_back(k);
      bucket->sumSlots.push_back(bucket->sum.narrow(0, offset, params[k].numel()).view(params[k].sizes()));
      for (size_t r = 0; r < R; ++r) {
        bucket->localSlots[r].push_back(bucket->local[r].narrow(0, offset, params[k].numel()).view(params[k].sizes()));
        bucket->sumOnDeviceSlots[r].push_back(
            bucket->sumOnDevice[r].narrow(0, offset, params[k].numel()).view(params[k].sizes()));
      }
      offset += params[k].numel();
    }
    buckets.push_back(std::move(bucket));
  }
  for (auto& replica : replicas) {
    replica.filled.resize(buckets.size());
    replica.pending.resize(buckets.size());
  }
}

void ReplicaGroup::Impl::onGradient(size_t r, size_t k, const torch::Tensor& grad) {
  Replica& self = replicas[r];
  if (!self.inBackward) return;  // a backward outside step(): not ours
  const auto start = Clock::now();
  torch::NoGradGuard noGrad;
  auto [b, i] = slotOf[k];
  // With a tensor, not a Scalar: mul_out's Scalar form multiplies into a temporary and copies it
  // (data_parallel.cpp's scaledInto); this is one kernel, its factor a 0-dim tensor chosen by the
  // slot's dtype (ScaleTensors).
  torch::Tensor& slot = buckets[b]->localSlots[r][i];
  torch::mul_out(slot, grad, self.weightTensors.forTensor(slot));
  self.times.copy += secondsSince(start);
  if (!self.filled[b][i]) {
    self.filled[b][i] = true;
    if (--self.pending[b] == 0) arrive(b);
  }
  if (options.overlap) sumReadyChunks(self, r, /*wait=*/false);
  self.hookSeconds += secondsSince(start);
}

void ReplicaGroup::Impl::arrive(size_t b) {
  if (buckets[b]->arrived.fetch_add(1) + 1 == int(replicas.size())) notifyAll();
}

// Replica r's chunk of bucket b: [b.numel * r / R, b.numel * (r+1) / R).
void ReplicaGroup::Impl::sumChunk(size_t r, Bucket& bucket) {
  const int64_t R = int64_t(replicas.size());
  const int64_t begin = bucket.numel * int64_t(r) / R, end = bucket.numel * (int64_t(r) + 1) / R;
  if (end > begin) {
    torch::NoGradGuard noGrad;
    auto out = bucket.sum.narrow(0, begin, end - begin);
    out.copy_(bucket.local[0].narrow(0, begin, end - begin));
    // A replica on another GPU: its part is copied to replica 0's device first (to() orders
    // the copy after the work queued on both devices).
    for (int64_t q = 1; q < R; ++q) out.add_(bucket.local[size_t(q)].narrow(0, begin, end - begin).to(out.device()));
  }
  if (bucket.summedChunks.fetch_add(1) + 1 == R && comm != nullptr && options.overlap) launchSummed();
}

// Mirrored across processes, overlapped: launches the allreduce of every bucket whose sum is
// complete, in bucket order. Buckets complete in that order (every replica sums its chunks in
// bucket order), but the replicas completing two of them race to launch: whoever holds the lock
// launches all that are ready, so every process issues its collectives in the same order.
void ReplicaGroup::Impl::launchSummed() {
  const int R = int(replicas.size());
  MutexLock lock(launchMutex);
  while (launched < buckets.size() && buckets[launched]->summedChunks.load() == R) {
    buckets[launched]->crossWork = comm->allreduceAsync(buckets[launched]->sum);
    ++launched;
  }
}

void ReplicaGroup::Impl::sumReadyChunks(Replica& self, size_t r, bool wait) {
  while (self.nextToSum < buckets.size()) {
    Bucket& bucket = *buckets[self.nextToSum];
    auto ready = [&] { return bucket.arrived.load() == int(replicas.size()); };
    if (!ready()) {
      if (!wait) return;
      waitUntil(self, ready, "to finish their backward pass");
    }
    const auto start = Clock::now();
    sumChunk(r, bucket);
    self.times.sum += secondsSince(start);
    ++self.nextToSum;
  }
}

}  // namespace cohort
