#include "ps/wire.h"

#include "compress/codec.h"
#include <cohort/error.h>

#include <cmath>
#include <cstring>
#include <unordered_set>

namespace cohort::ps {

namespace {

Status invalid(std::string message) { return Status::error(Code::kInvalidArgument, std::move(message)); }

}  // namespace

Status checkProtocol(uint32_t protocol) {
  if (protocol == kProtocolVersion) return Status::Ok();
  return Status::error(Code::kFailedPrecondition,
                       "protocol version " + std::to_string(protocol) + " is not this server's " +
                           std::to_string(kProtocolVersion) + ": run the same cohort on workers and servers");
}

bool isNoGradient(const wire::Tensor& t) {
  return t.dtype() == wire::DTYPE_UNSPECIFIED && t.numel() == 0 && t.data().empty();
}

void setNoGradient(wire::Tensor* t, const wire::PieceSpec& piece) {
  t->set_key(piece.key());
  t->set_numel(0);
  t->set_dtype(wire::DTYPE_UNSPECIFIED);
  t->clear_data();
}

Status checkPieceShape(const wire::Tensor& t, const wire::PieceSpec& p, const std::string& w) {
  if (t.dtype() != wire::FLOAT32) {
    const std::string name = wire::DType_Name(t.dtype());
    return invalid(w + ": " + p.name() + " has dtype " + (name.empty() ? std::to_string(t.dtype()) : name) +
                   ", expected FLOAT32");
  }
  if (t.numel() != p.numel()) {
    return invalid(w + ": " + p.name() + " has " + std::to_string(t.numel()) + " elements, expected " +
                   std::to_string(p.numel()));
  }
  return Status::Ok();
}

size_t firstNonFinite(const void* floats, size_t n) {
  // Exponent bits all ones (NaN or Inf) carry into bit 31 when 2^23 is added to them, and no other
  // exponent does. Read as integers (any alignment) in blocks of a fixed size: a loop of known
  // length that GCC vectorizes at -O2, where the loop over all n floats stayed scalar (perf saw it
  // take 5 % of a shard's push).
  const auto* bytes = static_cast<const char*>(floats);
  auto flag = [](uint32_t bits) { return (bits & 0x7f800000u) + 0x00800000u; };
  constexpr size_t kBlock = 16;
  uint32_t worst = 0;
  size_t j = 0;
  for (; j + kBlock <= n; j += kBlock) {
    uint32_t bits[kBlock];
    std::memcpy(bits, bytes + j * sizeof(float), sizeof(bits));
    for (size_t k = 0; k < kBlock; ++k) worst |= flag(bits[k]);
  }
  for (; j < n; ++j) {
    uint32_t bits;
    std::memcpy(&bits, bytes + j * sizeof(float), sizeof(bits));
    worst |= flag(bits);
  }
  if ((worst & 0x80000000u) == 0) return n;
  for (j = 0; j < n; ++j) {
    uint32_t bits;
    std::memcpy(&bits, bytes + j * sizeof(float), sizeof(bits));
    if (flag(bits) & 0x80000000u) return j;
  }
  return n;
}

Status checkTensors(const google::protobuf::RepeatedPtrField<wire::Tensor>& tensors,
                    std::span<const wire::PieceSpec> pieces, bool finiteOnly, const char* what, NoGradient noGradient) {
  const std::string w = what;
  for (int i = 0; i < tensors.size(); ++i) {
    const wire::Tensor& t = tensors.Get(i);
    if (size_t(i) >= pieces.size()) {
      bool known = false;
      for (const auto& q : pieces) known = known || q.key() == t.key();
      return invalid(w + ": " + (known ? "key " + std::to_string(t.key()) + " appears twice"
                                       : "unknown key " + std::to_string(t.key())) +
                     " (this shard holds " + std::to_string(pieces.size()) + " pieces)");
    }
    const wire::PieceSpec& p = pieces[size_t(i)];
    if (t.key() != p.key()) {
      bool known = false;
      for (const auto& q : pieces) known = known || q.key() == t.key();
      return invalid(w + ": " + (known ? "key " + std::to_string(t.key()) + " out of order" :
                                         "unknown key " + std::to_string(t.key())) +
                     " where piece " + std::to_string(p.key()) + " (" + p.name() + ") belongs");
    }
    if (noGradient == NoGradient::kAllowed && isNoGradient(t)) continue;
    if (Status s = checkPieceShape(t, p, w); !s.ok()) return s;
    if (t.data().size() != p.numel() * sizeof(float)) {
      return invalid(w + ": " + p.name() + " carries " + std::to_string(t.data().size()) + " bytes, expected " +
                     std::to_string(p.numel() * sizeof(float)));
    }
    if (finiteOnly) {
      if (const size_t j = firstNonFinite(t.data().data(), p.numel()); j < p.numel()) {
        float v;
        std::memcpy(&v, t.data().data() + j * sizeof(float), sizeof(float));
        return invalid(w + ": " + p.name() + " holds " + (std::isnan(v) ? "NaN" : "Inf") + " at element " +
                       std::to_string(j));
      }
    }
  }
  if (size_t(tensors.size()) < pieces.size()) {
    const auto& p = pieces[size_t(tensors.size())];
    return invalid(w + ": piece " + std::to_string(p.key()) + " (" + p.name() + ") is missing");
  }
  return Status::Ok();
}

void appendFloats(const wire::Tensor& tensor, std::vector<float>& out) {
  const size_t n = tensor.data().size() / sizeof(float);
  const size_t at = out.size();
  out.resize(at + n);
  std::memcpy(out.data() + at, tensor.data().data(), n * sizeof(float));
}

std::span<const float> floatsOf(const wire::Tensor& tensor, FloatScratch& scratch) {
  const std::string& data = tensor.data();
  const size_t n = data.size() / sizeof(float);
  if (reinterpret_cast<uintptr_t>(data.data()) % alignof(float) == 0) {
    return {reinterpret_cast<const float*>(data.data()), n};
  }
  scratch.resize(n);
  std::memcpy(scratch.data(), data.data(), n * sizeof(float));
  return scratch;
}

Status decodeCompressed(const std::string& message, std::span<const wire::PieceSpec> pieces, bool finiteOnly,
                        const char* what, std::vector<float>& out) {
  const std::string w = what;
  uint64_t total = 0;
  for (const auto& p : pieces) total += p.numel();
  const std::span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(message.data()), message.size());
  try {
    // The length first, so that nothing is allocated for a message that cannot fit.
    const uint64_t length = compress::decodedLength(bytes);
    if (length != total) {
      return invalid(w + ": the compressed message holds " + std::to_string(length) + " values, this shard's " +
                     std::to_string(pieces.size()) + " pieces hold " + std::to_string(total));
    }
    out.assign(size_t(total), 0.0f);
    compress::decodeAdd(bytes, out);
  } catch (const compress::MalformedMessage& e) {
    return invalid(w + ": " + e.what());
  }
  if (finiteOnly) {
    size_t index = 0;
    for (const auto& p : pieces) {
      for (uint64_t j = 0; j < p.numel(); ++j, ++index) {
        if (!std::isfinite(out[index])) {
          return invalid(w + ": " + p.name() + " holds " + (std::isnan(out[index]) ? "NaN" : "Inf") + " at element " +
                         std::to_string(j) + " of the compressed message");
        }
      }
    }
  }
  return Status::Ok();
}

