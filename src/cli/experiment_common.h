// What `cohort compare` and `cohort sweep` share on the command line side.
#pragma once

#include "experiment/plan.h"

#include <CLI/CLI.hpp>

#include <string>

namespace cohort::cli {

// `cohort train`'s options, read from the train subcommand of app.
experiment::OptionCatalog trainCatalog(const CLI::App& app);

// This executable's path (/proc/self/exe), for the jobs to run.
std::string selfExecutable();

// The command line this process was started with, shell-quoted (from /proc/self/cmdline).
std::string selfInvocation();

}  // namespace cohort::cli
