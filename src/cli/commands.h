// The subcommands of the `cohort` binary. Each registers its options on the parsed App and
// returns the function that runs it.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

namespace cohort::ps {
struct ServerOptions;
}

namespace cohort::cli {

using Run = std::function<int()>;

Run addTrainCommand(CLI::App& app);
Run addLaunchCommand(CLI::App& app);
Run addPsCommand(CLI::App& app);
Run addSimulateCommand(CLI::App& app);
Run addEnsembleCommand(CLI::App& app);
Run addQuantizeCommand(CLI::App& app);
// compare and sweep read train's option set from app: add them after train.
Run addCompareCommand(CLI::App& app);
Run addSweepCommand(CLI::App& app);

// The parameter servers' shared secret: the token, else the file's contents, else
// $COHORT_AUTH_TOKEN (which `cohort launch --ps` sets), else none.
std::string resolveAuthToken(const std::string& token, const std::string& file);

// Serves one shard until the workers are done; the exit status.
int serveShard(ps::ServerOptions options);

// The options a TOML file sets, as command-line arguments for `command` ("--batch", "32", ...).
// Throws InvalidArgument naming the file and the key that `command` does not know.
std::vector<std::string> configToArgs(const CLI::App& command, const std::string& path);

// Replaces `--config FILE` (or --config=FILE) after a subcommand by the options FILE sets, placed
// before the other arguments so that the command line overrides the file.
std::vector<std::string> expandConfig(const CLI::App& app, std::vector<std::string> args);

}  // namespace cohort::cli