namespace {

size_t rowsWidth(wire::DType dtype) {
  switch (dtype) {
    case wire::FLOAT32: return 4;
    case wire::FLOAT16:
    case wire::BFLOAT16: return 2;
    default: return 0;
  }
}

}  // namespace

Status checkRows(const google::protobuf::RepeatedPtrField<wire::Rows>& rows, std::span<const wire::PieceSpec> pieces,
                 bool withData, bool finiteOnly, const char* what) {
  const std::string w = what;
  std::unordered_set<uint32_t> seen;
  std::vector<float> scratch;
  for (const wire::Rows& r : rows) {
    const wire::PieceSpec* piece = nullptr;
    for (const auto& p : pieces) {
      if (p.key() == r.key()) piece = &p;
    }
    if (piece == nullptr) return invalid(w + ": rows of unknown key " + std::to_string(r.key()));
    if (piece->row_dim() == 0) return invalid(w + ": rows of " + piece->name() + ", which is not row-sparse");
    if (!seen.insert(r.key()).second) return invalid(w + ": rows of " + piece->name() + " appear twice");
    const uint64_t count = piece->numel() / piece->row_dim();
    for (int i = 0; i < r.rows_size(); ++i) {
      if (r.rows(i) >= count) {
        return invalid(w + ": " + piece->name() + " has " + std::to_string(count) + " rows, got row " +
                       std::to_string(r.rows(i)));
      }
      if (i > 0 && r.rows(i) <= r.rows(i - 1)) {
        return invalid(w + ": the rows of " + piece->name() + " are not strictly increasing at row " +
                       std::to_string(r.rows(i)));
      }
    }
    if (!withData) {
      if (!r.data().empty() || r.dtype() != wire::DTYPE_UNSPECIFIED) {
        return invalid(w + ": a request for rows of " + piece->name() + " carries values");
      }
      continue;
    }
    const size_t width = rowsWidth(r.dtype());
    if (width == 0) {
      const std::string name = wire::DType_Name(r.dtype());
      return invalid(w + ": rows of " + piece->name() + " have dtype " + (name.empty() ? std::to_string(r.dtype()) : name) +
                     ", expected FLOAT32, FLOAT16 or BFLOAT16");
    }
    const uint64_t expected = uint64_t(r.rows_size()) * piece->row_dim() * width;
    if (r.data().size() != expected) {
      return invalid(w + ": " + std::to_string(r.rows_size()) + " rows of " + piece->name() + " carry " +
                     std::to_string(r.data().size()) + " bytes, expected " + std::to_string(expected));
    }
    if (finiteOnly) {
      rowFloats(r, scratch);
      for (size_t j = 0; j < scratch.size(); ++j) {
        if (!std::isfinite(scratch[j])) {
          return invalid(w + ": row " + std::to_string(r.rows(int(j / piece->row_dim()))) + " of " + piece->name() +
                         " holds " + (std::isnan(scratch[j]) ? "NaN" : "Inf"));
        }
      }
    }
  }
  return Status::Ok();
}

