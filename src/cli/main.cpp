#include <cohort/error.h>

#include "cli/commands.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <string>

namespace {

std::string firstLine(const std::string& text) { return text.substr(0, text.find('\n')); }

int fail(int code, const std::string& message) {
  std::fprintf(stderr, "cohort: error: %s\n", firstLine(message).c_str());
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cohort: distributed training of neural networks on libtorch"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "cohort 0.1.0");
  cohort::cli::Run train = cohort::cli::addTrainCommand(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return fail(2, std::string(e.what()) + " (see cohort --help)");
  }

  try {
    if (app.got_subcommand("train")) return train();
    return fail(2, "no command given (see cohort --help)");
  } catch (const cohort::InvalidArgument& e) {
    return fail(2, e.what());
  } catch (const cohort::Error& e) {
    return fail(1, e.what());
  } catch (const c10::Error& e) {
    return fail(1, e.what_without_backtrace());
  } catch (const std::exception& e) {
    return fail(1, e.what());
  }
}
