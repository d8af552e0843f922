#include "experiment/sweep.h"

#include "experiment/toml_file.h"

#include <toml++/toml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <optional>
#include <random>

namespace cohort::experiment {

namespace {

constexpr size_t kMaxTrials = 100000;

std::string formatNumber(double v) {
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, end);
}

std::optional<std::string> scalarText(const toml::node& node) {
  if (auto s = node.as_string()) return s->get();
  if (auto i = node.as_integer()) return std::to_string(i->get());
  if (auto f = node.as_floating_point()) return formatNumber(f->get());
  if (auto b = node.as_boolean()) return b->get() ? "true" : "false";
  return std::nullopt;
}

std::optional<double> numberOf(const toml::node* node) {
  if (node == nullptr) return std::nullopt;
  if (auto i = node->as_integer()) return double(i->get());
  if (auto f = node->as_floating_point()) return f->get();
  return std::nullopt;
}

std::string valueText(const SweepParameter& p, double v) {
  if (p.integer) return std::to_string(int64_t(std::llround(v)));
  return formatNumber(v);
}

void checkFlagValue(const SweepParameter& p, const std::string& value, const std::string& where) {
  if (!p.isFlag) return;
  COHORT_CHECK(value == "true" || value == "false", InvalidArgument, where, ": option '", p.flag.substr(2),
               "' is a flag: its values are true and false");
}

// The [sweep] table: mode, trials, seed, workers, ps.
void readSweepTable(const toml::table& sweep, const std::string& path, SweepSpace& space) {
  for (const auto& [key, node] : sweep) {
    const std::string k(key.str());
    if (k == "mode") {
      auto s = node.as_string();
      COHORT_CHECK(s != nullptr && (s->get() == "grid" || s->get() == "random"), InvalidArgument, path,
                   ": [sweep] mode is \"grid\" or \"random\"");
      space.random = s->get() == "random";
    } else if (k == "trials" || k == "seed" || k == "workers" || k == "ps") {
      auto i = node.as_integer();
      const int64_t min = k == "ps" ? 0 : k == "seed" ? 0 : 1;
      COHORT_CHECK(i != nullptr && i->get() >= min, InvalidArgument, path, ": [sweep] ", k,
                   " must be a whole number >= ", min);
      if (k == "trials") space.trials = int(i->get());
      if (k == "seed") space.seed = uint64_t(i->get());
      if (k == "workers") space.workers = int(i->get());
      if (k == "ps") space.shards = int(i->get());
    } else {
      throw InvalidArgument(path + ": [sweep] has no key '" + k +
                            "' (mode, trials, seed, workers, ps; train options go above the [sweep] table)");
    }
  }
}

// The train options of the file, in the file's order (toml++ iterates keys sorted): the grid's
// first option changes slowest.
std::vector<std::pair<std::string, const toml::node*>> optionsInFileOrder(const toml::table& root) {
  std::vector<std::pair<std::string, const toml::node*>> options;
  for (const auto& [key, node] : root) {
    if (key.str() != "sweep") options.emplace_back(std::string(key.str()), &node);
  }
  std::stable_sort(options.begin(), options.end(), [](const auto& a, const auto& b) {
    return a.second->source().begin.line < b.second->source().begin.line;
  });
  return options;
}

// A list of values: one of them per trial.
void readList(const toml::array& list, const std::string& path, const std::string& k, SweepParameter& p) {
  COHORT_CHECK(!list.empty(), InvalidArgument, path, ": option '", k, "' has an empty list of values");
  for (const toml::node& v : list) {
    auto text = scalarText(v);
    COHORT_CHECK(text.has_value(), InvalidArgument, path, ": option '", k, "': list values must be plain values");
    checkFlagValue(p, *text, path);
    p.values.push_back(*text);
  }
}

// A range's `steps` evenly spaced values (on a log scale with log = true), from min to max.
void expandSteps(const toml::node& st, const std::string& path, const std::string& k, SweepParameter& p) {
  auto n = st.as_integer();
  COHORT_CHECK(n != nullptr && n->get() >= 1, InvalidArgument, path, ": option '", k, "': steps must be >= 1");
  const int64_t steps = n->get();
  for (int64_t i = 0; i < steps; ++i) {
    const double t = steps == 1 ? 0.0 : double(i) / double(steps - 1);
    const double v =
        p.log ? std::exp(std::log(p.min) + t * (std::log(p.max) - std::log(p.min))) : p.min + t * (p.max - p.min);
    const std::string text = valueText(p, v);
    if (p.values.empty() || p.values.back() != text) p.values.push_back(text);
  }
}

// A range {min, max, log, steps}: drawn from in a random sweep, or its steps' values.
void readRange(const toml::table& range, const std::string& path, const std::string& k, bool random,
               SweepParameter& p) {
  for (const auto& [rk, rv] : range) {
    const std::string r(rk.str());
    COHORT_CHECK(r == "min" || r == "max" || r == "log" || r == "steps", InvalidArgument, path, ": option '", k,
                 "': a range has min, max, log and steps, not '", r, "'");
  }
  const auto lo = numberOf(range.get("min"));
  const auto hi = numberOf(range.get("max"));
  COHORT_CHECK(lo && hi, InvalidArgument, path, ": option '", k, "': a range needs numbers min and max");
  COHORT_CHECK(!p.isFlag, InvalidArgument, path, ": option '", k, "' is a flag: list [true, false] instead");
  COHORT_CHECK(*lo <= *hi, InvalidArgument, path, ": option '", k, "' has an empty range (min ", *lo, " > max ", *hi,
               ")");
  p.range = true;
  p.min = *lo;
  p.max = *hi;
  p.integer = range.get("min")->is_integer() && range.get("max")->is_integer();
  if (const toml::node* l = range.get("log")) {
    COHORT_CHECK(l->is_boolean(), InvalidArgument, path, ": option '", k, "': log is true or false");
    p.log = l->as_boolean()->get();
  }
  COHORT_CHECK(!p.log || p.min > 0, InvalidArgument, path, ": option '", k, "': a log range needs min > 0");
  if (const toml::node* st = range.get("steps")) {
    expandSteps(*st, path, k, p);
    p.range = false;
  } else {
    COHORT_CHECK(random, InvalidArgument, path, ": option '", k,
                 "': a range in a grid sweep needs steps = N (or use [sweep] mode = \"random\")");
  }
}

// One train option of the file: a list or a range is a parameter of the search, a value is the
// same in every trial.
void readOption(const std::string& k, const toml::node& node, const OptionCatalog& catalog, const std::string& path,
                SweepSpace& space) {
  const std::string name = catalog.check(k, path);
  SweepParameter p;
  p.flag = "--" + name;
  p.isFlag = !catalog.takesValue.at(name);
  if (const toml::array* list = node.as_array()) {
    readList(*list, path, k, p);
    space.parameters.push_back(std::move(p));
  } else if (const toml::table* range = node.as_table()) {
    readRange(*range, path, k, space.random, p);
    space.parameters.push_back(std::move(p));
  } else {
    auto text = scalarText(node);
    COHORT_CHECK(text.has_value(), InvalidArgument, path, ": option '", k, "': not a value, list or range");
    checkFlagValue(p, *text, path);
    if (p.isFlag) {
      if (*text == "true") setArg(space.fixed, p.flag, "");
    } else {
      setArg(space.fixed, p.flag, *text);
    }
  }
}

}  // namespace