void rowFloats(const wire::Rows& rows, std::vector<float>& out) {
  const std::string& data = rows.data();
  if (rows.dtype() == wire::FLOAT32) {
    out.resize(data.size() / sizeof(float));
    std::memcpy(out.data(), data.data(), out.size() * sizeof(float));
    return;
  }
  std::vector<uint16_t> bits(data.size() / sizeof(uint16_t));
  std::memcpy(bits.data(), data.data(), bits.size() * sizeof(uint16_t));
  out.resize(bits.size());
  if (rows.dtype() == wire::FLOAT16) {
    compress::halfToFloats(bits, out);
  } else {
    compress::bf16ToFloats(bits, out);
  }
}

void setRows(wire::Rows* rows, const wire::PieceSpec& piece, std::span<const uint32_t> which, const float* pieceValues) {
  rows->set_key(piece.key());
  rows->set_dtype(wire::FLOAT32);
  rows->mutable_rows()->Add(which.begin(), which.end());
  const size_t dim = size_t(piece.row_dim());
  std::string* data = rows->mutable_data();
  data->resize(which.size() * dim * sizeof(float));
  char* out = data->data();
  for (uint32_t r : which) {
    std::memcpy(out, pieceValues + size_t(r) * dim, dim * sizeof(float));
    out += dim * sizeof(float);
  }
}

void setTensor(wire::Tensor* tensor, const wire::PieceSpec& piece, const float* values) {
  tensor->set_key(piece.key());
  tensor->set_numel(piece.numel());
  tensor->set_dtype(wire::FLOAT32);
  tensor->set_data(reinterpret_cast<const char*>(values), piece.numel() * sizeof(float));
}

Status checkPieces(std::span<const wire::PieceSpec> pieces, uint64_t maxElements) {
  if (pieces.empty()) return invalid("Init: no pieces");
  std::unordered_set<uint32_t> keys;
  uint64_t total = 0;
  for (const auto& p : pieces) {
    if (!keys.insert(p.key()).second) return invalid("Init: key " + std::to_string(p.key()) + " appears twice");
    if (p.numel() == 0) return invalid("Init: piece " + p.name() + " is empty");
    if (p.row_dim() > 0 && (p.numel() % p.row_dim() != 0 || p.numel() / p.row_dim() > UINT32_MAX)) {
      return invalid("Init: piece " + p.name() + " of " + std::to_string(p.numel()) + " elements is not whole rows of " +
                     std::to_string(p.row_dim()));
    }
    if (p.numel() > maxElements - total) {
      return invalid("Init: the pieces hold more than " + std::to_string(maxElements) + " elements");
    }
    total += p.numel();
  }
  return Status::Ok();
}

