// Small helpers over text that every layer uses.
#pragma once

#include <string>
#include <string_view>

namespace cohort {

// The first line of a message: what an error says before the stack trace or the detail that
// c10d, torch and gRPC append after a newline, fit for a one-line report.
inline std::string firstLine(std::string_view text) { return std::string(text.substr(0, text.find('\n'))); }

}  // namespace cohort
