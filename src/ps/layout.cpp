#include "ps/layout.h"

#include <cohort/error.h>

#include <algorithm>
#include <numeric>

namespace cohort::ps {

std::vector<Piece> planLayout(std::span<const ParamInfo> params, int shards) {
  COHORT_CHECK(shards >= 1, InvalidArgument, "the parameter server needs at least one shard, got ", shards);
  uint64_t total = 0;
  for (const auto& p : params) {
    COHORT_CHECK(p.numel > 0, InvalidArgument, "parameter ", p.name, " is empty");
    total += p.numel;
  }
  // An even share, rounded up: no chunk is larger, so the loads differ by less than one share.
  const uint64_t share =
      std::clamp<uint64_t>((total + uint64_t(shards) - 1) / uint64_t(shards), 1, kMaxPieceElements);

  std::vector<size_t> order(params.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return params[a].numel > params[b].numel; });

  std::vector<uint64_t> load(size_t(shards), 0);
  auto leastLoaded = [&]() { return int(std::min_element(load.begin(), load.end()) - load.begin()); };
  std::vector<Piece> pieces;
  for (size_t i : order) {
    const ParamInfo& p = params[i];
    COHORT_CHECK(p.rowDim == 0 || p.numel % p.rowDim == 0, InvalidArgument, "parameter ", p.name, " of ", p.numel,
                 " elements is not whole rows of ", p.rowDim);
    const uint64_t chunk = p.rowDim == 0 ? share : std::max<uint64_t>(1, share / p.rowDim) * p.rowDim;
    const uint64_t chunks = (p.numel + chunk - 1) / chunk;
    for (uint64_t c = 0; c < chunks; ++c) {
      Piece piece;
      piece.param = i;
      piece.offset = c * chunk;
      piece.numel = std::min(chunk, p.numel - piece.offset);
      piece.rowDim = p.rowDim;
      piece.shard = leastLoaded();
      piece.name = chunks == 1 ? p.name
                               : p.name + "[" + std::to_string(piece.offset) + ":" +
                                     std::to_string(piece.offset + piece.numel) + "]";
      load[size_t(piece.shard)] += piece.numel;
      pieces.push_back(std::move(piece));
    }
  }
  // Keys follow the parameters' order, so a worker fills and reads pieces front to back.
  std::stable_sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
    return a.param != b.param ? a.param < b.param : a.offset < b.offset;
  });
  for (size_t k = 0; k < pieces.size(); ++k) pieces[k].key = uint32_t(k);
  return pieces;
}

std::vector<uint64_t> shardLoads(std::span<const Piece> pieces, int shards) {
  std::vector<uint64_t> load(size_t(std::max(shards, 0)), 0);
  for (const auto& p : pieces) load.at(size_t(p.shard)) += p.numel;
  return load;
}

}  // namespace cohort::ps
