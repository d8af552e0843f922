// `cohort sweep`'s search space: a TOML file naming, for any `cohort train` option, one value, a
// list of values, or a range; expanded into trials by grid or seeded random search. Torch-free.
//
//   model = "mlp"                                  # a value: every trial
//   batch = [32, 64]                               # a list: one of them
//   lr = { min = 0.001, max = 0.1, log = true }    # a range: drawn (random), or `steps = N`
//                                                  # evenly spaced values (grid, and random)
//   [sweep]                # last: in TOML, the keys after a [table] header belong to it
//   mode = "random"        # or "grid" (every combination, the first option changing slowest)
//   trials = 8             # random: how many
//   seed = 1               # random: the draws depend on it and the trial's number only
//   workers = 2            # each trial under cohort launch -n 2 (default 1)
//   ps = 1                 # ... --ps 1
// Integer bounds give integer values. Errors name the file and the option: an unknown option, an
// empty list, an empty range (min > max), a log range that reaches 0, a range without steps in a
// grid.
#pragma once

#include "experiment/plan.h"

#include <cstdint>
#include <string>
#include <vector>

namespace cohort::experiment {

struct SweepParameter {
  std::string flag;                  // "--lr"
  bool isFlag = false;               // values are "true" / "false"
  std::vector<std::string> values;   // a list (or a range with steps, expanded)
  bool range = false;                // drawn from [min, max]
  double min = 0, max = 0;
  bool log = false;
  bool integer = false;
};

struct SweepSpace {
  bool random = false;
  int trials = 0;
  uint64_t seed = 1;
  int workers = 1;
  int shards = 0;
  TrainArgs fixed;
  std::vector<SweepParameter> parameters;
};

SweepSpace readSweepFile(const std::string& path, const OptionCatalog& catalog);

struct Trial {
  std::string id;  // "trial-001"
  TrainArgs chosen;  // the swept options only
};

// Grid: every combination, the first parameter changing slowest. Random: `trials` draws.
std::vector<Trial> expandTrials(const SweepSpace& space);

// Trial `t`'s train options: the file's fixed ones, then its drawn ones. Where the trial draws
// --strategy or --ps-mode, the fixed options of other schemes and modes are left out (period = 8
// beside strategy = ["allreduce", "average"]), which train would refuse; drawn ones go as they are.
TrainArgs trialOptions(const SweepSpace& space, const Trial& t);

}  // namespace cohort::experiment
