#include <cohort/checkpoint.h>
#include <cohort/error.h>

#include <filesystem>
#include <new>

#include "hostile.h"
#include "test_util.h"

namespace cohort::checkpoint_test {
namespace {

std::vector<uint8_t> payloadFor(int64_t step, size_t size) {
  std::vector<uint8_t> p(size);
  for (size_t i = 0; i < size; ++i) p[i] = uint8_t((i * 31 + size_t(step) * 7) & 0xFF);
  return p;
}

void flipByte(const std::string& path, size_t offset) {
  std::string bytes = test::readFile(path);
  bytes[offset] = char(bytes[offset] ^ 0x5A);
  test::writeFile(path, bytes);
}

TEST(Checkpoint, RoundTripsAndListsNewestFirst) {
  test::TempDir dir;
  CheckpointStore store(dir.path());
  store.save(5, payloadFor(5, 1000));
  store.save(10, payloadFor(10, 2000));
  auto files = store.list();
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0].step, 10);
  EXPECT_EQ(files[1].step, 5);
  auto loaded = store.loadNewest(nullptr);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->file.step, 10);
  EXPECT_EQ(loaded->payload, payloadFor(10, 2000));
}

// A writer killed mid-save leaves prefix-<step>.ckpt.tmp.<host>.<pid>; the next store on the
// directory removes this machine's of processes that are gone, and keeps a live writer's, other
// prefixes', and a fresh one of another machine (or container), whose pid means nothing here: an
// evaluator's store in another pod removed the chief's mid-save. That one goes once untouched for
// kOrphanAge, as does one without a host (an older cohort's .tmp.<pid>).
TEST(Checkpoint, OrphanedTemporaryFilesOfDeadWritersAreRemoved) {
  test::TempDir dir;
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);  // gone: its pid names no process now
  const std::string here = ".tmp." + CheckpointStore::hostTag() + ".";
  const std::string dead = dir.file("ckpt-0000000007.ckpt" + here + std::to_string(child));
  const std::string live = dir.file("ckpt-0000000008.ckpt" + here + std::to_string(::getppid()));
  const std::string other = dir.file("shard-0000000007.ckpt" + here + std::to_string(child));
  const std::string elsewhere = dir.file("ckpt-0000000009.ckpt.tmp.another-host." + std::to_string(child));
  const std::string older = dir.file("ckpt-0000000010.ckpt.tmp." + std::to_string(child));
  for (const auto& path : {dead, live, other, elsewhere, older}) test::writeFile(path, "partial");
  CheckpointStore store(dir.path());
  EXPECT_FALSE(std::filesystem::exists(dead));
  EXPECT_TRUE(std::filesystem::exists(live));
  EXPECT_TRUE(std::filesystem::exists(other));
  EXPECT_TRUE(std::filesystem::exists(elsewhere));
  EXPECT_TRUE(std::filesystem::exists(older));
  EXPECT_TRUE(store.list().empty());
  // Aged, they go at the next save.
  const auto old =
      std::filesystem::file_time_type::clock::now() - CheckpointStore::kOrphanAge - std::chrono::minutes(1);
  for (const auto& path : {elsewhere, older}) std::filesystem::last_write_time(path, old);
  store.save(1, payloadFor(1, 10));
  EXPECT_FALSE(std::filesystem::exists(elsewhere));
  EXPECT_FALSE(std::filesystem::exists(older));
}

// Checkpoints of higher steps (unreadable ones a resume went past) never prune the one just written.
TEST(Checkpoint, TheCheckpointJustWrittenIsKept) {
  test::TempDir dir;
  CheckpointStore store(dir.path(), "ckpt", 2);
  for (int64_t step : {40, 50, 60}) test::writeFile(dir.file("ckpt-00000000" + std::to_string(step) + ".ckpt"), "bad");
  const std::string written = store.save(10, payloadFor(10, 10));
  EXPECT_TRUE(std::filesystem::exists(written));
  const auto loaded = store.loadNewest(nullptr);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->file.step, 10);
}

TEST(Checkpoint, KeepsOnlyTheNewest) {
  test::TempDir dir;
  CheckpointStore store(dir.path(), "ckpt", 3);
  for (int64_t step = 1; step <= 6; ++step) store.save(step * 100, payloadFor(step, 10));
  auto files = store.list();
  ASSERT_EQ(files.size(), 3u);
  EXPECT_EQ(files.back().step, 400);
}

