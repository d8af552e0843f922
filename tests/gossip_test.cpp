// Gossip with real processes on 127.0.0.1: a peer killed midway stops no one and the chief's
// model still learns; a frozen peer makes no one wait. And, in one process over loopback
// sockets, how a peer joins (GossipHandle).
#include <nlohmann/json.hpp>

#include "comm/store.h"
#include "gossip/peer.h"
#include "gossip_handle.h"
#include "test_util.h"

#include <cohort/error.h>
#include <cohort/gossip.h>
#include <cohort/job.h>

#include <torch/torch.h>

#include <csignal>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <future>
#include <thread>

namespace cohort::gossip_test {
namespace {

std::string train() { return test::cohortBinary() + " train --threads 1 --progress off --strategy gossip"; }

// A peer publishes its address only once it holds the chief's parameters. Every peer waits for
// all addresses before its first step, so no one trains alone while another still reads the
// chief's parameters from the store (1 s for the embed model's 128 MB: most of a short run, whose
// updates then reached the chief only after its last step). Here the test is the chief: it hosts
// the store and plays rank 0 with the transport alone; rank 1 is the Gossip handle.
TEST(GossipHandle, APeerPublishesItsAddressOnlyOnceItHoldsTheChiefsParameters) {
  using namespace std::chrono_literals;
  torch::nn::Linear net(3, 2);  // 8 parameters; made before the thread that attaches it
  test::ChiefPlayedByTest t;
  const std::string secret = t.kSecret;
  const Job& job = t.rank1;
  auto& chief = t.chief;
  auto attaching = std::async(std::launch::async, [&] { return std::make_unique<Gossip>(job, *net); });
  // The chief has not published its parameters: rank 1 has bound its socket but says nowhere
  // where it is.
  EXPECT_FALSE(chief->get("cohort/gossip/addr/1", 1s).has_value()) << "published before it had the parameters";
  gossip::Peer rank0({.rank = 0, .worldSize = 2, .token = secret, .timeoutSeconds = 30, .numel = 8});
  const std::string address = rank0.address().str();
  chief->set("cohort/gossip/addr/0", std::vector<uint8_t>(address.begin(), address.end()));
  std::vector<float> init(8);
  for (size_t i = 0; i < init.size(); ++i) init[i] = 0.25f * float(i) - 1.0f;
  t.publishLinearParameters(init);
  const auto published = chief->get("cohort/gossip/addr/1", 30s);
  const std::unique_ptr<Gossip> gossip = attaching.get();
  ASSERT_TRUE(published.has_value());
  // Attached: the replica is the chief's parameters.
  std::vector<float> held;
  for (const auto& p : net->parameters()) {
    const auto flat = p.detach().flatten();
    held.insert(held.end(), flat.data_ptr<float>(), flat.data_ptr<float>() + flat.numel());
  }
  EXPECT_EQ(held, init);
  rank0.connect({rank0.address(), gossip::parsePeerAddress(std::string(published->begin(), published->end()))});
  std::thread finishing([&] { gossip->finish(); });
  rank0.finish(gossip::PeerReport{});
  finishing.join();
  const auto counters = rank0.counters();
  EXPECT_TRUE(counters[1].finished);
  EXPECT_FALSE(counters[1].lost);
}

// A bfloat16 replica sends its own change exactly and none of the rounding of what it received
// (tests/gossip_handle.h; tests/gpu_sync_test.cpp runs the same on cuda:0).
TEST(GossipHandle, ABfloat16ReplicaSendsItsOwnChangeAndNoRounding) {
  test::expectBfloat16ReplicaSendsOnlyItsOwnChange(torch::Device(torch::kCPU));
}

// A model of two dtypes, and a float64 one (the float32 exchange would round it at every step),
// are refused before anything connects, by name.
TEST(GossipHandle, AModelOfTwoDtypesOrOfFloat64IsRefusedByName) {
  ClusterSpec spec;
  spec.rank = 1;
  spec.worldSize = 2;
  spec.master = {"127.0.0.1", 1};
  const Job job = Job::fromSpec(spec, {.timeout = std::chrono::seconds(1)});
  const auto expectRefused = [&](torch::nn::Module& net, const std::string& named, const std::string& fix) {
    try {
      Gossip gossip(job, net);
      FAIL() << "taken; expected a refusal naming " << named;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(named), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(fix), std::string::npos) << e.what();
    }
  };
  torch::nn::Sequential mixed(torch::nn::Linear(3, 2), torch::nn::Linear(2, 1));
  mixed[1]->to(torch::kBFloat16);
  expectRefused(*mixed, "BFloat16", "module->to(dtype)");
  torch::nn::Linear float64(3, 2);
  float64->to(torch::kFloat64);
  expectRefused(*float64, "double", "module->to(torch::kFloat32)");
}

// A peer that loses every other one before any stream opened (here rank 0's published address
// refuses every connection) fails at its next step instead of training alone; before, it went on
// alone and its run ended as if the job had succeeded.
TEST(GossipHandle, APeerThatNeverReachedAnotherFailsInsteadOfTrainingAlone) {
  using namespace std::chrono_literals;
  torch::nn::Linear net(3, 2);
  test::ChiefPlayedByTest t;
  const Job job = Job::fromSpec(t.rank1.cluster(), {.timeout = 1s});
  const std::string nowhere = "127.0.0.1:1";  // nothing listens on port 1
  t.chief->set("cohort/gossip/addr/0", std::vector<uint8_t>(nowhere.begin(), nowhere.end()));
  t.publishLinearParameters(std::vector<float>(8, 0.0f));
  Gossip gossip(job, *net);
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  std::string error;
  while (error.empty() && std::chrono::steady_clock::now() < deadline) {
    try {
      gossip.step(1);
      std::this_thread::yield();
    } catch (const CommError& e) {
      error = e.what();
    }
  }
  EXPECT_NE(error.find("lost every other peer before a stream to or from any of them opened"), std::string::npos)
      << "it trained alone: " << error;
}

// A model whose parameters' shapes differ from the chief's is refused with InvalidArgument, as
// the header says, even with as many parameters (Linear(2, 4) against the chief's Linear(3, 2):
// 8 each); and the reason takes the place of this peer's address, so that the others fail at once
// naming it instead of waiting out the timeout for an address that never comes.
TEST(GossipHandle, AModelOfOtherShapesIsRefusedAndTheOthersAreTold) {
  using namespace std::chrono_literals;
  torch::nn::Linear other(2, 4);
  test::ChiefPlayedByTest t;
  t.publishLinearParameters(std::vector<float>(8, 0.0f));
  try {
    Gossip gossip(t.rank1, *other);
    FAIL() << "a model of other shapes was taken";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("parameter 0 (weight) is [4, 2] here but [2, 3] on the chief"),
              std::string::npos)
        << e.what();
  }
  const auto published = t.chief->get("cohort/gossip/addr/1", 1s);
  ASSERT_TRUE(published.has_value()) << "the others are not told";
  EXPECT_NE(std::string(published->begin(), published->end()).find("failed: gossip: parameter 0 (weight)"),
            std::string::npos);
}

