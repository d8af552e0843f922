#include <cohort/error.h>
#include <cohort/idx.h>

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

namespace cohort {

namespace {

constexpr size_t kHeaderPrefix = 4;  // 0, 0, type, ndims
// The most data bytes a header may promise. A data set is loaded whole and held twice while it
// becomes a tensor; Fashion-MNIST's largest file is 47 MB unpacked, EMNIST's 550 MB. 4 GiB leaves
// room for larger sets of this kind, and a header promising more is refused before any reading.
constexpr uint64_t kMaxDataBytes = uint64_t{4} << 30;
// How far past the promised data readIdxFile reads before it stops: enough to count a few stray
// bytes after the data (parseIdx reports how many), little enough that a stream that goes on (a
// gzip bomb: megabytes that unpack to gigabytes) costs at most this much memory over the promise.
constexpr size_t kMaxTrailingBytes = size_t{1} << 20;
// gzread's unit of reading.
constexpr size_t kChunkBytes = size_t{1} << 20;

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

namespace {

struct IdxHeader {
  IdxType type = IdxType::kUint8;
  std::vector<int64_t> dims;
  size_t headerBytes = 0;
  size_t dataBytes = 0;  // what the dimensions promise
};

// Checks the header at the start of `bytes` (which must hold at least its first 4 bytes to say
// anything) and what its dimensions promise, against kMaxDataBytes. Throws IoError naming `name`.
IdxHeader parseHeader(std::span<const uint8_t> bytes, const std::string& name) {
  COHORT_CHECK(bytes.size() >= kHeaderPrefix, IoError, name, ": not an IDX file: ", bytes.size(),
               " bytes is shorter than the 4-byte header");
  COHORT_CHECK(bytes[0] == 0 && bytes[1] == 0 && knownType(bytes[2]), IoError, name,
               ": not an IDX file: wrong magic number (expected 00 00 <type> <ndims>)");
  const int ndims = bytes[3];
  COHORT_CHECK(ndims >= 1, IoError, name, ": IDX header declares zero dimensions");
  IdxHeader header;
  header.type = static_cast<IdxType>(bytes[2]);
  header.headerBytes = kHeaderPrefix + 4 * size_t(ndims);
  COHORT_CHECK(bytes.size() >= header.headerBytes, IoError, name, ": truncated IDX header: ", bytes.size(),
               " bytes, the header of ", ndims, " dimensions needs ", header.headerBytes);
  // Each dimension is below 2^32 and the running product stays at most kMaxDataBytes, so none of
  // this overflows.
  const uint64_t elementSize = idxElementSize(header.type);
  uint64_t dataBytes = elementSize;
  for (int i = 0; i < ndims; ++i) {
    const uint64_t d = readBigEndian32(&bytes[kHeaderPrefix + 4 * i]);
    header.dims.push_back(int64_t(d));
    dataBytes *= d;
    COHORT_CHECK(dataBytes <= kMaxDataBytes, IoError, name, ": the IDX header's dimensions promise more than ",
                 kMaxDataBytes, " bytes of data, the most an IDX data set may hold (dimension ", i, " is ", d,
                 "): not a data set cohort can load");
  }
  header.dataBytes = size_t(dataBytes);
  return header;
}

}  // namespace

IdxArray parseIdx(std::span<const uint8_t> bytes, const std::string& name) {
  const IdxHeader header = parseHeader(bytes, name);
  IdxArray array;
  array.type = header.type;
  array.dims = header.dims;
  const size_t expected = header.dataBytes;
  const size_t body = bytes.size() - header.headerBytes;
  COHORT_CHECK(body >= expected, IoError, name, ": truncated IDX file: the header promises ",
               expected, " bytes of data, the file has ", body);
  COHORT_CHECK(body == expected, IoError, name, ": IDX file has ", body - expected,
               " bytes after the data its header describes");
  array.data.assign(bytes.begin() + ptrdiff_t(header.headerBytes), bytes.end());
  return array;
}

IdxArray readIdxFile(const std::string& path) {
  // gzread reads plain files unchanged, so one path handles both.
  std::unique_ptr<gzFile_s, int (*)(gzFile)> file(gzopen(path.c_str(), "rb"), gzclose);
  COHORT_CHECK(file != nullptr, IoError, path, ": cannot open: ", std::strerror(errno));
  std::vector<uint8_t> bytes;
  // Reads until `bytes` holds `size` bytes or the stream ends, a chunk at a time: what is
  // allocated follows what the file really holds, never what it claims.
  auto readUpTo = [&](size_t size) {
    while (bytes.size() < size) {
      const size_t before = bytes.size();
      bytes.resize(before + std::min(size - before, kChunkBytes));
      const int n = gzread(file.get(), bytes.data() + before, unsigned(bytes.size() - before));
      if (n < 0) {
        int code = 0;
        throw IoError(path + ": cannot read: " + gzerror(file.get(), &code));
      }
      bytes.resize(before + size_t(n));
      if (n == 0) return;
    }
  };
  readUpTo(kHeaderPrefix);
  if (bytes.size() == kHeaderPrefix) readUpTo(kHeaderPrefix + 4 * size_t(bytes[3]));
  const IdxHeader header = parseHeader(bytes, path);
  // One byte over the limit tells that the stream goes on; no more of it is unpacked.
  const size_t limit = header.headerBytes + header.dataBytes + kMaxTrailingBytes;
  readUpTo(limit + 1);
  COHORT_CHECK(bytes.size() <= limit, IoError, path, ": the file goes on past the ", header.dataBytes,
               " bytes of data its IDX header promises (reading stopped ", kMaxTrailingBytes,
               " bytes after them): not an IDX file of these dimensions (a gzip bomb?)");
  // A gzip stream cut short reads as EOF without an error from gzread; gzclose reports it.
  const int closed = gzclose(file.release());
  COHORT_CHECK(closed == Z_OK, IoError, path, ": truncated or corrupt gzip stream");
  return parseIdx(bytes, path);
}

}  // namespace cohort
