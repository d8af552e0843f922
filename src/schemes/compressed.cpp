#include "schemes/compressed.h"

#include <cohort/error.h>

#include "base/clock.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace cohort {

using compress::CodecKind;

namespace {

// The point-to-point tag of the 16-bit ring's messages. Only the communication thread sends and
// receives with it, in the same order on every rank, so the messages of one pair of ranks pair in order.
constexpr int kRingTag = 0x7c16;
// The 16-bit ring's segment: each hop's chunk goes as pieces of at most this many bytes.
constexpr int64_t kRingSegmentBytes = 256 << 10;

std::span<uint16_t> bits16(torch::Tensor& t) {
  return {reinterpret_cast<uint16_t*>(t.data_ptr()), size_t(t.numel())};
}
std::span<float> floats(torch::Tensor& t) { return {t.data_ptr<float>(), size_t(t.numel())}; }

// The current stream of `device` on the calling thread.
c10::Stream currentStream(c10::Device device) { return c10::impl::VirtualGuardImpl(device.type()).getStream(device); }

// Where the 16-bit ring's pieces lie in a buffer of n values over `size` ranks: chunk c is
// [n c / N, n (c+1) / N) (sizes differ by at most one; some are empty when n < N), and each chunk
// is cut into `segments` pieces the same way, the same number on every rank.
struct RingLayout {
  int64_t n;
  int size;
  int64_t segments;

  RingLayout(int64_t values, int ranks)
      : n(values),
        size(ranks),
        segments(std::max<int64_t>(1, (2 * (values / ranks + 1) + kRingSegmentBytes - 1) / kRingSegmentBytes)) {}
  int mod(int c) const { return ((c % size) + size) % size; }
  int64_t first(int c, int64_t k) const {
    const int64_t start = n * c / size, length = n * (c + 1) / size - start;
    return start + length * k / segments;
  }
  int64_t length(int c, int64_t k) const { return first(c, k + 1) - first(c, k); }
};

// Runs f and adds the seconds it took to `into`.
template <class F>
void timed(double& into, F&& f) {
  const auto t = Clock::now();
  f();
  into += secondsSince(t);
}

}  // namespace

SelectOn selectOnFromEnvironment() {
  const char* value = std::getenv("COHORT_SPARSE_SELECT");
  if (value == nullptr || std::string(value).empty() || std::string(value) == "host") return SelectOn::Host;
  COHORT_CHECK(std::string(value) == "device", InvalidArgument, "COHORT_SPARSE_SELECT=", value,
               ": expected host (topk, threshold and onebit encode on the host) or device (on the GPU)");
  return SelectOn::Device;
}

CompressedSum::CompressedSum(std::shared_ptr<Communicator> comm, compress::CodecSpec spec, std::vector<int64_t> buffers,
                             c10::Device device, SelectOn select)
    : comm_(std::move(comm)), spec_(spec), device_(device) {
  const bool staged = !device_.is_cpu() && spec_.kind != CodecKind::None;
  // Every sparse codec (topk, threshold, onebit) has a pass on the device (DeviceSelect).
  const bool selectsOnDevice = staged && select == SelectOn::Device && !spec_.dense();
  if (staged) {
    stream_ = c10::impl::VirtualGuardImpl(device_.type()).getStreamFromGlobalPool(device_, /*isHighPriority=*/false);
  }
  const auto type16 = spec_.kind == CodecKind::Bf16 ? torch::kBFloat16 : torch::kHalf;
  int64_t longest = 0;
  for (int64_t n : buffers) {
    encoders_.emplace_back(spec_, size_t(n));
    if (selectsOnDevice) selects_.emplace_back(spec_, n, device_);
    longest = std::max(longest, n);
    if (staged) {
      Staging& s = staging_.emplace_back(device_.type());
      const auto pinned = torch::TensorOptions().pinned_memory(true);
      if (spec_.sixteenBit()) {
        s.host = torch::empty({n}, pinned.dtype(type16));
        s.device16 = torch::empty({n}, torch::TensorOptions().dtype(type16).device(device_));
      } else {
        s.host = torch::empty({n}, pinned.dtype(torch::kFloat32));
      }
    } else if (spec_.sixteenBit()) {
      // The wire's 16-bit values; a kHalf tensor for bf16 too (point-to-point messages are bytes).
      wire16_.push_back(torch::empty({n}, torch::kHalf));
    }
  }
  if (staged && spec_.sixteenBit()) accumulator_ = torch::empty({longest}, torch::kFloat32);
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
  // Copies still queued on the stream use the staging buffers (and the caller's buffers), which
  // the device's caching allocator would otherwise hand out again while they run.
  try {
    if (stream_) stream_->synchronize();
  } catch (const std::exception& e) {
    // After a sticky CUDA error (often what is unwinding past this handle) the wait throws too;
    // from a destructor that would end the process.
    envOrStandard(comm_ ? comm_->options().env : nullptr)
        .log(LogLevel::kWarning, std::string("CompressedSum: waiting for its stream's copies failed: ") + e.what());
  }
}

