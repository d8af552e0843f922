// Decentralized asynchronous SGD without a server (Strom 2015): every peer trains its own replica
// on its shard, sends the change its optimizer step made to the other peers without waiting, and
// adds the changes it receives at the start of its next step (gossip/peer.h is the transport).
//
// Why the optimizer's change and not gradient x lr: it is exactly what the sender applied, for
// every optimizer (momentum, Adam), so every replica is "initial parameters + the sum of every
// update it has received"; once all messages are delivered the replicas agree (up to the codec's
// residuals and float summation order).
//
// Staleness of a received update: the updates (steps, own and received) folded into this replica
// just before it applies the update, minus those folded into the sender's replica when it made
// the update (that update included), clamped at 0. It is ps's "version applied - version pulled"
// with each replica's own count as its version.
//
// synchronize() adds what has arrived and never waits. finish() is the end: each peer sends what
// is left and DONE (with its statistics), then waits, at most --timeout, until every other peer
// finished or was lost; the final evaluation on the chief therefore sees every update every live
// peer made, and a dead peer costs nothing but its missing numbers.
#pragma once

#include <cohort/gossip.h>
#include <cohort/job.h>

#include "strategy/strategy.h"

#include <memory>

namespace cohort {

// `--strategy gossip`: the CLI's adapter over the library's Gossip handle (include/cohort/gossip.h).
std::unique_ptr<Strategy> makeGossipStrategy(const Job& job, GossipOptions options);

}  // namespace cohort
