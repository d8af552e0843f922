// Files the user names on the command line (a flag's value): reading one whole, checking where
// one will be written, and replacing one so that a crash leaves the old file or the new one.
#pragma once

#include <functional>
#include <string>
#include <string_view>

namespace cohort {

// The contents of `path`, given as `flag` ("--hostfile"). Throws InvalidArgument "FLAG PATH: ..."
// for a path that does not exist, is a directory (which opens as a stream that reads nothing), or
// cannot be read (with the system's reason), or holds more than 64 MiB (/dev/zero would never end);
// `fix`, when not empty, ends the message.
std::string readNamedFile(std::string_view flag, const std::string& path, std::string_view fix = {});

// Before the work whose result goes to `path` (given as `flag`): throws InvalidArgument "FLAG
// PATH: ..." when `path` is empty or a directory, or when its directory does not exist.
void checkOutputPath(std::string_view flag, const std::string& path);

// Replaces `path` with the file `write` makes at the temporary path it is given (`path`.tmp, in
// the same directory), synced to disk, and then its directory: a crash leaves the old file or the
// new one, never part of one; the new file keeps the old one's permissions. The temporary is removed
// when `write` throws (rethrown) or the file cannot be synced or renamed (IoError naming `path`).
// A symlink's target is replaced (the link stays); a path that is there and not a regular file
// (/dev/stdout, a FIFO) is given to `write` itself, written in place.
void replaceFile(const std::string& path, const std::function<void(const std::string& tmp)>& write);
// replaceFile with `text` as the contents.
void replaceFileWithText(const std::string& path, std::string_view text);

// Writes all of `data` to `fd` (a terminal, pipe or file: standard output or error), retrying
// short writes and EINTR and, when the descriptor is non-blocking (as a CI runner may leave a
// pipe), waiting until it takes more instead of dropping the rest. Returns false when it cannot
// (closed, EPIPE, an error): output is not worth failing over.
bool writeToStream(int fd, std::string_view data);

}  // namespace cohort
