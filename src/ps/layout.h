// Which shard holds which part of which parameter. Shards are balanced by bytes: parameters are
// placed largest first on the least-loaded shard, and one larger than an even share (or than
// kMaxPieceElements) is cut into chunks of at most that, spread the same way. A row-sparse table is
// cut into chunks of whole rows (a table is thus partitioned by rows over the shards).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace cohort::ps {

// The largest piece (elements): protobuf reserves a string up front only below 50 MB and grows
// larger ones by appending, copy after copy; 4M floats (16 MB) per piece keep every message
// field on the fast path, and a large tensor travels as several pieces even to one shard.
constexpr uint64_t kMaxPieceElements = uint64_t(4) << 20;

struct ParamInfo {
  std::string name;
  uint64_t numel = 0;
  // > 0: a row-sparse table (an embedding) of rows this wide: it is cut on row boundaries only,
  // so that each piece is whole rows and travels by rows.
  uint64_t rowDim = 0;
};

struct Piece {
  uint32_t key = 0;     // unique in the job; pieces are numbered in parameter order
  int shard = 0;
  size_t param = 0;     // index into the parameter list
  uint64_t offset = 0;  // first element of the parameter this piece holds
  uint64_t numel = 0;
  std::string name;     // "fc1.weight" or "fc1.weight[0:1000]"
  uint64_t rowDim = 0;  // the parameter's, when row-sparse: the piece holds rows offset/rowDim ...
};

// Throws InvalidArgument when shards < 1 or a parameter is empty.
std::vector<Piece> planLayout(std::span<const ParamInfo> params, int shards);

// Elements per shard under a layout.
std::vector<uint64_t> shardLoads(std::span<const Piece> pieces, int shards);

}  // namespace cohort::ps