const char* modeName(wire::Mode mode) {
  switch (mode) {
    case wire::MODE_SYNC: return "sync";
    case wire::MODE_ASYNC: return "async";
    case wire::MODE_SOFTSYNC: return "softsync";
    case wire::MODE_SSP: return "ssp";
    default: return "";
  }
}

const char* stalenessLrName(wire::StalenessLr rule) {
  switch (rule) {
    case wire::STALENESS_LR_NONE: return "none";
    case wire::STALENESS_LR_INVERSE: return "inverse";
    default: return "";
  }
}

const char* pushName(wire::Push push) {
  switch (push) {
    case wire::PUSH_GRADIENTS: return "gradients";
    case wire::PUSH_UPDATES: return "updates";
    default: return "";
  }
}

const char* optimizerName(wire::Optimizer optimizer) {
  switch (optimizer) {
    case wire::OPTIMIZER_SGD: return "sgd";
    case wire::OPTIMIZER_MOMENTUM: return "momentum";
    case wire::OPTIMIZER_ADAM: return "adam";
    case wire::OPTIMIZER_ADAGRAD: return "adagrad";
    default: return "";
  }
}

UpdateRule updateRule(wire::Optimizer optimizer) {
  switch (optimizer) {
    case wire::OPTIMIZER_SGD: return UpdateRule::kSgd;
    case wire::OPTIMIZER_MOMENTUM: return UpdateRule::kMomentum;
    case wire::OPTIMIZER_ADAM: return UpdateRule::kAdam;
    case wire::OPTIMIZER_ADAGRAD: return UpdateRule::kAdagrad;
    default: throw InvalidArgument("optimizer " + std::to_string(int(optimizer)) + " is not one this shard knows");
  }
}

namespace {

// One of the policy's choices: refused when unset (UNSPECIFIED, or a peer that sent it as text
// in its old field) or unknown (a number this version does not know).
Status checkChoice(int value, const char* name, const char* field, const char* expected) {
  if (value == 0) return invalid(std::string("Init: no ") + field + ": expected " + expected);
  if (*name == '\0') {
    return invalid(std::string("Init: unknown ") + field + " '" + std::to_string(value) + "': expected " + expected);
  }
  return Status::Ok();
}

}  // namespace

Status checkPolicy(const wire::Policy& p) {
  const wire::Mode m = p.mode();
  if (Status s = checkChoice(m, modeName(m), "mode", "sync, async, softsync or ssp"); !s.ok()) return s;
  if (p.workers() < 1 || p.workers() > 65536) return invalid("Init: workers must be in 1..65536");
  if (p.backup_workers() >= p.workers()) {
    return invalid("Init: backup workers (" + std::to_string(p.backup_workers()) + ") must be fewer than the " +
                   std::to_string(p.workers()) + " workers");
  }
  if (m == wire::MODE_SOFTSYNC && (p.softsync() < 1 || p.softsync() > p.workers())) {
    return invalid("Init: softsync must be in 1.." + std::to_string(p.workers()) + ", got " +
                   std::to_string(p.softsync()));
  }
  if (Status s = checkChoice(p.staleness_lr(), stalenessLrName(p.staleness_lr()), "staleness_lr", "none or inverse");
      !s.ok()) {
    return s;
  }
  if (Status s = checkChoice(p.push(), pushName(p.push()), "push", "gradients or updates"); !s.ok()) return s;
  if (Status s =
          checkChoice(p.optimizer(), optimizerName(p.optimizer()), "optimizer", "sgd, momentum, adam or adagrad");
      !s.ok()) {
    return s;
  }
  if (!(p.lr() > 0) || !std::isfinite(p.lr())) return invalid("Init: lr must be positive");
  if (!(p.momentum() >= 0 && p.momentum() < 1)) return invalid("Init: momentum must be in [0, 1)");
  if (!(p.timeout_s() > 0) || !(p.timeout_s() <= 1e6)) return invalid("Init: timeout must be in (0, 1e6] s");
  if (m == wire::MODE_SSP && p.warmup_steps() > 0) {
    // Workers held in warm-up would be the slowest, and hold worker 0 in turn.
    return invalid("Init: warm-up steps cannot be combined with ssp: use async or softsync for a warm-up");
  }
  if (p.warmup_steps() < 0 || p.checkpoint_every() < 0) return invalid("Init: negative step count");
  return Status::Ok();
}

}  // namespace cohort::ps