// A peer that cannot listen where the cluster spec puts it (TF_CONFIG names an address of
// another machine) tells the others why in the store, as for a model of other shapes; before, they
// waited out the timeout for its address.
TEST(GossipHandle, APeerThatCannotListenTellsTheOthers) {
  using namespace std::chrono_literals;
  torch::nn::Linear net(3, 2);
  test::ChiefPlayedByTest t;
  ClusterSpec spec = t.rank1.cluster();
  spec.workers = {{"127.0.0.1", 1}, {"192.0.2.1", 1}};  // TEST-NET-1: on no interface here
  t.publishLinearParameters(std::vector<float>(8, 0.0f));
  EXPECT_THROW(Gossip(Job::fromSpec(spec, {.timeout = 30s}), *net), CommError);
  const auto published = t.chief->get("cohort/gossip/addr/1", 1s);
  ASSERT_TRUE(published.has_value()) << "the others are not told";
  EXPECT_NE(std::string(published->begin(), published->end()).find("failed: gossip: cannot listen on 192.0.2.1"),
            std::string::npos);
}

// Three peers on Fashion-MNIST; peer 2 is SIGKILLed after the chief's 60th step. The other two
// finish their 300 steps, the chief names the lost peer and its model reaches the bound.
TEST(GossipMultiproc, APeerKilledMidwayStopsNoOneAndTheModelLearns) {
  test::TempDir dir;
  const std::string flags =
      " --model mlp --data fashion-mnist --batch 64 --optimizer momentum --lr 0.01 --timeout 20 --auth-token g0ss1p";
  const std::string metrics = dir.file("m.jsonl");
  // By hand, as a cluster operator would: the chief's store on a port of its choosing first.
  test::Process chief(test::tfConfig(0, 3, {}, "chief", 0) + " " + train() + flags + " --steps 300 --metrics " +
                      metrics);
  const int port = chief.port();
  ASSERT_GT(port, 0) << chief.output();
  test::Process victim(test::tfConfig(port, 3, {}, "worker", 1) + " " + train() + flags + " --steps 100000");
  test::Process worker(test::tfConfig(port, 3, {}, "worker", 0) + " " + train() + flags + " --steps 300");
  ASSERT_TRUE(test::waitForFileText(metrics, "\"step\":60,")) << chief.output();
  victim.kill(SIGKILL);
  const test::CommandResult v = victim.wait(std::chrono::seconds(30));
  const test::CommandResult c = chief.wait(std::chrono::seconds(200));
  const test::CommandResult w = worker.wait(std::chrono::seconds(60));
  const std::string chiefLog = c.output;
  const std::string logs = chiefLog + w.output + v.output;
  EXPECT_EQ(c.exitCode, 0) << logs;
  EXPECT_EQ(w.exitCode, 0) << logs;
  auto done = test::lastEvent(metrics, "done");
  ASSERT_FALSE(done.is_null()) << logs;
  EXPECT_EQ(done["steps"], 300);
  EXPECT_GE(done["test_accuracy"].get<double>(), 0.75) << done.dump();
  ASSERT_EQ(done["workers_lost"].size(), 1u) << done.dump();
  EXPECT_EQ(done["workers_lost"][0], 2);
  EXPECT_EQ(done["peer_steps"][1], 300) << done.dump();
  EXPECT_EQ(done["peer_steps"][2], -1) << done.dump();
  EXPECT_GT(done["peer_bytes_sent"][1].get<int64_t>(), 0);
  EXPECT_GT(done["bytes_received_from_peer"][1].get<int64_t>(), 0);
  EXPECT_GT(done["bytes_received_from_peer"][2].get<int64_t>(), 0) << "peer 2 sent nothing before it died";
  EXPECT_EQ(done["unauthenticated"], 0);
  EXPECT_NE(chiefLog.find("gossip peer 2 is lost"), std::string::npos) << chiefLog;
  EXPECT_NE(chiefLog.find("worker 2 stopped before the end"), std::string::npos) << chiefLog;
  auto step = test::lastEvent(metrics, "step");
  EXPECT_EQ(step["peers_live"], 1) << step.dump();
  EXPECT_TRUE(step.contains("staleness_mean")) << step.dump();
}