void CompressedSum::resetResiduals() {
  for (auto& e : encoders_) e.resetResidual();
  if (selects_.empty()) return;
  c10::StreamGuard onCopies(*stream_);  // after the passes queued there
  for (auto& d : selects_) d.residual().zero_();
}

std::span<const float> CompressedSum::residual(size_t id) {
  if (!selects_.empty()) {
    stream_->synchronize();  // the passes that wrote it
    const torch::Tensor onHost = selects_.at(id).residual().to(torch::kCPU);
    encoders_.at(id).setResidual({onHost.data_ptr<float>(), size_t(onHost.numel())});
  }
  return encoders_.at(id).residual();
}

void CompressedSum::setResidual(size_t id, std::span<const float> residual) {
  encoders_.at(id).setResidual(residual);
  if (selects_.empty()) return;
  c10::StreamGuard onCopies(*stream_);
  const torch::Tensor from = torch::from_blob(const_cast<float*>(residual.data()), {int64_t(residual.size())});
  selects_[id].residual().copy_(from);  // from pageable memory: done when copy_ returns
}

CompressedSum::Phases CompressedSum::phases() const {
  MutexLock lock(mutex_);
  return phases_;
}

void CompressedSum::start(size_t id, torch::Tensor flat) {
  // Codec none sums any floating dtype (Gloo and NCCL do); the others encode float32 values.
  const bool dtypeOk = spec_.kind == CodecKind::None ? flat.is_floating_point() : flat.scalar_type() == torch::kFloat32;
  COHORT_CHECK(
      id < encoders_.size() && dtypeOk && flat.is_contiguous() && flat.numel() == int64_t(encoders_[id].length()),
      InvalidArgument, "CompressedSum: buffer ", id, " must be a contiguous ",
      spec_.kind == CodecKind::None ? "floating-point" : "float32", " tensor of ",
      id < encoders_.size() ? encoders_[id].length() : 0, " elements");
  COHORT_CHECK(flat.device() == device_, InvalidArgument, "CompressedSum: buffer ", id, " is on ", flat.device(),
               ", but this exchange was made for buffers on ", device_);
  if (spec_.kind == CodecKind::None) {
    const CommCounters before = comm_->counters();
    works_[id] = comm_->allreduceAsync(flat);
    const CommCounters after = comm_->counters();
    bytesSent_ += after.bytesSent - before.bytesSent;
    bytesReceived_ += after.bytesReceived - before.bytesReceived;
    return;
  }
  if (!device_.is_cpu()) stageToHost(id, flat);
  {
    MutexLock lock(mutex_);
    done_[id] = false;
    queue_.push_back(Job{id, std::move(flat)});
  }
  changed_.notifyAll();
}

