// The TOML files `cohort compare` and `cohort sweep` take: read whole (base/files.h's rules), then
// parsed, each failure one line naming the file.
#pragma once

#include <toml++/toml.h>

#include <string>
#include <string_view>

namespace cohort::experiment {

// The table in `path`, given as `what` ("the sweep file"). Throws InvalidArgument for a path that
// cannot be read ("WHAT PATH: is a directory, not a file; FIX"), a file that is not TOML ("PATH:LINE:
// what is wrong"), or one with no keys at all ("WHAT PATH: is empty; FIX").
toml::table readTomlFile(std::string_view what, const std::string& path, std::string_view fix);

}  // namespace cohort::experiment
