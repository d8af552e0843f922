// The job's rendezvous store: a small key-value server the chief hosts at the master address, and
// its client. It replaces c10d's TCPStore, which trusts the network: it listens on every
// interface, has no authentication, and allocates whatever size a stranger's SET announces.
// Torch-free (compiled into cohort_comm); comm/c10d_store.h adapts Client to c10d::Store for Gloo.
//
//   CHALLENGE (server -> client) = magic u32 "CST1" | flags u32 (1: the job has a secret) | nonce (32)
//   HELLO     (client -> server) = nonce (32) | HMAC(secret, "cohort-store client" | both nonces)
//   ANSWER    (server -> client) = 1 | HMAC(secret, "cohort-store server" | both nonces); 0 | 32 zeros
//   frame     = body length u32 | body | tag (16, with a secret: AES-GMAC over length and body)
//   request   = op u8 | fields, reply = status u8 (0 ok, 1 timed out, 2 refused) | fields
// Integers are little-endian; HELLO and ANSWER only when the job has a secret.
//
// With a secret, nothing reaches the key-value map from a peer that has not proved it. The
// handshake and the tags are base/auth_channel.h's, the client being the connector: the client
// answers a fresh nonce with its proof (the secret never crosses the wire), the server proves it
// back (so a process connecting to a forged store learns nothing and believes nothing), and every
// later frame carries a tag over its length and body under HMAC(secret, "cohort-store session" |
// nonces): a stranger who relays a connection cannot insert, alter, replay or reorder a request.
// Before the proof the server reads 64 fixed bytes and nothing else; at most maxPendingHandshakes
// connections are unproven at a time, each for at most handshakeTimeout. After it, a body grows as
// its bytes arrive (a length prefix is a claim, not an allocation), up to maxValueBytes.
//
// Without a secret the store is c10d's model: whoever reaches the port is trusted. It still binds
// the master address's interface only.
#pragma once

#include <cohort/env.h>
#include <cohort/error.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace cohort::store {

struct ServerOptions {
  std::string host;    // the master address: the server listens on this interface only
  int port = 0;        // 0: any free port (port() tells which)
  std::string secret;  // empty: no authentication
  std::chrono::milliseconds handshakeTimeout{10'000};
  int maxPendingHandshakes = 64;
  int maxConnections = 4096;
  size_t maxValueBytes = size_t(1) << 30;
  Env* env = nullptr;  // its warnings (<cohort/env.h>); null: Env::standard()
};

// Counters of what the server refused, for tests and logs.
struct ServerStats {
  int64_t accepted = 0;        // connections that proved the secret (or all, without one)
  int64_t refused = 0;         // wrong proof, garbage, or a handshake that timed out
  int64_t dropped = 0;         // closed at once: too many unproven connections or in all
  int64_t malformed = 0;       // proven connections that sent a bad frame or tag
  int open = 0;                // connections open now
};

// What Server::start throws when another process listens on the port already.
class AddressInUse : public CommError {
 public:
  using CommError::CommError;
};

class Server {
 public:
  // Binds host:port (host's own interface; every interface when host is a name that is not an
  // address of this machine, with a warning) and starts serving. Throws CommError naming the
  // address when it cannot listen (AddressInUse when another process listens there).
  static std::unique_ptr<Server> start(const ServerOptions& options);
  ~Server();  // stops serving and closes every connection

  int port() const;
  std::string boundAddress() const;
  ServerStats stats() const;

 private:
  struct Impl;
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// One connection to the store. Thread-safe (one request at a time); a request that waits (get,
// wait) holds the connection, so a thread that must not wait behind it opens its own Client.
class Client {
 public:
  // Connects, retrying until `timeout` while nothing listens yet, and proves the secret. Throws
  // CommError naming the address and what failed (no store, a store with another secret or none).
  static std::unique_ptr<Client> connect(const std::string& host, int port, const std::string& secret,
                                         std::chrono::milliseconds timeout);
  ~Client();

  void set(const std::string& key, const std::vector<uint8_t>& value);
  // Waits up to `timeout` for the key; std::nullopt when it did not appear.
  std::optional<std::vector<uint8_t>> get(const std::string& key, std::chrono::milliseconds timeout);
  int64_t add(const std::string& key, int64_t delta);
  bool check(const std::vector<std::string>& keys);
  // True when every key appeared within `timeout`.
  bool wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  bool remove(const std::string& key);
  int64_t numKeys();

  std::chrono::milliseconds timeout() const;  // the default for operations that do not wait
  std::string where() const;                  // "host:port"

 private:
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace cohort::store
