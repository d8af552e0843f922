// Reading a file the user named on the command line (a flag's value): the whole of it, or one
// line that names the flag, the path and what is wrong with it.
#pragma once

#include <string>
#include <string_view>

namespace cohort {

// The contents of `path`, given as `flag` ("--hostfile"). Throws InvalidArgument "FLAG PATH: ..."
// for a path that does not exist, is a directory (which opens as a stream that reads nothing), or
// cannot be read (with the system's reason); `fix`, when not empty, ends the message.
std::string readNamedFile(std::string_view flag, const std::string& path, std::string_view fix = {});

}  // namespace cohort
