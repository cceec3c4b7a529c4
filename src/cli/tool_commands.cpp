#include "cli/tool_commands.h"

#include <iostream>

#include <fmt/format.h>
#include <torch/torch.h>

#include "cli/keys_help.h"
#include "cli/launch_commands.h"
#include "config/options.h"
#include "config/train_config.h"
#include "data/prepare.h"
#include "model/generate.h"
#include "sim/simulate.h"
#include "train/bench.h"
#include "train/export.h"
#include "train/report.h"
#include "util/parse_number.h"
#include "util/process_runtime.h"

namespace noloco {

namespace {

constexpr const char* kReplicaHelp =
    "a run directory's model: best (the mean of its replicas' weights at their newest common checkpoint where the "
    "run's validation found it at least as good as its best replica, else that replica), mean, or a replica's number";

struct GenerateArgs {
  SamplingOptions sampling;
  std::string prompt = "\n", device = "cpu", replica = kBestModel;
};

Options generate_options(GenerateArgs& a) {
  Options options("generate");
  options.add("prompt", a.prompt, "text to continue")
      .add("temperature", a.sampling.temperature, "0: greedy")
      .add("top_k", a.sampling.top_k, "0: whole vocabulary")
      .add("seed", a.sampling.seed, "sampling seed")
      .add("tokens", a.sampling.tokens, "tokens to generate")
      .add("device", a.device, "cpu | cuda | cuda:N")
      .add("replica", a.replica, kReplicaHelp);
  return options;
}

struct ExportArgs {
  ExportOptions export_options;
  std::string shard_size = "2GB";
};

Options export_options(ExportArgs& a) {
  Options options("export");
  options.add("shard_size", a.shard_size, "largest weight file, e.g. 2GB, 500MB, 4GiB")
      .add("dtype", a.export_options.dtype,
           "float32 | bfloat16 | float16; empty: the model's it started from (init_from), else float32")
      .add("replica", a.export_options.replica, kReplicaHelp);
  return options;
}

Options prepare_options(PrepareOptions& o) {
  Options options("prepare");
  options.add("out", o.out, "output directory: train_*.bin and val_*.bin shards and the tokenizer")
      .add("tokenizer", o.tokenizer,
           "bpe (trained on the inputs) | a sentencepiece .model | a directory holding tokenizer.model or a "
           "byte-level BPE tokenizer.json (not char: a char vocabulary is built at training time from data=FILE.txt)")
      .add("vocab_size", o.vocab_size, "BPE vocabulary to train (260..65536)")
      .add("val_fraction", o.val_fraction, "held out for validation (the tail of every chunk)")
      .add("text_field", o.text_field, "the field of a .jsonl line that holds its document")
      .add("shard_tokens", o.shard_tokens, "tokens a shard (llm.c's fineweb: 100M)");
  return options;
}

struct ReportArgs {
  std::string out_dir, throughput;
  double target_loss = 0;
};

Options report_options(ReportArgs& a) {
  Options options("report");
  options.add("out", a.out_dir, "write report.md and plots here")
      .add("target_loss", a.target_loss, "also time each run to its first validation loss at most this (0: off)")
      .add("throughput", a.throughput, "FROM:TO: also tokens/s between these steps, and as a share of the first run's");
  return options;
}

Options simulate_options(sim::SimulateOptions& o) {
  Options options("simulate");
  options.add("out", o.out,
              "directory for latency.csv, bandwidth.csv, idle.csv, unequal.csv and the figures fig5a.svg, fig5b.svg")
      .add("samples", o.samples, "Monte-Carlo draws of message times per point of the latency figure (5A)")
      .add("outer_steps", o.outer_steps, "outer steps simulated per replica count for the idle-time table")
      .add("max_replicas", o.max_replicas,
           "the largest replica count simulated (from 4, by factors of 4; idle from 2, by 2)")
      .add("model", o.model,
           "model preset whose parameter count sizes the bandwidth table's messages: tiny, 125m, 1.3b, 6.8b")
      .add("step_seconds", o.step_seconds, "compute seconds of one inner step, against which idle time is measured")
      .add("speeds", o.speeds,
           "replica speeds for the unequal-machines table: 1,1,1,0.33 (repeated over the replicas) or lognormal:S "
           "(mean 1, the log's standard deviation S)")
      .add("late_bound", o.late_bound,
           "how long a paced NoLoCo replica waits for a late partner, as a share of a typical outer period")
      .add("seed", o.seed, "seed of the simulated message times and pairings");
  return options;
}

}  // namespace

std::string generate_keys_help() { return keys_help(generate_options); }
std::string export_keys_help() { return keys_help(export_options); }
std::string prepare_keys_help() { return keys_help(prepare_options); }
std::string report_keys_help() { return keys_help(report_options); }
std::string simulate_keys_help() { return keys_help(simulate_options); }


int generate_command(const std::string& checkpoint, const std::vector<std::string>& args) {
  GenerateArgs a;
  generate_options(a).parse(args);
  const auto& o = a.sampling;
  constexpr int64_t kMaxTokens = 1000000;
  if (o.temperature < 0 || o.top_k < 0 || o.tokens < 0 || o.tokens > kMaxTokens)
    throw std::invalid_argument(fmt::format("temperature and top_k must be >= 0, tokens in [0, {}]", kMaxTokens));
  auto trained = load_trained_model(checkpoint, a.replica);
  // Only a choice the user may not expect is said: the text goes to stdout.
  if (trained.replica_over_mean) fmt::print(stderr, "generating with {}\n", trained.which);
  trained.model->to(torch::Device(a.device));
  const auto prompt = trained.tokenizer->encode(a.prompt);
  const auto context = trained.model->config.context;
  if (int64_t(prompt.size()) > context)
    fmt::print(stderr, "the prompt's {} tokens are more than the model's context ({}): it sees the last {}\n",
               prompt.size(), context, context);
  const auto ids = generate(trained.model, prompt, o);
  std::cout << trained.tokenizer->decode(ids) << std::endl;
  return 0;
}

int bench_command(const std::vector<std::string>& args) {
  if (!args.empty() && args[0] == "comm") return bench_comm_command({args.begin() + 1, args.end()});
  reexecute_for_runtime_settings();
  int64_t steps = 10;
  double peak = 0;
  Options options("bench");
  options.add("bench_steps", steps, "timed steps").add("peak_tflops", peak, "peak rate; 0: measure the matmul rate");
  const auto cfg = parse_config("", options.parse_known(args));
  if (steps < 1 || peak < 0) throw std::invalid_argument("bench_steps must be >= 1 and peak_tflops >= 0");
  const auto r = bench_training(cfg, steps, peak);
  fmt::print("bench {} ({} params) on {} in {}: batch {} x {} tokens, {} threads\n", r["model"].get<std::string>(),
             r["params"].get<int64_t>(), r["device"].get<std::string>(), r["precision"].get<std::string>(),
             r["batch"].get<int64_t>(), r["context"].get<int64_t>(), r["threads"].get<int>());
  fmt::print("  {:.0f} tokens/s (forward+backward+AdamW), {:.3f} TFLOP/s, MFU {:.1f}% of {:.2f} TFLOP/s ({})\n",
             r["tokens_per_s"].get<double>(), r["achieved_tflops"].get<double>(), 100 * r["mfu"].get<double>(),
             r["peak_tflops"].get<double>(), r["peak_source"].get<std::string>());
  std::cout << r.dump() << std::endl;
  return 0;
}

int export_command(const std::string& checkpoint, const std::string& hf_dir, const std::vector<std::string>& args) {
  ExportArgs a;
  export_options(a).parse(args);
  a.export_options.shard_bytes = parse_byte_size("shard_size", a.shard_size);
  const auto exported = export_hf(checkpoint, hf_dir, a.export_options);
  fmt::print("exported {} ({}) to {}\n", checkpoint, exported.model, hf_dir);
  if (!exported.config.empty()) fmt::print("{}\n", exported.config);
  return 0;
}

int prepare_command(const std::vector<std::string>& args) {
  PrepareOptions o;
  o.inputs = prepare_options(o).parse_known(args);
  for (const auto& input : o.inputs)
    if (input.find('=') != std::string::npos)
      throw std::invalid_argument(fmt::format("unknown prepare option '{}'", input));
  const auto r = prepare_corpus(o);
  fmt::print("{}\ntrain on it with: noloco train CONFIG data={} (its val shards and tokenizer come along)\n",
             describe(r), o.out);
  return 0;
}

int report_command(const std::vector<std::string>& args) {
  ReportArgs a;
  const auto runs = report_options(a).parse_known(args);
  if (runs.empty()) throw std::invalid_argument("report needs at least one run directory");
  const auto report = report_request(a.target_loss, a.throughput);
  if (a.out_dir.empty()) {
    std::cout << report_tables(runs, report);
  } else {
    std::cout << write_report(runs, a.out_dir, report);
    fmt::print("\nwrote {}/report.md and its plots\n", a.out_dir);
  }
  return 0;
}

int simulate_command(const std::vector<std::string>& args) {
  sim::SimulateOptions options;
  simulate_options(options).parse(args);
  sim::validate(options);
  const auto headline = sim::run_simulation(options);
  fmt::print("{}\nwrote latency.csv, bandwidth.csv, idle.csv, unequal.csv, fig5a.svg, fig5b.svg to {}\n",
             headline.dump(2), options.out);
  return 0;
}

}  // namespace noloco
