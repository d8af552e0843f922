#include <cohort/error.h>
#include <cohort/models.h>
#include "train/model_file.h"

#include <torch/torch.h>

#include "test_util.h"

namespace cohort::models_test {
namespace {

const InputShape kShape{1, 28, 28, 10};

TEST(Models, BuiltInsHaveTheDocumentedShapes) {
  torch::manual_seed(0);
  auto x = torch::rand({4, 1, 28, 28});
  for (const char* name : {"mlp", "cnn", "lstm"}) {
    auto model = makeModel(name, kShape);
    EXPECT_EQ(model->forward(x).sizes(), (std::vector<int64_t>{4, 10})) << name;
  }
  // 784-512-512-10 with biases.
  EXPECT_EQ(parameterCount(*makeModel("mlp", kShape)), 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10);
  // conv 32 5x5, conv 64 5x5, dense 1024 over 64x4x4, dense 10.
  EXPECT_EQ(parameterCount(*makeModel("cnn", kShape)),
            (25 * 32 + 32) + (25 * 32 * 64 + 64) + (1024 * 1024 + 1024) + (1024 * 10 + 10));
  // LSTM(28 -> 128) has 4 gates with two bias vectors, then dense 10.
  EXPECT_EQ(parameterCount(*makeModel("lstm", kShape)), 4 * 128 * (28 + 128) + 2 * 4 * 128 + 128 * 10 + 10);
}

TEST(Models, SameSeedSameParameters) {
  torch::manual_seed(42);
  auto a = makeModel("cnn", kShape);
  torch::manual_seed(42);
  auto b = makeModel("cnn", kShape);
  auto pa = a->parameters();
  auto pb = b->parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i]));
}

TEST(Models, UnknownModelIsRejected) {
  try {
    makeModel("resnet", kShape);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("unknown model 'resnet'"), std::string::npos);
  }
}

TEST(Models, NotTorchScriptIsRejectedWithItsPath) {
  test::TempDir dir;
  test::writeFile(dir.file("bad.pt"), "this is not a zip archive");
  try {
    makeModel(dir.file("bad.pt"), kShape);
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(dir.file("bad.pt") + ": not a TorchScript module"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(makeModel(dir.file("missing.pt"), kShape), IoError);
}

std::string makeScript(const test::TempDir& dir, const std::string& name, const std::string& flags) {
  const std::string path = dir.file(name);
  auto r = test::runCommand(test::python() + " " + test::sourceDir() + "/examples/make_torchscript.py " +
                            path + " " + flags);
  EXPECT_EQ(r.exitCode, 0) << r.output;
  return path;
}

// Scripted modules train like built-ins: their tensors are the ones the optimizer steps.
void expectTrains(torch::nn::Sequential model) {
  torch::manual_seed(1);
  auto x = torch::rand({32, 1, 28, 28});
  auto y = torch::randint(10, {32});
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto lossAt = [&] { return torch::nn::functional::cross_entropy(model->forward(x), y); };
  const double before = lossAt().item<double>();
  for (int i = 0; i < 30; ++i) {
    opt.zero_grad();
    auto l = lossAt();
    l.backward();
    opt.step();
  }
  EXPECT_LT(lossAt().item<double>(), before * 0.5);
}

TEST(Models, ScriptedSequentialBecomesOneLayerPerChild) {
  test::TempDir dir;
  auto model = makeModel(makeScript(dir, "seq.pt", ""), kShape);
  EXPECT_EQ(model->size(), 6u);  // Flatten, Linear, ReLU, Linear, ReLU, Linear
  EXPECT_EQ(parameterCount(*model), 784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10);
  EXPECT_EQ(model->forward(torch::rand({3, 1, 28, 28})).sizes(), (std::vector<int64_t>{3, 10}));
  expectTrains(model);
}

TEST(Models, ScriptedCustomModuleIsOneLayerWithBuffers) {
  test::TempDir dir;
  auto model = makeModel(makeScript(dir, "custom.pt", "--custom"), kShape);
  EXPECT_EQ(model->size(), 1u);
  EXPECT_EQ(model->buffers().size(), 3u);  // BatchNorm: running mean, running var, batches seen
  expectTrains(model);
}

// A torch archive of a model without cohort_model and cohort_shape (torch::save of the Sequential):
// libtorch 2.x reports the missing key with an exception that is not a c10::Error.
TEST(ModelFile, AnArchiveWithoutCohortsKeysNamesTheFile) {
  test::TempDir dir;
  torch::nn::Sequential model(torch::nn::Linear(4, 3));
  torch::save(model, dir.file("plain.pt"));
  try {
    loadModelFile(dir.file("plain.pt"));
    FAIL() << "loaded a file without cohort's keys";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(dir.file("plain.pt") + ": a torch archive without cohort's model description"),
              std::string::npos)
        << e.what();
  } catch (const std::exception& e) {
    FAIL() << "not an IoError naming the file: " << e.what();
  }
}

// A description whose shape would make the model's layers gigabytes is refused before the model
// is made.
TEST(ModelFile, AShapeBeyondTheLimitIsRefusedBeforeTheModelIsMade) {
  test::TempDir dir;
  torch::nn::Sequential model(torch::nn::Linear(4, 3));
  torch::serialize::OutputArchive archive;
  model->save(archive);
  archive.write("cohort_model", c10::IValue(std::string("mlp")));
  archive.write("cohort_shape", c10::IValue(std::vector<int64_t>{1, 1000000, 1000, 10}));
  archive.save_to(dir.file("huge.pt"));
  try {
    loadModelFile(dir.file("huge.pt"));
    FAIL() << "accepted cohort_shape [1, 1000000, 1000, 10]";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(dir.file("huge.pt") + ": cohort_shape [1, 1000000, 1000, 10] is not a model "
                                                               "cohort makes"),
              std::string::npos)
        << e.what();
  } catch (const std::exception& e) {
    FAIL() << "not an IoError naming the file: " << e.what();
  }
}

// A model without a Linear layer is refused before the 8-bit file is written: the file at --out
// was replaced first, and then the command said there was nothing to quantize.
TEST(ModelFile, QuantizingAModelWithoutLinearLayersLeavesTheOutputAlone) {
  test::TempDir dir;
  test::writeFile(dir.file("out.pt"), "the user's file");
  ModelFile convolutions;
  convolutions.path = dir.file("conv.pt");
  convolutions.spec = "conv";
  convolutions.model = torch::nn::Sequential(torch::nn::Conv2d(1, 2, 3), torch::nn::Flatten());
  try {
    quantizeModelFile(convolutions, dir.file("out.pt"));
    FAIL() << "quantized a model without a Linear layer";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("has no torch::nn::Linear layer to quantize"), std::string::npos) << e.what();
  }
  EXPECT_EQ(test::readFile(dir.file("out.pt")), "the user's file");
}

}  // namespace
}  // namespace cohort::models_test
