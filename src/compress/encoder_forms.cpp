// A sparse list's two forms (compress/format.h): whether the bitmap form is worth sending, and
// rewriting the form a pass wrote into the other.
#include "compress/encoder_internal.h"

#include <cmath>

namespace cohort::compress {

namespace {

// The parts of a list-form body this file wrote.
ListView viewList(const std::vector<uint8_t>& body) {
  ListView view;
  std::memcpy(&view.count, body.data(), 4);
  view.varints = body.data() + 4;
  const uint8_t* p = view.varints;
  for (uint32_t i = 0; i < view.count; ++i) {
    while (*p++ & 0x80) {
    }
  }
  view.isValue = p;
  view.negative = p + bitmapBytes(view.count);
  view.values = view.negative + bitmapBytes(view.count);
  return view;
}

// The parts of a bitmap-form body this file wrote.
BitmapView viewBitmap(const std::vector<uint8_t>& body, size_t length) {
  BitmapView view;
  view.length = length;
  std::memcpy(&view.count, body.data(), 4);
  std::memcpy(&view.valueCount, body.data() + 4, 4);
  view.sent = body.data() + 8;
  const uint8_t* p = view.sent + bitmapBytes(length);
  if (view.valueCount > 0 && view.valueCount < view.count) {
    view.ordinals = p;
    p += 4 * size_t(view.valueCount);
  }
  view.negative = p;
  view.values = p + bitmapBytes(view.count - view.valueCount);
  return view;
}

}  // namespace

bool bitmapFormPays(uint64_t length, uint64_t n, uint64_t v) {
  if (n == 0) return false;
  const double p = double(n) / double(length);
  const double entropy = p >= 1.0 ? 0.0 : -p * std::log2(p) - (1.0 - p) * std::log2(1.0 - p);
  const double listBits = double(length) * entropy + double(n - v) + 32.0 * double(v);
  return 8.0 * double(bitmapFormBytes(length, n, v)) <= 1.25 * listBits;
}

void listToBitmap(const std::vector<uint8_t>& from, size_t length, BitmapWriter& writer, std::vector<uint8_t>& to) {
  BitmapWriter::Cursor c = writer.begin(to, length);
  viewList(from).forEach([&](uint32_t index, bool isValue, bool negative, uint32_t bits) {
    if (isValue) {
      writer.addValue(c, index, std::bit_cast<float>(bits));
    } else {
      writer.addSign(c, index, negative);
    }
  });
  writer.finish(c);
}
void bitmapToList(const std::vector<uint8_t>& from, size_t length, ListWriter& list, std::vector<uint8_t>& to) {
  to.clear();
  Cursor c = list.begin(to);
  viewBitmap(from, length).forEach([&](uint32_t index, bool isValue, bool negative, uint32_t bits) {
    c = list.reserve(c, 1);
    if (isValue) {
      list.addValue(c, index, std::bit_cast<float>(bits));
    } else {
      list.addSign(c, index, negative);
    }
  });
  list.finish(c);
}

}  // namespace cohort::compress