// Peer 2 is frozen (SIGSTOP) once the chief has taken its first step (every peer has joined), and
// thawed only after the chief's 40th step event is written: the chief's steps cannot have waited
// for it, whatever the machine's load. Then peer 2 finishes, and at the end every update of every
// peer has reached the chief's replica: the ones of peer 2's frozen steps after the chief's last
// step. (What a merely slow peer costs the others in time is measured in bench/gossip.py.)
TEST(GossipMultiproc, AFrozenPeerMakesNoOneWait) {
  test::TempDir dir;
  const std::string metrics = dir.file("m.jsonl");
  const std::string flags = " --model mlp --data synthetic:3000 --batch 16 --steps 40 --gossip-peers 1 --timeout 120"
                            " --auth-token g0ss1p";
  test::Process chief(test::tfConfig(0, 3, {}, "chief", 0) + " " + train() + flags + " --metrics " + metrics);
  const int port = chief.port();
  ASSERT_GT(port, 0) << chief.output();
  test::Process worker(test::tfConfig(port, 3, {}, "worker", 0) + " " + train() + flags);
  test::Process slow(test::tfConfig(port, 3, {}, "worker", 1) + " " + train() + flags);
  ASSERT_TRUE(test::waitForFileText(metrics, "\"step\":1,")) << chief.output();
  slow.kill(SIGSTOP);
  const bool chiefFinishedItsSteps = test::waitForFileText(metrics, "\"step\":40,");
  slow.kill(SIGCONT);
  EXPECT_TRUE(chiefFinishedItsSteps) << "the chief's steps waited for the frozen peer\n" << chief.output();
  const test::CommandResult c = chief.wait(std::chrono::seconds(200));
  const test::CommandResult w = worker.wait(std::chrono::seconds(60));
  const test::CommandResult s = slow.wait(std::chrono::seconds(60));
  const std::string logs = c.output + w.output + s.output;
  ASSERT_EQ(c.exitCode, 0) << logs;
  EXPECT_EQ(w.exitCode, 0) << logs;
  EXPECT_EQ(s.exitCode, 0) << logs;
  auto done = test::lastEvent(metrics, "done");
  ASSERT_FALSE(done.is_null()) << logs;
  EXPECT_EQ(done["workers_lost"].size(), 0u) << done.dump();
  EXPECT_EQ(done["gossip_peers"], 1);
  EXPECT_EQ(done["peer_steps"], (nlohmann::json{40, 40, 40})) << done.dump();
  EXPECT_EQ(done["updates_folded"], 3 * 40) << done.dump();
  // The messages the chief folded during its 40 steps, against all it folded: peer 2's steps after
  // its thaw came in only after the chief's last step.
  int64_t duringSteps = 0;
  for (const auto& line : test::lines(test::readFile(metrics))) {
    const auto e = nlohmann::json::parse(line);
    if (e["event"] == "step") duringSteps += e["messages_applied"].get<int64_t>();
  }
  EXPECT_LT(duringSteps, done["messages_applied"].get<int64_t>()) << done.dump();
  int64_t histogramTotal = 0;
  for (auto& c : done["staleness_histogram"]) histogramTotal += c.get<int64_t>();
  EXPECT_EQ(histogramTotal, done["messages_applied"].get<int64_t>());
  EXPECT_EQ(done["messages_from_peer"][1].get<int64_t>() + done["messages_from_peer"][2].get<int64_t>(),
            done["messages_applied"].get<int64_t>());
}

