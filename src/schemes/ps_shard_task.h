// The shard of a parameter-server task (TF_CONFIG's "ps" tasks, `cohort launch --ps`), as options:
// shared by the library's serveParameterServerShard, which serves it in the caller's process as it
// is, and the command line's ps tasks, which serve it in a process of their own
// (src/cli/shard_process.cpp).
#pragma once

#include "ps/service.h"

#include <cohort/job.h>
#include <cohort/parameter_server.h>

#include <string>

namespace cohort {

// This task's shard: its address in the cluster spec, the job's secret and TLS files, a folder of
// its own under `checkpointDir` (when given), the job's Env (`job` must outlive the options), and
// restartedInJob when cohort launch restarted it alone. Throws InvalidArgument when this process
// is not a ps task or has no address.
ps::ServerOptions shardTaskOptions(const Job& job, const ParameterServerOptions& options,
                                   const std::string& checkpointDir);

}  // namespace cohort
