#include "cli/launch_children.h"

#include <cohort/error.h>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <charconv>
#include <string_view>

namespace cohort::cli {

namespace {

// The launcher reads its ends of a child's pipes without blocking (cli/launch_output.h).
int nonBlocking(int fd) {
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  return fd;
}

// "port P" or "port none": the port, 0 for none, -1 for anything else.
int parsePort(std::string_view text) {
  if (text == "none") return 0;
  int port = -1;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), port);
  return ec != std::errc() || end != text.data() + text.size() || port < 1 || port > kMaxPort ? -1 : port;
}

}  // namespace

void startChild(LaunchedChild& child, const std::vector<std::string>& command, const EnvChanges& env) {
  SubprocessOptions options;
  options.argv = command;
  options.setEnv = env;
  options.unsetEnv = assignedElsewhere();
  options.out = ChildStream::pipe();
  options.err = ChildStream::pipe();
  options.extra = {{kChannelFd, ChildStream::pipe()}};
  options.parentDeathSignal = SIGTERM;
  // A group of its own, which the launcher signals whole: a wrapper (sh -c, a script) leaves no
  // trainer behind, not even across a restart. The launcher forwards the terminal's Ctrl-C.
  options.processGroup = kNewGroup;
  options.execFailurePrefix = "cohort launch: ";
  try {
    child.process = Subprocess::spawn(options);
  } catch (const SubprocessError& e) {
    throw Error("launch: cannot start " + child.label + ": " + e.what());
  }
  const std::string prefix = "[" + child.label + "] ";
  child.out =
      std::make_unique<LineForwarder>(nonBlocking(child.process.releaseFd(STDOUT_FILENO)), STDOUT_FILENO, prefix);
  child.err =
      std::make_unique<LineForwarder>(nonBlocking(child.process.releaseFd(STDERR_FILENO)), STDERR_FILENO, prefix);
  child.channel = std::make_unique<ChannelReader>(nonBlocking(child.process.releaseFd(kChannelFd)));
}

// The messages of base/launcher_channel.h.
void readChannel(LaunchedChild& child, WorkerLoss& scheme) {
  if (!child.channel) return;
  for (const std::string& line : child.channel->readLines()) {
    const std::string_view text(line);
    const size_t space = text.find(' ');
    const std::string_view verb = text.substr(0, space);
    const std::string_view rest = space == std::string_view::npos ? "" : text.substr(space + 1);
    if (verb == "fault-policy" && !child.server && child.rank == 0) {
      if (auto loss = parseWorkerLoss(rest)) scheme = *loss;
    } else if (verb == "shard-checkpoints" && child.server) {
      child.writesCheckpoints = true;
    } else if (verb == "shard-has-checkpoint" && child.server) {
      child.hasCheckpoint = true;
    } else if (verb == "finished") {
      child.finished = true;
    } else if (verb == "error") {
      child.error = std::string(rest);
    } else if (verb == "port" && child.tellsPort() && child.port < 0) {
      child.port = parsePort(rest);  // the first port counts: a shard restarted alone binds the one the workers know
    }
  }
}

void drain(LaunchedChild& child, WorkerLoss& scheme) {
  for (LineForwarder* f : {child.out.get(), child.err.get()}) {
    for (int i = 0; i < 16 && f != nullptr && f->readAvailable(); ++i) {
    }
  }
  readChannel(child, scheme);
}

void closePipes(LaunchedChild& child, WorkerLoss& scheme) {
  if (child.out) {
    drain(child, scheme);
    child.out->close();
    child.err->close();
  }
  if (child.channel) child.channel->close();
}

}  // namespace cohort::cli
