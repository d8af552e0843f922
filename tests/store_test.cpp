// The rendezvous store (src/comm/store.h): what the job's processes do with it, and what a
// stranger on its port can and cannot do. Torch-free; real sockets on 127.0.0.1.
#include "comm/store.h"

#include "base/crypto.h"
#include "base/host_port.h"
#include "hostile.h"

#include <cohort/env.h>
#include <cohort/error.h>

#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>

#include <condition_variable>
#include <mutex>
#include <thread>

namespace cohort::store {
namespace {

using namespace std::chrono_literals;
using test::RawConnection;

constexpr const char* kSecret = "0123456789abcdef0123456789abcdef";

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

std::unique_ptr<Server> startServer(const std::string& secret, std::chrono::milliseconds handshake = 2000ms) {
  return Server::start(ServerOptions{.host = "127.0.0.1", .port = 0, .secret = secret, .handshakeTimeout = handshake});
}

TEST(Store, EveryOperationWithASecret) {
  auto server = startServer(kSecret);
  auto a = Client::connect("127.0.0.1", server->port(), kSecret, 5s);
  auto b = Client::connect("127.0.0.1", server->port(), kSecret, 5s);
  a->set("k", bytes("value"));
  EXPECT_EQ(b->get("k", 1s), bytes("value"));
  EXPECT_EQ(b->add("n", 3), 3);
  EXPECT_EQ(a->add("n", -1), 2);
  EXPECT_EQ(a->get("n", 1s), bytes("2"));  // counters read as decimal text, as c10d's
  EXPECT_TRUE(a->check({"k", "n"}));
  EXPECT_FALSE(a->check({"k", "missing"}));
  EXPECT_EQ(a->numKeys(), 2);
  EXPECT_TRUE(a->remove("k"));
  EXPECT_FALSE(a->remove("k"));
  EXPECT_FALSE(a->get("k", 100ms).has_value());  // timed out, not an error
  EXPECT_EQ(server->stats().accepted, 2);
  EXPECT_EQ(server->stats().refused, 0);
}

TEST(Store, AGetWaitsForTheKeyAnotherClientSets) {
  auto server = startServer(kSecret);
  auto waiter = Client::connect("127.0.0.1", server->port(), kSecret, 5s);
  auto setter = Client::connect("127.0.0.1", server->port(), kSecret, 5s);
  std::optional<std::vector<uint8_t>> got;
  std::thread t([&] { got = waiter->get("late", 20s); });
  EXPECT_FALSE(setter->wait({"late"}, 50ms));
  setter->set("late", bytes("here"));
  t.join();
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(*got, bytes("here"));
  EXPECT_TRUE(setter->wait({"late"}, 1s));
}

TEST(Store, ListensOnTheMasterAddressOnly) {
  auto server = startServer(kSecret);
  EXPECT_EQ(server->boundAddress().rfind("127.0.0.1:", 0), 0u) << server->boundAddress();
}

TEST(Store, AClientWithAnotherSecretIsRefused) {
  auto server = startServer(kSecret);
  try {
    Client::connect("127.0.0.1", server->port(), "not the secret", 5s);
    FAIL() << "connected with a wrong secret";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("refused this process's proof"), std::string::npos) << e.what();
  }
  EXPECT_EQ(server->stats().refused, 1);
  EXPECT_EQ(server->stats().accepted, 0);
}

// An Env that keeps what it is told, for the test to wait on.
class RecordingEnv : public Env {
 public:
  void log(LogLevel level, const std::string& line) override {
    std::lock_guard<std::mutex> lock(mu_);
    lines_.emplace_back(level, line);
    cv_.notify_all();
  }
  // The first line logged, waiting up to `within` for one.
  std::optional<std::pair<LogLevel, std::string>> first(std::chrono::milliseconds within) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, within, [&] { return !lines_.empty(); })) return std::nullopt;
    return lines_.front();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::pair<LogLevel, std::string>> lines_;
};

TEST(Store, ItsWarningsGoToTheEnvItWasGiven) {
  RecordingEnv env;
  auto server = Server::start(ServerOptions{.host = "127.0.0.1", .port = 0, .secret = kSecret, .env = &env});
  EXPECT_THROW(Client::connect("127.0.0.1", server->port(), "not the secret", 5s), CommError);
  const auto line = env.first(10s);
  ASSERT_TRUE(line.has_value()) << "the server refused a proof and logged nothing to its Env";
  EXPECT_EQ(line->first, LogLevel::kWarning);
  EXPECT_NE(line->second.find("rendezvous store at 127.0.0.1:" + std::to_string(server->port())), std::string::npos)
      << line->second;
  EXPECT_NE(line->second.find("did not prove the job's secret"), std::string::npos) << line->second;
  EXPECT_EQ(line->second.find("cohort:"), std::string::npos) << "the prefix is the Env's to add: " << line->second;
}

