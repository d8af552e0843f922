// The pipeline's manifest (include/cohort/pipeline.h): `pipeline.manifest` beside the stages'
// checkpoints (stage-K/) records the stages and the cut, so that a resume cuts the model the same
// way. Text: "stages S", "replicas R", "cut L1[+C1],L2,...", then comment lines naming the layers.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace cohort {

constexpr const char* kPipelineManifest = "pipeline.manifest";

struct PipelineManifest {
  int stages = 0;
  int replicas = 0;
  std::vector<int> counts;  // layers per stage
  std::vector<int> splits;  // per stage: output channels of the next stage's first layer it computes
};

// The manifest at `path`; nullopt when there is none. Throws IoError when it does not parse.
std::optional<PipelineManifest> readPipelineManifest(const std::string& path);

// Writes `dir`/pipeline.manifest (through a temporary file and a rename); `layers` names each
// layer for the reader. Throws IoError when it cannot.
void writePipelineManifest(const std::string& dir, const PipelineManifest& manifest,
                           const std::vector<std::string>& layers);

}  // namespace cohort
