// TorchScript modules as cohort layers. A ScriptedLayer registers the scripted module's own
// parameter and buffer tensors (the same tensors, not copies) with torch::nn::Module, so the
// optimizer, the strategies and checkpoints see them like a built-in model's.
#include <cohort/error.h>
#include <cohort/models.h>

#include <torch/script.h>
#include <torch/torch.h>

#include <filesystem>

namespace cohort {

namespace {

std::string sanitize(std::string name) {
  for (char& c : name) {
    if (c == '.') c = '_';
  }
  return name;
}

// Cloneable (so that in-process replicas can copy it): clone() deep-copies the scripted module
// (reset) and then gives the copy's tensors the original's values.
struct ScriptedLayerImpl : torch::nn::Cloneable<ScriptedLayerImpl> {
  explicit ScriptedLayerImpl(torch::jit::Module module) : script(std::move(module)) { registerTensors(); }

  void reset() override {
    // The deep copy's tensors do not require gradients (clone() copies under NoGradGuard): the
    // originals say which do.
    std::vector<bool> trainable;
    for (const auto& p : script.named_parameters(/*recurse=*/true)) trainable.push_back(p.value.requires_grad());
    script = script.deepcopy();
    registerTensors(&trainable);
  }

  void registerTensors(const std::vector<bool>* trainable = nullptr) {
    size_t k = 0;
    for (const auto& p : script.named_parameters(/*recurse=*/true)) {
      const bool grad = trainable != nullptr && k < trainable->size() ? (*trainable)[k] : p.value.requires_grad();
      register_parameter(sanitize(p.name), p.value, grad);
      ++k;
    }
    for (const auto& b : script.named_buffers(/*recurse=*/true)) {
      register_buffer(sanitize(b.name), b.value);
    }
  }

  torch::Tensor forward(const torch::Tensor& x) {
    return script.forward({x}).toTensor();
  }

  void train(bool on) override {
    torch::nn::Cloneable<ScriptedLayerImpl>::train(on);
    script.train(on);
  }

  torch::jit::Module script;
};
TORCH_MODULE(ScriptedLayer);

bool isSequential(const torch::jit::Module& m) {
  const auto type = m.type()->name();
  return type && type->name() == "Sequential";
}

}  // namespace

torch::nn::Sequential loadScriptedModel(const std::string& path) {
  COHORT_CHECK(std::filesystem::exists(path), IoError, path, ": no such file");
  COHORT_CHECK(!std::filesystem::is_directory(path), IoError, path,
               ": is a directory, not a TorchScript file (make one with torch.jit.script(model).save(path))");
  torch::jit::Module module;
  try {
    module = torch::jit::load(path);
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    what = what.substr(0, what.find('\n'));
    throw IoError(path + ": not a TorchScript module (make one with torch.jit.script(model).save(path)): " + what);
  }
  COHORT_CHECK(module.find_method("forward").has_value(), IoError, path,
               ": the TorchScript module has no forward method");
  torch::nn::Sequential model;
  if (isSequential(module)) {
    for (const auto& child : module.named_children()) {
      model->push_back(std::string(child.name), ScriptedLayer(child.value));
    }
  }
  if (model->size() == 0) model->push_back(std::string("script"), ScriptedLayer(module));
  return model;
}

}  // namespace cohort