// --codec for gossip: after 3 uncompressed warm-up steps every update is a threshold message,
// far smaller than the 2.7 MB of float32 an uncompressed mlp update takes, and the model still
// learns.
TEST(GossipMultiproc, CompressedUpdatesAfterTheWarmUp) {
  test::TempDir dir;
  const std::string metrics = dir.file("m.jsonl");
  auto r = test::runCommand(test::launchPrefix(3) + train() + " --model mlp --data synthetic:3000 --batch 16 --steps 40" +
                                " --codec threshold:0.002 --codec-warmup-steps 3 --metrics " + metrics,
                            200);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  auto done = test::lastEvent(metrics, "done");
  ASSERT_FALSE(done.is_null()) << r.output;
  EXPECT_EQ(done["codec"], "threshold:0.002") << done.dump();
  EXPECT_EQ(done["updates_folded"], 3 * 40) << done.dump();
  EXPECT_GE(done["test_accuracy"].get<double>(), 0.9) << done.dump();
  // At most 3 warm-up messages per destination at full size; the 37 compressed steps after them
  // together must not weigh as much as 8 uncompressed ones.
  const int64_t raw = 669706 * 4;  // the mlp's parameters, float32
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_LT(done["peer_bytes_sent"][rank].get<int64_t>(), 2 * (3 + 8) * raw) << "rank " << rank << ": "
                                                                                 << done.dump();
  }
}

