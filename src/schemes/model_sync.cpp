#include "schemes/model_sync.h"

#include <cohort/error.h>

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/torch.h>

#include <algorithm>

#include <map>
#include <optional>
#include <sstream>
#include <unordered_set>

namespace cohort {

void exchangePacked(const std::vector<torch::Tensor>& tensors,
                    const std::function<void(torch::Tensor& packed)>& exchange) {
  torch::NoGradGuard noGrad;
  std::map<c10::ScalarType, std::vector<torch::Tensor>> byType;
  for (const auto& t : tensors) byType[t.scalar_type()].push_back(t);
  for (auto& [type, group] : byType) {
    std::optional<c10::Device> device;  // the group's first device tensor, if any
    for (const auto& t : group) {
      if (!t.device().is_cpu()) {
        device = t.device();
        break;
      }
    }
    if (!device) {  // all in host memory: packed there, as it always was
      std::vector<torch::Tensor> flat;
      for (auto& t : group) flat.push_back(t.reshape({-1}));
      auto packed = torch::cat(flat);
      exchange(packed);
      int64_t offset = 0;
      for (auto& t : group) {
        t.copy_(packed.narrow(0, offset, t.numel()).view_as(t));
        offset += t.numel();
      }
      continue;
    }
    // Some on a device: packed in pinned host memory (torch's caching host allocator, so a buffer
    // of this size is reused from one call to the next), the device ones copied out without
    // blocking and waited for once, exchanged there, and copied back without blocking. The copies
    // back are ordered before the device's next kernels; the allocator keeps the buffer from
    // being reused before they have read it (it records an event on the stream of each copy).
    int64_t total = 0;
    for (const auto& t : group) total += t.numel();
    auto packed = torch::empty({total}, torch::TensorOptions().dtype(type).pinned_memory(true));
    int64_t offset = 0;
    for (const auto& t : group) {
      packed.narrow(0, offset, t.numel()).copy_(t.reshape({-1}), /*non_blocking=*/true);
      offset += t.numel();
    }
    std::vector<c10::Device> devices;
    for (const auto& t : group) {
      if (!t.device().is_cpu() && std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
        devices.push_back(t.device());
      }
    }
    for (const auto& d : devices) c10::impl::VirtualGuardImpl(d.type()).getStream(d).synchronize();
    exchange(packed);
    offset = 0;
    for (auto& t : group) {
      t.copy_(packed.narrow(0, offset, t.numel()).view_as(t), /*non_blocking=*/!t.device().is_cpu());
      offset += t.numel();
    }
  }
}

void averageInPlace(Communicator& comm, const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> floating;
  for (const auto& t : tensors) {
    if (t.defined() && t.is_floating_point()) floating.push_back(t);
  }
  if (floating.empty()) return;
  exchangePacked(floating, [&](torch::Tensor& packed) {
    comm.allreduce(packed);
    packed.div_(comm.worldSize());
  });
}

void broadcastModel(Communicator& comm, torch::nn::Module& model, int root) {
  std::vector<torch::Tensor> tensors;
  for (auto& [name, p] : uniqueParameters(model)) tensors.push_back(p);
  for (auto& b : model.buffers()) {
    if (b.defined()) tensors.push_back(b);  // may be int64, e.g. BatchNorm's count
  }
  if (tensors.empty()) return;
  exchangePacked(tensors, [&](torch::Tensor& packed) { comm.broadcast(packed, root); });
}

std::vector<std::pair<std::string, torch::Tensor>> uniqueParameters(torch::nn::Module& model) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::unordered_set<const void*> seen;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    if (!item.value().defined()) continue;
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.emplace_back(item.key(), item.value());
  }
  return out;
}

