#include "train/model_file.h"

#include "base/files.h"
#include "base/text.h"

#include <cohort/error.h>

#include <ATen/native/quantized/PackedParams.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>

namespace cohort {

namespace {

constexpr const char* kQuantizedFormat = "int8-linear-v1";
// The largest model description a file may give: the model is made from it before the file's
// tensors are compared with it, and its layers grow with the image (the cnn's hidden layer is
// about 4096 weights per input value: 1 GB at this many, 1 x 256 x 256) and with the classes (as
// the libsvm reader's limit). The data sets cohort trains on have 784 to 3072 values per image.
constexpr int64_t kMaxInputValues = int64_t{1} << 16;
constexpr int64_t kMaxClasses = 4096;

// Every tensor of the model in a fixed order: parameters, then buffers.
std::vector<torch::Tensor> modelTensors(torch::nn::Sequential& model) {
  std::vector<torch::Tensor> out;
  for (const auto& p : model->named_parameters()) out.push_back(p.value());
  for (const auto& b : model->named_buffers()) out.push_back(b.value());
  return out;
}

// For each tensor of modelTensors(): the index of the child whose Linear weight it is, or -1.
std::vector<int64_t> linearWeightOwners(torch::nn::Sequential& model, const std::vector<torch::Tensor>& tensors) {
  std::vector<int64_t> owner(tensors.size(), -1);
  for (size_t child = 0; child < model->size(); ++child) {
    auto linear = model->ptr(child)->as<torch::nn::Linear>();
    if (linear == nullptr) continue;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].is_same(linear->weight)) owner[i] = int64_t(child);
    }
  }
  return owner;
}

void writeDescription(torch::serialize::OutputArchive& archive, const std::string& spec, const InputShape& s) {
  archive.write("cohort_model", c10::IValue(spec));
  archive.write("cohort_shape", c10::IValue(std::vector<int64_t>{s.channels, s.height, s.width, s.classes}));
}

// A Linear layer run by libtorch's dynamic int8 kernel: the activations are quantized per batch,
// the weights were quantized once.
struct QuantizedLinearImpl : torch::nn::Module {
  explicit QuantizedLinearImpl(c10::intrusive_ptr<LinearPackedParamsBase> packed) : packed_(std::move(packed)) {}
  torch::Tensor forward(const torch::Tensor& x) { return packed_->apply_dynamic(x.contiguous(), false); }
  c10::intrusive_ptr<LinearPackedParamsBase> packed_;
};
TORCH_MODULE(QuantizedLinear);

}  // namespace

void saveModelFile(torch::nn::Sequential& model, const std::string& spec, const InputShape& shape,
                   const std::string& path) {
  try {
    torch::serialize::OutputArchive archive;
    model->save(archive);
    writeDescription(archive, spec, shape);
    replaceFile(path, [&](const std::string& tmp) { archive.save_to(tmp); });
  } catch (const c10::Error& e) {
    throw IoError(path + ": cannot save the model: " + firstLine(e.what_without_backtrace()));
  }
}

