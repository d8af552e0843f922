// readNamedFile (base/files.h): a file the user named, whole, or one line saying what is wrong.
#include "base/files.h"

#include <cohort/error.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace cohort {
namespace {

std::string refusal(const std::string& path, std::string_view fix = {}) {
  try {
    readNamedFile("--flag", path, fix);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(read)";
}

TEST(ReadNamedFile, ReadsTheWholeFileAndNamesWhatIsWrongOtherwise) {
  char pattern[] = "/tmp/cohort-files-XXXXXX";
  ASSERT_NE(::mkdtemp(pattern), nullptr);
  const std::string dir = pattern;
  const std::string file = dir + "/f";
  const std::string bytes = std::string("a\0b\n", 4) + std::string(200'000, 'x');  // more than one read
  std::ofstream(file, std::ios::binary) << bytes;
  EXPECT_EQ(readNamedFile("--flag", file), bytes);
  std::ofstream(dir + "/empty", std::ios::binary).flush();
  EXPECT_EQ(readNamedFile("--flag", dir + "/empty"), "");

  EXPECT_EQ(refusal(dir + "/missing"), "--flag " + dir + "/missing: no such file");
  EXPECT_EQ(refusal(dir, "the fix"), "--flag " + dir + ": is a directory, not a file; the fix");
  // A read that fails (the kernel refuses to read this process's memory at address 0).
  EXPECT_EQ(refusal("/proc/self/mem").rfind("--flag /proc/self/mem: cannot read it: ", 0), 0u) << refusal("/proc/self/mem");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace cohort
