// "host:port" and "[v6 host]:port" as the cluster's conventions write them.
#pragma once

#include <cohort/cluster.h>

#include <optional>
#include <string>

namespace cohort {

// The host (brackets removed) and a port in 1..65535 (0..65535 with allowPortZero: a task that
// listens on any free port and tells its launcher); nullopt for anything else, including an IPv6
// host without brackets.
std::optional<HostPort> parseHostPort(const std::string& text, bool allowPortZero = false);

}  // namespace cohort
