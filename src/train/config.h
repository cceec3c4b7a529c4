// Everything a run is configured by. One flat namespace of keys, so a YAML
// file and `key=value` overrides on the command line address the same things.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "model/config.h"

namespace noloco {

struct TrainConfig {
  // data
  std::string data = "data/tinyshakespeare.txt";
  std::string val_data;            // separate validation token file; else the tail of `data`
  std::string tokenizer = "char";  // char | bpe | path to a sentencepiece .model
  int64_t vocab_size = 0;          // BPE size to train, or the vocabulary of a token file
  double val_fraction = 0.1;
  // model
  std::string model = "tiny";  // preset; the keys below override its fields
  ModelConfig arch = model_preset("tiny");
  // inner optimisation
  int64_t batch = 12;
  int64_t grad_accum = 1;
  int64_t steps = 2000;
  int64_t warmup = 100;
  int64_t decay_steps = 0;  // 0: decay over all steps
  double lr = 1e-3;
  double min_lr = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.99;
  double weight_decay = 0.1;
  double clip = 1.0;  // global gradient norm; 0 disables
  // evaluation and logging
  int64_t eval_interval = 250;
  int64_t eval_batches = 20;
  int64_t log_interval = 10;
  int64_t sample_tokens = 200;
  std::string sample_prompt = "\n";
  // run
  uint64_t seed = 1337;
  std::string device = "cpu";  // cpu | cuda | cuda:N
  std::string precision = "fp32";  // fp32 | bf16 (autocast, CUDA only)
  int64_t threads = 0;         // intra-op threads; 0: cores / local replicas
  std::string out;             // run directory; default runs/<method>-<time>
  int64_t checkpoint_interval = 0;  // 0: at every eval
  bool resume = false;
  // distributed (see optim/ and comm/)
  std::string method = "none";  // none | ddp | diloco | noloco
  int64_t replicas = 1;
  // pipeline (see pipeline/): each replica split into `stages` workers
  int64_t stages = 1;
  std::string stage_layers;       // layer counts per stage, "3,5"; empty: balanced
  std::string routing = "random";  // random | fixed: which replica of the next stage gets a micro-batch
  int64_t outer_interval = 0;   // H; 0: 100 for diloco, 50 for noloco
  double outer_momentum = -1;   // alpha; <0: 0.3 for diloco, 0.5 for noloco
  double outer_lr = 0.7;        // beta
  double gamma = -1;            // <0: equal to outer_lr
  int64_t group_size = 2;
  std::string wire_dtype = "fp32";  // fp32 | bf16
  std::string bind = "127.0.0.1";
  int64_t port = 0;  // store port; 0: pick a free one
  double peer_timeout = 60;
  int64_t restarts = 0;  // times the launcher restarts a failed noloco worker, which rejoins from a live peer
  double heartbeat_timeout = 30;  // seconds without a heartbeat before a worker counts as hung
  // Failure injection for tests and drills: "RANK:STEP[,RANK:STEP...]" kills
  // those workers with SIGKILL just before those inner steps; "RANK:STEP:checkpoint"
  // kills it halfway through writing the checkpoint of that step; "RANK:STEP:freeze"
  // stops the whole process (SIGSTOP), like a hung machine.
  std::string inject_crash;
  struct CrashPoint {
    enum class Mode { kill, kill_in_checkpoint, freeze };
    int64_t rank, step;
    Mode mode;
  };
  std::vector<CrashPoint> crash_plan() const;

  // Fills method-dependent defaults (H, alpha, gamma, decay_steps).
  void resolve();
  // Throws std::invalid_argument naming the first bad key.
  void validate() const;
  std::string to_yaml() const;
};

struct ConfigKey {
  std::string name, help;
};
std::vector<ConfigKey> config_keys();

// YAML file (may be empty: defaults) then overrides "key=value" in order.
// Throws std::invalid_argument on unknown keys, bad values or a bad file.
TrainConfig load_config(const std::string& yaml_path, const std::vector<std::string>& overrides);
// Same from YAML text (used by tests and the fuzzer).
TrainConfig parse_config(const std::string& yaml_text, const std::vector<std::string>& overrides,
                         const std::string& origin = "config");

}  // namespace noloco
