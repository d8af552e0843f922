// Who joined a job's rendezvous (the store the chief hosts, comm/store.h). Before a process writes
// anything its peers read (Gloo's addresses, the gossip peers' ports), it claims its rank in the
// store and checks its world size against the first process's to come. A rank that two processes
// were given (a launch line copied without changing RANK) or a world size that is not the others'
// then ends the rendezvous at once, on every process still in it, with one line naming the rank and the
// processes, instead of a timeout or an unrelated error (the second process's Gloo address
// overwrote the first's). Defined in rendezvous.cpp.
//
// Keys, under "cohort/join/":
//   arrivals       how many processes came (an add: the first gets 1)
//   arrival/N      the N-th one's world size, rank and who it is ("2 0 pid 4242 on host node3");
//                  each compares its world size with the first's
//   rank/R         how many processes claimed rank R (an add: the first gets 1)
//   rank/R/N       who the N-th claimant of rank R is
//   rank/R/N/left  set when that claimant has read the refusal (or made it) and leaves
//   refused        the line a process refused the job with; every process waiting in its
//                  rendezvous checks it (RankClaim::refusal) and fails with it
// The chief hosts the store: once it has read the refusal it waits (a few seconds at most) until
// every other claimant has left, so that none finds the store gone instead of the line.
// A process that claims its rank after the others formed their group (one started late) is
// refused alone: the job it would have joined is complete. A rank whose first claimant was a
// process of this host that has ended is taken by the new one (a peer restarted alone, which its
// scheme takes or refuses for its own reason: gossip says it cannot rejoin a running group).
#pragma once

#include "comm/store.h"

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace cohort::store {

// How often a process waiting in its rendezvous checks whether another process refused the job.
constexpr std::chrono::milliseconds kRefusalCheckPeriod{250};
// How long the chief keeps its store for the other claimants to read a refusal, at most.
constexpr std::chrono::milliseconds kRefusalLinger{5000};

// "pid 4242 on host node3".
std::string thisProcess();

class RankClaim {
 public:
  // Claims `rank` of a job of `worldSize` workers for this process, through `store` (which must
  // outlive the claim), after comparing its world size with the first process's to arrive. Throws
  // InvalidArgument when the world sizes differ or another process claimed the rank already, after
  // recording the same line where refusal() finds it; CommError when the store fails.
  static RankClaim make(Client& store, int rank, int worldSize, std::chrono::milliseconds timeout);

  // The line a process of the job refused it with, or nothing. When there is one, this claim
  // leaves (the chief's waits for the others' first, kRefusalLinger at most).
  std::optional<std::string> refusal() const;

 private:
  RankClaim(Client& store, int rank, int worldSize, int64_t number)
      : store_(&store), rank_(rank), worldSize_(worldSize), number_(number) {}
  Client* store_;
  int rank_;
  int worldSize_;
  int64_t number_;  // this process is the number_-th claimant of rank_
};

}  // namespace cohort::store
