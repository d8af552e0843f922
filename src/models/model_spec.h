// What a --model text names. Torch-free.
#pragma once

#include <string>

namespace cohort {

// Whether `spec` names a TorchScript file (any path with a '/', or a name ending in .pt) rather
// than a model of the zoo (makeModel's rule, which the Trainer's checks of a loaded file share).
inline bool isModelFileSpec(const std::string& spec) {
  return spec.find('/') != std::string::npos || (spec.size() >= 3 && spec.compare(spec.size() - 3, 3, ".pt") == 0);
}

}  // namespace cohort
