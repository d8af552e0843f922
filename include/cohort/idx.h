// The IDX file format of MNIST and Fashion-MNIST (http://yann.lecun.com/exdb/mnist/):
// two zero bytes, a type code, the number of dimensions, the dimensions as big-endian uint32,
// then the data in row-major order. No torch here: the parser works on bytes.
#pragma once

#include <cohort/export.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace cohort {

enum class IdxType : uint8_t {
  kUint8 = 0x08,
  kInt8 = 0x09,
  kInt16 = 0x0B,
  kInt32 = 0x0C,
  kFloat32 = 0x0D,
  kFloat64 = 0x0E,
};

struct COHORT_API IdxArray {
  IdxType type = IdxType::kUint8;
  std::vector<int64_t> dims;
  std::vector<uint8_t> data;  // raw elements, big-endian as in the file

  int64_t elements() const;
};

COHORT_API size_t idxElementSize(IdxType type);

// Parses a whole IDX file held in memory. `name` is used in error messages only.
// Throws IoError on a wrong magic, an unknown type, a truncated or over-long body.
COHORT_API IdxArray parseIdx(std::span<const uint8_t> bytes, const std::string& name);

// Reads an IDX file, gzip-compressed or plain (detected from the contents, not the name).
COHORT_API IdxArray readIdxFile(const std::string& path);

}  // namespace cohort
