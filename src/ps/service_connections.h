// The shard's accept loop (Connections): binds the shard's port, accepts, hands each connection
// to gRPC and keeps at most 64 unproven connections and a bounded number in all. Private to src/ps;
// service.cpp's ShardServer holds one.
#pragma once

#include "base/thread_annotations.h"
#include "ps/service_refusals.h"

#include <grpcpp/server_builder.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace cohort::ps::service_internal {

// The shard's own accept loop. gRPC's listener takes every connection and keeps each that sent
// HTTP/2's preface for as long as its peer holds it open: 1,000 idle strangers held 1,000
// descriptors and 150 MB of a shard (issue 30), where the store and the gossip peers hold at most
// 64 connections that have not proved the secret. So the shard binds the port itself, accepts,
// and hands each connection to gRPC (ExternalConnectionAcceptor) while keeping a record of it:
//  - a connection is proven by its first call that reaches the service with a good proof (any
//    call, where the shard has no secret): Service::handle calls prove() with the call's peer;
//  - at most kMaxUnproven connections are unproven at a time: a newcomer evicts the oldest (it
//    had the most time to prove itself), so a flood cannot lock the job's processes out; an
//    evicted connection is shut down (its client, if it was one, retries on a new one);
//  - at most maxConnections() are open in all (half the descriptors the process may open: no fixed
//    ceiling, the accept loop polls and gRPC uses epoll): beyond, a newcomer is closed at once and
//    the shard logs the limit and how to raise it. ShardServer refuses an Init for more workers
//    than fit beside kMaxUnproven.
// gRPC closes a connection by itself as before (the peer left, the handshake deadline); a record
// goes once its descriptor no longer holds its socket (the same device and inode), which the loop
// looks at after every accept and at least once a second. Thread-safe.
class Connections {
 public:
  using Steady = std::chrono::steady_clock;
  static constexpr int kMaxUnproven = 64;

  struct Counts {
    int open = 0;         // connections handed to gRPC and not closed since
    int unproven = 0;     // of those, not proven and not evicted
    int64_t evicted = 0;  // unproven connections shut down for a newcomer
    int64_t dropped = 0;  // newcomers closed at once: too many open
  };

  // Binds `address` ("host:port", "[v6]:port"; port 0: a free one), every address the host
  // resolves to; throws Error naming it when it cannot.
  // `refusals` logs for it and gives back the heap pages of the connections gRPC closed.
  // maxConnections: 0 for half the process's open-file limit.
  Connections(const std::string& address, std::shared_ptr<Refusals> refusals, int maxConnections = 0);
  ~Connections();
  Connections(const Connections&) = delete;
  Connections& operator=(const Connections&) = delete;

  int port() const { return port_; }
  int maxConnections() const { return maxConnections_; }
  // Where maxConnections() comes from, for messages: "half its open-file limit of 2048", or
  // "its ServerOptions::maxConnections".
  const std::string& limitSource() const { return limitSource_; }
  // What fixes a limit too low for `workers`, for messages: the open-file limit to raise to.
  std::string raiseLimitHint(int64_t workers) const;

  // Starts accepting into gRPC (the server is started: a connection handed to it earlier is closed).
  void start(std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor);

  // Stops accepting; connections already handed over stay gRPC's. Idempotent.
  void stop();

  // A call from `peer` (ServerContext::peer(): "ipv4:127.0.0.1:5555", "ipv6:%5B::1%5D:5555")
  // carried a good proof.
  void prove(const std::string& peer);

  Counts counts();

  // Shuts every open connection down (ShardServer::cutConnectionsForTesting).
  void cutAll();

 private:
  struct Connection {
    int fd = -1;
    dev_t device = 0;  // the socket's identity: the descriptor's number may be reused once gRPC closes it
    ino_t inode = 0;
    std::string peer;  // peerKey
    Steady::time_point accepted;
    bool proven = false;
    bool evicted = false;
  };

  static void setPort(sockaddr_storage& a, int port);
  static int portOf(const sockaddr_storage& a);

  // "address port", the same for an accepted peer and for gRPC's spelling of it (an IPv4 address
  // mapped into IPv6 as its IPv4 self).
  static std::string peerKey(const sockaddr_storage& a);
  static std::string peerKey(std::string peer);

  void listen(const std::string& address);
  void closeListening();
  void acceptLoop();

  // Accepts what is waiting on `listener`.
  void acceptAll(int listener);

  // Drops the records of connections gRPC has closed, and asks for their memory back from the heap
  // (keepFreedMemory() would keep it).
  void reapLocked() REQUIRES(mu_);

  // Shuts the oldest unproven connection down; gRPC sees it end and closes it. Its descriptor still
  // holds its socket (reapLocked just looked), and only this thread opens sockets in a shard.
  void evictOldestUnprovenLocked() REQUIRES(mu_);

  // At most one line a second.
  void warn(const std::string& message);

  const std::shared_ptr<Refusals> refusals_;
  int maxConnections_ = 0;
  std::string limitSource_;
  std::vector<int> listening_;
  int wake_ = -1;
  int port_ = 0;
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  Steady::time_point lastWarning_;  // the accept loop's thread only

  Mutex mu_;
  std::map<uint64_t, Connection> open_ GUARDED_BY(mu_);
  std::map<std::string, uint64_t> byPeer_ GUARDED_BY(mu_);  // peerKey -> the latest connection from it
  uint64_t nextId_ GUARDED_BY(mu_) = 0;
  Counts counts_ GUARDED_BY(mu_);
};

}  // namespace cohort::ps::service_internal
