// The training schemes, one vocabulary for every layer. A name is parsed once, where it comes in
// (the command line's --strategy, a compare or sweep file, simulate's --strategy); inside, the
// code compares Schemes, never names.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace cohort {

enum class Scheme { kLocal, kAllreduce, kAverage, kPs, kGossip, kPipeline, kTensor, kMirrored, kCentral, kHogwild };

// The name --strategy gives it: "local", "allreduce", ..., "hogwild".
const char* schemeName(Scheme scheme);

// The scheme a name means; nullopt for any other text (the caller names what it read and where,
// and lists schemeNames()).
std::optional<Scheme> parseScheme(std::string_view name);

// Every scheme, in declaration order.
std::vector<Scheme> allSchemes();

// Every name, in declaration order: "local, allreduce, ..., hogwild".
std::string schemeNames();

// mirrored, central, hogwild: replica threads of one process that share its memory.
bool isInProcess(Scheme scheme);

// Where a `cohort train` flag that acts under some schemes only acts, when it does nothing under
// `scheme` (and, for a ps flag of some modes only, under `psMode`: "sync", "async", "softsync" or
// "ssp"): "--strategy average", "--strategy mirrored, central or hogwild", "--ps-mode softsync".
// nullopt when it acts here, and for every flag that acts under every scheme. One table, so that
// train refuses such a flag and compare and sweep leave a shared one out of the runs it means
// nothing to. `flag` is the long name with its dashes: "--period".
std::optional<std::string> whereFlagActs(std::string_view flag, Scheme scheme, std::string_view psMode);

// The flags whereFlagActs knows, for a command to check the ones it was given.
std::vector<std::string> schemeSpecificFlags();

}  // namespace cohort
