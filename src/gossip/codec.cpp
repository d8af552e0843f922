#include "gossip/codec.h"

#include <cohort/error.h>

#include <cstring>

namespace cohort::gossip {

namespace {

class RawEncoder final : public UpdateEncoder {
 public:
  void encode(std::span<const float> update, std::vector<uint8_t>& out) override {
    const size_t at = out.size();
    out.resize(at + update.size_bytes());
    if (!update.empty()) std::memcpy(out.data() + at, update.data(), update.size_bytes());
  }
};

class RawDecoder final : public UpdateDecoder {
 public:
  void decodeAdd(std::span<const uint8_t> message, std::span<float> out, float scale) const override {
    COHORT_CHECK(message.size() == out.size_bytes(), InvalidArgument, "an uncompressed update of ", message.size(),
                 " bytes does not fit ", out.size(), " floats (", out.size_bytes(), " bytes)");
    for (size_t i = 0; i < out.size(); ++i) {
      float v;
      std::memcpy(&v, message.data() + i * sizeof(float), sizeof(float));
      out[i] += scale * v;
    }
  }
};

std::unique_ptr<UpdateEncoder> rawEncoder(const std::string&, size_t) { return std::make_unique<RawEncoder>(); }

}  // namespace

Codec makeCodec(const std::string& spec) {
  if (spec.empty() || spec == "none") {
    Codec c;
    c.name = "none";
    c.spec = "none";
    c.makeEncoder = rawEncoder;
    c.decoder = std::make_unique<RawDecoder>();
    return c;
  }
  throw InvalidArgument("--codec " + spec + " is not available for gossip in this build: use --codec none");
}

}  // namespace cohort::gossip
