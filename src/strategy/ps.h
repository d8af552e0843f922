// `--strategy ps`: the CLI's adapter over the library's ParameterServerClient
// (include/cohort/parameter_server.h; implemented in schemes/parameter_server.cpp over ps/client.h).
//
// The worker pulls the parameters, computes a gradient on its batch, and pushes it to every shard;
// the shards run the optimizer and the update policy (ps/shard.h). Each push asks for the
// parameters back, so a step is one round trip per shard, to all shards in parallel: the next
// step's pull rides on this step's push. With push = updates the worker runs its optimizer
// itself and pushes the change in its parameters, which the shards add. With --codec, each push
// carries one codec message per shard (PushRequest.compressed); the worker keeps one encoder, and
// so one residual, per shard. The pulls stay float32.
#pragma once

#include <cohort/job.h>
#include <cohort/parameter_server.h>

#include "strategy/strategy.h"

#include <memory>

namespace cohort {

std::unique_ptr<Strategy> makePsStrategy(const Job& job, ParameterServerOptions options);

}  // namespace cohort
