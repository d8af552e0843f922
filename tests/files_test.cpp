// readNamedFile (base/files.h): a file the user named, whole, or one line saying what is wrong.
#include "base/files.h"

#include <cohort/error.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

namespace cohort {
namespace {

// A fresh directory under /tmp, removed with its contents at the end of the test.
struct TempDir {
  TempDir() {
    char pattern[] = "/tmp/cohort-files-XXXXXX";
    if (::mkdtemp(pattern) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = pattern;
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string path;
};

std::string refusal(const std::string& path, std::string_view fix = {}) {
  try {
    readNamedFile("--flag", path, fix);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(read)";
}

TEST(ReadNamedFile, ReadsTheWholeFileAndNamesWhatIsWrongOtherwise) {
  const TempDir temp;
  const std::string& dir = temp.path;
  const std::string file = dir + "/f";
  const std::string bytes = std::string("a\0b\n", 4) + std::string(200'000, 'x');  // more than one read
  std::ofstream(file, std::ios::binary) << bytes;
  EXPECT_EQ(readNamedFile("--flag", file), bytes);
  std::ofstream(dir + "/empty", std::ios::binary).flush();
  EXPECT_EQ(readNamedFile("--flag", dir + "/empty"), "");

  EXPECT_EQ(refusal(dir + "/missing"), "--flag " + dir + "/missing: no such file");
  EXPECT_EQ(refusal(dir, "the fix"), "--flag " + dir + ": is a directory, not a file; the fix");
  // A read that fails (the kernel refuses to read this process's memory at address 0).
  EXPECT_EQ(refusal("/proc/self/mem").rfind("--flag /proc/self/mem: cannot read it: ", 0), 0u)
      << refusal("/proc/self/mem");
  // A file that never ends is read up to the cap, not until memory runs out.
  EXPECT_EQ(refusal("/dev/zero"), "--flag /dev/zero: is larger than 64 MiB, more than such a file holds");
}

TEST(CheckOutputPath, RefusesEmptyPathsDirectoriesAndMissingDirectories) {
  const TempDir temp;
  const std::string& dir = temp.path;
  auto refusal = [](const std::string& path) {
    try {
      checkOutputPath("--out", path);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("(taken)");
  };
  EXPECT_EQ(refusal(dir + "/new.pt"), "(taken)");
  EXPECT_EQ(refusal("relative.pt"), "(taken)");
  EXPECT_EQ(refusal(""), "--out needs a file to write to, got an empty path");
  EXPECT_EQ(refusal(dir), "--out " + dir + ": is a directory; name the file to write in it");
  EXPECT_EQ(refusal(dir + "/sub/"), "--out " + dir + "/sub/: is a directory; name the file to write in it");
  EXPECT_EQ(refusal(dir + "/sub/x.pt"),
            "--out " + dir + "/sub/x.pt: the directory " + dir + "/sub does not exist; create it first");
}

// The new contents replace the old whole; a writer that fails leaves the old file and no
// temporary behind.
TEST(ReplaceFile, ReplacesWholeOrNotAtAll) {
  const TempDir temp;
  const std::string& dir = temp.path;
  const std::string path = dir + "/results.jsonl";
  replaceFileWithText(path, "first\n");
  EXPECT_EQ(readNamedFile("--flag", path), "first\n");
  replaceFileWithText(path, "second, longer\n");
  EXPECT_EQ(readNamedFile("--flag", path), "second, longer\n");
  EXPECT_THROW(replaceFile(path,
                           [](const std::string& tmp) {
                             std::ofstream(tmp) << "half";
                             throw IoError("the writer failed");
                           }),
               IoError);
  EXPECT_EQ(readNamedFile("--flag", path), "second, longer\n");
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  // A writer that writes nothing: nothing to sync, the old file stays.
  EXPECT_THROW(replaceFile(path, [](const std::string&) {}), IoError);
  EXPECT_EQ(readNamedFile("--flag", path), "second, longer\n");
  EXPECT_THROW(replaceFileWithText(dir + "/none/x", "x"), IoError);
}

// Through a symlink the target is replaced and the link stays; the old file's permissions stay.
TEST(ReplaceFile, FollowsASymlinkAndKeepsThePermissions) {
  const TempDir temp;
  const std::string& dir = temp.path;
  const std::string target = dir + "/target.txt";
  const std::string link = dir + "/link.txt";
  replaceFileWithText(target, "old\n");
  std::filesystem::permissions(target, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  std::filesystem::create_symlink(target, link);
  replaceFileWithText(link, "new\n");
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  EXPECT_EQ(readNamedFile("--flag", target), "new\n");
  EXPECT_EQ(std::filesystem::status(target).permissions() & std::filesystem::perms::all,
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
}

}  // namespace
}  // namespace cohort
