#include "model/generate.h"

namespace noloco {

std::vector<int32_t> generate(LlamaForCausalLM& model, std::vector<int32_t> ids,
                              const SamplingOptions& o) {
  torch::NoGradGuard no_grad;
  const auto device = model->parameters().front().device();
  auto gen = at::detail::createCPUGenerator(o.seed);
  if (ids.empty()) ids.push_back(0);
  for (int64_t i = 0; i < o.tokens; ++i) {
    const int64_t T = std::min<int64_t>(int64_t(ids.size()), model->config.context);
    std::vector<int64_t> window(ids.end() - T, ids.end());
    auto input = torch::tensor(window, torch::kInt64).view({1, T}).to(device);
    auto logits = model->forward(input).select(1, T - 1).squeeze(0).to(torch::kCPU, torch::kFloat32);
    int64_t next;
    if (o.temperature <= 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      logits = logits / o.temperature;
      if (o.top_k > 0 && o.top_k < logits.size(0)) {
        auto kth = std::get<0>(logits.topk(o.top_k)).min();
        logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
      }
      next = torch::multinomial(torch::softmax(logits, -1), 1, false, gen).item<int64_t>();
    }
    ids.push_back(int32_t(next));
  }
  return ids;
}

}  // namespace noloco
