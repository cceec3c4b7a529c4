// Everything a run is configured by, one struct per subsystem, each class
// taking only its own. Users address every field by one flat key name (the
// table in train_config.cpp), in a YAML file or as key=value overrides.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "config/choices.h"
#include "config/model_config.h"

namespace noloco {

struct DataConfig {
  std::string path = "data/tinyshakespeare.txt";  // key `data`: text, or token files (see data/token_stream.h)
  std::string val_path;                           // key `val_data`: else the tail of `data`
  std::string tokenizer = "char";                 // char | bpe | path to a sentencepiece .model
  int64_t vocab_size = 0;                         // BPE size to train, or the vocabulary of a token file
  double val_fraction = 0.1;
  bool raw_tokens = false;           // token files are nanoGPT's bare uint16 ids (no llm.c header)
  bool accept_changed_data = false;  // resume although the data changed since the run started
  // init_from's directory when no tokenizer is named: its tokenizer, if it
  // holds one, is the run's (data/dataset.h looks; a config does not read files).
  std::string model_dir;
};

// The inner optimizer (AdamW), its schedule, and the batch it steps on.
struct InnerConfig {
  int64_t batch = 12;      // sequences per micro-batch per replica
  int64_t grad_accum = 1;  // micro-batches per step
  int64_t steps = 2000;
  int64_t warmup = 100;
  int64_t decay_steps = 0;  // 0: decay over all steps
  double lr = 1e-3;
  double min_lr = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.99;
  double weight_decay = 0.1;
  double clip = 1.0;  // global gradient norm; 0 disables
};

// The outer method wrapped around the inner optimizer (optim/).
struct OuterConfig {
  Method method = Method::none;
  int64_t interval = 0;         // H; 0: 100 for diloco, 50 for noloco
  double momentum = -1;         // α; < 0: 0.3 for diloco, 0.5 for noloco
  double lr = 0.7;              // β
  double gamma = -1;            // γ; < 0: equal to β
  int64_t group_size = 2;       // n
  // The wire format of DiLoCo's and NoLoCo's messages (optim/channels.h).
  CodecSpec::Type wire_dtype = CodecSpec::Type::fp32;
  double topk = 0;                  // fraction of each 4096-value chunk sent; 0: dense
  int64_t message_rank = 0;         // Δ's matrices as rank-r factors (optim/low_rank.h); 0: whole
  bool error_feedback = true;       // what a lossy codec drops from Δ is sent next time
  double error_feedback_decay = 1;  // e ← decay·e + Δ before each message (SparseLoCo's β)
  int64_t quant_block = 64;         // values sharing one int8/int4 scale
  bool stochastic_rounding = false;
  // automatic: all_gather with message_rank, else reduce_scatter.
  DilocoMean diloco_mean = DilocoMean::automatic;
  // weights (diloco, all_gather): θ ← φ + decay·(what this replica's message left out).
  ResidualHome residual = ResidualHome::message;
  // The preset that set the codec keys above (a key given with it overrides it).
  OuterCompression compression = OuterCompression::none;
  // automatic: theta when γ = β and the codec is fp32 or bf16, else delta_phi.
  NolocoMessage message = NolocoMessage::automatic;
  // codec: the codec above, without error feedback; coset: phi_bits a value.
  // automatic: codec for a lossless codec, else coset.
  PhiCoding phi_coding = PhiCoding::automatic;
  int64_t phi_bits = 4;
  int64_t phi_every = 1;  // φ travels (and pulls) every phi_every-th outer step; 0: never
  // Schedules (optim/slow_weights.h): the weights in `fragments` slices
  // synchronised at staggered steps; exchanges overlapped with the next period,
  // with `eager`: each replica stepping with its own Δ meanwhile.
  int64_t fragments = 1;
  bool overlap = false;
  bool eager = false;
  PaceMode pace = PaceMode::steps;
  // NoLoCo with pace=speed: how long a replica waits at an outer step for a
  // partner alive but late, as a share of its own last period's time; then
  // it steps without it (comm/transport/meeting.h). 0: until the partner is
  // given up (peer_timeout, or its heartbeat).
  double partner_wait = 0;
};

// The network: where to listen, how long to wait for whom.
struct CommConfig {
  std::string bind = "127.0.0.1";
  // The port this worker's links are dialed at (each local worker the next
  // one up), and the address other machines reach it at (a forwarded port,
  // a public address): comm/link/link_endpoint.h. 0 and empty: any port,
  // reached at bind.
  int64_t listen_port = 0;
  std::string advertise;  // HOST or HOST:PORT
  double peer_timeout = 60;
  bool seal = true;  // comm/transport/seal.h
  // Publish a small sealed status into the run's store at most once a second, for the live page (comm/view/).
  bool live_status = true;
  bool insecure = false;  // seal=false is accepted off loopback only with it (comm/launch/worker_connections.cpp)
  double heartbeat_timeout = 30;  // seconds without a heartbeat before a worker counts as hung
  double startup_timeout = 30;    // seconds a launched worker may take to its first heartbeat (>= heartbeat_timeout)
  double store_outage = 600;      // seconds a worker trains on without the run's store before it ends (checkpoint, summary)
  int64_t restarts = 0;           // times the launcher restarts a failed worker, which rejoins from a live peer
  // The local launcher puts every worker behind a link capped at this rate
  // each way ("10mbit"; comm/launch/capped_links.h; root only). Empty: no cap.
  std::string rate;
  // This machine's upload speed ("20mbit"): its links that cross it leave at
  // 95% of it, so its router's queue stays empty (comm/link/uplink_share.h).
  // Empty: at TCP's own pace.
  std::string uplink;
};

struct PipelineConfig {
  int64_t stages = 1;
  std::string stage_layers;         // layer counts per stage, "3,5"; empty: balanced
  Routing routing = Routing::random;
  Schedule schedule = Schedule::gpipe;
  // Training traffic between stages (pipeline/activation_channel.h); evaluations stay exact.
  // int8: 3.9x fewer bytes than fp32 and free on every corpus measured (docs/pipeline.md).
  CodecSpec::Type activation_codec = CodecSpec::Type::int8;
  std::optional<CodecSpec::Type> activation_grad_codec;  // unset (same): as the activations; resolved with the config
  bool activation_rotation = true;  // integer codes: Hadamard-rotate each block first
  int64_t activation_subspace = 0;  // K: residual-stream writes kept in a K-dim subspace (model/subspace.h); 0: off
  // The standard deviation of the embedding's frozen part (outside the span) in a seeded run; 0: the
  // initial embedding's own. Resolved from the width when unset; an imported model keeps its own (unset).
  std::optional<double> activation_subspace_token_std;
};

struct EvalConfig {
  int64_t interval = 250;  // key `eval_interval`
  int64_t batches = 20;    // key `eval_batches`
  // Steps between the evaluations across replicas (weight spread, the mean
  // model's loss: a weight all-reduce, costly on slow links); 0: at every
  // evaluation. Always at the last step.
  int64_t spread_interval = 0;
  // How many replicas those evaluations average: a group of every live
  // replica forms a full mesh, which at tens of replicas no longer forms
  // within a timeout, and whose cost grows with them; 0: all.
  int64_t spread_replicas = 8;
  int64_t log_interval = 10;
  int64_t sample_tokens = 200;
  std::string sample_prompt = "\n";
};

struct RunConfig {
  uint64_t seed = 1337;
  std::string device = "cpu";      // cpu | cuda | cuda:N
  Precision precision = Precision::fp32;  // bf16: autocast, CUDA only
  int64_t threads = 0;             // intra-op threads; 0: cores / local workers
  // A slow machine on purpose: each inner step stretched by a factor, "F" for
  // every worker started, or "R:F,R:F" by replica (slowdown_of).
  std::string slowdown;
  std::string out;                 // run directory; default runs/<method>-<time>
  int64_t checkpoint_interval = 0;  // 0: at every evaluation
  int64_t keep_checkpoints = 0;     // newest checkpoints kept per worker; 0: all
  bool resume = false;
  int64_t replicas = 1;
  // Workers per replica (data parallel inside it: gradients averaged every
  // inner step over the replica's own group); the outer method runs between replicas.
  int64_t replica_workers = 1;
  // Local launcher: the most workers it starts; 0: what the machine can host
  // (8 per core, and memory).
  int64_t max_local_workers = 0;
  // Failure drills, "RANK:STEP[:checkpoint|:freeze]" or "RANK:startup", comma-separated; see CrashPoint.
  std::string inject_crash;
};

// A failure drill: worker `rank` is killed (SIGKILL) just before inner step
// `step`, or halfway through writing that step's checkpoint, or frozen
// (SIGSTOP) like a hung machine, or killed while starting, before it joins
// the run ("RANK:startup").
struct CrashPoint {
  enum class Mode { kill, kill_in_checkpoint, freeze, corrupt, diverge, stall, startup, freeze_at_startup, handover };
  int64_t rank = 0, step = 0;
  Mode mode = Mode::kill;
  double stall_seconds = 0;  // stall: how long the worker stands still, heartbeat on
};
// The factor by which `replica`'s steps are stretched under `spec` (run.slowdown): 1 when none is named.
// Throws std::invalid_argument on a malformed spec.
double slowdown_of(const std::string& spec, int64_t replica);

// Throws std::invalid_argument on a malformed plan.
std::vector<CrashPoint> parse_crash_plan(const std::string& plan);

// Layer ranges [first, end) of each pipeline stage: `spec` is a comma-
// separated list of layer counts ("3,5"), or empty for a balanced split
// (earlier stages take the remainder). Throws std::invalid_argument.
struct LayerRange {
  int64_t first = 0, end = 0;
};
std::vector<LayerRange> stage_layer_ranges(int64_t layers, int64_t stages, const std::string& spec);

struct TrainConfig {
  std::string preset = "tiny";  // key `model`; the model keys override its fields
  ModelConfig model = model_preset("tiny");
  // A Hugging Face Llama directory the run starts from: its shape (only
  // context may differ), its weights, and by default its tokenizer.
  std::string init_from;
  DataConfig data;
  InnerConfig inner;
  OuterConfig outer;
  CommConfig comm;
  PipelineConfig pipeline;
  EvalConfig eval;
  RunConfig run;

