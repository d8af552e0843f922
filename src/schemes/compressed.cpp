#include "schemes/compressed.h"

#include <cohort/error.h>

#include "base/clock.h"

#include <torch/torch.h>

#include <cstring>
#include <string>

namespace cohort {

using compress::CodecKind;

namespace {

// The point-to-point tag of the 16-bit ring's messages. Only the communication thread sends and
// receives with it, one hop after the other, so the messages of one pair of ranks pair in order.
constexpr int kRingTag = 0x7c16;

std::span<uint16_t> bits16(torch::Tensor& t) {
  return {reinterpret_cast<uint16_t*>(t.data_ptr()), size_t(t.numel())};
}
std::span<float> floats(torch::Tensor& t) { return {t.data_ptr<float>(), size_t(t.numel())}; }

}  // namespace

CompressedSum::CompressedSum(std::shared_ptr<Communicator> comm, compress::CodecSpec spec, std::vector<int64_t> buffers)
    : comm_(std::move(comm)), spec_(spec) {
  for (int64_t n : buffers) {
    encoders_.emplace_back(spec_, size_t(n));
    // The wire's 16-bit values; a kHalf tensor for bf16 too (point-to-point messages are bytes).
    if (spec_.sixteenBit()) wire16_.push_back(torch::empty({n}, torch::kHalf));
  }
  works_.resize(buffers.size());
  done_.assign(buffers.size(), true);
  if (spec_.kind != CodecKind::None) thread_ = std::thread([this] { run(); });
}

CompressedSum::~CompressedSum() {
  {
    MutexLock lock(mutex_);
    stopping_ = true;
    queue_.clear();
  }
  changed_.notifyAll();
  if (thread_.joinable()) thread_.join();
}

void CompressedSum::resetResiduals() {
  for (auto& e : encoders_) e.resetResidual();
}

CompressedSum::Phases CompressedSum::phases() const {
  MutexLock lock(mutex_);
  return phases_;
}

void CompressedSum::start(size_t id, torch::Tensor flat) {
  COHORT_CHECK(id < encoders_.size() && flat.scalar_type() == torch::kFloat32 && flat.is_contiguous() &&
                   flat.numel() == int64_t(encoders_[id].length()),
               InvalidArgument, "CompressedSum: buffer ", id, " must be a contiguous float32 tensor of ",
               id < encoders_.size() ? encoders_[id].length() : 0, " elements");
  if (spec_.kind == CodecKind::None) {
    const CommCounters before = comm_->counters();
    works_[id] = comm_->allreduceAsync(flat);
    const CommCounters after = comm_->counters();
    bytesSent_ += after.bytesSent - before.bytesSent;
    bytesReceived_ += after.bytesReceived - before.bytesReceived;
    return;
  }
  {
    MutexLock lock(mutex_);
    done_[id] = false;
    queue_.push_back(Job{id, std::move(flat)});
  }
  changed_.notifyAll();
}

void CompressedSum::finish(size_t id, torch::Tensor flat) {
  if (spec_.kind == CodecKind::None) {
    works_.at(id).wait();
    works_[id] = CommWork();
    return;
  }
  // Every exchange ahead of this one is bounded by the communicator's timeout per operation (2
  // (N-1) hops of the ring, two allgathers for a sparse message): give up when the thread has
  // finished nothing for longer than the longest of them.
  const auto patience = comm_->options().timeout * (2 * comm_->worldSize() + 1);
  MutexLock lock(mutex_);
  size_t seen = finished_;
  auto deadline = std::chrono::steady_clock::now() + patience;
  while (!done_.at(id)) {
    if (finished_ != seen) {
      seen = finished_;
      deadline = std::chrono::steady_clock::now() + patience;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      throw TimeoutError("the " + spec_.text() + " exchange of gradient bucket " + std::to_string(id) +
                         " made no progress for " +
                         std::to_string(std::chrono::duration_cast<std::chrono::seconds>(patience).count()) +
                         " s: a peer stopped answering (--timeout to wait longer)");
    }
    changed_.waitUntil(mutex_, deadline);
  }
  if (failure_) std::rethrow_exception(failure_);
  (void)flat;  // the communication thread wrote the sum into the tensor start() was given
}

void CompressedSum::run() {
  for (;;) {
    Job job;
    bool failed = false;
    {
      MutexLock lock(mutex_);
      while (queue_.empty() && !stopping_) changed_.waitFor(mutex_, std::chrono::seconds(1));
      if (stopping_) return;
      job = std::move(queue_.front());
      queue_.pop_front();
      failed = failure_ != nullptr;
    }
    std::exception_ptr error;
    if (!failed) {
      try {
        exchange(job.id, job.flat);
      } catch (...) {
        error = std::current_exception();
      }
    }
    {
      MutexLock lock(mutex_);
      if (error && !failure_) failure_ = error;
      done_[job.id] = true;
      ++finished_;
    }
    changed_.notifyAll();
  }
}

void CompressedSum::exchange(size_t id, torch::Tensor& flat) {
  if (spec_.sixteenBit()) {
    ring16(id, flat);
  } else {
    sparse(id, flat);
  }
}

void CompressedSum::ring16(size_t id, torch::Tensor& flat) {
  const bool half = spec_.kind == CodecKind::Fp16;
  const auto to16 = half ? compress::floatsToHalf : compress::floatsToBf16;
  const auto from16 = half ? compress::halfToFloats : compress::bf16ToFloats;
  const auto addAndRound = half ? compress::addHalfAndRound : compress::addBf16AndRound;
  torch::Tensor& wire = wire16_[id];
  const int64_t n = flat.numel();
  const int size = comm_->worldSize();
  const int rank = comm_->rank();
  // Chunk c is [n c / N, n (c+1) / N): sizes differ by at most one; some are empty when n < N.
  auto first = [&](int c) { return n * c / size; };
  auto length = [&](int c) { return first(c + 1) - first(c); };
  auto acc = [&](int c) { return floats(flat).subspan(size_t(first(c)), size_t(length(c))); };
  auto bits = [&](int c) { return bits16(wire).subspan(size_t(first(c)), size_t(length(c))); };
  auto mod = [&](int c) { return ((c % size) + size) % size; };
  Phases spent;
  auto timed = [](double& into, auto&& f) {
    const auto t = Clock::now();
    f();
    into += secondsSince(t);
  };
  // One hop: chunk `out` (16 bits) to the next rank, chunk `in` from the previous one.
  auto hop = [&](int out, int in) {
    timed(spent.wireSeconds, [&] {
      CommWork send, receive;
      if (length(out) > 0) send = comm_->sendAsync(wire.narrow(0, first(out), length(out)), (rank + 1) % size, kRingTag);
      if (length(in) > 0) receive = comm_->recvAsync(wire.narrow(0, first(in), length(in)), mod(rank - 1), kRingTag);
      send.wait();
      receive.wait();
    });
    bytesSent_ += 2 * length(out);
    bytesReceived_ += 2 * length(in);
  };
  if (size == 1) {
    timed(spent.encodeSeconds, [&] { to16(floats(flat), bits16(wire)); });
  } else {
    timed(spent.encodeSeconds, [&] { to16(acc(rank), bits(rank)); });
    // Reduce-scatter: after hop s, this rank holds the partial sum of chunk rank - s - 1 over
    // s + 2 ranks, rounded; after the last, the whole sum of chunk rank + 1.
    for (int s = 0; s + 1 < size; ++s) {
      const int in = mod(rank - s - 1);
      hop(mod(rank - s), in);
      timed(spent.decodeSeconds, [&] { addAndRound(bits(in), acc(in), bits(in)); });
    }
    // Allgather: the owners' 16-bit sums, passed on unchanged.
    for (int s = 0; s + 1 < size; ++s) hop(mod(rank + 1 - s), mod(rank - s));
  }
  // Every rank converts the same bits: the same floats everywhere.
  timed(spent.decodeSeconds, [&] { from16(bits16(wire), floats(flat)); });
  MutexLock lock(mutex_);
  phases_.encodeSeconds += spent.encodeSeconds;
  phases_.wireSeconds += spent.wireSeconds;
  phases_.decodeSeconds += spent.decodeSeconds;
}

void CompressedSum::sparse(size_t id, torch::Tensor& flat) {
  const int n = comm_->worldSize();
  Phases spent;
  auto t = Clock::now();
  encoders_[id].encode(floats(flat), message_);
  spent.encodeSeconds = secondsSince(t);
  t = Clock::now();
  auto bytes = torch::from_blob(message_.data(), {int64_t(message_.size())}, torch::kUInt8);
  std::vector<torch::Tensor> all = comm_->allgatherVariable(bytes);
  spent.wireSeconds = secondsSince(t);
  t = Clock::now();
  flat.zero_();
  for (int r = 0; r < n; ++r) {
    const torch::Tensor& m = all[size_t(r)];
    const std::span<const uint8_t> msg(m.data_ptr<uint8_t>(), size_t(m.numel()));
    try {
      compress::decodeAdd(msg, floats(flat));
    } catch (const compress::MalformedMessage& e) {
      throw CommError("rank " + std::to_string(r) + " sent a " + spec_.text() + " message this rank cannot read (" +
                      e.what() + "): do all workers run the same cohort with the same --codec?");
    }
    if (r != comm_->rank()) bytesReceived_ += m.numel();
  }
  bytesSent_ += int64_t(message_.size()) * (n - 1);
  spent.decodeSeconds = secondsSince(t);
  MutexLock lock(mutex_);
  phases_.encodeSeconds += spent.encodeSeconds;
  phases_.wireSeconds += spent.wireSeconds;
  phases_.decodeSeconds += spent.decodeSeconds;
}

}  // namespace cohort
