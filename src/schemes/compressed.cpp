#include "schemes/compressed.h"

#include <cohort/error.h>

#include <torch/torch.h>

#include <cstring>

namespace cohort {

using compress::CodecKind;

namespace {

std::span<uint16_t> bits16(torch::Tensor& t) {
  return {reinterpret_cast<uint16_t*>(t.data_ptr()), size_t(t.numel())};
}
std::span<float> floats(torch::Tensor& t) { return {t.data_ptr<float>(), size_t(t.numel())}; }

}  // namespace

CompressedSum::CompressedSum(std::shared_ptr<Communicator> comm, compress::CodecSpec spec, std::vector<int64_t> buffers)
    : comm_(std::move(comm)), spec_(spec) {
  for (int64_t n : buffers) {
    encoders_.emplace_back(spec_, size_t(n));
    // bf16 bits travel in a kHalf-typed tensor: Gloo in c10d 1.13 refuses at::kBFloat16 even for
    // an allgather ("Invalid scalar type"), and an allgather only copies bytes.
    if (spec_.sixteenBit()) wire16_.push_back(torch::empty({n}, torch::kHalf));
  }
}

void CompressedSum::resetResiduals() {
  for (auto& e : encoders_) e.resetResidual();
}

CommWork CompressedSum::start(size_t id, torch::Tensor flat) {
  COHORT_CHECK(flat.scalar_type() == torch::kFloat32 && flat.is_contiguous() && flat.numel() == int64_t(encoders_.at(id).length()),
               InvalidArgument, "CompressedSum: buffer ", id, " must be a contiguous float32 tensor of ",
               encoders_[id].length(), " elements");
  const int n = comm_->worldSize();
  // Runs one Communicator call and adds the bytes it counted to this sum's.
  auto counted = [&](auto&& call) {
    const CommCounters before = comm_->counters();
    auto result = call();
    const CommCounters after = comm_->counters();
    bytesSent_ += after.bytesSent - before.bytesSent;
    bytesReceived_ += after.bytesReceived - before.bytesReceived;
    return result;
  };
  switch (spec_.kind) {
    case CodecKind::None:
      return counted([&] { return comm_->allreduceAsync(flat); });
    case CodecKind::Fp16: {
      torch::Tensor& half = wire16_[id];
      compress::floatsToHalf(floats(flat), bits16(half));
      return counted([&] { return comm_->allreduceAsync(half); });
    }
    case CodecKind::Bf16: {
      torch::Tensor& bf = wire16_[id];
      compress::floatsToBf16(floats(flat), bits16(bf));
      std::vector<torch::Tensor> all = counted([&] { return comm_->allgather(bf); });
      flat.zero_();
      std::vector<float> tmp(size_t(flat.numel()));
      float* out = flat.data_ptr<float>();
      for (auto& t : all) {  // rank order: the same sum everywhere
        compress::bf16ToFloats(bits16(t), tmp);
        for (size_t i = 0; i < tmp.size(); ++i) out[i] += tmp[i];
      }
      return {};
    }
    default: break;
  }
  encoders_[id].encode(floats(flat), message_);
  auto bytes = torch::from_blob(message_.data(), {int64_t(message_.size())}, torch::kUInt8);
  std::vector<torch::Tensor> all = comm_->allgatherVariable(bytes);
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
  return {};
}

void CompressedSum::finish(size_t id, torch::Tensor flat) {
  if (spec_.kind != CodecKind::Fp16) return;
  compress::halfToFloats(bits16(wire16_[id]), floats(flat));
}

}  // namespace cohort
