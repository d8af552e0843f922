// Checking and decoding what arrives on the wire. Everything here treats the request as hostile:
// it is what the fuzz target (fuzz/push_fuzz.cpp) drives.
#pragma once

#include "ps/status.h"
#include "ps.pb.h"

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace cohort::ps {

// Bumped whenever a message changes meaning; a shard refuses every other version.
constexpr uint32_t kProtocolVersion = 1;

Status checkProtocol(uint32_t protocol);

// `tensors` must hold exactly one FLOAT32 tensor per piece, in the pieces' order, with the piece's
// key and element count, data of numel * 4 bytes, and (when finiteOnly) no NaN or Inf. The error
// names the first problem: unknown key, missing piece, wrong shape or dtype, truncated data,
// non-finite value (with its index).
Status checkTensors(const google::protobuf::RepeatedPtrField<wire::Tensor>& tensors,
                    std::span<const wire::PieceSpec> pieces, bool finiteOnly, const char* what);

// The values of a tensor checked by checkTensors, appended to out.
void appendFloats(const wire::Tensor& tensor, std::vector<float>& out);

// The values of a tensor checked by checkTensors, in place when its data is aligned for floats
// (it is, from protobuf's parser), else copied into scratch.
std::span<const float> floatsOf(const wire::Tensor& tensor, std::vector<float>& scratch);

// A push's compressed field: a codec message of every piece's values side by side, in the
// pieces' order. Decodes it into out (resized to the pieces' total), refusing a malformed message
// (compress::decodeAdd's checks), a length other than the pieces' total, and (when finiteOnly)
// NaN or Inf, naming the first.
Status decodeCompressed(const std::string& message, std::span<const wire::PieceSpec> pieces, bool finiteOnly,
                        const char* what, std::vector<float>& out);

// A tensor for piece with `values` (numel floats) as its data.
void setTensor(wire::Tensor* tensor, const wire::PieceSpec& piece, const float* values);

// The pieces of an Init request: distinct keys, positive sizes, at most maxElements in all.
Status checkPieces(std::span<const wire::PieceSpec> pieces, uint64_t maxElements);

// The policy of an Init request: known names, counts that fit the number of workers.
Status checkPolicy(const wire::Policy& policy);

}  // namespace cohort::ps
