// A host and a port, as the cluster's conventions (TF_CONFIG, MASTER_ADDR/PORT, --peers) name a
// process's address.
#pragma once

#include <cohort/export.h>

#include <string>

namespace cohort {

struct COHORT_API HostPort {
  std::string host;  // a name or an address; IPv6 without brackets
  int port = 0;

  // "host:port", or "[host]:port" when host is an IPv6 address (a host already in brackets keeps
  // them once).
  std::string str() const;
  bool operator==(const HostPort&) const = default;
};

}  // namespace cohort
