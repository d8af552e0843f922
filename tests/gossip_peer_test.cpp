// The gossip transport without torch: the frame format, and peers as objects in one process
// talking over real sockets on 127.0.0.1 (accumulation for peers not chosen, a wrong token, a
// peer that disappears).
#include "compress/codec.h"
#include "gossip/peer.h"
#include "gossip/wire.h"

#include <cohort/error.h>

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <thread>

namespace cohort::gossip {
namespace {

TEST(GossipWire, FramesRoundTrip) {
  const auto hello = helloFrame({kProtocol, 2, 3, "s3cret"});
  const FrameHeader h = parseHeader(std::span<const uint8_t, kHeaderBytes>(hello.data(), kHeaderBytes), 1024);
  EXPECT_EQ(h.type, FrameType::kHello);
  ASSERT_EQ(h.length, hello.size() - kHeaderBytes);
  const Hello back = parseHello(std::span(hello).subspan(kHeaderBytes));
  EXPECT_EQ(back.rank, 2u);
  EXPECT_EQ(back.worldSize, 3u);
  EXPECT_EQ(back.token, "s3cret");

  std::vector<uint8_t> update;
  beginUpdateFrame({.sender = 1, .encoding = Encoding::kCodec, .version = 41, .step = 17, .steps = 3, .samples = 96,
                    .numel = 5},
                   update);
  update.insert(update.end(), {9, 8, 7});
  finishUpdateFrame(update);
  const FrameHeader uh = parseHeader(std::span<const uint8_t, kHeaderBytes>(update.data(), kHeaderBytes), 1024);
  ASSERT_EQ(uh.length, kUpdateHeaderBytes + 3);
  const auto body = std::span(update).subspan(kHeaderBytes);
  const UpdateMeta m = parseUpdate(body);
  EXPECT_EQ(m.sender, 1u);
  EXPECT_EQ(m.encoding, Encoding::kCodec);
  EXPECT_EQ(m.version, 41);
  EXPECT_EQ(m.step, 17);
  EXPECT_EQ(m.steps, 3);
  EXPECT_EQ(m.samples, 96);
  EXPECT_EQ(m.numel, 5u);
  EXPECT_EQ(body.subspan(kUpdateHeaderBytes).size(), 3u);

  const auto done = doneFrame({.steps = 7, .bytesSent = -1, .stalenessMax = 1LL << 40});
  const PeerReport r = parseDone(std::span(done).subspan(kHeaderBytes));
  EXPECT_EQ(r.steps, 7);
  EXPECT_EQ(r.bytesSent, -1);
  EXPECT_EQ(r.stalenessMax, 1LL << 40);
}

TEST(GossipWire, MalformedFramesAreRejected) {
  auto hello = helloFrame({kProtocol, 1, 2, "t"});
  auto header = [](std::vector<uint8_t>& f) { return std::span<const uint8_t, kHeaderBytes>(f.data(), kHeaderBytes); };
  EXPECT_THROW(parseHeader(header(hello), 4), InvalidArgument);  // longer than the limit
  auto badMagic = hello;
  badMagic[0] ^= 1;
  EXPECT_THROW(parseHeader(header(badMagic), 1024), InvalidArgument);
  auto badType = hello;
  badType[4] = 9;
  EXPECT_THROW(parseHeader(header(badType), 1024), InvalidArgument);
  const auto body = std::span(hello).subspan(kHeaderBytes);
  for (size_t n = 0; n < body.size(); ++n) EXPECT_THROW(parseHello(body.first(n)), InvalidArgument) << n;
  std::vector<uint8_t> update;
  beginUpdateFrame({.sender = 1, .steps = 1, .numel = 1}, update);
  finishUpdateFrame(update);
  const auto ub = std::span(update).subspan(kHeaderBytes);
  for (size_t n = 0; n < kUpdateHeaderBytes; ++n) EXPECT_THROW(parseUpdate(ub.first(n)), InvalidArgument) << n;
  std::vector<uint8_t> zeroSteps;
  beginUpdateFrame({.sender = 1, .steps = 0, .numel = 1}, zeroSteps);
  finishUpdateFrame(zeroSteps);
  EXPECT_THROW(parseUpdate(std::span(zeroSteps).subspan(kHeaderBytes)), InvalidArgument);
  EXPECT_THROW(parseDone(std::span(update).subspan(kHeaderBytes)), InvalidArgument);
  EXPECT_TRUE(sameToken("abc", "abc"));
  EXPECT_FALSE(sameToken("abc", "abd"));
  EXPECT_FALSE(sameToken("abc", "abcd"));
}

// n peers on 127.0.0.1, connected to each other.
std::vector<std::unique_ptr<Peer>> makePeers(int n, size_t numel, double timeout,
                                             const std::vector<std::string>& tokens = {},
                                             const std::string& codec = "none", int64_t warmup = 0) {
  std::vector<std::unique_ptr<Peer>> peers;
  std::vector<HostPort> addresses;
  for (int r = 0; r < n; ++r) {
    peers.push_back(std::make_unique<Peer>(PeerOptions{.rank = r,
                                                       .worldSize = n,
                                                       .token = tokens.empty() ? "tok" : tokens[size_t(r)],
                                                       .timeoutSeconds = timeout,
                                                       .numel = numel,
                                                       .codec = codec,
                                                       .codecWarmupSteps = warmup}));
    addresses.push_back(peers.back()->address());
  }
  for (auto& p : peers) p->connect(addresses);
  return peers;
}

UpdateMeta meta(int64_t step) { return {.version = step, .step = step, .steps = 1, .samples = 10}; }

// Updates for a peer that is not chosen wait in its accumulator and leave with its next turn
// (here: finish), summed, so nothing is lost.
TEST(GossipPeer, UnchosenPeersGetTheSumLater) {
  auto peers = makePeers(3, 4, 30);
  const std::vector<int> onlyOne{1};
  for (int s = 1; s <= 5; ++s) {
    const std::vector<float> update{float(s), 1.0f, -0.5f, 0.0f};
    peers[0]->publish(update, meta(s), onlyOne);
  }
  // Finishing in parallel: each waits for the others' DONE.
  std::vector<std::thread> finishing;
  for (auto& p : peers) finishing.emplace_back([&p] { p->finish(PeerReport{.steps = 5}); });
  for (auto& t : finishing) t.join();
  for (int r : {1, 2}) {
    std::vector<float> into(4, 0.0f);
    const Drained d = peers[size_t(r)]->drain(into);
    EXPECT_EQ(d.steps, 5) << "peer " << r;
    EXPECT_EQ(d.samples, 50) << "peer " << r;
    EXPECT_EQ(into, (std::vector<float>{15.0f, 5.0f, -2.5f, 0.0f})) << "peer " << r;
    ASSERT_FALSE(d.metas.empty());
    EXPECT_EQ(d.metas.back().step, 5);
    EXPECT_EQ(d.metas.back().sender, 0u);
  }
  // Peer 2 was never chosen: everything came in the one message finish() flushed.
  const auto counters = peers[0]->counters();
  EXPECT_EQ(counters[2].messagesSent, 1);
  EXPECT_GE(counters[1].messagesSent, 1);
  for (int r : {1, 2}) {
    const auto c = peers[size_t(r)]->counters();
    EXPECT_TRUE(c[0].finished);
    ASSERT_TRUE(c[0].report.has_value());
    EXPECT_EQ(c[0].report->steps, 5);
    EXPECT_EQ(c[0].bytesReceived, counters[size_t(r)].bytesSent);  // HELLO, UPDATEs, DONE
  }
  EXPECT_EQ(peers[1]->livePeers(), (std::vector<int>{0, 2}));
}

TEST(GossipPeer, AWrongTokenIsRefused) {
  auto peers = makePeers(2, 2, 1.0, {"right", "wrong"});
  std::vector<std::thread> finishing;
  for (auto& p : peers) finishing.emplace_back([&p] { p->finish(PeerReport{}); });
  for (auto& t : finishing) t.join();
  EXPECT_EQ(peers[0]->refusedStreams(), 1);
  EXPECT_EQ(peers[1]->refusedStreams(), 1);
  EXPECT_TRUE(peers[0]->counters()[1].lost);
  EXPECT_FALSE(peers[0]->counters()[1].finished);
}

// A peer that goes away is dropped as soon as its stream closes; the others finish without
// waiting out the timeout.
TEST(GossipPeer, ADeadPeerIsDroppedAndTheOthersFinish) {
  const double timeout = 60;
  auto peers = makePeers(3, 3, timeout);
  const std::vector<int> all{0, 1, 2};
  // Every stream is up before peer 2 goes: each peer sends one update and waits (at most 20 s)
  // until it has one from each of the others. (A peer that dies before the others reach it is
  // dropped only when connecting to it has failed for the whole timeout.)
  std::vector<std::vector<float>> got(3, std::vector<float>(3, 0.0f));
  for (int r = 0; r < 3; ++r) peers[size_t(r)]->publish(std::vector<float>{1, 2, 3}, meta(1), all);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (int r = 0; r < 3; ++r) {
    int64_t seen = 0;
    while (seen < 2 && std::chrono::steady_clock::now() < deadline) {
      std::vector<float> into(3, 0.0f);
      seen += peers[size_t(r)]->drain(into).messages;
      for (size_t i = 0; i < 3; ++i) got[size_t(r)][i] += into[i];
      if (seen < 2) std::this_thread::yield();
    }
    ASSERT_EQ(seen, 2) << "peer " << r;
    EXPECT_EQ(got[size_t(r)], (std::vector<float>{2, 4, 6})) << "peer " << r;
  }
  peers[0]->publish(std::vector<float>{1, 2, 3}, meta(2), all);
  peers[2].reset();  // closes its sockets, as a killed process's kernel does
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> finishing;
  for (int r : {0, 1}) finishing.emplace_back([&, r] { peers[size_t(r)]->finish(PeerReport{.steps = 1}); });
  for (auto& t : finishing) t.join();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(waited, timeout / 2) << "finish() waited for the dead peer";
  for (int r : {0, 1}) {
    const auto c = peers[size_t(r)]->counters();
    EXPECT_TRUE(c[2].lost) << "peer " << r;
    EXPECT_TRUE(c[size_t(1 - r)].finished) << "peer " << r;
    EXPECT_EQ(peers[size_t(r)]->livePeers(), (std::vector<int>{1 - r}));
  }
  std::vector<float> into(3, 0.0f);
  peers[1]->drain(into);
  EXPECT_EQ(into, (std::vector<float>{1, 2, 3}));
}

void finishAll(std::vector<std::unique_ptr<Peer>>& peers) {
  std::vector<std::thread> finishing;
  for (auto& p : peers) finishing.emplace_back([&p] { p->finish(PeerReport{}); });
  for (auto& t : finishing) t.join();
}

// The codec slot: after the warm-up step (sent uncompressed), each destination's messages come
// from an encoder of its own, residual included: the receiver gets exactly what a lone encoder
// fed the same updates sends.
TEST(GossipPeer, UpdatesTravelThroughTheCodecAfterTheWarmUp) {
  const std::string codec = "threshold:0.5";
  auto peers = makePeers(2, 4, 30, {}, codec, 1);
  const std::vector<int> toOne{1};
  const std::vector<std::vector<float>> updates{{0.7f, -0.2f, 0.1f, 3.0f}, {0.2f, -0.4f, 0.3f, 0.0f},
                                                {-0.1f, -0.1f, 0.3f, 0.0f}};
  std::vector<float> expected(4, 0.0f), got(4, 0.0f);
  compress::Encoder reference(compress::CodecSpec::parse(codec), 4);
  for (size_t s = 0; s < updates.size(); ++s) {
    peers[0]->publish(updates[s], meta(int64_t(s) + 1), toOne);
    if (s == 0) {
      for (size_t i = 0; i < 4; ++i) expected[i] += updates[s][i];  // the warm-up step, exact
    } else {
      compress::decodeAdd(reference.encode(updates[s]), expected);
    }
    // One message per step: wait (at most 20 s) until it arrived, or steps would merge.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    int64_t seen = 0;
    while (seen == 0 && std::chrono::steady_clock::now() < deadline) {
      std::vector<float> into(4, 0.0f);
      seen += peers[1]->drain(into).messages;
      for (size_t i = 0; i < 4; ++i) got[i] += into[i];
      if (seen == 0) std::this_thread::yield();
    }
    ASSERT_EQ(seen, 1) << "step " << s + 1 << " did not arrive as one message";
  }
  finishAll(peers);
  std::vector<float> rest(4, 0.0f);
  peers[1]->drain(rest);
  EXPECT_EQ(rest, std::vector<float>(4, 0.0f));
  EXPECT_EQ(got, expected);
  EXPECT_NE(got[0], updates[0][0] + updates[1][0] + updates[2][0]) << "the codec sent everything: not a threshold";
}

TEST(GossipPeer, AnUnknownCodecIsRefused) {
  EXPECT_THROW(Peer(PeerOptions{.rank = 0, .worldSize = 2, .numel = 3, .codec = "zip"}), InvalidArgument);
}

}  // namespace
}  // namespace cohort::gossip