TEST(Checkpoint, CorruptNewestFallsBackToPrevious) {
  test::TempDir dir;
  CheckpointStore store(dir.path());
  store.save(1, payloadFor(1, 500));
  const std::string newest = store.save(2, payloadFor(2, 500));
  flipByte(newest, 100);
  std::vector<std::string> warnings;
  auto loaded = store.loadNewest([&](const std::string& m) { warnings.push_back(m); });
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->file.step, 1);
  EXPECT_EQ(loaded->payload, payloadFor(1, 500));
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find(newest), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("checksum mismatch"), std::string::npos) << warnings[0];
}

TEST(Checkpoint, TruncatedFileIsRefusedWithItsPath) {
  test::TempDir dir;
  CheckpointStore store(dir.path());
  const std::string path = store.save(3, payloadFor(3, 5000));
  std::filesystem::resize_file(path, 3000);
  try {
    CheckpointStore::readVerified(path);
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(path + ": corrupt checkpoint"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(store.loadNewest(nullptr).has_value());
}

// A sparse file of 20 GB behind a valid header that claims all of it: the header agrees with the
// file's size, so only the limit on a checkpoint's size stops it, before anything is read. Under a
// cap on the address space a reader that allocates first fails with bad_alloc instead.
TEST(Checkpoint, SparseFileClaimingTwentyGigabytesIsRefusedBeforeReading) {
  test::TempDir dir;
  CheckpointStore store(dir.path());
  const std::string path = store.save(7, payloadFor(7, 16));
  const uint64_t claimed = 20'000'000'000;
  std::string header = test::readFile(path).substr(0, 24);
  for (int i = 0; i < 8; ++i) header[12 + i] = char(claimed >> (8 * i));
  test::writeFile(path, header);
  std::filesystem::resize_file(path, 24 + claimed);
  test::AddressSpaceCap cap(int64_t{1} << 30);
  ASSERT_TRUE(cap.ok());
  try {
    CheckpointStore::readVerified(path);
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(path + ": the header's payload length is 20000000000 bytes, more than a "
                                                "checkpoint may hold (17179869184)"),
              std::string::npos)
        << e.what();
  } catch (const std::bad_alloc&) {
    FAIL() << "allocated what the header claims";
  }
}

// ckpt-<step>.ckpt whose step does not fit int64 is no checkpoint of this store: left out of the
// list, and the good one beside it is loaded (Trainer.ResumeSkipsAFileWhoseStepIsBeyondInt64: the
// warning).
TEST(Checkpoint, StepBeyondInt64IsSkipped) {
  test::TempDir dir;
  CheckpointStore store(dir.path());
  store.save(5, payloadFor(5, 100));
  test::writeFile(dir.file("ckpt-99999999999999999999.ckpt"), "stray");
  std::vector<CheckpointFile> files;
  try {
    files = store.list();
  } catch (const std::exception& e) {
    FAIL() << e.what();
  }
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0].step, 5);
  auto loaded = store.loadNewest(nullptr);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->file.step, 5);
}

TEST(Checkpoint, ForeignFileIsNotACheckpoint) {
  test::TempDir dir;
  test::writeFile(dir.file("ckpt-0000000007.ckpt"), "hello, not a checkpoint at all");
  EXPECT_THROW(CheckpointStore::readVerified(dir.file("ckpt-0000000007.ckpt")), IoError);
}

TEST(Checkpoint, TemporaryFilesAreIgnored) {
  test::TempDir dir;
  CheckpointStore store(dir.path());
  store.save(1, payloadFor(1, 10));
  test::writeFile(dir.file("ckpt-0000000009.ckpt.tmp.123"), "partial");
  auto files = store.list();
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0].step, 1);
}

TEST(Checkpoint, EmptyPayloadRoundTrips) {
  test::TempDir dir;
  CheckpointStore store(dir.path());
  store.save(0, {});
  auto loaded = store.loadNewest(nullptr);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_TRUE(loaded->payload.empty());
}

TEST(Checkpoint, PrefixesKeepStoresApart) {
  test::TempDir dir;
  CheckpointStore a(dir.path(), "stage0");
  CheckpointStore b(dir.path(), "stage1");
  a.save(1, payloadFor(1, 10));
  EXPECT_EQ(a.list().size(), 1u);
  EXPECT_TRUE(b.list().empty());
}

}  // namespace
}  // namespace cohort::checkpoint_test
