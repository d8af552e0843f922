// Precompiled header for every target that uses libtorch (see CMakeLists.txt).
#pragma once
#include <torch/torch.h>
#include <torch/script.h>