TEST(Store, SecretAndNoSecretDoNotMix) {
  auto withSecret = startServer(kSecret);
  auto without = startServer("");
  try {
    Client::connect("127.0.0.1", withSecret->port(), "", 5s);
    FAIL();
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("needs the job's secret"), std::string::npos) << e.what();
  }
  try {
    Client::connect("127.0.0.1", without->port(), kSecret, 5s);
    FAIL();
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("runs without a secret"), std::string::npos) << e.what();
  }
  auto plain = Client::connect("127.0.0.1", without->port(), "", 5s);
  plain->set("a", bytes("b"));
  EXPECT_EQ(plain->get("a", 1s), bytes("b"));
}

TEST(Store, NothingListeningIsATimeoutNamingTheAddress) {
  int port = 0;
  {
    auto server = startServer("");
    port = server->port();
  }
  try {
    Client::connect("127.0.0.1", port, "", 300ms);
    FAIL();
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(port)), std::string::npos) << e.what();
  }
}

// A forged store (a stranger listening where MASTER_ADDR points) cannot answer the challenge.
TEST(Store, AForgedStoreIsRefusedByTheClient) {
  const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(listener, 4), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  std::thread forger([&] {
    const int fd = ::accept(listener, nullptr, nullptr);
    std::vector<uint8_t> challenge = {0x43, 0x53, 0x54, 0x31, 1, 0, 0, 0};
    challenge.resize(40, 7);
    ::send(fd, challenge.data(), challenge.size(), MSG_NOSIGNAL);
    uint8_t hello[64];
    size_t got = 0;
    while (got < sizeof(hello)) {
      const ssize_t r = ::recv(fd, hello + got, sizeof(hello) - got, 0);
      if (r <= 0) break;
      got += size_t(r);
    }
    std::vector<uint8_t> answer(33, 9);
    answer[0] = 1;  // "accepted", with a proof it cannot make
    ::send(fd, answer.data(), answer.size(), MSG_NOSIGNAL);
    ::close(fd);
  });
  try {
    Client::connect("127.0.0.1", ntohs(addr.sin_port), kSecret, 5s);
    ADD_FAILURE() << "believed a forged store";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("did not prove the job's secret"), std::string::npos) << e.what();
  }
  forger.join();
  ::close(listener);
}

// Strangers on the port: garbage, an oversized length, silence, a flood, and a frame that a
// stranger who watched a real handshake cannot tag. The job's client still works, and the
// server's descriptors and memory come back.
TEST(Store, StrangersAreRefusedAndLeaveNothingBehind) {
  auto server = startServer(kSecret, 500ms);
  auto job = Client::connect("127.0.0.1", server->port(), kSecret, 5s);
  job->set("cohort/gossip/init", bytes("the chief's parameters"));
  const int before = test::openDescriptors();
  ASSERT_TRUE(test::resetPeakMemory());
  const int64_t peakBefore = test::statusBytes("VmHWM");
  {
    std::vector<std::unique_ptr<RawConnection>> strangers;
    std::vector<uint8_t> garbage(4096);
    crypto::randomBytes(garbage);
    for (int i = 0; i < 150; ++i) {
      auto c = std::make_unique<RawConnection>(server->port());
      ASSERT_TRUE(c->connected());
      if (i % 3 == 0) c->send(garbage);                                     // random bytes
      if (i % 3 == 1) c->send(std::vector<uint8_t>{0xf0, 0xff, 0xff, 0x7f});  // a 2 GB length prefix
      strangers.push_back(std::move(c));                                     // i % 3 == 2: silence
    }
    // The job's own processes still get in and are served during the flood.
    auto late = Client::connect("127.0.0.1", server->port(), kSecret, 10s);
    EXPECT_EQ(late->get("cohort/gossip/init", 1s), bytes("the chief's parameters"));
    for (auto& c : strangers) EXPECT_TRUE(c->closedByPeer(10s));
  }
  EXPECT_EQ(job->get("cohort/gossip/init", 1s), bytes("the chief's parameters"));  // nothing overwritten
  EXPECT_GE(server->stats().refused + server->stats().dropped, 150);
  EXPECT_EQ(test::waitForDescriptors(before, 10s), before);
  EXPECT_LT(test::statusBytes("VmHWM") - peakBefore, 64 << 20);
}