void CompressedSum::stageToHost(size_t id, const torch::Tensor& flat) {
  Staging& s = staging_[id];
  // The copy starts after what the caller's stream has queued so far: the kernels that wrote the
  // buffer. The caller does not touch the buffer again before finish().
  s.written.record(currentStream(device_));
  s.written.block(*stream_);
  if (!selects_.empty()) return;  // the communication thread's pass reads the buffer on the stream
  c10::StreamGuard onCopies(*stream_);
  if (spec_.sixteenBit()) {
    s.device16.copy_(flat);  // the cast, on the device
    s.host.copy_(s.device16, /*non_blocking=*/true);
  } else {
    s.host.copy_(flat, /*non_blocking=*/true);
  }
  s.copied.record(*stream_);
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
  // The communication thread wrote the sum into the tensor start() was given (on a device: queued
  // its copy there, which the caller's stream now waits for).
  if (!device_.is_cpu()) staging_[id].returned.block(currentStream(flat.device()));
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
  if (!device_.is_cpu()) {
    exchangeStaged(id, flat);
  } else if (spec_.sixteenBit()) {
    ring16(wire16_[id], flat, /*toFloats=*/true);
  } else {
    sparse(id, flat);
  }
}

void CompressedSum::exchangeStaged(size_t id, torch::Tensor& flat) {
  Staging& s = staging_[id];
  if (!selects_.empty()) {
    sparseOnDevice(id, flat, s.host);
    c10::StreamGuard onCopies(*stream_);
    flat.copy_(s.host, /*non_blocking=*/true);
    s.returned.record(*stream_);
    return;
  }
  const auto t = Clock::now();
  s.copied.synchronize();  // this buffer's copy to the host, nothing else of the device's
  {
    MutexLock lock(mutex_);
    phases_.encodeSeconds += secondsSince(t);
  }
  if (spec_.sixteenBit()) {
    torch::Tensor wire = s.host.view(torch::kHalf);  // bf16 too: the ring moves 16-bit patterns
    torch::Tensor acc = accumulator_.narrow(0, 0, flat.numel());
    const auto from16 = spec_.kind == CodecKind::Fp16 ? compress::halfToFloats : compress::bf16ToFloats;
    from16(bits16(wire), floats(acc));  // this rank's values, as they crossed
    ring16(wire, acc, /*toFloats=*/false);
  } else {
    sparse(id, s.host);
  }
  c10::StreamGuard onCopies(*stream_);
  if (spec_.sixteenBit()) {
    s.device16.copy_(s.host, /*non_blocking=*/true);
    flat.copy_(s.device16);  // the cast back, on the device
  } else {
    flat.copy_(s.host, /*non_blocking=*/true);
  }
  s.returned.record(*stream_);
}