// --resume keeps the codec's warm-up where the checkpoint left it: 40 steps under topk:0.01 with
// 30 warm-up steps, then resumed to 60: the 20 resumed steps go compressed (topk:0.01 of the mlp:
// ~54 kB a message, against 2.7 MB of float32). Before, each peer's step count, and with it the
// warm-up, started over at the resume: the resumed steps went raw, ~95x the bytes.
TEST(GossipMultiproc, AResumedRunKeepsTheCodecWarmUpItPassed) {
  test::TempDir dir;
  const std::string metrics = dir.file("m.jsonl");
  const std::string run = test::launchPrefix(2) + train() +
                          " --model mlp --data synthetic:3000 --batch 16 --codec topk:0.01 --codec-warmup-steps 30 "
                          "--checkpoint-every 20 --checkpoint-dir " +
                          dir.file("ckpt") + " --metrics " + metrics;
  auto first = test::runCommand(run + " --steps 40", 200);
  ASSERT_EQ(first.exitCode, 0) << first.output;
  auto resumed = test::runCommand(run + " --steps 60 --resume", 200);
  ASSERT_EQ(resumed.exitCode, 0) << resumed.output;
  int64_t resumedSteps = 0, resumedBytes = 0;
  for (const auto& line : test::lines(test::readFile(metrics))) {
    const auto event = nlohmann::json::parse(line);
    if (event["event"] != "step" || event["step"].get<int64_t>() <= 40) continue;
    ++resumedSteps;
    resumedBytes += event["bytes_sent"].get<int64_t>();
  }
  EXPECT_EQ(resumedSteps, 20) << resumed.output;
  const int64_t raw = 669706 * 4;  // the mlp's parameters, float32
  EXPECT_LT(resumedBytes, 2 * raw) << "the resumed steps went uncompressed: the warm-up started over";
  auto done = test::lastEvent(metrics, "done");
  ASSERT_FALSE(done.is_null()) << resumed.output;
  // Each peer's steps count from the checkpoint's step, as the chief's do.
  EXPECT_EQ(done["peer_steps"], nlohmann::json::array({60, 60})) << done.dump();
}

// A sparse embedding table (640 kB): every step sends the rows its gradient touched and the
// small dense layers, never the table; the peers still agree enough to learn.
TEST(GossipMultiproc, SparseTablesSendOnlyTheirChangedRows) {
  test::TempDir dir;
  const std::string metrics = dir.file("m.jsonl");
  auto r = test::runCommand(test::launchPrefix(2) + train() + " --model embed:rows=20000,dim=8,hidden=8" +
                                " --data synthetic-bags:2000,20000 --batch 8 --steps 60 --optimizer adagrad --lr 0.05" +
                                " --metrics " + metrics,
                            200);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  auto done = test::lastEvent(metrics, "done");
  ASSERT_FALSE(done.is_null()) << r.output;
  EXPECT_EQ(done["updates_folded"], 2 * 60) << done.dump();
  // A step's message: at most 8 bags x 50 ids, 400 rows of a 4-byte id and 8 floats, the dense
  // layers (8*8+8 + 2*8+2 floats) and the frame; the table alone is 640000 bytes. (Messages that
  // leave while the link is busy hold several steps, and fewer bytes than those steps apart.)
  const int64_t perStep = 400 * (4 + 8 * 4) + 90 * 4 + 200;
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_LT(done["peer_bytes_sent"][rank].get<int64_t>(), 60 * perStep + 1000) << done.dump();
  }
  EXPECT_GT(done["test_accuracy"].get<double>(), 0.0) << done.dump();
  // The rows' share of what the chief sent: a 4-byte id and 8 float32 values each.
  const int64_t rows = done["rows_sent_to_peer"][1].get<int64_t>();
  EXPECT_GT(rows, 60 * 8) << done.dump();  // at least 20 ids a bag, some of them distinct
  EXPECT_EQ(done["row_bytes_sent_to_peer"][1].get<int64_t>(), rows * (4 + 8 * 4)) << done.dump();
  EXPECT_LT(done["row_bytes_sent_to_peer"][1].get<int64_t>(), done["bytes_sent_to_peer"][1].get<int64_t>());
  // The step events account for what the peer's threads sent between steps (all but what
  // finish() sends at the end), not only what left during the step call itself.
  int64_t stepSent = 0;
  for (const auto& line : test::lines(test::readFile(metrics))) {
    const auto e = nlohmann::json::parse(line);
    if (e["event"] == "step") stepSent += e["bytes_sent"].get<int64_t>();
  }
  const int64_t total = done["peer_bytes_sent"][0].get<int64_t>();
  EXPECT_GT(stepSent, total / 2) << "the chief's steps were charged " << stepSent << " of its " << total << " bytes";
  EXPECT_LE(stepSent, total);
  // The rest left after the last step, and the done event says how much: nothing is lost.
  EXPECT_EQ(stepSent, done["bytes_sent"].get<int64_t>());
  EXPECT_EQ(stepSent + done["bytes_sent_after_steps"].get<int64_t>(), total) << done.dump();
  EXPECT_EQ(done["bytes_received"].get<int64_t>() + done["bytes_received_after_steps"].get<int64_t>(),
            done["peer_bytes_received"][0].get<int64_t>())
      << done.dump();
  EXPECT_GT(done["bytes_sent_after_steps"].get<int64_t>(), 0) << "DONE itself leaves after the last step";
}

