#include <cohort/error.h>
#include <cohort/trainer.h>

#include "cli/commands.h"

#include <cstdio>
#include <algorithm>
#include <map>

namespace cohort::cli {

std::vector<std::string> configToArgs(const CLI::App& command, const std::string& path) {
  std::vector<CLI::ConfigItem> items;
  try {
    items = CLI::ConfigTOML().from_file(path);
  } catch (const CLI::Error& e) {
    throw InvalidArgument(path + ": cannot read the config file: " + e.what());
  }
  std::vector<std::string> args;
  for (const auto& item : items) {
    if (item.name == "++" || item.name == "--") continue;  // section markers
    COHORT_CHECK(item.parents.empty(), InvalidArgument, path, ": unknown key '", item.fullname(),
                 "': sections are not used, write the keys at the top level");
    std::string flag = "--" + item.name;
    std::replace(flag.begin() + 2, flag.end(), '_', '-');
    const CLI::Option* option = command.get_option_no_throw(flag);
    COHORT_CHECK(option != nullptr && flag != "--config" && flag != "--help", InvalidArgument, path,
                 ": unknown key '", item.name, "' (see cohort ", command.get_name(), " --help)");
    if (option->get_expected_max() == 0) {  // a flag: true or false
      COHORT_CHECK(item.inputs.size() == 1 && (item.inputs[0] == "true" || item.inputs[0] == "false"),
                   InvalidArgument, path, ": key '", item.name, "' takes true or false");
      if (item.inputs[0] == "true") args.push_back(flag);
      continue;
    }
    COHORT_CHECK(item.inputs.size() == 1, InvalidArgument, path, ": key '", item.name,
                 "' takes one value");
    args.push_back(flag);
    args.push_back(item.inputs[0]);
  }
  return args;
}

Run addTrainCommand(CLI::App& app) {
  auto options = std::make_shared<TrainOptions>();
  auto progress = std::make_shared<std::string>("auto");
  TrainOptions& o = *options;
  CLI::App* train = app.add_subcommand("train", "Train a model with one of the distribution schemes");
  // A flag given twice (in --config and on the command line) takes the last: the command line.
  train->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  // Read by expandConfig() before parsing; declared here for --help.
  train->add_option("--config", "Read options from a TOML file: keys are the long flag names "
                                "(batch = 32, eval-every = 100); the command line overrides them");

  train->add_option("--model", o.model, "mlp, cnn, lstm, or a TorchScript file FILE.pt")
      ->capture_default_str();
  train->add_option("--data", o.data, "fashion-mnist, mnist:DIR or synthetic[:N]")->capture_default_str();
  train->add_option("--epochs", o.epochs, "Epochs to train")->capture_default_str();
  train->add_option("--steps", o.steps, "Steps to train in all (overrides --epochs)");
  train->add_option("--batch", o.batch, "Batch size per worker")->capture_default_str();
  train->add_option("--lr", o.lr, "Learning rate")->capture_default_str();
  train->add_option("--optimizer", o.optimizer, "sgd, momentum or adam")->capture_default_str();
  train->add_option("--momentum", o.momentum, "Momentum of the momentum optimizer")->capture_default_str();
  train->add_option("--threads", o.threads, "Intra-op threads (0: all cores)")->capture_default_str();
  train->add_option("--seed", o.seed, "Seed for initialization and data order")->capture_default_str();
  train->add_option("--eval-every", o.evalEvery, "Evaluate on the test set every N steps (0: at the end)")
      ->capture_default_str();
  train->add_option("--target-accuracy", o.targetAccuracy,
                    "Stop at the first evaluation reaching this test accuracy (0: never)");
  train->add_option("--checkpoint-dir", o.checkpointDir, "Write checkpoints to this directory");
  train->add_option("--checkpoint-every", o.checkpointEvery,
                    "Checkpoint every N steps (0: at the end only)");
  train->add_flag("--resume", o.resume, "Continue from the newest checkpoint in --checkpoint-dir");
  train->add_option("--metrics", o.metricsPath, "Write JSON-lines metrics to this file");
  train->add_option("--progress", *progress, "auto, bar, lines or off")
      ->check(CLI::IsMember({"auto", "bar", "lines", "off"}))
      ->capture_default_str();
  train->add_option("--save-model", o.saveModelPath,
                    "Save the trained model here (torch::save); with {rank} in the path every rank saves");
  train->add_option("--timeout", o.timeoutSeconds, "Seconds to wait for a peer before failing")
      ->capture_default_str();
  train->add_option("--strategy", o.strategy.name, "local, allreduce or average")
      ->check(CLI::IsMember({"local", "allreduce", "average"}))
      ->capture_default_str();
  auto* dp = "Data parallelism";
  train->add_option("--bucket-mb", o.strategy.bucketMb, "allreduce: gradient bucket size in MB")
      ->group(dp)->capture_default_str();
  train->add_option("--first-bucket-mb", o.strategy.firstBucketMb,
                    "allreduce: size of the first bucket, launched earliest")->group(dp)->capture_default_str();
  train->add_flag("--no-overlap{false}", o.strategy.overlap,
                  "allreduce: launch every allreduce after backward instead of during it")->group(dp);
  train->add_option("--period", o.strategy.period, "average: average the parameters every K steps")
      ->group(dp)->capture_default_str();
  train->add_flag("--average-optimizer-state", o.strategy.averageOptimizerState,
                  "average: average momentum / Adam state too")->group(dp);

  return [options, progress]() {
    TrainOptions& o = *options;
    static const std::map<std::string, ProgressMode> kModes{{"auto", ProgressMode::kAuto},
                                                           {"bar", ProgressMode::kBar},
                                                           {"lines", ProgressMode::kLines},
                                                           {"off", ProgressMode::kOff}};
    o.progress = kModes.at(*progress);
    Trainer trainer(o);
    TrainResult r = trainer.run();
    if (!trainer.isChief()) return 0;  // the chief reports for the job
    std::printf("done: %lld steps, %lld epochs, test accuracy %.4f, test loss %.4f, %.1f samples/s, %.1f s\n",
                (long long)r.steps, (long long)r.epochs, r.testAccuracy, r.testLoss,
                r.samplesPerSecond, r.wallSeconds);
    if (r.secondsToTarget) std::printf("target accuracy reached after %.1f s\n", *r.secondsToTarget);
    return 0;
  };
}

}  // namespace cohort::cli