void CompressedSum::ring16(torch::Tensor& wire, torch::Tensor& flat, bool toFloats) {
  const bool half = spec_.kind == CodecKind::Fp16;
  const auto to16 = half ? compress::floatsToHalf : compress::floatsToBf16;
  const auto from16 = half ? compress::halfToFloats : compress::bf16ToFloats;
  const auto addAndRound = half ? compress::addHalfAndRound : compress::addBf16AndRound;
  const int size = comm_->worldSize();
  const int rank = comm_->rank();
  const RingLayout ring(flat.numel(), size);
  const int64_t segments = ring.segments;
  auto first = [&](int c, int64_t k) { return ring.first(c, k); };
  auto length = [&](int c, int64_t k) { return ring.length(c, k); };
  auto mod = [&](int c) { return ring.mod(c); };
  auto acc = [&](int c, int64_t k) { return floats(flat).subspan(size_t(first(c, k)), size_t(length(c, k))); };
  auto bits = [&](int c, int64_t k) { return bits16(wire).subspan(size_t(first(c, k)), size_t(length(c, k))); };
  Phases spent;
  if (size == 1) {
    timed(spent.encodeSeconds, [&] { to16(floats(flat), bits16(wire)); });
  } else {
    // Hops 0..N-2 reduce-scatter: after hop h this rank holds the partial sum of chunk rank-h-1
    // over h+2 ranks, rounded; after the last, the whole sum of chunk rank+1. Hops N-1..2N-3
    // gather the owners' 16-bit sums, passed on unchanged. What a hop receives is what the next
    // one sends (out(h+1) == in(h)).
    const int hops = 2 * (size - 1);
    auto out = [&](int h) { return h < size - 1 ? mod(rank - h) : mod(rank + 1 - (h - size + 1)); };
    auto in = [&](int h) { return h < size - 1 ? mod(rank - h - 1) : mod(rank - (h - size + 1)); };
    std::vector<CommWork> sends, receives(size_t(hops * segments));
    auto receive = [&](int h) {
      for (int64_t k = 0; k < segments; ++k) {
        if (length(in(h), k) == 0) continue;
        receives[size_t(h * segments + k)] =
            comm_->recvAsync(wire.narrow(0, first(in(h), k), length(in(h), k)), mod(rank - 1), kRingTag);
        bytesReceived_ += 2 * length(in(h), k);
      }
    };
    auto send = [&](int h, int64_t k) {
      if (length(out(h), k) == 0) return;
      sends.push_back(comm_->sendAsync(wire.narrow(0, first(out(h), k), length(out(h), k)), (rank + 1) % size, kRingTag));
      bytesSent_ += 2 * length(out(h), k);
    };
    // Pipelined by segment, so that the link carries the next hop while this one's tail is still
    // arriving: a segment goes on as soon as it has arrived (and, reducing, been added). A hop's
    // receives are posted one hop ahead: Gloo sends only to a posted receive, and the peer learns
    // of it from a message that would otherwise queue behind this rank's own segments. (With 2
    // ranks hop h+1 lands in the chunk hop h sends; the peer sends a segment of it only after
    // this rank's segment of hop h has all arrived there, so its bytes have left this buffer.)
    // Both ranks post sends and receives hop by hop, segment by segment, so the messages of one
    // tag pair in order.
    receive(0);
    const int64_t mine = first(rank, 0), mineLength = first(rank, segments) - mine;
    timed(spent.encodeSeconds, [&] {
      to16(floats(flat).subspan(size_t(mine), size_t(mineLength)), bits16(wire).subspan(size_t(mine), size_t(mineLength)));
    });
    for (int64_t k = 0; k < segments; ++k) send(0, k);
    for (int h = 0; h < hops; ++h) {
      if (h + 1 < hops) receive(h + 1);
      for (int64_t k = 0; k < segments; ++k) {
        timed(spent.wireSeconds, [&] { receives[size_t(h * segments + k)].wait(); });
        if (h < size - 1) timed(spent.decodeSeconds, [&] { addAndRound(bits(in(h), k), acc(in(h), k), bits(in(h), k)); });
        if (h + 1 < hops) send(h + 1, k);
      }
    }
    timed(spent.wireSeconds, [&] {
      for (auto& s : sends) s.wait();
    });
  }
  // Every rank converts the same bits: the same floats everywhere.
  if (toFloats) timed(spent.decodeSeconds, [&] { from16(bits16(wire), floats(flat)); });
  MutexLock lock(mutex_);
  phases_.encodeSeconds += spent.encodeSeconds;
  phases_.wireSeconds += spent.wireSeconds;
  phases_.decodeSeconds += spent.decodeSeconds;
}

void CompressedSum::sparse(size_t id, torch::Tensor& flat) {
  const auto t = Clock::now();
  encoders_[id].encode(floats(flat), message_);
  gatherAndSum(flat, secondsSince(t));
}

// `host` is written again (gatherAndSum) only after select() has synchronized the stream, so after
// the previous round's copy out of it, queued there, has read it.
void CompressedSum::sparseOnDevice(size_t id, const torch::Tensor& flat, torch::Tensor& host) {
  const auto t = Clock::now();
  {
    c10::StreamGuard onCopies(*stream_);  // after the kernels that wrote the buffer (start())
    selects_[id].encode(flat, encoders_[id], message_);
  }
  gatherAndSum(host, secondsSince(t));
}

void CompressedSum::gatherAndSum(torch::Tensor& flat, double encodeSeconds) {
  const int n = comm_->worldSize();
  Phases spent;
  spent.encodeSeconds = encodeSeconds;
  auto t = Clock::now();
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