// A stranger without the secret cannot produce a frame the server takes: a SET with a made-up
// tag after a proof it replays from elsewhere is refused, the key is not written.
TEST(Store, AFrameWithAWrongTagIsRefused) {
  auto server = startServer(kSecret);
  RawConnection c(server->port());
  std::array<uint8_t, 40> challenge{};
  ASSERT_TRUE(c.read(challenge, 5s));
  // Prove the secret as a real client would (the test knows it), then send a frame whose tag is
  // not the session's: what a stranger relaying a live connection would have to do.
  std::array<uint8_t, 32> nonce{};
  crypto::randomBytes(nonce);
  crypto::HmacSha256 mac{std::string_view(kSecret)};
  mac.update(std::string_view("cohort-store client"));
  mac.update(std::span<const uint8_t>(challenge.data() + 8, 32));
  mac.update(std::span<const uint8_t>(nonce));
  const crypto::Digest proof = mac.final();
  std::vector<uint8_t> hello(nonce.begin(), nonce.end());
  hello.insert(hello.end(), proof.begin(), proof.end());
  c.send(hello);
  std::array<uint8_t, 33> answer{};
  ASSERT_TRUE(c.read(answer, 5s));
  ASSERT_EQ(answer[0], 1);
  std::vector<uint8_t> set = {1, 1, 0, 0, 0, 'k', 'x'};  // SET "k" = "x"
  std::vector<uint8_t> frame = {uint8_t(set.size()), 0, 0, 0};
  frame.insert(frame.end(), set.begin(), set.end());
  frame.resize(frame.size() + 16, 0xaa);  // a tag it cannot compute
  c.send(frame);
  EXPECT_TRUE(c.closedByPeer(5s));
  auto job = Client::connect("127.0.0.1", server->port(), kSecret, 5s);
  EXPECT_FALSE(job->check({"k"}));
  EXPECT_EQ(server->stats().malformed, 1);
}

// base/host_port's, which the store, the communicator, gossip and the ps service all ask.
TEST(Store, LoopbackNames) {
  EXPECT_TRUE(isLoopbackHost("127.0.0.1"));
  EXPECT_TRUE(isLoopbackHost("127.1.2.3"));
  EXPECT_TRUE(isLoopbackHost("localhost"));
  EXPECT_TRUE(isLoopbackHost("::1"));
  EXPECT_TRUE(isLoopbackHost("[::1]"));
  EXPECT_FALSE(isLoopbackHost("10.0.0.1"));
  EXPECT_FALSE(isLoopbackHost("127.example.com"));
  EXPECT_FALSE(isLoopbackHost("::2"));
}

TEST(Store, AddressText) {
  sockaddr_in v4{};
  v4.sin_family = AF_INET;
  v4.sin_addr.s_addr = htonl(0x0a000002);
  EXPECT_EQ(addressText(reinterpret_cast<const sockaddr*>(&v4)), "10.0.0.2");
  sockaddr_in6 v6{};
  v6.sin6_family = AF_INET6;
  v6.sin6_addr = in6addr_loopback;
  EXPECT_EQ(addressText(reinterpret_cast<const sockaddr*>(&v6)), "::1");
  sockaddr other{};
  other.sa_family = AF_UNIX;
  EXPECT_EQ(addressText(&other), "");
}

}  // namespace
}  // namespace cohort::store

namespace cohort::crypto {
namespace {

std::string hexOf(std::span<const uint8_t> bytes) {
  std::string out;
  char buf[3];
  for (uint8_t b : bytes) {
    std::snprintf(buf, sizeof(buf), "%02x", b);
    out += buf;
  }
  return out;
}

// RFC 4231 test case 2, and NIST's GCM test case 1 (zero key and nonce, nothing to tag).
TEST(Crypto, KnownAnswers) {
  HmacSha256 hmac{std::string_view("Jefe")};
  hmac.update(std::string_view("what do ya want "));
  hmac.update(std::string_view("for nothing?"));
  EXPECT_EQ(hexOf(hmac.final()), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  const std::array<uint8_t, 16> zeroKey{};
  const std::array<uint8_t, 12> zeroNonce{};
  Gmac gmac(zeroKey);
  EXPECT_EQ(hexOf(gmac.tag(zeroNonce, {})), "58e2fccefa7e3061367f1d57a4e7455a");
}

TEST(Crypto, GmacDependsOnEveryByteAndNotOnHowTheyAreCut) {
  std::array<uint8_t, 16> key{};
  randomBytes(key);
  Gmac gmac(key);
  std::vector<uint8_t> data(100'000);
  randomBytes(data);
  std::array<uint8_t, 12> nonce{};
  const auto whole = gmac.tag(nonce, {data});
  const std::span<const uint8_t> all(data);
  EXPECT_EQ(gmac.tag(nonce, {all.first(12), all.subspan(12)}), whole);
  data[54'321] ^= 1;
  EXPECT_NE(gmac.tag(nonce, {data}), whole);
  data[54'321] ^= 1;
  nonce[0] = 1;
  EXPECT_NE(gmac.tag(nonce, {data}), whole);
}

}  // namespace
}  // namespace cohort::crypto