namespace {

// One line per tensor: "param fc.weight float [10, 64]".
std::vector<std::string> describeModel(torch::nn::Module& model) {
  std::vector<std::string> lines;
  auto line = [](const char* kind, const std::string& name, const torch::Tensor& t) {
    std::ostringstream out;
    out << kind << " " << name << " " << t.dtype() << " " << t.sizes();
    return out.str();
  };
  for (const auto& [name, p] : uniqueParameters(model)) {
    lines.push_back(line(p.requires_grad() ? "parameter" : "frozen parameter", name, p));
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    if (item.value().defined()) lines.push_back(line("buffer", item.key(), item.value()));
  }
  return lines;
}

std::vector<uint8_t> join(const std::vector<std::string>& lines) {
  std::string all;
  for (const auto& l : lines) all += l + "\n";
  return {all.begin(), all.end()};
}

std::vector<std::string> split(const std::vector<uint8_t>& bytes) {
  std::vector<std::string> lines;
  std::string cur;
  for (uint8_t c : bytes) {
    if (c == '\n') {
      lines.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(char(c));
    }
  }
  return lines;
}

// FNV-1a of the description, as a signed 64-bit value for an int64 tensor.
int64_t fingerprint(const std::vector<uint8_t>& bytes) {
  uint64_t h = 1469598103934665603ull;
  for (uint8_t c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return int64_t(h);
}

}  // namespace

void checkSameModel(Communicator& comm, torch::nn::Module& model, const std::string& who, const std::string& extra) {
  std::vector<std::string> mine = describeModel(model);
  if (!extra.empty()) mine.push_back(extra);
  const std::vector<uint8_t> bytes = join(mine);
  auto all = comm.allgather(torch::tensor({fingerprint(bytes), int64_t(mine.size())}, torch::kInt64));
  const int64_t reference = all[0][0].item<int64_t>();
  int other = -1;
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r][0].item<int64_t>() != reference) {
      other = int(r);
      break;
    }
  }
  if (other < 0) return;
  // Every rank learns both sides, so every rank throws the same message instead of hanging.
  const auto first = split(comm.broadcastBytes(bytes, 0));
  const auto second = split(comm.broadcastBytes(bytes, other));
  size_t i = 0;
  while (i < first.size() && i < second.size() && first[i] == second[i]) ++i;
  std::ostringstream out;
  out << who << ": the ranks' models or options differ: rank 0 has " << first.size() << " tensors, rank " << other << " has "
      << second.size() << "; first difference at tensor " << i << ": rank 0 has "
      << (i < first.size() ? first[i] : "nothing") << ", rank " << other << " has "
      << (i < second.size() ? second[i] : "nothing")
      << " (every rank must build the same model before the handle is made)";
  throw InvalidArgument(out.str());
}

namespace {

size_t totalNumel(const std::vector<torch::Tensor>& params) {
  size_t n = 0;
  for (const auto& p : params) n += size_t(p.numel());
  return n;
}

}  // namespace

void packParameters(const std::vector<torch::Tensor>& params, const torch::Tensor& flat) {
  COHORT_CHECK_EQ(size_t(flat.numel()), totalNumel(params), Error, "packParameters: the flat buffer's size");
  torch::NoGradGuard noGrad;
  int64_t at = 0;
  for (const auto& p : params) {
    flat.narrow(0, at, p.numel()).copy_(p.detach().reshape({-1}));
    at += p.numel();
  }
}

void unpackParameters(const torch::Tensor& flat, const std::vector<torch::Tensor>& params) {
  COHORT_CHECK_EQ(size_t(flat.numel()), totalNumel(params), Error, "unpackParameters: the flat buffer's size");
  torch::NoGradGuard noGrad;
  int64_t at = 0;
  for (const auto& p : params) {
    // Through copy_, not memcpy: the parameter's version counter moves, so autograd notices a
    // graph that saved the old values.
    p.detach().copy_(flat.narrow(0, at, p.numel()).view_as(p));
    at += p.numel();
  }
}

