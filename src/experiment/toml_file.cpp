#include "experiment/toml_file.h"

#include <cohort/error.h>

#include "base/files.h"

namespace cohort::experiment {

toml::table readTomlFile(std::string_view what, const std::string& path, std::string_view fix) {
  const std::string text = readNamedFile(what, path, fix);
  toml::table root;
  try {
    root = toml::parse(text, path);
  } catch (const toml::parse_error& e) {
    throw InvalidArgument(path + ":" + std::to_string(e.source().begin.line) + ": " + std::string(e.description()));
  }
  COHORT_CHECK(!root.empty(), InvalidArgument, what, " ", path, ": is empty; ", fix);
  return root;
}

}  // namespace cohort::experiment
