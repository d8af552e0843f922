// Checking and decoding what arrives on the wire. Everything here treats the request as hostile:
// it is what the fuzz target (fuzz/push_fuzz.cpp) drives.
#pragma once

#include "ps.pb.h"
#include "ps/optimizer.h"
#include "ps/status.h"

#include <cstdint>
#include <span>
#include <string>
#include <memory>
#include <utility>
#include <vector>

namespace cohort::ps {

// Bumped whenever a message changes meaning; a shard refuses every other version. 2: pushes of
// float32 values travel as frames (ps/frame.h, the PushFramed call). 3: or as a stream of frames,
// a chunk of pieces each (the PushStream call). 4: a push's value may say that the worker has no
// gradient for the piece (isNoGradient).
constexpr uint32_t kProtocolVersion = 4;

Status checkProtocol(uint32_t protocol);

// A push's value for a piece whose parameter has no gradient this step (its grad undefined: a
// frozen layer, a branch the batch did not use): the piece's key, numel 0, dtype
// DTYPE_UNSPECIFIED, no data (a few bytes, no payload). The shard leaves such a piece and its
// optimizer state alone, as torch's optimizers skip a parameter without a gradient; sync and
// softsync count the push in the piece's average as a zero gradient (DataParallel's rule for a
// parameter some ranks did not use), and a piece no push of the step or group had a gradient for
// is left alone.
bool isNoGradient(const wire::Tensor& t);
void setNoGradient(wire::Tensor* t, const wire::PieceSpec& piece);

// Whether a check lets a push's value say "no gradient" (isNoGradient): pushes only, never Init
// values or replies.
enum class NoGradient { kRefused, kAllowed };

// `tensors` must hold exactly one FLOAT32 tensor per piece, in the pieces' order, with the piece's
// key and element count, data of numel * 4 bytes, and (when finiteOnly) no NaN or Inf; or, where
// allowed, the piece's no-gradient value. The error names the first problem: unknown key, missing
// piece, wrong shape or dtype, truncated data, non-finite value (with its index).
Status checkTensors(const google::protobuf::RepeatedPtrField<wire::Tensor>& tensors,
                    std::span<const wire::PieceSpec> pieces, bool finiteOnly, const char* what,
                    NoGradient noGradient = NoGradient::kRefused);

// One tensor's dtype (FLOAT32) and element count against its piece; the error starts with what.
Status checkPieceShape(const wire::Tensor& t, const wire::PieceSpec& p, const std::string& what);

// The index of the first NaN or Inf among n floats at any alignment, or n when all are finite.
size_t firstNonFinite(const void* floats, size_t n);

// Leaves what it makes uninitialized (resize() does not zero): for buffers about to be written
// whole, such as a push's floats copied out of the transport's buffers.
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

// Where a piece's floats are copied when they cannot be read in place.
using FloatScratch = std::vector<float, DefaultInitAllocator<float>>;

// The values of a tensor checked by checkTensors, appended to out.
void appendFloats(const wire::Tensor& tensor, std::vector<float>& out);

// The values of a tensor checked by checkTensors, in place when its data is aligned for floats
// (it is, from protobuf's parser), else copied into scratch.
std::span<const float> floatsOf(const wire::Tensor& tensor, FloatScratch& scratch);

// A push's compressed field: a codec message of every piece's values side by side, in the
// pieces' order. Decodes it into out (resized to the pieces' total), refusing a malformed message
// (compress::decodeAdd's checks), a length other than the pieces' total, and (when finiteOnly)
// NaN or Inf, naming the first.
Status decodeCompressed(const std::string& message, std::span<const wire::PieceSpec> pieces, bool finiteOnly,
                        const char* what, std::vector<float>& out);

// The rows of row-sparse pieces (PieceSpec.row_dim > 0) in a push (withData) or a request for
// rows (!withData): each entry names a row-sparse piece of `pieces` at most once, its rows are
// strictly increasing and inside the piece, and (withData) its data holds exactly that many rows
// of FLOAT32, FLOAT16 or BFLOAT16 values, finite when finiteOnly; without data, no data and no
// dtype. The error names the first problem.
Status checkRows(const google::protobuf::RepeatedPtrField<wire::Rows>& rows, std::span<const wire::PieceSpec> pieces,
                 bool withData, bool finiteOnly, const char* what);

// The values of rows checked by checkRows, as floats, into out (resized).
void rowFloats(const wire::Rows& rows, std::vector<float>& out);

// Sets rows to the given rows of piece, their values taken from `pieceValues` (the piece's numel
// floats), as FLOAT32.
void setRows(wire::Rows* rows, const wire::PieceSpec& piece, std::span<const uint32_t> which, const float* pieceValues);

// A tensor for piece with `values` (numel floats) as its data.
void setTensor(wire::Tensor* tensor, const wire::PieceSpec& piece, const float* values);

// The pieces of an Init request: distinct keys, positive sizes, at most maxElements in all.
Status checkPieces(std::span<const wire::PieceSpec> pieces, uint64_t maxElements);

// The names of the policy's choices, as the command line and messages spell them ("sync",
// "inverse", "gradients", "adam"); "" for UNSPECIFIED or a value this version does not know.
const char* modeName(wire::Mode mode);
const char* stalenessLrName(wire::StalenessLr rule);
const char* pushName(wire::Push push);
const char* optimizerName(wire::Optimizer optimizer);

// The update rule an optimizer on the wire means. Only for a policy checkPolicy() accepted: any
// other value throws InvalidArgument.
UpdateRule updateRule(wire::Optimizer optimizer);

// The policy of an Init request: every choice set and known, counts that fit the number of workers.
Status checkPolicy(const wire::Policy& policy);

}  // namespace cohort::ps