void flattenParameters(const std::vector<torch::Tensor>& params, std::span<float> flat) {
  packParameters(params, torch::from_blob(flat.data(), {int64_t(flat.size())}, torch::kFloat32));
}

void unflattenParameters(const std::vector<torch::Tensor>& params, std::span<const float> flat) {
  unpackParameters(torch::from_blob(const_cast<float*>(flat.data()), {int64_t(flat.size())}, torch::kFloat32), params);
}

void requireCpuModel(torch::nn::Module& model, const std::string& who) {
  for (const auto& [name, p] : uniqueParameters(model)) {
    COHORT_CHECK(p.device().is_cpu(), InvalidArgument, who, ": parameter ", name, " is on ", p.device(), "; ", who,
                 " trains on the CPU only so far (on a device: DataParallel, ParameterAveraging, ParameterServerClient, "
                 "Gossip): call module->to(torch::kCPU), or "
                 "--device cpu");
  }
}

c10::Device modelDevice(torch::nn::Module& model, const std::string& who) {
  std::optional<std::pair<std::string, c10::Device>> first;
  for (const auto& [name, p] : uniqueParameters(model)) {
    if (!first) {
      first.emplace(name, p.device());
      COHORT_CHECK(p.device().is_cpu() || p.device().is_cuda(), InvalidArgument, who, ": parameter ", name, " is on ",
                   p.device(), "; ", who, " trains on the CPU or a CUDA device: call module->to(device) first");
      continue;
    }
    COHORT_CHECK(p.device() == first->second, InvalidArgument, who, ": parameter ", name, " is on ", p.device(),
                 " but ", first->first, " on ", first->second, "; ", who,
                 " needs the whole model on one device: call module->to(device) first");
  }
  return first ? first->second : c10::Device(c10::kCPU);
}

std::string optimizerBytes(const torch::optim::Optimizer& optimizer) {
  std::string bytes;
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  archive.save_to([&](const void* data, size_t size) {
    bytes.append(static_cast<const char*>(data), size);
    return size;
  });
  return bytes;
}

std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> loadOptimizerKeepingOptions(
    torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive) {
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> kept;
  for (auto& group : optimizer.param_groups()) kept.push_back(group.options().clone());
  optimizer.load(archive);
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> saved;
  for (size_t g = 0; g < kept.size(); ++g) {
    auto& group = optimizer.param_groups()[g];
    saved.push_back(group.options().clone());
    group.set_options(std::move(kept[g]));
  }
  return saved;
}

void clearGradients(torch::nn::Module& model) {
  for (auto& p : model.parameters()) p.mutable_grad().reset();
}

bool hasRowSparseGradient(torch::nn::Module& model, const torch::Tensor& param) {
  const auto isSparseTable = [&](torch::nn::Module& m) {
    if (const auto* bag = m.as<torch::nn::EmbeddingBagImpl>())
      return bag->options.sparse() && bag->weight.is_same(param);
    if (const auto* emb = m.as<torch::nn::EmbeddingImpl>()) return emb->options.sparse() && emb->weight.is_same(param);
    return false;
  };
  // The model itself, then its submodules: modules(include_self = true) needs the model held in a
  // shared_ptr, and a handle should take one made on the stack.
  if (isSparseTable(model)) return true;
  for (const auto& m : model.modules(/*include_self=*/false)) {
    if (isSparseTable(*m)) return true;
  }
  return false;
}

bool hasRowSparseTable(torch::nn::Module& model) {
  for (const auto& p : model.parameters()) {
    if (hasRowSparseGradient(model, p)) return true;
  }
  return false;
}

std::pair<torch::Tensor, torch::Tensor> gradientRows(const torch::Tensor& grad) {
  torch::NoGradGuard noGrad;
  const torch::Tensor sparse = grad.is_sparse() ? grad.coalesce() : grad.to_sparse(1);
  return {sparse.indices().select(0, 0).contiguous(), sparse.values().contiguous()};
}

}  // namespace cohort
