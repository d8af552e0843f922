// The subcommands of the `cohort` binary. Each registers its options on the parsed App and
// returns the function that runs it.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace cohort::cli {

using Run = std::function<int()>;

Run addTrainCommand(CLI::App& app);

}  // namespace cohort::cli
