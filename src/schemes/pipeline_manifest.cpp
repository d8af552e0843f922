// The pipeline's manifest (schemes/pipeline_manifest.h).
#include "schemes/pipeline_manifest.h"

#include <cohort/error.h>

#include "base/files.h"
#include "schemes/pipeline_plan.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace cohort {

namespace {

// "L" or "L+C" of a manifest's cut into its layers and channels; false when it is neither.
bool parseCutItem(const std::string& item, int* layers, int* channels) {
  char* end = nullptr;
  const long v = std::strtol(item.c_str(), &end, 10);
  long c = 0;
  if (end != item.c_str() && *end == '+') {
    const char* rest = end + 1;
    c = std::strtol(rest, &end, 10);
    if (end == rest || c <= 0) return false;
  }
  if (end == item.c_str() || *end != '\0' || v <= 0) return false;
  *layers = int(v);
  *channels = int(c);
  return true;
}

}  // namespace

std::optional<PipelineManifest> readPipelineManifest(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  PipelineManifest m;
  std::string key;
  std::string cut;
  while (in >> key) {
    if (key == "stages") {
      in >> m.stages;
    } else if (key == "replicas") {
      in >> m.replicas;
    } else if (key == "cut") {
      in >> cut;
    } else {
      std::getline(in, key);  // a comment
    }
  }
  COHORT_CHECK(m.stages > 0 && !cut.empty(), IoError, path, ": not a pipeline manifest");
  std::stringstream items(cut);
  for (std::string item; std::getline(items, item, ',');) {
    int layers = 0;
    int channels = 0;
    COHORT_CHECK(parseCutItem(item, &layers, &channels), IoError, path, ": not a pipeline manifest (cut ", cut, ")");
    m.counts.push_back(layers);
    m.splits.push_back(channels);
  }
  return m;
}

void writePipelineManifest(const std::string& dir, const PipelineManifest& m, const std::vector<std::string>& layers) {
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/" + kPipelineManifest;
  std::ostringstream out;
  out << "stages " << m.stages << "\nreplicas " << m.replicas << "\ncut " << joinCut(m.counts, m.splits) << "\n";
  out << "# layers per stage (L+C: and the first C output channels of the next layer); stage K's checkpoints "
         "are in stage-K/\n";
  for (size_t j = 0; j < layers.size(); ++j) out << "# layer " << j << " " << layers[j] << "\n";
  replaceFileWithText(path, out.str());
}

}  // namespace cohort