// --codec fp16 and bf16 on a sparse model: the rows' values travel as 16 bits, so each row takes
// 4 + 2 * 32 bytes against 4 + 4 * 32 under float32 (the ids stay 32-bit integers), and the
// chief's rows weigh about half as much as in the same run without a codec.
TEST(GossipMultiproc, SparseTablesUnderFp16SendAboutHalfTheRowBytes) {
  const auto run = [](const std::string& codec) {
    test::TempDir dir;
    const std::string metrics = dir.file("m.jsonl");
    auto r = test::runCommand(test::launchPrefix(2) + train() + " --model embed:rows=20000,dim=32,hidden=8" +
                                  " --data synthetic-bags:2000,20000 --batch 8 --steps 40 --optimizer adagrad" +
                                  " --lr 0.05 --codec " + codec + " --codec-warmup-steps 0 --metrics " + metrics,
                              200);
    EXPECT_EQ(r.exitCode, 0) << r.output;
    auto done = test::lastEvent(metrics, "done");
    EXPECT_FALSE(done.is_null()) << r.output;
    return done;
  };
  const auto wide = run("none");
  const auto half = run("fp16");
  const auto brain = run("bf16");
  ASSERT_FALSE(wide.is_null() || half.is_null() || brain.is_null());
  const auto rowBytes = [](const nlohmann::json& done) { return done["row_bytes_sent_to_peer"][1].get<int64_t>(); };
  const auto rows = [](const nlohmann::json& done) { return done["rows_sent_to_peer"][1].get<int64_t>(); };
  for (const auto* done : {&wide, &half, &brain}) {
    EXPECT_EQ((*done)["updates_folded"], 2 * 40) << done->dump();
    EXPECT_GT(rows(*done), 40 * 8) << done->dump();
    EXPECT_GT(done->at("test_accuracy").get<double>(), 0.0) << done->dump();
  }
  EXPECT_EQ(half["codec"], "fp16");
  EXPECT_EQ(rowBytes(wide), rows(wide) * (4 + 32 * 4)) << wide.dump();
  EXPECT_EQ(rowBytes(half), rows(half) * (4 + 32 * 2)) << half.dump();
  EXPECT_EQ(rowBytes(brain), rows(brain) * (4 + 32 * 2)) << brain.dump();
  // The runs send about the same rows (steps that leave together merge theirs, so not exactly);
  // 16-bit values make them weigh 68/132 = 0.52 as much.
  const double ratio = double(rowBytes(half)) / double(rowBytes(wide));
  EXPECT_GT(ratio, 0.35) << half.dump() << "\n" << wide.dump();
  EXPECT_LT(ratio, 0.7) << half.dump() << "\n" << wide.dump();
  EXPECT_LT(half["bytes_sent_to_peer"][1].get<int64_t>(), wide["bytes_sent_to_peer"][1].get<int64_t>());
}

}  // namespace
}  // namespace cohort::gossip_test
