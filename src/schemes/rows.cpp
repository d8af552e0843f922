#include "schemes/rows.h"

#include <torch/torch.h>

namespace cohort {

SummedRows allreduceRows(Communicator& comm, const torch::Tensor& ids, const torch::Tensor& values,
                         const compress::CodecSpec& codec) {
  torch::NoGradGuard noGrad;
  const int64_t dim = values.size(1);
  // 16-bit values travel in a kHalf tensor: c10d 1.13's Gloo refuses kBFloat16.
  torch::Tensor flat = values.reshape({-1});
  if (codec.kind == compress::CodecKind::Fp16) flat = flat.to(torch::kHalf);
  if (codec.kind == compress::CodecKind::Bf16) flat = flat.to(torch::kBFloat16).view(torch::kHalf);
  const auto counts = comm.allgather(torch::tensor({ids.numel()}, torch::kInt64));
  int64_t longest = 0, total = 0;
  for (const auto& c : counts) {
    longest = std::max(longest, c.item<int64_t>());
    total += c.item<int64_t>();
  }
  auto paddedIds = torch::zeros({longest}, torch::kInt64);
  paddedIds.narrow(0, 0, ids.numel()).copy_(ids);
  auto paddedValues = torch::zeros({longest * dim}, flat.options());
  paddedValues.narrow(0, 0, flat.numel()).copy_(flat);
  const auto allIds = comm.allgather(paddedIds);
  const auto allValues = comm.allgather(paddedValues);

  SummedRows out;
  const int64_t rowBytes = 8 + dim * int64_t(flat.element_size());
  out.bytesSent = ids.numel() * rowBytes * (comm.worldSize() - 1);
  out.bytesReceived = (total - ids.numel()) * rowBytes;
  std::vector<torch::Tensor> idParts, valueParts;
  for (size_t r = 0; r < counts.size(); ++r) {
    const int64_t n = counts[r].item<int64_t>();
    idParts.push_back(allIds[r].narrow(0, 0, n));
    torch::Tensor v = allValues[r].narrow(0, 0, n * dim);
    if (codec.kind == compress::CodecKind::Bf16) v = v.view(torch::kBFloat16);
    valueParts.push_back(v.to(torch::kFloat32).reshape({n, dim}));
  }
  // Sum by row: unique ids, then index_add in rank order (deterministic on every rank).
  const torch::Tensor allRowIds = torch::cat(idParts);
  auto [unique, inverse] = [&] {
    auto r = torch::_unique(allRowIds, /*sorted=*/true, /*return_inverse=*/true);
    return std::pair{std::get<0>(r), std::get<1>(r)};
  }();
  out.ids = unique;
  out.values = torch::zeros({unique.numel(), dim}, torch::kFloat32);
  const torch::Tensor allRowValues = torch::cat(valueParts);
  // index_add_ on the CPU adds the rows in order, one after the other.
  out.values.index_add_(0, inverse, allRowValues);
  return out;
}

}  // namespace cohort
