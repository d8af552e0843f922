// Writes the codec fuzz targets' seed corpora: a few real messages of each codec, small.
//   codec_seeds DIR         ->  DIR/{dense,topk,threshold,onebit}/<codec>_<length>
//   codec_seeds --push DIR  ->  DIR/compressed_<codec>: PushRequests for push_fuzz's shard (308 values)
// The committed fuzz/codec_corpus/ and fuzz/corpus/compressed_* were made with it.
#include "compress/codec.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

// A PushRequest in protobuf's wire format, by hand: protocol 2, worker 0, samples 8, compressed.
std::string pushRequest(const std::vector<uint8_t>& message) {
  std::string out = {0x08, 0x02, 0x10, 0x00, 0x28, 0x08, 0x42};
  size_t n = message.size();
  while (n >= 0x80) {
    out.push_back(char(n | 0x80));
    n >>= 7;
  }
  out.push_back(char(n));
  out.append(reinterpret_cast<const char*>(message.data()), message.size());
  return out;
}

int writePushes(const std::filesystem::path& dir) {
  using namespace cohort::compress;
  std::filesystem::create_directories(dir);
  for (const char* text : {"fp16", "topk:0.1", "threshold:0.5", "onebit"}) {
    std::vector<float> input(308);
    for (size_t i = 0; i < input.size(); ++i) input[i] = std::sin(float(i) * 0.37f);
    Encoder enc(CodecSpec::parse(text), input.size());
    std::string name = text;
    name = name.substr(0, name.find(':'));
    std::ofstream(dir / ("compressed_" + name), std::ios::binary) << pushRequest(enc.encode(input));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace cohort::compress;
  if (argc == 3 && std::string(argv[1]) == "--push") return writePushes(argv[2]);
  if (argc != 2) {
    std::fprintf(stderr, "usage: codec_seeds DIR | codec_seeds --push DIR\n");
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  // topk and threshold twice: a dense list (the bitmap form) and a sparse one (the zstd'd list).
  const char* codecs[][2] = {{"dense", "none"},           {"dense", "fp16"},          {"dense", "bf16"},
                             {"topk", "topk:0.3"},         {"topk", "topk:0.05"},      {"threshold", "threshold:0.5"},
                             {"threshold", "threshold:2"}, {"onebit", "onebit"}};
  for (const auto& [folder, text] : codecs) {
    // 512: long enough that threshold:0.5's list takes the bitmap form (shorter ones stay lists:
    // the form's fixed bytes weigh more there).
    for (size_t n : {0, 7, 64, 512}) {
      std::vector<float> input(n);
      for (size_t i = 0; i < n; ++i) input[i] = std::sin(float(i) * 1.7f) * (i % 5 == 0 ? 3.0f : 0.7f);
      if (n == 64) input[3] = INFINITY;
      Encoder enc(CodecSpec::parse(text), n);
      const auto message = enc.encode(input);
      std::filesystem::create_directories(dir / folder);
      std::string name = text;
      for (char& c : name) c = c == ':' ? '_' : c;
      std::ofstream(dir / folder / (name + "_" + std::to_string(n)), std::ios::binary)
          .write(reinterpret_cast<const char*>(message.data()), std::streamsize(message.size()));
    }
  }
  return 0;
}