SweepSpace readSweepFile(const std::string& path, const OptionCatalog& catalog) {
  const toml::table root =
      readTomlFile("the sweep file", path, "a sweep file names the options to try, one per line: lr = [0.01, 0.1]");
  SweepSpace space;
  if (const toml::table* sweep = root["sweep"].as_table()) readSweepTable(*sweep, path, space);
  COHORT_CHECK(!space.random || space.trials > 0, InvalidArgument, path, ": a random sweep needs [sweep] trials = N");
  for (const auto& [k, node] : optionsInFileOrder(root)) readOption(k, *node, catalog, path, space);
  if (!space.random) {
    size_t total = 1;
    for (const SweepParameter& p : space.parameters) {
      total *= p.values.size();
      COHORT_CHECK(total <= kMaxTrials, InvalidArgument, path, ": the grid has more than ", kMaxTrials, " trials");
    }
  }
  return space;
}

std::vector<Trial> expandTrials(const SweepSpace& space) {
  auto name = [](size_t i) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "trial-%03zu", i + 1);
    return std::string(buf);
  };
  auto set = [](Trial& t, const SweepParameter& p, const std::string& value) {
    if (p.isFlag) {
      if (value == "true") setArg(t.chosen, p.flag, "");
    } else {
      setArg(t.chosen, p.flag, value);
    }
  };
  std::vector<Trial> trials;
  if (space.random) {
    for (int i = 0; i < space.trials; ++i) {
      // Each trial's draws depend on the seed and its number only: the same file gives the same
      // trials, however many run at once and however often the sweep is resumed.
      std::mt19937_64 gen(space.seed * 1000003ULL + uint64_t(i));
      Trial t{name(size_t(i)), {}};
      for (const SweepParameter& p : space.parameters) {
        std::uniform_real_distribution<double> unit(0.0, 1.0);
        if (!p.range) {
          set(t, p, p.values[size_t(unit(gen) * double(p.values.size())) % p.values.size()]);
          continue;
        }
        const double u = unit(gen);
        // An integer range is drawn over [min, max + 1) and floored, so that max is drawn as often
        // as any other value (on a log scale, as often as its share of that log range).
        const double top = p.integer ? p.max + 1 : p.max;
        double v = p.log ? std::exp(std::log(p.min) + u * (std::log(top) - std::log(p.min))) : p.min + u * (top - p.min);
        if (p.integer) v = std::clamp(std::floor(v), p.min, p.max);
        set(t, p, valueText(p, v));
      }
      trials.push_back(std::move(t));
    }
    return trials;
  }
  size_t total = 1;
  for (const SweepParameter& p : space.parameters) total *= p.values.size();
  for (size_t i = 0; i < total; ++i) {
    Trial t{name(i), {}};
    size_t rest = i;
    std::vector<size_t> pick(space.parameters.size());
    for (size_t k = space.parameters.size(); k-- > 0;) {
      pick[k] = rest % space.parameters[k].values.size();
      rest /= space.parameters[k].values.size();
    }
    for (size_t k = 0; k < space.parameters.size(); ++k) set(t, space.parameters[k], space.parameters[k].values[pick[k]]);
    trials.push_back(std::move(t));
  }
  return trials;
}

TrainArgs trialOptions(const SweepSpace& space, const Trial& t) {
  const std::string* drawnScheme = findArg(t.chosen, "--strategy");
  const std::string* drawnMode = findArg(t.chosen, "--ps-mode");
  TrainArgs args = space.fixed;
  if (drawnScheme != nullptr || drawnMode != nullptr) {
    const std::string* schemeText = drawnScheme != nullptr ? drawnScheme : findArg(space.fixed, "--strategy");
    const std::string* modeText = drawnMode != nullptr ? drawnMode : findArg(space.fixed, "--ps-mode");
    // train's default scheme where none is named; an unknown name is train's to refuse.
    const std::optional<Scheme> scheme = schemeText != nullptr ? parseScheme(*schemeText) : Scheme::kLocal;
    if (scheme) args = withoutFlagsOfOtherSchemes(space.fixed, *scheme, modeText != nullptr ? *modeText : "");
  }
  for (const auto& [flag, value] : t.chosen) setArg(args, flag, value);
  return args;
}

}  // namespace cohort::experiment
