// What the gossip peer needs from a codec (the slot `--codec` fills): encode a flat float update,
// keeping an error-feedback residual, and add a decoded message into a flat buffer. Torch-free.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace cohort::gossip {

// One encoder per destination: its residual holds what earlier messages did not carry.
class UpdateEncoder {
 public:
  virtual ~UpdateEncoder() = default;
  // Appends the message for update (+ the residual) to out; what is not sent stays in the residual.
  virtual void encode(std::span<const float> update, std::vector<uint8_t>& out) = 0;
};

// Stateless on the receiving side.
class UpdateDecoder {
 public:
  virtual ~UpdateDecoder() = default;
  // out += scale * decoded(message). Throws InvalidArgument on a malformed message (wrong length,
  // index out of range), never reading outside `message`.
  virtual void decodeAdd(std::span<const uint8_t> message, std::span<float> out, float scale) const = 0;
};

// A codec by its --codec spelling. "none": raw little-endian float32, no residual.
struct Codec {
  std::string name;
  // A fresh encoder for a buffer of numel floats.
  std::unique_ptr<UpdateEncoder> (*makeEncoder)(const std::string& spec, size_t numel) = nullptr;
  std::unique_ptr<UpdateDecoder> decoder;
  std::string spec;
  std::unique_ptr<UpdateEncoder> newEncoder(size_t numel) const { return makeEncoder(spec, numel); }
};

// Throws InvalidArgument for a codec this build cannot do.
Codec makeCodec(const std::string& spec);

}  // namespace cohort::gossip