ModelFile loadModelFile(const std::string& path) {
  COHORT_CHECK(std::filesystem::is_regular_file(path), IoError, path, ": no such model file");
  ModelFile file;
  file.path = path;
  torch::serialize::InputArchive archive;
  c10::IValue value;
  // Not only c10::Error: in libtorch 2.x a missing key, and TorchScript's reader of a garbled
  // archive's code, throw exceptions of their own.
  try {
    archive.load_from(path, torch::Device(torch::kCPU));  // written on any device, read on the CPU
  } catch (const std::exception&) {
    throw IoError(path + ": not a model file (not a torch archive): give a file written by cohort train --save-model");
  }
  std::vector<int64_t> s;
  std::string format;
  try {
    archive.read("cohort_model", value);
    file.spec = value.toStringRef();
    archive.read("cohort_shape", value);
    s = value.toIntVector();
    file.quantized = archive.try_read("cohort_format", value);
    if (file.quantized) format = value.toStringRef();
  } catch (const std::exception&) {
    throw IoError(path + ": a torch archive without cohort's model description: give a file written by "
                  "cohort train --save-model");
  }
  COHORT_CHECK(s.size() == 4, IoError, path, ": cohort_shape has ", s.size(), " entries, expected 4");
  const bool fits = s[0] >= 1 && s[1] >= 1 && s[2] >= 1 && s[0] <= kMaxInputValues && s[1] <= kMaxInputValues &&
                    s[2] <= kMaxInputValues && s[0] * s[1] <= kMaxInputValues && s[0] * s[1] * s[2] <= kMaxInputValues &&
                    s[3] >= 1 && s[3] <= kMaxClasses;
  COHORT_CHECK(fits, IoError, path, ": cohort_shape [", s[0], ", ", s[1], ", ", s[2], ", ", s[3],
               "] is not a model cohort makes (channels x height x width at most ", kMaxInputValues, ", 1 to ",
               kMaxClasses, " classes): give a file written by cohort train --save-model");
  file.shape = {s[0], s[1], s[2], s[3]};
  COHORT_CHECK(!file.quantized || format == kQuantizedFormat, IoError, path, ": quantized format '", format,
               "' is not one this build reads (", kQuantizedFormat, ")");
  try {
    file.model = makeModel(file.spec, file.shape);
  } catch (const std::exception& e) {
    throw IoError(path + ": cohort_model '" + file.spec.substr(0, 200) + "' does not make a model: " +
                  firstLine(e.what()));
  }
  try {
    if (!file.quantized) {
      file.model->load(archive);
    } else {
      torch::NoGradGuard noGrad;
      const std::vector<torch::Tensor> tensors = modelTensors(file.model);
      const std::vector<int64_t> owner = linearWeightOwners(file.model, tensors);
      file.int8Weights.resize(file.model->size());
      file.scales.resize(file.model->size());
      for (size_t i = 0; i < tensors.size(); ++i) {
        torch::Tensor stored;
        if (owner[i] < 0) {
          archive.read("p" + std::to_string(i), stored);
          tensors[i].copy_(stored);
          continue;
        }
        torch::Tensor q, scale;
        archive.read("q" + std::to_string(i), q);
        archive.read("s" + std::to_string(i), scale);
        COHORT_CHECK(q.scalar_type() == torch::kInt8 && q.sizes() == tensors[i].sizes() && scale.dim() == 1 &&
                         scale.size(0) == q.size(0),
                     IoError, path, ": the int8 weight of layer ", owner[i], " does not fit the model");
        tensors[i].copy_(q.to(torch::kFloat32) * scale.unsqueeze(1));
        file.int8Weights[size_t(owner[i])] = q;
        file.scales[size_t(owner[i])] = scale;
      }
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw IoError(path + ": the model file does not fit its model (" + file.spec + "): " + firstLine(e.what()));
  }
  file.model->eval();
  return file;
}

int quantizeModelFile(const ModelFile& floatModel, const std::string& outPath) {
  COHORT_CHECK(!floatModel.quantized, InvalidArgument, floatModel.path, " is quantized already");
  torch::NoGradGuard noGrad;
  torch::nn::Sequential model = floatModel.model;
  const std::vector<torch::Tensor> tensors = modelTensors(model);
  const std::vector<int64_t> owner = linearWeightOwners(model, tensors);
  // Refused before anything is written: an existing file at outPath stays as it was.
  COHORT_CHECK(std::any_of(owner.begin(), owner.end(), [](int64_t o) { return o >= 0; }), InvalidArgument,
               floatModel.path, " (", floatModel.spec, ") has no torch::nn::Linear layer to quantize");
  int quantized = 0;
  try {
    torch::serialize::OutputArchive archive;
    writeDescription(archive, floatModel.spec, floatModel.shape);
    archive.write("cohort_format", c10::IValue(std::string(kQuantizedFormat)));
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (owner[i] < 0) {
        archive.write("p" + std::to_string(i), tensors[i].detach(), /*is_buffer=*/true);
        continue;
      }
      // Symmetric per-row scale: the row's largest |w| maps to 127.
      const torch::Tensor w = tensors[i].detach();
      torch::Tensor scale = w.abs().amax(1).div(127.0f).clamp_min(1e-12f);
      torch::Tensor q = w.div(scale.unsqueeze(1)).round().clamp(-127, 127).to(torch::kInt8);
      archive.write("q" + std::to_string(i), q, /*is_buffer=*/true);
      archive.write("s" + std::to_string(i), scale, /*is_buffer=*/true);
      ++quantized;
    }
    replaceFile(outPath, [&](const std::string& tmp) { archive.save_to(tmp); });
  } catch (const c10::Error& e) {
    throw IoError(outPath + ": cannot write the quantized model: " + firstLine(e.what_without_backtrace()));
  }
  return quantized;
}

std::string quantizedEngine() {
  const auto& engines = at::globalContext().supportedQEngines();
  for (const auto& [engine, name] : {std::pair{at::QEngine::ONEDNN, "onednn"}, std::pair{at::QEngine::FBGEMM, "fbgemm"},
                                     std::pair{at::QEngine::QNNPACK, "qnnpack"}}) {
    if (std::find(engines.begin(), engines.end(), engine) != engines.end()) {
      at::globalContext().setQEngine(engine);
      return name;
    }
  }
  return "";
}

int useQuantizedKernels(ModelFile& file) {
  COHORT_CHECK(file.quantized, InvalidArgument, file.path, " is not quantized");
  if (quantizedEngine().empty()) return 0;
  static const auto prepack =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("quantized::linear_prepack", "")
          .typed<c10::intrusive_ptr<LinearPackedParamsBase>(at::Tensor, c10::optional<at::Tensor>)>();
  torch::nn::Sequential replaced;
  int count = 0;
  size_t child = 0;
  for (const auto& layer : *file.model) {
    const std::string name = std::to_string(child);
    auto linear = file.model->ptr(child)->as<torch::nn::Linear>();
    if (linear == nullptr || !file.int8Weights[child].defined()) {
      replaced->push_back(name, layer);
    } else {
      const torch::Tensor scales = file.scales[child].to(torch::kDouble);
      const torch::Tensor zeros = torch::zeros({scales.size(0)}, torch::kLong);
      const torch::Tensor q = at::_make_per_channel_quantized_tensor(file.int8Weights[child], scales, zeros, 0);
      c10::optional<at::Tensor> bias;
      if (linear->bias.defined()) bias = linear->bias.detach();
      replaced->push_back(std::string(name), QuantizedLinear(prepack.call(q, bias)));
      ++count;
    }
    ++child;
  }
  file.model = replaced;
  file.model->eval();
  return count;
}

}  // namespace cohort