  // Fills method-dependent defaults (H, α, γ, decay_steps).
  void resolve();
  // Throws std::invalid_argument naming the first bad key.
  void validate() const;
  // What depends on the run's shape once it is known (replicas from
  // WORLD_SIZE under torchrun): group size, failure-drill ranks.
  void validate_workers() const;
  std::string to_yaml() const;
  // to_yaml without the keys each machine sets for itself (machine_keys()):
  // what every worker of a run must agree on.
  std::string run_yaml() const;
  int64_t workers() const { return run.replicas * pipeline.stages * run.replica_workers; }
};

// Every config key with its meaning and default, for --help.
std::string config_keys_help();
// The keys that configure an outer method and its network (method, seed, the
// outer keys and the comm keys): all a training loop other than ours (the
// Python module) can set.
std::vector<std::string> outer_method_keys();

// The keys a worker sets for its own machine (paths, device, threads,
// addresses, timeouts, logging): they may differ between a run's workers.
const std::vector<std::string>& machine_keys();
// Empty when `ours` and `run` (run_yaml()s) agree, else "key: ours here, run's in the run; ...".
std::string run_yaml_differences(const std::string& ours, const std::string& run);

// YAML file (may be empty: defaults) then overrides "key=value" in order.
// Throws std::invalid_argument on unknown keys, bad values or a bad file.
TrainConfig load_config(const std::string& yaml_path, const std::vector<std::string>& overrides);
// Same from YAML text (used by tests and the fuzzer).
TrainConfig parse_config(const std::string& yaml_text, const std::vector<std::string>& overrides,
                         const std::string& origin = "config");

}  // namespace noloco
