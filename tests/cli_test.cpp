// Bad input at the command line: one line naming the problem, a non-zero exit, no crash.
#include <zlib.h>

#include "test_util.h"

#include <filesystem>

namespace cohort::cli_test {
namespace {

void expectOneLineError(const std::string& args, const std::string& needle, int code = -1,
                        const std::string& env = "") {
  auto r = test::runCommand("env " + env + test::cohortBinary() + " " + args, 120);
  EXPECT_NE(r.exitCode, 0) << args;
  if (code >= 0) EXPECT_EQ(r.exitCode, code) << args << "\n" << r.output;
  auto lines = test::lines(r.output);
  ASSERT_EQ(lines.size(), 1u) << args << "\n" << r.output;
  EXPECT_EQ(lines[0].rfind("cohort: error: ", 0), 0u) << lines[0];
  EXPECT_NE(lines[0].find(needle), std::string::npos) << "expected '" << needle << "' in: " << lines[0];
}

// --backend nccl carries CUDA tensors only: a model on the CPU is refused, naming the fix (the same
// line on a machine with a GPU, since --device cpu says where the model is).
// --version says what this build and machine give cohort: the LibTorch (2.11 or later), whether
// it has CUDA and sees a GPU, NCCL, the codecs' kernels. This machine's answers where they are
// known here: no GPU is visible (tests labelled gpu run elsewhere).
TEST(Cli, VersionNamesTheLibTorchTheDevicesAndNccl) {
  auto r = test::runCommand(test::cohortBinary() + " --version", 60);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_EQ(r.output.rfind("cohort 0.", 0), 0u) << r.output;
  EXPECT_NE(r.output.find("LibTorch 2."), std::string::npos) << r.output;
  EXPECT_TRUE(r.output.find("built for CUDA ") != std::string::npos ||
              r.output.find("for the CPU only") != std::string::npos)
      << r.output;
  if (r.output.find("built for CUDA ") != std::string::npos) {
    EXPECT_NE(r.output.find("no CUDA device visible"), std::string::npos) << "a GPU on a CI machine?\n" << r.output;
  }
  EXPECT_NE(r.output.find("\nNCCL: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("\ncodec kernels: "), std::string::npos) << r.output;
}

TEST(Cli, BackendNcclWithAModelOnTheCpuIsRefused) {
  expectOneLineError("train --strategy allreduce --backend nccl --device cpu --model mlp --data synthetic:200 "
                     "--steps 2 --progress off",
                     "--backend nccl carries collectives over CUDA tensors, but this run's model is on the CPU "
                     "(--device cpu): use --device cuda",
                     2);
  expectOneLineError("train --strategy ps --backend nccl --device cpu --model mlp --data synthetic:200 --steps 1",
                     "--backend nccl", 2);
}

// The done event says what carried the gradients: Gloo for a model on the CPU, whatever --backend.
TEST(Cli, TheDoneEventNamesTheBackend) {
  test::TempDir dir;
  auto r = test::runCommand(test::cohortBinary() + " train --strategy allreduce --backend auto --device cpu --model "
                            "mlp --data synthetic:200 --steps 2 --progress off --metrics " + dir.file("m.jsonl"), 120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_EQ(test::lastEvent(dir.file("m.jsonl"), "done")["backend"], "gloo") << r.output;
}

TEST(Cli, UnknownBackendNamesTheChoices) {
  expectOneLineError("train --backend mpi --steps 1", "--backend: mpi not in {auto,nccl,gloo}", 2);
  // Not CLI11's map of the names to the enum's numbers, which it showed before.
  expectOneLineError("train --outer-optimizer adam --steps 1", "--outer-optimizer: adam not in {sgd,momentum,nesterov}",
                     2);
}

// --optimizer is parsed once, where it comes in (a --config file's optimizer key too).
TEST(Cli, UnknownOptimizerNamesTheChoices) {
  expectOneLineError("train --optimizer rmsprop --steps 1 --data synthetic:60",
                     "unknown optimizer 'rmsprop': expected sgd, momentum, adam or adagrad", 2);
  test::TempDir dir;
  test::writeFile(dir.file("c.toml"), "optimizer = \"rmsprop\"\nsteps = 1\ndata = \"synthetic:60\"\n");
  expectOneLineError("train --config " + dir.file("c.toml"), "unknown optimizer 'rmsprop'", 2);
}

TEST(Cli, UnknownModel) { expectOneLineError("train --model resnet --steps 1", "unknown model 'resnet'", 2); }

TEST(Cli, UnknownFlag) { expectOneLineError("train --bogus 3", "--bogus", 2); }

TEST(Cli, NegativeBatch) { expectOneLineError("train --batch -4 --steps 1", "--batch must be positive", 2); }

TEST(Cli, NotANumber) { expectOneLineError("train --lr fast", "--lr", 2); }

TEST(Cli, UnknownStrategy) {
  expectOneLineError("train --strategy telepathy --steps 1 --data synthetic:60", "--strategy: telepathy not in", 2);
}

TEST(Cli, MissingFashionMnistNamesTheDebianPackage) {
  expectOneLineError("train --steps 1", "apt-get install dataset-fashion-mnist", 1,
                     "COHORT_FASHION_MNIST_DIR=/nonexistent/fashion ");
}

TEST(Cli, MissingDataDirectory) {
  expectOneLineError("train --data mnist:/nonexistent/data --steps 1", "/nonexistent/data: no such directory");
}

void writeGzip(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  gzwrite(f, bytes.data(), unsigned(bytes.size()));
  gzclose(f);
}

TEST(Cli, TruncatedIdxFile) {
  test::TempDir dir;
  // A header that promises 10 images of 28x28 followed by only 100 bytes.
  std::string header{'\0', '\0', '\x08', '\x03', '\0', '\0', '\0', '\x0a', '\0', '\0', '\0', '\x1c', '\0', '\0', '\0', '\x1c'};
  writeGzip(dir.file("train-images-idx3-ubyte.gz"), header + std::string(100, 'x'));
  expectOneLineError("train --data mnist:" + dir.path() + " --steps 1", "truncated IDX file");
}

TEST(Cli, WrongMagicIdxFile) {
  test::TempDir dir;
  test::writeFile(dir.file("train-images-idx3-ubyte"), "GIF89a not an idx file");
  expectOneLineError("train --data mnist:" + dir.path() + " --steps 1", "wrong magic");
}

TEST(Cli, NotATorchScriptFile) {
  test::TempDir dir;
  test::writeFile(dir.file("model.pt"), "definitely not torchscript");
  expectOneLineError("train --model " + dir.file("model.pt") + " --data synthetic:60 --batch 16 --steps 1",
                     dir.file("model.pt") + ": not a TorchScript module");
}

TEST(Cli, UnknownConfigKey) {
  test::TempDir dir;
  test::writeFile(dir.file("c.toml"), "batch = 32\nlearning_speed = 3\n");
  expectOneLineError("train --config " + dir.file("c.toml"), "learning_speed", 2);
}

TEST(Cli, ConfigFileSetsOptions) {
  test::TempDir dir;
  test::writeFile(dir.file("c.toml"), "model = \"mlp\"\ndata = \"synthetic:120\"\nsteps = 3\nbatch = 8\nprogress = \"off\"\n");
  auto r = test::runCommand(test::cohortBinary() + " train --config " + dir.file("c.toml") + " --threads 1");
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("done: 3 steps"), std::string::npos) << r.output;
}

TEST(Cli, ResumeWithOnlyCorruptCheckpointsNamesThem) {
  test::TempDir dir;
  test::writeFile(dir.file("ckpt-0000000004.ckpt"), "COHORTCK garbage");
  expectOneLineError("train --data synthetic:60 --batch 16 --steps 5 --checkpoint-dir " + dir.path() + " --resume",
                     "no readable checkpoint in " + dir.path());
}

// A new run among an earlier run's checkpoints is refused: its own were pruned as it wrote them
// (the earlier run's steps were higher), and a later --resume took up the earlier run.
TEST(Cli, ANewRunAmongAnEarlierRunsCheckpointsIsRefused) {
  test::TempDir dir;
  const std::string train =
      "train --model mlp --data synthetic:200 --batch 8 --threads 1 --progress off "
      "--checkpoint-every 5 --checkpoint-dir " +
      dir.path();
  auto first = test::runCommand(test::cohortBinary() + " " + train + " --steps 10", 120);
  ASSERT_EQ(first.exitCode, 0) << first.output;
  expectOneLineError(train + " --steps 5", "--checkpoint-dir " + dir.path() +
                                               " holds checkpoints of an earlier run (the newest " +
                                               dir.file("ckpt-0000000010.ckpt") + ", step 10): --resume goes on");
  EXPECT_TRUE(std::filesystem::exists(dir.file("ckpt-0000000010.ckpt")));
}

// --save-model of a model of bags of ids trained every step and then failed on a torch error
// ("Dimension out of range"), losing the done event: it is refused before training.
TEST(Cli, SaveModelOfBagsIsRefusedBeforeTraining) {
  test::TempDir dir;
  expectOneLineError(
      "train --model embed:rows=1000 --data synthetic-bags:600,1000 --steps 2 --batch 8 --progress off "
      "--save-model " +
          dir.file("m.pt"),
      "--save-model: a model of bags of ids (--data synthetic-bags:600,1000) cannot be written");
  EXPECT_FALSE(std::filesystem::exists(dir.file("m.pt")));
}

// COHORT_LAUNCH_FD inherited without the launcher's pipe (here fd 3 is a file this process was
// given): the launcher's lines ("port none", the fault policy) were written into it.
TEST(Cli, ALaunchChannelThatIsNoPipeIsNotWrittenTo) {
  test::TempDir dir;
  test::writeFile(dir.file("file"), "");
  auto r = test::runCommand("env COHORT_LAUNCH_FD=3 " + test::cohortBinary() +
                                " train --model mlp --data synthetic:60 --steps 1 --batch 8 --threads 1 --progress off "
                                "3>>" +
                                dir.file("file"),
                            120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_EQ(test::readFile(dir.file("file")), "");
}

// A resumed run's --lr applies (LibTorch's Optimizer::load put the checkpoint's back, silently).
TEST(Cli, ResumeTakesTheRunsLearningRate) {
  test::TempDir dir;
  const std::string train = test::cohortBinary() +
                            " train --model mlp --data synthetic:200 --batch 8 --threads 1"
                            " --progress off --optimizer momentum --checkpoint-dir ";
  auto first = test::runCommand(train + dir.path() + " --steps 5 --lr 0.05", 120);
  ASSERT_EQ(first.exitCode, 0) << first.output;
  std::filesystem::copy(dir.path(), dir.file("again"));
  auto same = test::runCommand(train + dir.path() + " --steps 10 --lr 0.05 --resume", 120);
  auto other = test::runCommand(train + dir.file("again") + " --steps 10 --lr 0.5 --resume", 120);
  ASSERT_EQ(same.exitCode, 0) << same.output;
  ASSERT_EQ(other.exitCode, 0) << other.output;
  EXPECT_EQ(same.output.find("learning rate"), std::string::npos) << same.output;
  EXPECT_NE(other.output.find("cohort: the checkpoint's learning rate was 0.05; this run's --lr 0.5 applies"),
            std::string::npos)
      << other.output;
  const auto done = [](const std::string& out) {  // "done: ... test loss L" (not the speed)
    const size_t from = out.find("done:");
    return out.substr(from, out.find(',', out.find("test loss", from)) - from);
  };
  EXPECT_NE(done(same.output), done(other.output)) << "the resumed run trained at the checkpoint's learning rate";
}

// A quick run, so that a flag that is wrongly accepted ends in "done" rather than in a timeout.
const std::string kQuickRun = "train --model mlp --data synthetic:60 --batch 8 --steps 1 --progress off --threads 1 ";

TEST(Cli, StepsBeyondTheLimitNamesTheRange) {
  expectOneLineError(kQuickRun + "--steps 1e23", "--steps: Value 1e23 not in range 1 to 1000000000000", 2);
  expectOneLineError(kQuickRun + "--steps 100000000000000000000000",
                     "--steps: Value 100000000000000000000000 not in range 1 to 1000000000000", 2);
}

TEST(Cli, NegativeSeedIsRefused) {
  expectOneLineError(kQuickRun + "--seed -1", "--seed: Value -1 is not a seed: a whole number in 0..18446744073709551615",
                     2);
}

TEST(Cli, EmptySaveModelPathIsRefused) {
  expectOneLineError(kQuickRun + "--save-model ''", "--save-model needs a file to write the model to", 2);
}

TEST(Cli, ConfigKeyWithoutAValueNamesTheFile) {
  test::TempDir dir;
  test::writeFile(dir.file("c.toml"), "model = \"mlp\"\nbatch =\n");
  expectOneLineError("train --config " + dir.file("c.toml"), dir.file("c.toml") + ": key 'batch' has no value", 2);
}

// A 10 MB value is refused naming the file, and the message shows only its beginning.
TEST(Cli, ConfigValueOfTenMegabytesNamesTheFileAndEchoesAPrefix) {
  test::TempDir dir;
  test::writeFile(dir.file("c.toml"), "steps = 1\ndata = \"" + std::string(10'000'000, 'A') + "\"\n");
  auto r = test::runCommand(test::cohortBinary() + " train --config " + dir.file("c.toml"), 120);
  EXPECT_EQ(r.exitCode, 2) << r.output.substr(0, 300);
  EXPECT_LT(r.output.size(), 400u) << r.output.substr(0, 300);
  EXPECT_NE(r.output.find("cohort: error: " + dir.file("c.toml") + ": key 'data' has a value of 10000000 bytes"),
            std::string::npos)
      << r.output.substr(0, 300);
}

// A directory would open as an empty config; a second --config, or an empty one, would be read
// by nobody: each is refused in one line.
TEST(Cli, ConfigThatIsADirectoryTwiceOrEmptyIsRefused) {
  test::TempDir dir;
  test::writeFile(dir.file("a.toml"), "steps = 1\n");
  test::writeFile(dir.file("b.toml"), "steps = 2\n");
  expectOneLineError("train --config " + dir.path(),
                     "--config " + dir.path() + ": is a directory, not a file; --config takes a TOML file", 2);
  expectOneLineError("train --config " + dir.file("a.toml") + " --config=" + dir.file("b.toml"),
                     "--config is given twice (" + dir.file("a.toml") + " and " + dir.file("b.toml") + ")", 2);
  expectOneLineError("train --config=", "--config needs a file", 2);
}

// A directory where a file is expected is said before training, in one line.
TEST(Cli, ADirectoryWhereAFileGoesIsNamed) {
  test::TempDir dir;
  expectOneLineError(kQuickRun + "--save-model " + dir.path(), "--save-model " + dir.path() + ": is a directory", 2);
  expectOneLineError(kQuickRun + "--model " + dir.path(), dir.path() + ": is a directory, not a TorchScript file");
  expectOneLineError("train --steps 1 --data libsvm:" + dir.path(), dir.path() + ": is a directory, not a data file");
  expectOneLineError(kQuickRun + "--save-model " + dir.file("none/m.pt"), "the directory " + dir.file("none"), 2);
  // ... but --checkpoint-dir, which the run makes, may hold the model.
  auto r = test::runCommand(test::cohortBinary() + " " + kQuickRun + "--checkpoint-dir " + dir.file("ck") +
                            " --save-model " + dir.file("ck/m.pt"));
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_TRUE(std::filesystem::is_regular_file(dir.file("ck/m.pt"))) << r.output;
}

// --steps 0 would be "not given" and train the default epoch.
TEST(Cli, ZeroStepsIsRefused) { expectOneLineError("train --steps 0", "--steps: Value 0 not in range 1 to", 2); }

// --replicas 0 would be "not given": the scheme's default (mirrored: the cores).
TEST(Cli, ZeroReplicasIsRefused) {
  expectOneLineError(kQuickRun + "--strategy mirrored --replicas 0", "--replicas: Value 0 not in range 1 to", 2);
}

// A flag of another scheme did nothing, silently: --replicas 4 under local trained one replica.
// Refused, naming where it acts; --codec none is every run's and passes.
TEST(Cli, AFlagOfAnotherSchemeIsRefused) {
  expectOneLineError(kQuickRun + "--strategy local --replicas 4",
                     "--replicas does not apply to --strategy local: it acts under --strategy pipeline, mirrored, "
                     "central or hogwild only; drop --replicas",
                     2);
  expectOneLineError(kQuickRun + "--strategy allreduce --period 4",
                     "--period does not apply to --strategy allreduce: it acts under --strategy average only", 2);
  expectOneLineError(kQuickRun + "--strategy mirrored --replicas 2 --micro-batches 2",
                     "--micro-batches does not apply to --strategy mirrored", 2);
  expectOneLineError(kQuickRun + "--strategy average --gossip-peers 1", "--gossip-peers does not apply", 2);
  expectOneLineError(kQuickRun + "--strategy ps --ps-mode sync --softsync 2",
                     "--softsync does not apply to --ps-mode sync: it acts under --ps-mode softsync only", 2);
  expectOneLineError(kQuickRun + "--strategy ps --staleness-bound 3",
                     "--staleness-bound does not apply to --ps-mode async: it acts under --ps-mode ssp only", 2);
  auto r = test::runCommand(test::cohortBinary() + " " + kQuickRun + "--strategy local --codec none", 120);
  EXPECT_EQ(r.exitCode, 0) << r.output;
}

// --momentum beside sgd, adam or adagrad, and --outer-momentum beside the outer sgd, did nothing.
TEST(Cli, MomentumWithoutAMomentumOptimizerIsRefused) {
  expectOneLineError(kQuickRun + "--optimizer sgd --momentum 0.5",
                     "--momentum is the momentum optimizer's, and --optimizer sgd has none: give --optimizer "
                     "momentum or drop --momentum",
                     2);
  expectOneLineError(kQuickRun + "--optimizer adam --momentum 0.5", "--optimizer adam has none", 2);
  expectOneLineError(kQuickRun + "--strategy average --outer-momentum 0.5",
                     "--outer-momentum is the outer optimizer's momentum, and --outer-optimizer sgd has none", 2);
}

TEST(Cli, HelpListsTheTrainOptions) {
  auto r = test::runCommand(test::cohortBinary() + " train --help");
  EXPECT_EQ(r.exitCode, 0);
  for (const char* flag : {"--model", "--data", "--epochs", "--steps", "--batch", "--lr", "--optimizer",
                           "--threads", "--seed", "--eval-every", "--target-accuracy", "--checkpoint-dir",
                           "--resume", "--metrics", "--strategy", "--config"}) {
    EXPECT_NE(r.output.find(flag), std::string::npos) << flag;
  }
}

}  // namespace
}  // namespace cohort::cli_test
