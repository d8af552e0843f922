// Exchanging row-sparse tensors (the gradients or changes of sparse embedding tables) between
// ranks as rows: what DataParallel and ParameterAveraging send for such tables instead of dense
// buffers.
#pragma once

#include <cohort/communicator.h>

#include "compress/codec.h"

#include <cstdint>

namespace cohort {

struct SummedRows {
  torch::Tensor ids;     // [n] int64, sorted, distinct: every row some rank sent
  torch::Tensor values;  // [n, dim] float32: the sum over the ranks of their values of that row
  int64_t bytesSent = 0;      // this rank's ids and values, once to each other rank
  int64_t bytesReceived = 0;  // the other ranks' ids and values
};

// A collective of comm: every rank gives its rows (ids [n] int64, distinct; values [n, dim]
// float32; n may be 0 and differ between ranks, dim may not) and gets their sum over all ranks,
// added in rank order on every rank so that all get the same bits (c10d sums sparse tensors this
// way: allgather of indices and values). fp16 and bf16 make the values travel as 16 bits; other
// codecs leave them float32. Byte counts are the real payloads, not Gloo's padding to the longest.
SummedRows allreduceRows(Communicator& comm, const torch::Tensor& ids, const torch::Tensor& values,
                         const compress::CodecSpec& codec);

}  // namespace cohort
