#include <cohort/error.h>

#include "base/launcher_channel.h"
#include "base/text.h"
#include "cli/commands.h"
#include "experiment/runner.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <optional>
#include <string>

namespace {

int fail(int code, const std::string& message) {
  // The verdict is in; what is left is exiting. `cohort launch` stops the other ranks with SIGTERM
  // when one of them fails, and a rank that lost this process can fail first: a SIGTERM now would
  // turn this status (2: the input was refused) into a kill, and the job would end with the
  // consequence's status instead of the cause's.
  std::signal(SIGTERM, SIG_IGN);
  std::fprintf(stderr, "cohort: error: %s\n", cohort::firstLine(message).c_str());
  cohort::launcher::tellError(cohort::firstLine(message));  // `cohort launch` names it with the exit
  return code;
}

}  // namespace

namespace cohort::cli {

std::vector<std::string> expandConfig(const CLI::App& app, std::vector<std::string> args) {
  if (args.empty()) return args;
  const CLI::App* command = nullptr;
  for (const CLI::App* sub : app.get_subcommands({})) {
    if (sub->get_name() == args[0]) command = sub;
  }
  if (command == nullptr) return args;
  // One --config per command, before any "--": a second would be read by nobody.
  std::optional<std::string> path;
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "--") break;
    std::optional<std::string> given;
    if (args[i] == "--config" && i + 1 < args.size()) {
      given = args[i + 1];
      args.erase(args.begin() + long(i), args.begin() + long(i) + 2);
    } else if (args[i].rfind("--config=", 0) == 0) {
      given = args[i].substr(9);
      args.erase(args.begin() + long(i));
    } else {
      continue;
    }
    --i;
    COHORT_CHECK(!path, InvalidArgument, "--config is given twice (", *path, " and ", *given,
                 "): a command reads one config file; put the keys in one, or override them on the command line");
    COHORT_CHECK(!given->empty(), InvalidArgument, "--config needs a file: --config FILE.toml");
    path = std::move(given);
  }
  if (!path) return args;
  std::vector<std::string> fromFile = configToArgs(*command, *path);
  args.insert(args.begin() + 1, fromFile.begin(), fromFile.end());
  return args;
}

}  // namespace cohort::cli

int main(int argc, char** argv) {
  // Inherited as ignored (a parent's SIG_IGN survives exec), SIGCHLD would have the kernel reap
  // every child itself: waitpid could never say how a job, a rank or an `ip` command ended.
  std::signal(SIGCHLD, SIG_DFL);
  CLI::App app{"cohort: distributed training of neural networks on libtorch"};
  app.require_subcommand(1);
  app.set_version_flag(
      "--version", [] { return cohort::cli::versionText(); },
      "Print cohort's version, its LibTorch (CUDA, cuDNN), the CUDA devices it sees, NCCL, and exit");
  cohort::cli::Run train = cohort::cli::addTrainCommand(app);
  cohort::cli::Run launch = cohort::cli::addLaunchCommand(app);
  cohort::cli::Run ps = cohort::cli::addPsCommand(app);
  cohort::cli::Run simulate = cohort::cli::addSimulateCommand(app);
  cohort::cli::Run ensemble = cohort::cli::addEnsembleCommand(app);
  cohort::cli::Run quantize = cohort::cli::addQuantizeCommand(app);
  cohort::cli::Run compare = cohort::cli::addCompareCommand(app);
  cohort::cli::Run sweep = cohort::cli::addSweepCommand(app);
  // After the subcommands: CLI11 copies a parent's footer into the subcommands made after it.
  app.footer(
      "cohort SUBCOMMAND --help lists a command's options. Every command also takes --config FILE.toml\n"
      "(one a command): its options from a TOML file whose keys are the long flag names (batch = 32);\n"
      "the command line overrides them.");

  try {
    std::vector<std::string> args = cohort::cli::expandConfig(app, {argv + 1, argv + argc});
    std::reverse(args.begin(), args.end());  // CLI11 takes them last first
    app.parse(args);
  } catch (const cohort::InvalidArgument& e) {
    return fail(2, e.what());
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return fail(2, std::string(e.what()) + " (see cohort --help)");
  } catch (const std::exception& e) {  // a validator's or a config's, out of memory: not a crash
    return fail(1, e.what());
  }

  try {
    if (app.got_subcommand("train")) return train();
    if (app.got_subcommand("launch")) return launch();
    if (app.got_subcommand("ps")) return ps();
    if (app.got_subcommand("simulate")) return simulate();
    if (app.got_subcommand("ensemble")) return ensemble();
    if (app.got_subcommand("quantize")) return quantize();
    if (app.got_subcommand("compare")) return compare();
    if (app.got_subcommand("sweep")) return sweep();
    return fail(2, "no command given (see cohort --help)");
  } catch (const cohort::InvalidArgument& e) {
    return fail(2, e.what());
  } catch (const cohort::experiment::Interrupted& e) {  // compare, sweep: told apart from a failure
    return fail(128 + e.signal(), e.what());
  } catch (const cohort::Error& e) {
    return fail(1, e.what());
  } catch (const c10::Error& e) {
    return fail(1, e.what_without_backtrace());
  } catch (const std::exception& e) {
    return fail(1, e.what());
  }
}
