// The update policy a ParameterServerClient sends its shards in Init: the options' choices
// (include/cohort/parameter_server.h's enums) as the wire's enums (proto/ps.proto), and the
// checks of the options against the job, made once when the client is built.
#pragma once

#include <cohort/parameter_server.h>

#include "ps.pb.h"

#include <string>
#include <vector>

namespace cohort {

// Throws InvalidArgument, naming the entry and `what` (the option they came from, "--ps-hosts"),
// unless every entry of `hosts` is HOST:PORT ([V6HOST]:PORT) with a port in 1..65535 and no two
// name the same address: a port beyond 65535 would wrap, a missing one would be gRPC's 443, and
// a shard named twice would hold the same keys twice.
void checkShardHosts(const std::vector<std::string>& hosts, const std::string& what);

// Throws InvalidArgument, naming the command-line option, for options that do not fit `workers`
// workers (backup workers, softsync, remedies that only the asynchronous modes have).
void checkPolicyOptions(const ParameterServerOptions& options, int workers);

// The Init policy: every field of `options` the shards apply, for `workers` workers and waits of at
// most timeoutSeconds.
ps::wire::Policy wirePolicy(const ParameterServerOptions& options, int workers, double timeoutSeconds);

}  // namespace cohort
