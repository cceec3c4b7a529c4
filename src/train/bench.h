// Throughput of forward + backward + AdamW for a model shape.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "config/train_config.h"

namespace noloco {

// Times `steps` training steps (after 2 warm-up steps) on random tokens of a
// vocabulary of `config.data.vocab_size` (or 256). Returns tokens/s, achieved
// TFLOP/s, and model-FLOPs utilisation against the device's measured peak
// matmul rate (or `peak_tflops` when given).
nlohmann::json bench_training(const TrainConfig& config, int64_t steps, double peak_tflops);

}  // namespace noloco
