#include <cohort/cluster.h>
#include <cohort/error.h>

#include <gtest/gtest.h>

#include <initializer_list>
#include <map>
#include <string>
#include <tuple>
#include <vector>

namespace cohort::cluster_test {
namespace {

using Vars = std::map<std::string, std::string>;

EnvLookup envOf(Vars vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

ClusterSpec resolve(const Vars& vars) { return resolveCluster(envOf(vars)); }

// The InvalidArgument message resolveCluster throws for vars, or a failure when it throws none.
::testing::AssertionResult failsWith(const Vars& vars, std::initializer_list<std::string> parts) {
  try {
    ClusterSpec spec = resolve(vars);
    return ::testing::AssertionFailure() << "resolved without error to " << describe(spec);
  } catch (const InvalidArgument& e) {
    const std::string message = e.what();
    for (const std::string& part : parts) {
      if (message.find(part) == std::string::npos) {
        return ::testing::AssertionFailure() << "message \"" << message << "\" lacks \"" << part << "\"";
      }
    }
    return ::testing::AssertionSuccess();
  }
}

std::string tfConfig(const std::string& cluster, const std::string& type, int index) {
  return "{\"cluster\": " + cluster + ", \"task\": {\"type\": \"" + type + "\", \"index\": " +
         std::to_string(index) + "}}";
}

const std::string kTfCluster =
    R"({"chief": ["c:2222"], "worker": ["a:2222", "b:2222", "a:2223"], "ps": ["p0:3333", "p1:3333"],)"
    R"( "evaluator": ["e:4444"]})";

// ----------------------------------------------------------------------------------------------
// single process

TEST(Cluster, NothingSetIsASingleProcess) {
  ClusterSpec spec = resolve({});
  EXPECT_EQ(spec.role, Role::kWorker);
  EXPECT_EQ(spec.rank, 0);
  EXPECT_EQ(spec.worldSize, 1);
  EXPECT_EQ(spec.localRank, 0);
  EXPECT_EQ(spec.localWorldSize, 1);
  EXPECT_EQ(spec.master, (HostPort{"127.0.0.1", 29500}));
  EXPECT_TRUE(spec.workers.empty());
  EXPECT_TRUE(spec.parameterServers.empty());
  EXPECT_EQ(spec.source, "single");
  EXPECT_TRUE(spec.isChief());
}

TEST(Cluster, EmptyValuesCountAsUnset) {
  ClusterSpec spec = resolve({{"TF_CONFIG", ""}, {"RANK", ""}, {"WORLD_SIZE", ""}, {"OMPI_COMM_WORLD_RANK", ""},
                              {"SLURM_PROCID", ""}, {"MASTER_PORT", ""}});
  EXPECT_EQ(spec.source, "single");
  ClusterSpec torchrun = resolve({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", ""}, {"LOCAL_RANK", ""}});
  EXPECT_EQ(torchrun.master.port, 29500);
  EXPECT_EQ(torchrun.localRank, 0);
}

TEST(Cluster, UnrelatedVariablesAreIgnored) {
  EXPECT_EQ(resolve({{"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "1234"}, {"LOCAL_RANK", "3"}}).source, "single");
}

TEST(Cluster, HostPortStr) {
  EXPECT_EQ((HostPort{"node1", 29500}).str(), "node1:29500");
  EXPECT_EQ((HostPort{"::1", 80}).str(), "[::1]:80");
}

TEST(Cluster, Describe) {
  ClusterSpec spec = resolve({{"TF_CONFIG", tfConfig(R"({"worker": ["127.0.0.1:29500", "127.0.0.1:29501"]})",
                                                     "worker", 1)}});
  EXPECT_EQ(describe(spec), "worker 1 of 2 (TF_CONFIG), master 127.0.0.1:29500");
  EXPECT_EQ(describe(resolve({})), "worker 0 of 1 (single), master 127.0.0.1:29500");
  EXPECT_EQ(describe(resolve({{"TF_CONFIG", tfConfig(kTfCluster, "ps", 1)}})), "ps 1 of 2 (TF_CONFIG), master c:2222");
  EXPECT_EQ(describe(resolve({{"TF_CONFIG", tfConfig(kTfCluster, "evaluator", 0)}})),
            "evaluator 0 (TF_CONFIG), master c:2222");
  EXPECT_EQ(describe(resolve({{"RANK", "1"}, {"WORLD_SIZE", "3"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "7"}})),
            "worker 1 of 3 (torchrun), master h:7");
}

// ----------------------------------------------------------------------------------------------
// TF_CONFIG

TEST(ClusterTfConfig, ChiefIsRankZeroAndWorkersFollow) {
  ClusterSpec chief = resolve({{"TF_CONFIG", tfConfig(kTfCluster, "chief", 0)}});
  EXPECT_EQ(chief.source, "TF_CONFIG");
  EXPECT_EQ(chief.role, Role::kWorker);
  EXPECT_EQ(chief.rank, 0);
  EXPECT_TRUE(chief.isChief());
  EXPECT_EQ(chief.worldSize, 4);
  EXPECT_EQ(chief.master, (HostPort{"c", 2222}));
  ASSERT_EQ(chief.workers.size(), 4u);
  EXPECT_EQ(chief.workers[0], (HostPort{"c", 2222}));
  EXPECT_EQ(chief.workers[1], (HostPort{"a", 2222}));
  EXPECT_EQ(chief.workers[2], (HostPort{"b", 2222}));
  EXPECT_EQ(chief.workers[3], (HostPort{"a", 2223}));
  ASSERT_EQ(chief.parameterServers.size(), 2u);
  EXPECT_EQ(chief.parameterServers[1], (HostPort{"p1", 3333}));
  EXPECT_EQ(chief.localRank, 0);
  EXPECT_EQ(chief.localWorldSize, 1);

  for (int i = 0; i < 3; ++i) {
    ClusterSpec worker = resolve({{"TF_CONFIG", tfConfig(kTfCluster, "worker", i)}});
    EXPECT_EQ(worker.role, Role::kWorker);
    EXPECT_EQ(worker.rank, i + 1) << "worker " << i;
    EXPECT_FALSE(worker.isChief());
    EXPECT_EQ(worker.worldSize, 4);
    EXPECT_EQ(worker.master, (HostPort{"c", 2222}));
    EXPECT_EQ(worker.workers, chief.workers);
  }
}

TEST(ClusterTfConfig, LocalRankCountsWorkersOnTheSameHost) {
  // Host a has ranks 1 and 3; host b rank 2.
  ClusterSpec first = resolve({{"TF_CONFIG", tfConfig(kTfCluster, "worker", 0)}});
  EXPECT_EQ(first.localRank, 0);
  EXPECT_EQ(first.localWorldSize, 2);
  ClusterSpec second = resolve({{"TF_CONFIG", tfConfig(kTfCluster, "worker", 2)}});
  EXPECT_EQ(second.localRank, 1);
  EXPECT_EQ(second.localWorldSize, 2);
  ClusterSpec alone = resolve({{"TF_CONFIG", tfConfig(kTfCluster, "worker", 1)}});
  EXPECT_EQ(alone.localRank, 0);
  EXPECT_EQ(alone.localWorldSize, 1);

  // Every task on one host (the dataparallel test's layout).
  const std::string local = R"({"chief": ["127.0.0.1:5000"], "worker": ["127.0.0.1:5001", "127.0.0.1:5002"]})";
  const std::tuple<const char*, int, int> cases[] = {{"chief", 0, 0}, {"worker", 0, 1}, {"worker", 1, 2}};
  for (const auto& [type, index, rank] : cases) {
    ClusterSpec spec = resolve({{"TF_CONFIG", tfConfig(local, type, index)}});
    EXPECT_EQ(spec.rank, rank);
    EXPECT_EQ(spec.localRank, rank);
    EXPECT_EQ(spec.localWorldSize, 3);
  }
}

TEST(ClusterTfConfig, WithoutAChiefWorkerZeroIsRankZeroAndMaster) {
  const std::string cluster = R"({"worker": ["w0:1000", "w1:1001"]})";
  ClusterSpec zero = resolve({{"TF_CONFIG", tfConfig(cluster, "worker", 0)}});
  EXPECT_EQ(zero.rank, 0);
  EXPECT_TRUE(zero.isChief());
  EXPECT_EQ(zero.worldSize, 2);
  EXPECT_EQ(zero.master, (HostPort{"w0", 1000}));
  ClusterSpec one = resolve({{"TF_CONFIG", tfConfig(cluster, "worker", 1)}});
  EXPECT_EQ(one.rank, 1);
  EXPECT_EQ(one.master, (HostPort{"w0", 1000}));
}

TEST(ClusterTfConfig, ChiefAlone) {
  ClusterSpec spec = resolve({{"TF_CONFIG", tfConfig(R"({"chief": ["c:1"]})", "chief", 0)}});
  EXPECT_EQ(spec.worldSize, 1);
  EXPECT_TRUE(spec.isChief());
  EXPECT_EQ(spec.master, (HostPort{"c", 1}));
}

TEST(ClusterTfConfig, ParameterServerAndEvaluator) {
  ClusterSpec ps = resolve({{"TF_CONFIG", tfConfig(kTfCluster, "ps", 1)}});
  EXPECT_EQ(ps.role, Role::kParameterServer);
  EXPECT_EQ(ps.rank, 1);
  EXPECT_FALSE(ps.isChief());
  EXPECT_EQ(ps.worldSize, 4);
  EXPECT_EQ(ps.localRank, 0);
  EXPECT_EQ(ps.localWorldSize, 1);
  EXPECT_EQ(ps.master, (HostPort{"c", 2222}));
  EXPECT_EQ(ps.parameterServers.size(), 2u);
  EXPECT_EQ(ps.workers.size(), 4u);

  ClusterSpec ev = resolve({{"TF_CONFIG", tfConfig(kTfCluster, "evaluator", 0)}});
  EXPECT_EQ(ev.role, Role::kEvaluator);
  EXPECT_EQ(ev.rank, 0);
  EXPECT_FALSE(ev.isChief());
  EXPECT_EQ(ev.localWorldSize, 1);
}

TEST(ClusterTfConfig, IndexDefaultsToZeroAndIPv6IsBracketed) {
  ClusterSpec spec = resolve(
      {{"TF_CONFIG", R"({"cluster": {"worker": ["[::1]:7000", "[::1]:7001"]}, "task": {"type": "worker"}})"}});
  EXPECT_EQ(spec.rank, 0);
  EXPECT_EQ(spec.master, (HostPort{"::1", 7000}));
  EXPECT_EQ(spec.master.str(), "[::1]:7000");
  EXPECT_EQ(spec.localWorldSize, 2);
}

TEST(ClusterTfConfig, RejectsMalformedDocuments) {
  EXPECT_TRUE(failsWith({{"TF_CONFIG", "{not json"}}, {"TF_CONFIG", "not JSON"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", "[1, 2]"}}, {"TF_CONFIG", "not a JSON object"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", R"({"task": {"type": "worker", "index": 0}})"}}, {"TF_CONFIG", "\"cluster\""}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", R"({"cluster": {"worker": ["a:1"]}})"}}, {"TF_CONFIG", "\"task\""}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", R"({"cluster": ["a:1"], "task": {"type": "worker"}})"}},
                        {"TF_CONFIG", "\"cluster\" is not an object"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", R"({"cluster": {"worker": ["a:1"]}, "task": "worker"})"}},
                        {"TF_CONFIG", "\"task\" is not an object"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", R"({"cluster": {"worker": "a:1"}, "task": {"type": "worker"}})"}},
                        {"TF_CONFIG", "cluster.worker", "not a list"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", R"({"cluster": {"worker": ["a:1", 7]}, "task": {"type": "worker"}})"}},
                        {"TF_CONFIG", "cluster.worker[1]", "not a \"host:port\" string"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", R"({"cluster": {"master": ["a:1"]}, "task": {"type": "worker"}})"}},
                        {"TF_CONFIG", "cluster.master", "chief, worker, ps, evaluator"}));
}

TEST(ClusterTfConfig, RejectsBadTasks) {
  const std::string cluster = R"({"chief": ["c:1"], "worker": ["w:2", "w:3"]})";
  EXPECT_TRUE(failsWith({{"TF_CONFIG", tfConfig(cluster, "master", 0)}},
                        {"TF_CONFIG", "task.type", "\"master\"", "chief, worker, ps, evaluator"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", tfConfig(cluster, "ps", 0)}}, {"TF_CONFIG", "task.type", "cluster.ps"}));
  // An evaluator need not be listed (TensorFlow keeps it out of the cluster; so does TFJob).
  const ClusterSpec unlisted = resolve({{"TF_CONFIG", tfConfig(cluster, "evaluator", 0)}});
  EXPECT_EQ(unlisted.role, Role::kEvaluator);
  EXPECT_EQ(unlisted.rank, 0);
  EXPECT_EQ(unlisted.worldSize, 3);
  EXPECT_TRUE(failsWith({{"TF_CONFIG", tfConfig(R"({"chief": ["c:1"], "evaluator": ["e:1"]})", "evaluator", 1)}},
                        {"TF_CONFIG", "task.index=1", "cluster.evaluator has 1 entry"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", tfConfig(R"({"worker": ["w:2"]})", "chief", 0)}},
                        {"TF_CONFIG", "task.type", "cluster.chief"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", tfConfig(cluster, "worker", 2)}},
                        {"TF_CONFIG", "task.index=2", "out of range", "cluster.worker has 2 entries"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", tfConfig(cluster, "chief", 1)}},
                        {"TF_CONFIG", "task.index=1", "cluster.chief has 1 entry"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", tfConfig(cluster, "worker", -1)}}, {"TF_CONFIG", "task.index=-1", "negative"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", R"({"cluster": {"worker": ["w:2"]}, "task": {"type": "worker", "index": "0"}})"}},
                        {"TF_CONFIG", "task.index", "not a whole number"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", R"({"cluster": {"worker": ["w:2"]}, "task": {"type": "worker", "index": 0.5}})"}},
                        {"TF_CONFIG", "task.index", "not a whole number"}));
  EXPECT_TRUE(failsWith(
      {{"TF_CONFIG", R"({"cluster": {"worker": ["w:2"]}, "task": {"type": "worker", "index": 99999999999999}})"}},
      {"TF_CONFIG", "task.index", "out of range"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", R"({"cluster": {"worker": ["w:2"]}, "task": {"index": 0}})"}},
                        {"TF_CONFIG", "task.type", "missing"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", R"({"cluster": {"worker": ["w:2"]}, "task": {"type": 1}})"}},
                        {"TF_CONFIG", "task.type", "not a string"}));
}

TEST(ClusterTfConfig, RejectsBadClusters) {
  EXPECT_TRUE(failsWith({{"TF_CONFIG", tfConfig(R"({"chief": ["c:1", "d:1"], "worker": ["w:2"]})", "worker", 0)}},
                        {"TF_CONFIG", "cluster.chief", "at most one chief"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", tfConfig(R"({"ps": ["p:1"]})", "ps", 0)}},
                        {"TF_CONFIG", "no chief and no worker"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", tfConfig(R"({"chief": [], "worker": []})", "worker", 0)}},
                        {"TF_CONFIG", "no chief and no worker"}));
  for (const std::string bad : {"w", "w:", ":80", "w:65536", "w:-1", "w:http", "w:80x", "::1:80", "[::1]"}) {
    EXPECT_TRUE(failsWith({{"TF_CONFIG", tfConfig(R"({"worker": ["a:1", ")" + bad + R"("]})", "worker", 0)}},
                          {"TF_CONFIG", "cluster.worker[1]", "\"" + bad + "\"", "valid port (0..65535)"}))
        << bad;
  }
  EXPECT_TRUE(failsWith({{"TF_CONFIG", tfConfig(R"({"worker": ["a:1"], "ps": ["p"]})", "worker", 0)}},
                        {"TF_CONFIG", "cluster.ps[0]", "valid port"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", tfConfig(R"({"chief": ["c:99999"], "worker": ["a:1"]})", "worker", 0)}},
                        {"TF_CONFIG", "cluster.chief[0]", "valid port"}));
  EXPECT_NO_THROW(resolve({{"TF_CONFIG", tfConfig(R"({"worker": ["a:1", "b:65535"]})", "worker", 1)}}));
  // Port 0: a task that listens on any free port and tells its launcher (cohort launch).
  EXPECT_EQ(resolve({{"TF_CONFIG", tfConfig(R"({"chief": ["c:0"], "ps": ["p:0"]})", "chief", 0)}}).master,
            (HostPort{"c", 0}));
}

TEST(ClusterTfConfig, TorchrunVariablesThatAgreeAreAccepted) {
  ClusterSpec spec =
      resolve({{"TF_CONFIG", tfConfig(kTfCluster, "worker", 1)}, {"RANK", "2"}, {"WORLD_SIZE", "4"},
               {"MASTER_ADDR", "elsewhere"}, {"MASTER_PORT", "1"}});
  EXPECT_EQ(spec.source, "TF_CONFIG");
  EXPECT_EQ(spec.rank, 2);
  EXPECT_EQ(spec.master, (HostPort{"c", 2222}));  // MASTER_ADDR/PORT do not override TF_CONFIG
  // A ps is not a worker: RANK is not compared, WORLD_SIZE still is.
  EXPECT_NO_THROW(resolve({{"TF_CONFIG", tfConfig(kTfCluster, "ps", 0)}, {"RANK", "3"}, {"WORLD_SIZE", "4"}}));
}

TEST(ClusterTfConfig, TorchrunVariablesThatDisagreeAreAnError) {
  EXPECT_TRUE(failsWith({{"TF_CONFIG", tfConfig(kTfCluster, "worker", 1)}, {"RANK", "1"}, {"WORLD_SIZE", "4"}},
                        {"RANK=1", "TF_CONFIG", "rank 2"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", tfConfig(kTfCluster, "chief", 0)}, {"RANK", "0"}, {"WORLD_SIZE", "2"}},
                        {"WORLD_SIZE=2", "TF_CONFIG", "4 workers"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", tfConfig(kTfCluster, "chief", 0)}, {"RANK", "3"}}, {"RANK=3", "TF_CONFIG"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", tfConfig(kTfCluster, "ps", 0)}, {"WORLD_SIZE", "3"}},
                        {"WORLD_SIZE=3", "TF_CONFIG"}));
  EXPECT_TRUE(failsWith({{"TF_CONFIG", tfConfig(kTfCluster, "chief", 0)}, {"RANK", "zero"}},
                        {"RANK=zero is not a whole number"}));
}

// ----------------------------------------------------------------------------------------------
// torchrun

TEST(ClusterTorchrun, ReadsAllVariables) {
  ClusterSpec spec = resolve({{"RANK", "5"},
                              {"WORLD_SIZE", "8"},
                              {"LOCAL_RANK", "1"},
                              {"LOCAL_WORLD_SIZE", "4"},
                              {"MASTER_ADDR", "node7"},
                              {"MASTER_PORT", "12345"}});
  EXPECT_EQ(spec.source, "torchrun");
  EXPECT_EQ(spec.role, Role::kWorker);
  EXPECT_EQ(spec.rank, 5);
  EXPECT_EQ(spec.worldSize, 8);
  EXPECT_EQ(spec.localRank, 1);
  EXPECT_EQ(spec.localWorldSize, 4);
  EXPECT_EQ(spec.master, (HostPort{"node7", 12345}));
  EXPECT_TRUE(spec.workers.empty());
  EXPECT_FALSE(spec.isChief());
}

TEST(ClusterTorchrun, Defaults) {
  ClusterSpec spec = resolve({{"RANK", "0"}, {"WORLD_SIZE", "3"}, {"MASTER_ADDR", "10.1.2.3"}});
  EXPECT_TRUE(spec.isChief());
  EXPECT_EQ(spec.localRank, 0);
  EXPECT_EQ(spec.localWorldSize, 3);  // LOCAL_WORLD_SIZE defaults to WORLD_SIZE
  EXPECT_EQ(spec.master, (HostPort{"10.1.2.3", 29500}));

  ClusterSpec one = resolve({{"RANK", "0"}, {"WORLD_SIZE", "1"}});  // MASTER_ADDR optional alone
  EXPECT_EQ(one.master, (HostPort{"127.0.0.1", 29500}));
  EXPECT_EQ(one.source, "torchrun");

  EXPECT_EQ(resolve({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "[::1]"}}).master, (HostPort{"::1", 29500}));
}

// Kubeflow's PyTorchJob, as its operator sets the variables (pkg/controller.v1/pytorch/envvar.go):
// RANK is the pod's (master 0, worker i -> i + 1), WORLD_SIZE = replicas x nprocPerNode, and
// PET_NPROC_PER_NODE, PET_NODE_RANK, PET_NNODES are for torchrun.
Vars pyTorchJobPod(int rank, int replicas, int nprocPerNode) {
  return {{"MASTER_ADDR", "train-master-0"}, {"MASTER_PORT", "23456"},
          {"WORLD_SIZE", std::to_string(replicas * nprocPerNode)}, {"RANK", std::to_string(rank)},
          {"PET_NPROC_PER_NODE", std::to_string(nprocPerNode)}, {"PET_NODE_RANK", std::to_string(rank)},
          {"PET_NNODES", std::to_string(replicas)}, {"PYTHONUNBUFFERED", "0"}};
}

TEST(ClusterKubeflow, PyTorchJobPodsAreOneProcessEach) {
  for (int rank = 0; rank < 3; ++rank) {
    const ClusterSpec spec = resolve(pyTorchJobPod(rank, 3, 1));
    EXPECT_EQ(spec.source, "torchrun");
    EXPECT_EQ(spec.rank, rank);
    EXPECT_EQ(spec.worldSize, 3);
    EXPECT_EQ(spec.localRank, 0);
    EXPECT_EQ(spec.localWorldSize, 1) << "one process in this pod: it gets all the pod's cores";
    EXPECT_EQ(spec.master, (HostPort{"train-master-0", 23456}));
  }
}

// nprocPerNode's default, "auto" (and "cpu", "gpu"), makes the operator count one process a pod:
// it was refused as "not a whole number", so every PyTorchJob that left it out failed.
TEST(ClusterKubeflow, NamedNprocPerNodeIsOneProcessAPod) {
  for (const char* named : {"auto", "cpu", "gpu"}) {
    Vars vars = pyTorchJobPod(1, 3, 1);
    vars["PET_NPROC_PER_NODE"] = named;
    const ClusterSpec spec = resolve(vars);
    EXPECT_EQ(spec.rank, 1) << named;
    EXPECT_EQ(spec.worldSize, 3) << named;
    EXPECT_EQ(spec.localWorldSize, 1) << named;
  }
  Vars bad = pyTorchJobPod(1, 3, 1);
  bad["PET_NPROC_PER_NODE"] = "four";
  EXPECT_TRUE(failsWith(bad, {"PET_NPROC_PER_NODE=four"}));
}

TEST(ClusterKubeflow, NprocPerNodeWithoutTorchrunInThePodIsAnError) {
  // 2 pods x 4 processes: WORLD_SIZE=8 counts processes, RANK=1 is the second pod.
  EXPECT_TRUE(failsWith(pyTorchJobPod(1, 2, 4), {"PET_NPROC_PER_NODE=4", "WORLD_SIZE=8", "RANK numbers pods",
                                                 "nprocPerNode: \"1\"", "torchrun"}));
}

TEST(ClusterKubeflow, TorchrunInThePodGivesEachProcessItsRank) {
  Vars vars = pyTorchJobPod(1, 2, 4);
  // What torchrun --nnodes=$PET_NNODES --nproc-per-node=$PET_NPROC_PER_NODE sets for local rank 1.
  vars["RANK"] = "5";
  vars["LOCAL_RANK"] = "1";
  vars["LOCAL_WORLD_SIZE"] = "4";
  const ClusterSpec spec = resolve(vars);
  EXPECT_EQ(spec.rank, 5);
  EXPECT_EQ(spec.worldSize, 8);
  EXPECT_EQ(spec.localRank, 1);
  EXPECT_EQ(spec.localWorldSize, 4);
}

// TFJob's TF_CONFIG: no chief (worker 0 leads), service names, and an "environment" key.
TEST(ClusterKubeflow, TfJobConfigWithItsEnvironmentKey) {
  const std::string cluster =
      R"({"worker": ["mnist-worker-0.default.svc:2222", "mnist-worker-1.default.svc:2222"],)"
      R"( "ps": ["mnist-ps-0.default.svc:2222"]})";
  auto config = [&](const std::string& type, int index) {
    return "{\"cluster\": " + cluster + ", \"task\": {\"type\": \"" + type + "\", \"index\": " +
           std::to_string(index) + "}, \"environment\": \"cloud\"}";
  };
  const ClusterSpec worker = resolve({{"TF_CONFIG", config("worker", 1)}});
  EXPECT_EQ(worker.source, "TF_CONFIG");
  EXPECT_EQ(worker.role, Role::kWorker);
  EXPECT_EQ(worker.rank, 1);
  EXPECT_EQ(worker.worldSize, 2);
  EXPECT_EQ(worker.master, (HostPort{"mnist-worker-0.default.svc", 2222}));
  const ClusterSpec ps = resolve({{"TF_CONFIG", config("ps", 0)}});
  EXPECT_EQ(ps.role, Role::kParameterServer);
  ASSERT_EQ(ps.parameterServers.size(), 1u);
  EXPECT_EQ(ps.parameterServers[0], (HostPort{"mnist-ps-0.default.svc", 2222}));
}

TEST(ClusterTorchrun, OneOfRankAndWorldSizeIsAnError) {
  EXPECT_TRUE(failsWith({{"RANK", "0"}}, {"WORLD_SIZE is not", "RANK is set"}));
  EXPECT_TRUE(failsWith({{"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}}, {"RANK is not", "WORLD_SIZE is set"}));
}

TEST(ClusterTorchrun, NumbersMustBeWhole) {
  EXPECT_TRUE(failsWith({{"RANK", "abc"}, {"WORLD_SIZE", "2"}}, {"RANK=abc is not a whole number"}));
  EXPECT_TRUE(failsWith({{"RANK", "0"}, {"WORLD_SIZE", "2x"}}, {"WORLD_SIZE=2x is not a whole number"}));
  EXPECT_TRUE(failsWith({{"RANK", "1.0"}, {"WORLD_SIZE", "2"}}, {"RANK=1.0 is not a whole number"}));
  EXPECT_TRUE(failsWith({{"RANK", " 1"}, {"WORLD_SIZE", "2"}}, {"RANK= 1 is not a whole number"}));
  EXPECT_TRUE(failsWith({{"RANK", "+1"}, {"WORLD_SIZE", "2"}}, {"RANK=+1 is not a whole number"}));
  EXPECT_TRUE(failsWith({{"RANK", "0"}, {"WORLD_SIZE", "99999999999"}}, {"WORLD_SIZE=99999999999 is too large"}));
  EXPECT_TRUE(failsWith({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "x"}}, {"LOCAL_RANK=x is not a whole number"}));
  EXPECT_TRUE(failsWith({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_WORLD_SIZE", "y"}},
                        {"LOCAL_WORLD_SIZE=y is not a whole number"}));
  EXPECT_TRUE(failsWith({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "http"}},
                        {"MASTER_PORT=http is not a whole number"}));
}

TEST(ClusterTorchrun, RangesAreChecked) {
  EXPECT_TRUE(failsWith({{"RANK", "3"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}}, {"RANK=3 is not below WORLD_SIZE=2"}));
  EXPECT_TRUE(failsWith({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}}, {"RANK=2 is not below WORLD_SIZE=2"}));
  EXPECT_TRUE(failsWith({{"RANK", "-1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}}, {"RANK=-1 is negative"}));
  EXPECT_TRUE(failsWith({{"RANK", "0"}, {"WORLD_SIZE", "0"}}, {"WORLD_SIZE=0 must be at least 1"}));
  EXPECT_TRUE(failsWith({{"RANK", "0"}, {"WORLD_SIZE", "-2"}}, {"WORLD_SIZE=-2 must be at least 1"}));
  EXPECT_TRUE(failsWith({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "h"}, {"LOCAL_RANK", "2"},
                         {"LOCAL_WORLD_SIZE", "2"}},
                        {"LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"}));
  EXPECT_TRUE(failsWith({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"LOCAL_RANK", "2"}},
                        {"LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2", "WORLD_SIZE"}));
  EXPECT_TRUE(failsWith({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"LOCAL_RANK", "-1"}},
                        {"LOCAL_RANK=-1 is negative"}));
  EXPECT_TRUE(failsWith({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"LOCAL_WORLD_SIZE", "0"}},
                        {"LOCAL_WORLD_SIZE=0 must be at least 1"}));
  EXPECT_TRUE(failsWith({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"LOCAL_WORLD_SIZE", "3"}},
                        {"LOCAL_WORLD_SIZE=3 is more than WORLD_SIZE=2"}));
}

TEST(ClusterTorchrun, MasterAddrIsNeededForMoreThanOneWorker) {
  EXPECT_TRUE(failsWith({{"RANK", "1"}, {"WORLD_SIZE", "2"}}, {"MASTER_ADDR is not set", "WORLD_SIZE=2"}));
  EXPECT_TRUE(failsWith({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1234"}}, {"MASTER_ADDR"}));
}

TEST(ClusterTorchrun, MasterPortMustBeAPort) {
  for (const std::string bad : {"65536", "-5", "100000"}) {
    EXPECT_TRUE(failsWith({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", bad}},
                          {"MASTER_PORT=" + bad + " is not a port (0..65535)"}))
        << bad;
  }
  EXPECT_EQ(resolve({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "65535"}}).master.port, 65535);
  EXPECT_EQ(resolve({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "1"}}).master.port, 1);
  // 0: the chief listens on any free port and tells its launcher, which tells the others.
  EXPECT_EQ(resolve({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "0"}}).master.port, 0);
}

TEST(ClusterTorchrun, OpenMpiVariablesThatAgreeAreAccepted) {
  ClusterSpec spec = resolve({{"RANK", "1"},
                              {"WORLD_SIZE", "2"},
                              {"MASTER_ADDR", "h"},
                              {"OMPI_COMM_WORLD_RANK", "1"},
                              {"OMPI_COMM_WORLD_SIZE", "2"},
                              {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"}});
  EXPECT_EQ(spec.source, "torchrun");
  EXPECT_EQ(spec.localWorldSize, 2);  // torchrun's rules, not OpenMPI's
}

TEST(ClusterTorchrun, OpenMpiVariablesThatDisagreeAreAnError) {
  EXPECT_TRUE(failsWith({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"OMPI_COMM_WORLD_RANK", "0"},
                         {"OMPI_COMM_WORLD_SIZE", "2"}},
                        {"RANK=1", "OMPI_COMM_WORLD_RANK=0"}));
  EXPECT_TRUE(failsWith({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"OMPI_COMM_WORLD_RANK", "1"},
                         {"OMPI_COMM_WORLD_SIZE", "4"}},
                        {"WORLD_SIZE=2", "OMPI_COMM_WORLD_SIZE=4"}));
  EXPECT_TRUE(failsWith({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"OMPI_COMM_WORLD_SIZE", "3"}},
                        {"WORLD_SIZE=1", "OMPI_COMM_WORLD_SIZE=3"}));
}

// ----------------------------------------------------------------------------------------------
// OpenMPI

TEST(ClusterOpenMpi, OneHostNeedsNoMasterAddr) {
  for (int rank = 0; rank < 3; ++rank) {
    ClusterSpec spec = resolve({{"OMPI_COMM_WORLD_RANK", std::to_string(rank)},
                                {"OMPI_COMM_WORLD_SIZE", "3"},
                                {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(rank)},
                                {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"}});
    EXPECT_EQ(spec.source, "OpenMPI");
    EXPECT_EQ(spec.rank, rank);
    EXPECT_EQ(spec.worldSize, 3);
    EXPECT_EQ(spec.localRank, rank);
    EXPECT_EQ(spec.localWorldSize, 3);
    EXPECT_EQ(spec.master, (HostPort{"127.0.0.1", 29500}));
    EXPECT_EQ(spec.isChief(), rank == 0);
  }
  // mpirun -x MASTER_PORT=... (the dataparallel test's form).
  ClusterSpec spec = resolve({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                              {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                              {"MASTER_PORT", "4321"}});
  EXPECT_EQ(spec.master, (HostPort{"127.0.0.1", 4321}));
}

TEST(ClusterOpenMpi, SeveralHostsNeedMasterAddr) {
  const Vars twoHosts = {{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                         {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
  EXPECT_TRUE(failsWith(twoHosts, {"MASTER_ADDR is not set", "OMPI_COMM_WORLD_LOCAL_SIZE=2", "mpirun -x MASTER_ADDR="}));
  Vars withMaster = twoHosts;
  withMaster["MASTER_ADDR"] = "head";
  withMaster["MASTER_PORT"] = "777";
  ClusterSpec spec = resolve(withMaster);
  EXPECT_EQ(spec.rank, 3);
  EXPECT_EQ(spec.localRank, 1);
  EXPECT_EQ(spec.localWorldSize, 2);
  EXPECT_EQ(spec.master, (HostPort{"head", 777}));
}

TEST(ClusterOpenMpi, WithoutTheLocalPairTheLayoutIsUnknown) {
  ClusterSpec alone = resolve({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}});
  EXPECT_EQ(alone.localRank, 0);
  EXPECT_EQ(alone.localWorldSize, 1);
  EXPECT_EQ(alone.master, (HostPort{"127.0.0.1", 29500}));
  EXPECT_TRUE(failsWith({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}},
                        {"MASTER_ADDR is not set", "OMPI_COMM_WORLD_LOCAL_SIZE is unset"}));
}

TEST(ClusterOpenMpi, Errors) {
  EXPECT_TRUE(failsWith({{"OMPI_COMM_WORLD_RANK", "0"}}, {"OMPI_COMM_WORLD_SIZE is not"}));
  EXPECT_TRUE(failsWith({{"OMPI_COMM_WORLD_SIZE", "1"}}, {"OMPI_COMM_WORLD_RANK is not"}));
  EXPECT_TRUE(failsWith({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}},
                        {"OMPI_COMM_WORLD_LOCAL_SIZE is not"}));
  EXPECT_TRUE(failsWith({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"}},
                        {"OMPI_COMM_WORLD_LOCAL_RANK is not"}));
  EXPECT_TRUE(failsWith({{"OMPI_COMM_WORLD_RANK", "x"}, {"OMPI_COMM_WORLD_SIZE", "1"}},
                        {"OMPI_COMM_WORLD_RANK=x is not a whole number"}));
  EXPECT_TRUE(failsWith({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "2"}},
                        {"OMPI_COMM_WORLD_RANK=2 is not below OMPI_COMM_WORLD_SIZE=2"}));
  EXPECT_TRUE(failsWith({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "0"}},
                        {"OMPI_COMM_WORLD_SIZE=0 must be at least 1"}));
  EXPECT_TRUE(failsWith({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                         {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}},
                        {"OMPI_COMM_WORLD_LOCAL_RANK=2 is not below OMPI_COMM_WORLD_LOCAL_SIZE=2"}));
  EXPECT_TRUE(failsWith({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                         {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"}},
                        {"OMPI_COMM_WORLD_LOCAL_SIZE=3 is more than OMPI_COMM_WORLD_SIZE=2"}));
  EXPECT_TRUE(failsWith({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}, {"MASTER_PORT", "70000"}},
                        {"MASTER_PORT=70000 is not a port (0..65535)"}));
}

// ----------------------------------------------------------------------------------------------
// Slurm

TEST(ClusterSlurm, ReadsTheStep) {
  ClusterSpec spec = resolve({{"SLURM_PROCID", "5"},
                              {"SLURM_NTASKS", "8"},
                              {"SLURM_LOCALID", "1"},
                              {"SLURM_NTASKS_PER_NODE", "4"},
                              {"SLURM_JOB_NODELIST", "gpu[07-08]"}});
  EXPECT_EQ(spec.source, "Slurm");
  EXPECT_EQ(spec.role, Role::kWorker);
  EXPECT_EQ(spec.rank, 5);
  EXPECT_EQ(spec.worldSize, 8);
  EXPECT_EQ(spec.localRank, 1);
  EXPECT_EQ(spec.localWorldSize, 4);
  EXPECT_EQ(spec.master, (HostPort{"gpu07", 29500}));
}

TEST(ClusterSlurm, MasterSources) {
  const Vars base = {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}};
  Vars v = base;
  v["SLURM_NODELIST"] = "b,a";
  EXPECT_EQ(resolve(v).master, (HostPort{"b", 29500}));
  v["SLURM_JOB_NODELIST"] = "x";  // preferred over SLURM_NODELIST
  EXPECT_EQ(resolve(v).master, (HostPort{"x", 29500}));
  v["MASTER_PORT"] = "6000";
  EXPECT_EQ(resolve(v).master, (HostPort{"x", 6000}));
  v["MASTER_ADDR"] = "chosen";  // preferred over the node list
  EXPECT_EQ(resolve(v).master, (HostPort{"chosen", 6000}));

  EXPECT_TRUE(failsWith(base, {"MASTER_ADDR is not set", "SLURM_JOB_NODELIST", "SLURM_NTASKS=2"}));
  ClusterSpec one = resolve({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}});
  EXPECT_EQ(one.master, (HostPort{"127.0.0.1", 29500}));
  EXPECT_EQ(one.localWorldSize, 1);

  EXPECT_TRUE(failsWith({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "node[01-"}},
                        {"SLURM_JOB_NODELIST=node[01-", "not a Slurm host list", "'[' without ']'"}));
}

TEST(ClusterSlurm, LocalWorldSize) {
  const Vars base = {{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "5"}, {"SLURM_JOB_NODELIST", "n[1-3]"}};
  Vars v = base;
  EXPECT_EQ(resolve(v).localWorldSize, 1);  // nothing says: 1

  // SLURM_STEP_TASKS_PER_NODE "2(x2),1": nodes 0 and 1 run 2 tasks, node 2 runs 1.
  v["SLURM_STEP_TASKS_PER_NODE"] = "2(x2),1";
  v["SLURM_TASKS_PER_NODE"] = "4";
  v["SLURM_NODEID"] = "1";
  v["SLURM_LOCALID"] = "1";
  EXPECT_EQ(resolve(v).localWorldSize, 2);
  v["SLURM_NODEID"] = "2";
  v["SLURM_LOCALID"] = "0";
  EXPECT_EQ(resolve(v).localWorldSize, 1);
  v["SLURM_NODEID"] = "0";
  EXPECT_EQ(resolve(v).localWorldSize, 2);
  v.erase("SLURM_STEP_TASKS_PER_NODE");  // the job's list when the step's is missing
  EXPECT_EQ(resolve(v).localWorldSize, 4);
  v["SLURM_NTASKS_PER_NODE"] = "3";  // a plain --ntasks-per-node wins
  EXPECT_EQ(resolve(v).localWorldSize, 3);
  v["SLURM_NTASKS_PER_NODE"] = "3(x2)";  // not plain: falls back to the list
  EXPECT_EQ(resolve(v).localWorldSize, 4);
  v["SLURM_TASKS_PER_NODE"] = "garbage";  // unreadable: 1
  EXPECT_EQ(resolve(v).localWorldSize, 1);

  Vars bad = base;
  bad["SLURM_LOCALID"] = "2";
  bad["SLURM_NTASKS_PER_NODE"] = "2";
  EXPECT_TRUE(failsWith(bad, {"SLURM_LOCALID=2 is not below the 2 tasks on this node", "SLURM_NTASKS_PER_NODE=2"}));
  bad.erase("SLURM_NTASKS_PER_NODE");
  EXPECT_TRUE(failsWith(bad, {"SLURM_LOCALID=2", "no readable per-node count"}));
}

TEST(ClusterSlurm, Errors) {
  EXPECT_TRUE(failsWith({{"SLURM_PROCID", "0"}}, {"SLURM_NTASKS is not"}));
  EXPECT_TRUE(failsWith({{"SLURM_NTASKS", "2"}}, {"SLURM_PROCID is not"}));
  EXPECT_TRUE(failsWith({{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "2"}}, {"SLURM_PROCID=2 is not below SLURM_NTASKS=2"}));
  EXPECT_TRUE(failsWith({{"SLURM_PROCID", "a"}, {"SLURM_NTASKS", "2"}}, {"SLURM_PROCID=a is not a whole number"}));
  EXPECT_TRUE(failsWith({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "0"}}, {"SLURM_NTASKS=0 must be at least 1"}));
  EXPECT_TRUE(failsWith({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_LOCALID", "-1"}},
                        {"SLURM_LOCALID=-1 is negative"}));
}

TEST(ClusterSlurm, NodelistExpansion) {
  using V = std::vector<std::string>;
  EXPECT_EQ(expandSlurmNodelist("x"), V{"x"});
  EXPECT_EQ(expandSlurmNodelist("a,b"), (V{"a", "b"}));
  EXPECT_EQ(expandSlurmNodelist("node[01-04,07],gpu5"), (V{"node01", "node02", "node03", "node04", "node07", "gpu5"}));
  EXPECT_EQ(expandSlurmNodelist("n[8-10]"), (V{"n8", "n9", "n10"}));
  EXPECT_EQ(expandSlurmNodelist("n[098-100]"), (V{"n098", "n099", "n100"}));
  EXPECT_EQ(expandSlurmNodelist("rack[1-2]-n[1,3]"), (V{"rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"}));
  EXPECT_EQ(expandSlurmNodelist("n[5]x"), V{"n5x"});
  EXPECT_EQ(expandSlurmNodelist("a.example.com,b[1-2].example.com"),
            (V{"a.example.com", "b1.example.com", "b2.example.com"}));
  for (const std::string bad : {"", "a,", ",a", "n[1-", "n1]", "n[]", "n[a-b]", "n[3-1]", "n[[1]]", "n[1--2]",
                                "n[-1]", "n[0-99999999]"}) {
    EXPECT_THROW(expandSlurmNodelist(bad), InvalidArgument) << bad;
  }
  try {
    expandSlurmNodelist("n[3-1]");
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("\"n[3-1]\" is not a Slurm host list"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("backwards"), std::string::npos) << e.what();
  }
}

// Under mpirun inside an sbatch allocation SLURM_PROCID is 0 on every rank: OpenMPI wins and the
// two are not compared.
TEST(ClusterSlurm, OpenMpiInsideSlurmIsNotCrossChecked) {
  ClusterSpec spec = resolve({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                              {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                              {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_JOB_NODELIST", "n1"}});
  EXPECT_EQ(spec.source, "OpenMPI");
  EXPECT_EQ(spec.rank, 1);
  EXPECT_EQ(spec.worldSize, 2);
}

// ----------------------------------------------------------------------------------------------
// precedence

TEST(ClusterPrecedence, TfConfigThenTorchrunThenOpenMpiThenSlurm) {
  const Vars slurm = {{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"SLURM_JOB_NODELIST", "s[1-2]"}};
  EXPECT_EQ(resolve(slurm).source, "Slurm");

  Vars ompi = slurm;
  ompi.insert({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "3"}, {"MASTER_ADDR", "m"}});
  EXPECT_EQ(resolve(ompi).source, "OpenMPI");
  EXPECT_EQ(resolve(ompi).rank, 2);

  Vars torchrun = ompi;
  torchrun.insert({{"RANK", "2"}, {"WORLD_SIZE", "3"}});
  EXPECT_EQ(resolve(torchrun).source, "torchrun");
  EXPECT_EQ(resolve(torchrun).worldSize, 3);

  Vars tf = torchrun;
  tf["TF_CONFIG"] = tfConfig(R"({"chief": ["c:1"], "worker": ["w:1", "w:2"]})", "worker", 1);
  ClusterSpec spec = resolve(tf);
  EXPECT_EQ(spec.source, "TF_CONFIG");
  EXPECT_EQ(spec.rank, 2);
  EXPECT_EQ(spec.master, (HostPort{"c", 1}));
}

TEST(ClusterPrecedence, ALaterSourceIsNotReadWhenAnEarlierOneIsSet) {
  // A broken Slurm environment does not matter under torchrun.
  EXPECT_EQ(resolve({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"SLURM_PROCID", "junk"}}).source, "torchrun");
  // Nor a broken OpenMPI local pair under TF_CONFIG.
  EXPECT_EQ(resolve({{"TF_CONFIG", tfConfig(R"({"worker": ["w:1"]})", "worker", 0)},
                     {"OMPI_COMM_WORLD_LOCAL_RANK", "x"}})
                .source,
            "TF_CONFIG");
}

// Without a secret, the store's key is the launcher's job id: the first of COHORT_JOB_ID,
// TORCHELASTIC_RUN_ID (not torchrun's shared default "none"), SLURM_JOB_ID, PMIX_NAMESPACE.
TEST(Cluster, TheJobIdentityIsTheLaunchersJobIdWhenThereIsNoSecret) {
  const Vars torchrun = {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};
  EXPECT_EQ(resolve(torchrun).storeKey(), "");
  Vars v = torchrun;
  v["TORCHELASTIC_RUN_ID"] = "none";
  EXPECT_EQ(resolve(v).jobIdentity, "");
  v["TORCHELASTIC_RUN_ID"] = "run-7";
  v["SLURM_JOB_ID"] = "42";
  EXPECT_EQ(resolve(v).jobIdentity, "run-7");
  EXPECT_EQ(resolve(v).jobIdentitySource, "TORCHELASTIC_RUN_ID");
  EXPECT_EQ(resolve(v).storeKey(), "job:run-7");
  v["COHORT_JOB_ID"] = "mine";
  EXPECT_EQ(resolve(v).storeKey(), "job:mine");
  v["COHORT_AUTH_TOKEN"] = "s3cret";
  EXPECT_EQ(resolve(v).storeKey(), "s3cret");  // a secret wins
  Vars slurm = torchrun;
  slurm["SLURM_JOB_ID"] = "42";
  EXPECT_EQ(resolve(slurm).jobIdentitySource, "SLURM_JOB_ID");
  slurm["SLURM_STEP_ID"] = "3";  // roles from torchrun's variables: the job id alone, as before
  EXPECT_EQ(resolve(slurm).jobIdentity, "42");
}

// Two srun steps side by side in one allocation: each finds its task 0 on its own first node and
// has an identity of its own, so that neither joins the other's store (both used the allocation's
// first node and the job id, and were admitted to each other's store).
TEST(ClusterSlurm, StepsOfOneAllocationAreTwoJobs) {
  Vars a = {{"SLURM_PROCID", "1"},  {"SLURM_NTASKS", "2"},
            {"SLURM_JOB_ID", "42"}, {"SLURM_JOB_NODELIST", "node[1-2]"},
            {"SLURM_STEP_ID", "0"}, {"SLURM_STEP_NODELIST", "node1"}};
  Vars b = a;
  b["SLURM_STEP_ID"] = "1";
  b["SLURM_STEP_NODELIST"] = "node2";
  EXPECT_EQ(resolve(a).master.host, "node1");
  EXPECT_EQ(resolve(b).master.host, "node2");
  EXPECT_EQ(resolve(a).jobIdentity, "42.0");
  EXPECT_EQ(resolve(b).jobIdentity, "42.1");
  EXPECT_EQ(resolve(b).jobIdentitySource, "SLURM_JOB_ID.SLURM_STEP_ID");
  EXPECT_NE(resolve(a).storeKey(), resolve(b).storeKey());
  b.erase("SLURM_STEP_NODELIST");  // an older Slurm: the allocation's first node
  EXPECT_EQ(resolve(b).master.host, "node1");
}

}  // namespace
}  // namespace cohort::cluster_test
