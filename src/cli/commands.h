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

// `cohort --version`: cohort's version, then what this build and this machine give it: the
// LibTorch and its CUDA and cuDNN, the CUDA devices the process sees, NCCL, the codecs' kernels.
std::string versionText();

// The parameter servers' shared secret: the token, else the file's contents, else
// $COHORT_AUTH_TOKEN (which `cohort launch --ps` sets), else none.
std::string resolveAuthToken(const std::string& token, const std::string& file);

// The process around one shard, for `cohort ps` and the ps tasks of `cohort train`
// (shard_process.cpp): serves it (ps::serveShard) until the workers are done, prints
// "cohort ps: listening on HOST:PORT" once ready, stops on SIGTERM or SIGINT with a checkpoint,
// keeps freed memory off the heap's top, and arms the test hook COHORT_TEST_KILL_SHARD_AT. The
// exit status.
int runShardProcess(ps::ServerOptions options);

// The options a TOML file sets, as command-line arguments for `command` ("--batch", "32", ...).
// Throws InvalidArgument naming the file and the key that `command` does not know.
std::vector<std::string> configToArgs(const CLI::App& command, const std::string& path);

// Replaces `--config FILE` (or --config=FILE) after a subcommand by the options FILE sets, placed
// before the other arguments so that the command line overrides the file.
std::vector<std::string> expandConfig(const CLI::App& app, std::vector<std::string> args);

}  // namespace cohort::cli
