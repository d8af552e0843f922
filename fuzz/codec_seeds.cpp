// Writes the codec fuzz targets' seed corpora: a few real messages of each codec, small.
//   codec_seeds DIR   ->  DIR/{dense,topk,threshold,onebit}/<codec>_<length>
// The committed fuzz/codec_corpus/ was made with it.
#include "compress/codec.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  using namespace cohort::compress;
  if (argc != 2) {
    std::fprintf(stderr, "usage: codec_seeds DIR\n");
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  const char* codecs[][2] = {{"dense", "none"},   {"dense", "fp16"},          {"dense", "bf16"},
                             {"topk", "topk:0.3"}, {"threshold", "threshold:0.5"}, {"onebit", "onebit"}};
  for (const auto& [folder, text] : codecs) {
    for (size_t n : {0, 7, 64}) {
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
