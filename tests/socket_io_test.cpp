// base/socket_io.h on socket pairs and on 127.0.0.1: whole transfers, and every way a wait ends.
#include "base/socket_io.h"
#include "base/host_port.h"

#include <cohort/error.h>

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

namespace cohort {
namespace {

using namespace std::chrono_literals;

// Two connected stream sockets, closed at the end of the test.
struct SocketPair {
  int a = -1, b = -1;
  SocketPair() {
    int fds[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    a = fds[0];
    b = fds[1];
  }
  ~SocketPair() {
    if (a >= 0) ::close(a);
    if (b >= 0) ::close(b);
  }
};

IoClock::time_point in(IoClock::duration d) { return IoClock::now() + d; }

TEST(SocketIo, MovesMoreThanTheSocketBufferHolds) {
  SocketPair s;
  std::vector<uint8_t> sent(8 << 20);
  std::iota(sent.begin(), sent.end(), uint8_t(0));
  std::vector<uint8_t> got(sent.size());
  IoStatus read = IoStatus::kError;
  std::thread reader([&] { read = readFull(s.b, got.data(), got.size(), {.deadline = in(30s)}); });
  EXPECT_EQ(writeFull(s.a, sent.data(), sent.size(), {.deadline = in(30s)}), IoStatus::kOk);
  reader.join();
  EXPECT_EQ(read, IoStatus::kOk);
  EXPECT_EQ(got, sent);
}

TEST(SocketIo, AReadEndsAtTheDeadline) {
  SocketPair s;
  uint8_t byte = 7;
  ASSERT_EQ(::write(s.a, &byte, 1), 1);
  uint8_t two[2];
  const auto start = IoClock::now();
  EXPECT_EQ(readFull(s.b, two, 2, {.deadline = in(200ms)}), IoStatus::kTimeout);
  const auto waited = IoClock::now() - start;
  EXPECT_GE(waited, 200ms);
  EXPECT_LT(waited, 5s);
  EXPECT_EQ(two[0], 7);  // what arrived was read
}

TEST(SocketIo, APassedDeadlineStillReadsWhatHasArrived) {
  SocketPair s;
  uint8_t byte = 9;
  ASSERT_EQ(::write(s.a, &byte, 1), 1);
  uint8_t got = 0;
  EXPECT_EQ(readFull(s.b, &got, 1, {.deadline = IoClock::now()}), IoStatus::kOk);
  EXPECT_EQ(got, 9);
}

TEST(SocketIo, TheIdleLimitRestartsWithEveryByte) {
  SocketPair s;
  // Five bytes 100 ms apart under an idle limit of 1 s: 400 ms in all, never 1 s without a byte.
  std::thread writer([&] {
    for (uint8_t i = 0; i < 5; ++i) {
      if (i > 0) std::this_thread::sleep_for(100ms);
      ASSERT_EQ(::write(s.a, &i, 1), 1);
    }
  });
  uint8_t got[5];
  EXPECT_EQ(readFull(s.b, got, 5, {.idle = 1s}), IoStatus::kOk);
  writer.join();
  uint8_t more;
  const auto start = IoClock::now();
  EXPECT_EQ(readFull(s.b, &more, 1, {.idle = 150ms}), IoStatus::kTimeout);
  EXPECT_GE(IoClock::now() - start, 150ms);
}

TEST(SocketIo, AStopFlagEndsAWaitWithinATick) {
  SocketPair s;
  std::atomic<bool> stop{false};
  IoStatus status = IoStatus::kOk;
  uint8_t byte;
  std::thread reader([&] { status = readFull(s.b, &byte, 1, {.stop = &stop}); });
  std::this_thread::sleep_for(50ms);
  const auto start = IoClock::now();
  stop = true;
  reader.join();
  EXPECT_EQ(status, IoStatus::kStopped);
  EXPECT_LT(IoClock::now() - start, kStopTick * 10);
}

TEST(SocketIo, AClosedPeerIsClosedForAReadAndAnErrorForAWrite) {
  SocketPair s;
  uint8_t byte = 1;
  ASSERT_EQ(::write(s.a, &byte, 1), 1);
  ::close(s.a);
  s.a = -1;
  uint8_t two[2];
  EXPECT_EQ(readFull(s.b, two, 2, {.deadline = in(5s)}), IoStatus::kClosed);
  // No SIGPIPE: the write fails with EPIPE.
  EXPECT_EQ(writeFull(s.b, two, 2, {.deadline = in(5s)}), IoStatus::kError);
  EXPECT_EQ(errno, EPIPE);
  EXPECT_STREQ(describe(IoStatus::kClosed), "the connection was closed");
}

// A listening socket on 127.0.0.1 and its port.
struct Listener {
  int fd = -1;
  int port = 0;
  Listener() {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    EXPECT_EQ(::listen(fd, 4), 0);
    EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
    port = ntohs(addr.sin_port);
  }
  ~Listener() {
    if (fd >= 0) ::close(fd);
  }
};

TEST(SocketIo, ConnectsAndTalks) {
  Listener l;
  std::string error;
  const int fd = connectTo(HostPort{"127.0.0.1", l.port}, in(5s), error);
  ASSERT_GE(fd, 0) << error;
  const int accepted = ::accept(l.fd, nullptr, nullptr);
  ASSERT_GE(accepted, 0);
  const std::string hello = "hello";
  EXPECT_EQ(writeFull(fd, hello.data(), hello.size(), {.deadline = in(5s)}), IoStatus::kOk);
  std::string got(hello.size(), '\0');
  EXPECT_EQ(readFull(accepted, got.data(), got.size(), {.deadline = in(5s)}), IoStatus::kOk);
  EXPECT_EQ(got, hello);
  ::close(accepted);
  ::close(fd);
}

TEST(SocketIo, ConnectingWhereNothingListensSaysWhy) {
  int port = 0;
  {
    Listener l;  // a port that was free a moment ago and is closed now
    port = l.port;
  }
  std::string error;
  EXPECT_EQ(connectTo(HostPort{"127.0.0.1", port}, in(5s), error), -1);
  EXPECT_NE(error.find("refused"), std::string::npos) << error;
  EXPECT_EQ(connectTo(HostPort{"no-such-host.invalid", 1}, in(5s), error), -1);
  EXPECT_FALSE(error.empty());
}

// GLOO_SOCKET_IFNAME is a comma-separated list, as PyTorch reads it ("eth0,eth1": one Gloo device
// each); it was passed whole to Gloo, which failed with "Unable to find address for: eth0,eth1".
TEST(SocketInterfaces, GlooSocketIfnameIsAList) {
  ::unsetenv("GLOO_SOCKET_IFNAME");
  EXPECT_TRUE(cohort::socketInterfaces().empty());
  ::setenv("GLOO_SOCKET_IFNAME", "lo,lo", 1);
  EXPECT_EQ(cohort::socketInterfaces(), (std::vector<std::string>{"lo", "lo"}));
  EXPECT_EQ(cohort::addressTowards("192.0.2.1", 29500), "127.0.0.1");
  ::setenv("GLOO_SOCKET_IFNAME", "lo,nosuch9", 1);
  try {
    cohort::socketInterfaces();
    ADD_FAILURE() << "nosuch9 was accepted";
  } catch (const cohort::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("GLOO_SOCKET_IFNAME=lo,nosuch9: nosuch9 is no interface"), std::string::npos)
        << e.what();
  }
  ::unsetenv("GLOO_SOCKET_IFNAME");
}

}  // namespace
}  // namespace cohort
