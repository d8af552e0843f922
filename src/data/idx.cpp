#include <cohort/error.h>
#include <cohort/idx.h>

#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <limits>

namespace cohort {

namespace {

constexpr size_t kHeaderPrefix = 4;  // 0, 0, type, ndims
// Fashion-MNIST's largest file is 47 MB unpacked; refuse anything absurd rather than allocate it.
constexpr int64_t kMaxElements = int64_t{1} << 34;

uint32_t readBigEndian32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

bool knownType(uint8_t code) {
  switch (static_cast<IdxType>(code)) {
    case IdxType::kUint8:
    case IdxType::kInt8:
    case IdxType::kInt16:
    case IdxType::kInt32:
    case IdxType::kFloat32:
    case IdxType::kFloat64:
      return true;
  }
  return false;
}

}  // namespace

size_t idxElementSize(IdxType type) {
  switch (type) {
    case IdxType::kUint8:
    case IdxType::kInt8:
      return 1;
    case IdxType::kInt16:
      return 2;
    case IdxType::kInt32:
    case IdxType::kFloat32:
      return 4;
    case IdxType::kFloat64:
      return 8;
  }
  return 0;
}

int64_t IdxArray::elements() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

IdxArray parseIdx(std::span<const uint8_t> bytes, const std::string& name) {
  COHORT_CHECK(bytes.size() >= kHeaderPrefix, IoError, name, ": not an IDX file: ", bytes.size(),
               " bytes is shorter than the 4-byte header");
  COHORT_CHECK(bytes[0] == 0 && bytes[1] == 0 && knownType(bytes[2]), IoError, name,
               ": not an IDX file: wrong magic number (expected 00 00 <type> <ndims>)");
  const int ndims = bytes[3];
  COHORT_CHECK(ndims >= 1, IoError, name, ": IDX header declares zero dimensions");
  const size_t headerSize = kHeaderPrefix + 4 * size_t(ndims);
  COHORT_CHECK(bytes.size() >= headerSize, IoError, name, ": truncated IDX header: ", bytes.size(),
               " bytes, the header of ", ndims, " dimensions needs ", headerSize);

  IdxArray array;
  array.type = static_cast<IdxType>(bytes[2]);
  int64_t elements = 1;
  for (int i = 0; i < ndims; ++i) {
    const int64_t d = readBigEndian32(&bytes[kHeaderPrefix + 4 * i]);
    array.dims.push_back(d);
    COHORT_CHECK(d == 0 || elements <= kMaxElements / d, IoError, name,
                 ": IDX dimensions are too large to be real");
    elements *= d;
  }
  const size_t expected = size_t(elements) * idxElementSize(array.type);
  const size_t body = bytes.size() - headerSize;
  COHORT_CHECK(body >= expected, IoError, name, ": truncated IDX file: the header promises ",
               expected, " bytes of data, the file has ", body);
  COHORT_CHECK(body == expected, IoError, name, ": IDX file has ", body - expected,
               " bytes after the data its header describes");
  array.data.assign(bytes.begin() + headerSize, bytes.end());
  return array;
}

IdxArray readIdxFile(const std::string& path) {
  // gzread reads plain files unchanged, so one path handles both.
  gzFile file = gzopen(path.c_str(), "rb");
  COHORT_CHECK(file != nullptr, IoError, path, ": cannot open: ", std::strerror(errno));
  std::vector<uint8_t> bytes;
  std::vector<uint8_t> chunk(1 << 20);
  for (;;) {
    const int n = gzread(file, chunk.data(), unsigned(chunk.size()));
    if (n < 0) {
      int code = 0;
      std::string message = gzerror(file, &code);
      gzclose(file);
      throw IoError(path + ": cannot read: " + message);
    }
    if (n == 0) break;
    bytes.insert(bytes.end(), chunk.begin(), chunk.begin() + n);
    COHORT_CHECK(bytes.size() < (size_t{1} << 34), IoError, path, ": file is too large for an IDX data set");
  }
  // A gzip stream cut short reads as EOF without an error from gzread; gzclose reports it.
  const int closed = gzclose(file);
  COHORT_CHECK(closed == Z_OK, IoError, path, ": truncated or corrupt gzip stream");
  return parseIdx(bytes, path);
}

}  // namespace cohort
