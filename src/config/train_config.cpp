#include "config/train_config.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "config/options.h"
#include "config/run_layout.h"
#include "util/files.h"
#include "util/parse_number.h"

namespace noloco {

namespace {

[[noreturn]] void invalid(const std::string& m) { throw std::invalid_argument(m); }

// "fp32 | bf16 | ...": the codec types of wire/codec.h.
std::string codec_names() {
  std::string names;
  for (const auto& d : kCodecTypes) names += (names.empty() ? "" : " | ") + std::string(d.name);
  return names;
}

// The one table of config keys, in parts by subsystem: name, field, help.
// Order is the order of --help and of the resolved config.yaml.
void add_data_model_options(Options& o, TrainConfig& c) {
  o.add("data", c.data.path, "training text (tokenized once per run, cached in the run directory) or token files: a .bin, "
                            "a directory of llm.c shards (its *train*.bin; its *val*.bin validate) or a glob")
      .add("val_data", c.data.val_path, "validation token files (file, directory or glob); default: a data directory's val shards, "
                                          "else the last val_fraction of data")
      .add("tokenizer", c.data.tokenizer,
           "char | bpe | path to a sentencepiece .model | a directory holding one (run, checkpoint, Hugging Face)")
      .add("vocab_size", c.data.vocab_size, "BPE vocabulary to train, or vocabulary of a token file")
      .add("val_fraction", c.data.val_fraction, "fraction of the corpus held out for validation (0: none, the run is not validated)")
      .add("raw_tokens", c.data.raw_tokens, "token files are bare uint16 ids (nanoGPT's), without llm.c's header")
      .add("accept_changed_data", c.data.accept_changed_data,
           "resume although the data changed since the run started (no longer the run it continues)")
      .add("model", c.preset, "preset: tiny | 125m | 1.3b | 6.8b (keys below override it)")
      .add("init_from", c.init_from,
           "Hugging Face Llama directory to start from: shape, weights and tokenizer (model keys must agree, "
           "context may be shorter)")
      .add("hidden", c.model.hidden, "hidden size")
      .add("layers", c.model.layers, "decoder layers")
      .add("heads", c.model.heads, "attention heads")
      .add("kv_heads", c.model.kv_heads, "key/value heads (grouped-query attention); 0: heads")
      .add("head_dim", c.model.head_size, "width of one attention head; 0: hidden/heads")
      .add("tie_embeddings", c.model.tied_embeddings,
           "the output layer is the embedding matrix (tie_word_embeddings); with init_from the directory's: false "
           "unties a tied one (its head starts as a copy)")
      .add("intermediate", c.model.intermediate, "MLP size; 0: 8/3·hidden rounded to 64")
      .add("context", c.model.context, "sequence length")
      .add("rope_theta", c.model.rope_theta, "rotary base")
      .add("norm_eps", c.model.norm_eps, "RMSNorm epsilon");
}

void add_training_options(Options& o, TrainConfig& c) {
  o.add("batch", c.inner.batch, "sequences per micro-batch per replica")
      .add("grad_accum", c.inner.grad_accum, "micro-batches per step (the pipeline's M)")
      .add("steps", c.inner.steps, "inner steps")
      .add("warmup", c.inner.warmup, "linear warmup steps")
      .add("decay_steps", c.inner.decay_steps, "cosine decay length; 0: steps")
      .add("lr", c.inner.lr, "peak learning rate")
      .add("min_lr", c.inner.min_lr, "learning rate at the end of the decay")
      .add("beta1", c.inner.beta1, "AdamW beta1")
      .add("beta2", c.inner.beta2, "AdamW beta2")
      .add("weight_decay", c.inner.weight_decay, "AdamW weight decay (2-D weights only)")
      .add("clip", c.inner.clip, "global gradient-norm clip; 0 disables")
      .add("eval_interval", c.eval.interval, "steps between evaluations")
      .add("eval_batches", c.eval.batches, "validation batches per evaluation")
      .add("spread_interval", c.eval.spread_interval,
           "steps between evaluations across replicas (weight std, mean model); 0: every evaluation")
      .add("spread_replicas", c.eval.spread_replicas,
           "replicas whose weights make the weight std and mean model: the first live one and a sample drawn per "
           "evaluation; 0: all")
      .add("log_interval", c.eval.log_interval, "steps between progress lines")
      .add("sample_tokens", c.eval.sample_tokens,
           "tokens of the sample printed at the end (each evaluation prints one line of its first 40); 0: none")
      .add("sample_prompt", c.eval.sample_prompt, "prompt of the evaluation samples")
      .add("seed", c.run.seed, "run seed")
      .add("device", c.run.device, "cpu | cuda | cuda:N")
      .add("precision", c.run.precision, "fp32 | bf16 (CUDA autocast; weights and optimizer stay fp32)")
      .add("threads", c.run.threads, "intra-op threads per worker; 0: cores / local replicas")
      .add("slowdown", c.run.slowdown,
           "a slow machine on purpose (tests, demos): each inner step stretched F times by waiting; F for every "
           "worker started, or R:F,R:F by replica")
      .add("out", c.run.out, "run directory; default runs/<method>-<date>")
      .add("checkpoint_interval", c.run.checkpoint_interval, "steps between checkpoints; 0: at every evaluation")
      .add("keep_checkpoints", c.run.keep_checkpoints, "newest checkpoints kept per worker; 0: all")
      .add("resume", c.run.resume, "continue from the newest complete checkpoint in out");
}

void add_topology_options(Options& o, TrainConfig& c) {
  o.add("method", c.outer.method, "none (replicas train independently) | ddp | diloco | noloco")
      .add("replicas", c.run.replicas, "data-parallel replicas")
      .add("replica_workers", c.run.replica_workers,
           "workers per replica: they average gradients every inner step (the replica steps with their batches "
           "together) and the first of them runs the outer method for the replica")
      .add("max_local_workers", c.run.max_local_workers,
           "local launcher: the most workers it starts; 0: what this machine can host (8 per core, memory)")
      .add("stages", c.pipeline.stages, "pipeline stages per replica (replicas x stages workers)")
      .add("stage_layers", c.pipeline.stage_layers, "layers per stage, e.g. 3,5; empty: balanced")
      .add("routing", c.pipeline.routing, "random | fixed: routing of micro-batches between stage replicas")
      .add("schedule", c.pipeline.schedule,
           "gpipe | 1f1b: all forwards then all backwards, or one forward one backward (activation memory bounded "
           "by stages, not micro-batches); the same gradients")
      .add("activation_codec", c.pipeline.activation_codec,
           "pipeline activations between stages on the wire: " + codec_names() +
               " (quant_block values a scale; int2 is ternary); default int8 (free on every corpus measured); "
               "evaluations stay fp32")
      .add("activation_grad_codec", c.pipeline.activation_grad_codec,
           "their gradients, back between stages: same (as activation_codec) | " + codec_names() +
               " (integer codes stochastically rounded: unbiased)")
      .add("activation_subspace", c.pipeline.activation_subspace,
           "K > 0: what the layers before the last stage write to the residual stream kept in a fixed "
           "K-dimensional subspace drawn from the seed, so a stage boundary carries K values a token (then coded "
           "by activation_codec) instead of hidden; 0: off")
      .add("activation_subspace_token_std", c.pipeline.activation_subspace_token_std,
           "with activation_subspace: the standard deviation of the embedding's frozen part (the tokens' identity "
           "outside the span, which every stage adds back) in a seeded run; 0: the initial embedding's own "
           "(0.02); default min(1, hidden/2048) (1 is node0's); an imported model keeps its own")
      .add("activation_rotation", c.pipeline.activation_rotation,
           "integer activation codes (both directions): a randomized Hadamard rotation of each quant_block "
           "(a power of two) before coding, which spreads outliers so fewer bits suffice (docs/pipeline.md)");
}

void add_outer_options(Options& o, TrainConfig& c) {
  o.add("compression", c.outer.compression,
           "diloco/noloco outer messages: none (the codec keys below as given) | sparse (int2 delta with error "
           "feedback, an outer step every 10 steps for one fragment of the weights) | topk (SparseLoCo's message: "
           "the top 64 of 4096 values as 2-bit bin means, Rice-coded positions, the rest kept in the weights; "
           "noloco sends no phi); measured at 4 to 16 replicas of small models: sparse at 0.06-0.17 bits a "
           "parameter per inner step and topk at 0.004-0.03 end within 1% of fp32 messages' loss on Shakespeare "
           "and over 600 steps, up to 2.3% above it on a second corpus over 2000 steps; topk's replicas drift "
           "apart, so export takes the best one; docs/results.md; keys given with it override it")
      .add("outer_interval", c.outer.interval, "H, inner steps between two synchronisations of the weights (with fragments=F, of each fragment: "
           "an outer step every H/F steps); 0: 100 diloco, 50 noloco")
      .add("outer_momentum", c.outer.momentum, "alpha; <0: 0.3 diloco, 0.5 noloco")
      .add("outer_lr", c.outer.lr, "beta, outer learning rate")
      .add("gamma", c.outer.gamma, "NoLoCo pull toward the group mean; <0: equal to outer_lr")
      .add("group_size", c.outer.group_size, "NoLoCo group size n")
      .add("wire_dtype", c.outer.wire_dtype,
           "wire codec of diloco/noloco messages: " + codec_names() +
               " (int2 is ternary; bins2 sends each value's sign and one of its block's two mean magnitudes)")
      .add("topk", c.outer.topk, "fraction of each 4096-value chunk sent (largest first); 0: dense")
      .add("message_rank", c.outer.message_rank,
           "send each weight matrix's delta as two rank-r factors (a randomized SVD; the factors through "
           "wire_dtype, vectors as they are); 0: whole. Needs noloco_message=delta_phi (noloco) or "
           "diloco_mean=all_gather (diloco)")
      .add("error_feedback", c.outer.error_feedback, "add what a lossy codec dropped from delta to the next message (diloco; noloco delta_phi)")
      .add("error_feedback_decay", c.outer.error_feedback_decay,
           "error feedback e <- decay*e + delta before each message (SparseLoCo's beta; 1: plain error feedback)")
      .add("diloco_mean", c.outer.diloco_mean,
           "compressed diloco: reduce_scatter (shards averaged by their owners, the mean compressed again: ~2 "
           "messages a replica) | all_gather (each replica's message compressed once, gathered by all: replicas-1 "
           "messages a replica) | auto: all_gather with message_rank, else reduce_scatter")
      .add("residual", c.outer.residual,
           "what a lossy outer message left out of delta: message (error feedback: sent with the next one) | "
           "weights (kept in the replica's own weights, theta = phi + decay*leftover, so no local progress is reset "
           "away; diloco needs diloco_mean=all_gather)")
      .add("quant_block", c.outer.quant_block, "values sharing one int8/int4 scale (and one coset step)")
      .add("stochastic_rounding", c.outer.stochastic_rounding, "unbiased stochastic rounding of integer codes")
      .add("noloco_message", c.outer.message,
           "what a NoLoCo replica sends: theta (needs gamma = outer_lr) | delta_phi | auto: theta for fp32/bf16 "
           "with gamma = outer_lr, else delta_phi")
      .add("phi_coding", c.outer.phi_coding,
           "how delta_phi sends phi: codec | coset (against the receiver's phi) | auto: codec if lossless, else coset")
      .add("phi_bits", c.outer.phi_bits, "bits a value of coset-coded phi")
      .add("phi_every", c.outer.phi_every,
           "send phi (and pull toward the group) every this many outer steps; 0: never (the replicas average "
           "their increments only)")
      .add("fragments", c.outer.fragments,
           "diloco/noloco: synchronise the weights in this many slices at staggered steps of each period, one "
           "slice an outer step")
      .add("overlap", c.outer.overlap,
           "diloco/noloco: exchange while the next period trains; apply the result one period late")
      .add("eager", c.outer.eager,
           "with overlap: take the outer step with the replica's own delta at once; the exchange's result, a period "
           "later, corrects it")
      .add("pace", c.outer.pace,
           "diloco/noloco: steps (every replica trains outer_interval inner steps between outer steps, and the "
           "slowest sets the pace) | speed (each trains as many of those steps as its speed allows against the "
           "fastest replica's, so all reach the outer step together; increments weighed by their steps; "
           "docs/communication.md)")
      .add("partner_wait", c.outer.partner_wait,
           "noloco with pace=speed: how long a replica waits at an outer step for a partner alive but late, as a "
           "share of its own last period (0.5: half a period); then it steps without it, and the late one alone "
           "when it comes, skipping slots to catch up (its work goes to its next partner). 0: wait until the "
           "partner is given up (peer_timeout)");
}

void add_comm_options(Options& o, TrainConfig& c) {
  o.add("bind", c.comm.bind, "address workers listen on (and the store, when worker 0 hosts it; the launcher's store is a private unix socket)")
      .add("listen_port", c.comm.listen_port,
           "one fixed port for every connection from other workers (a port forwarded to this machine, or a "
           "firewall's one opening; LOCAL_RANK r listens at listen_port + r); 0: a fresh port each")
      .add("advertise", c.comm.advertise,
           "HOST[:PORT] other machines reach listen_port at (the router's public address and forwarded port); "
           "empty: bind's")
      .add("peer_timeout", c.comm.peer_timeout,
           "seconds a store call or a peer's message may take; a NoLoCo partner that makes no progress this long "
           "(at least 3 s) is given up")
      .add("seal", c.comm.seal,
           "seal every payload between workers (authenticated encryption keyed from the run's token); false only to "
           "measure what sealing costs")
      .add("live_status", c.comm.live_status,
           "publish this worker's status (step, losses, bytes, partner; sealed, at most one store write a second) "
           "for the live page of `noloco watch` and `noloco serve`")
      .add("insecure", c.comm.insecure,
           "accept seal=false where traffic leaves this machine (bind, MASTER_ADDR or the store off loopback): the "
           "weights and the store's password then cross the network in clear")
      .add("restarts", c.comm.restarts,
           "noloco: restart a failed worker (its whole replica, with replica_workers) up to this many times; it "
           "rejoins from a live peer")
      .add("heartbeat_timeout", c.comm.heartbeat_timeout,
           "seconds without a heartbeat before the launcher kills a hung worker and partners stop waiting")
      .add("startup_timeout", c.comm.startup_timeout,
           "seconds a local worker may take to its first heartbeat (loading LibTorch and the data) before the "
           "launcher kills it as hung; heartbeat_timeout if longer")
      .add("store_outage", c.comm.store_outage,
           "seconds a worker trains on alone while the run's store does not answer (its serve restarting, its "
           "host gone), asking again each second; past them it ends with a checkpoint and its summary")
      .add("rate", c.comm.rate,
           "local launcher: cap each worker's link at this rate each way, e.g. 10mbit (own network namespaces; "
           "root only); empty: no cap")
      .add("uplink", c.comm.uplink,
           "this machine's upload speed, e.g. 20mbit (a speed test's figure): links that cross it (punched, relayed, "
           "direct off its local network) leave at 95% of it so its router's queue stays empty, which keeps both "
           "directions of an exchange between two homes busy; empty: TCP's own pace")
      .add("inject_crash", c.run.inject_crash,
           "failure drill: RANK:STEP[:checkpoint|:freeze|:stall=SECONDS|:corrupt|:diverge][,...] kills that worker "
           "(SIGKILL) before that step, or while writing its checkpoint, or freezes it (SIGSTOP), or stalls it for "
           "SECONDS (alive, heartbeat on, like a replica busy handing its state over), or flips one byte of its next "
           "outer message on the wire, or throws its weights off by noise of std 1 (a replica that blew up); "
           "RANK:startup[:freeze] kills (freezes) it before it joins the run; RANK:handover kills the worker with "
           "that id that joins the running run (noloco join) once a donor has claimed its hand-over");
}

Options config_options(TrainConfig& c) {
  Options o("config");
  add_data_model_options(o, c);
  add_training_options(o, c);
  add_topology_options(o, c);
  add_outer_options(o, c);
  add_comm_options(o, c);
  return o;
}

// The keys that describe a model and its tokenizer. With init_from, a config
// file's yield to the imported model (a config written for another model
// still serves to continue this one); given on the command line they must
// agree with it.
bool describes_model(const std::string& key) {
  static const std::set<std::string> keys = {"model",        "hidden",     "layers",    "heads",
                                             "kv_heads",     "head_dim",   "intermediate", "rope_theta",
                                             "norm_eps",     "tie_embeddings", "tokenizer", "vocab_size"};
  return keys.count(key) > 0;
}

// The model keys of a run with init_from must describe the imported model
// (only the context, the training window, may differ: a config file's longer
// one is cut to the model's positions, the command line's is refused); its
// tokenizer is the directory's unless one is named on the command line.
void adopt_imported_model(TrainConfig& c, const ModelConfig& hf, const std::set<std::string>& command_line) {
  auto same = [&](const char* key, auto ours, auto theirs) {
    if (ours != theirs)
      invalid(fmt::format("{}={} disagrees with init_from {} ({}): drop the key", key, ours, c.init_from, theirs));
  };
  same("hidden", c.model.hidden, hf.hidden);
  same("layers", c.model.layers, hf.layers);
  same("heads", c.model.heads, hf.heads);
  same("kv_heads", c.model.key_value_heads(), hf.key_value_heads());
  same("head_dim", c.model.head_dim(), hf.head_dim());
  if (c.model.tied_embeddings && !hf.tied_embeddings)
    invalid(fmt::format("tie_embeddings=true, but init_from {} has an lm_head of its own: drop the key", c.init_from));
  same("intermediate", c.model.intermediate_size(), hf.intermediate_size());
  same("rope_theta", c.model.rope_theta, hf.rope_theta);
  same("norm_eps", c.model.norm_eps, hf.norm_eps);
  c.model.rope_scaling = hf.rope_scaling;  // no key of ours: always the directory's
  if (c.model.context > hf.context && command_line.count("context"))
    invalid(fmt::format("context={} exceeds init_from {}'s max_position_embeddings ({})", c.model.context,
                        c.init_from, hf.context));
  c.model.context = std::min(c.model.context, hf.context);
  if (command_line.count("tokenizer")) return;
  c.data.model_dir = c.init_from;
  if (ends_with(c.data.path, ".bin") && c.data.vocab_size == 0) c.data.vocab_size = hf.vocab_size;
}

// The compression presets: the keys each sets before any key given with it.
//
// sparse (issue 27): every value travels, coarsely, on a staggered schedule
// (an outer step every 10 steps, each for the fragment then due): 0.10
// (DiLoCo) and 0.094 (NoLoCo) bits a parameter per inner step at 8 replicas,
// within 1% of fp32 on Shakespeare and over 600 steps, up to 2.2% off on the
// Vim manual over 2,000 (docs/results.md).
//
// topk (issue 47): SparseLoCo's message (the top 64 of each 4096 values of Δ,
// 2-bit bin means, positions Rice-coded), what it leaves out kept in the
// replica's own weights (residual=weights); NoLoCo sends no slow weights
// (phi_every=0). 0.0041 (NoLoCo) and 0.014 (DiLoCo, all-gathered: 7 messages
// a replica at 8) bits per inner step. A value a peer's message did not
// carry counts as the replica's own (optim/channels.h). The replicas' losses
// stay within 0-2.3% of fp32 messages' (docs/results.md), but their weights
// drift apart, so the run hands over its best replica rather than their mean.
// Bin means (bins2) rather than ternary int2: closer on every run measured,
// 2.4% more bytes.
void apply_compression_preset(OuterConfig& outer, OuterCompression compression, Method method) {
  if (compression == OuterCompression::none) return;
  if (!has_outer_steps(method))
    invalid(fmt::format("compression={} applies to diloco and noloco", choice_name(compression)));
  outer.wire_dtype = CodecSpec::Type::int2;
  outer.error_feedback = true;
  if (compression == OuterCompression::topk) {
    outer.wire_dtype = CodecSpec::Type::bins2;
    outer.topk = 64.0 / 4096;
    outer.residual = ResidualHome::weights;
    if (method == Method::diloco) outer.diloco_mean = DilocoMean::all_gather;
    outer.interval = method == Method::diloco ? 100 : 50;
    if (method == Method::noloco) outer.phi_every = 0;
    return;
  }
  if (method == Method::diloco) {  // reduce-scatter of int2 shards: 0.50 bits/param/outer step at 8 replicas
    outer.fragments = 8;
    outer.interval = 80;
    return;
  }
  // int2 Δ, φ coset-coded in 4 bits every 2nd outer step: 0.90 bits/param/outer step.
  outer.fragments = 5;
  outer.interval = 50;
  outer.phi_bits = 4;
  outer.phi_every = 2;
}

}  // namespace

std::string config_keys_help() {
  TrainConfig c;
  return config_options(c).help();
}

std::vector<std::string> outer_method_keys() {
  TrainConfig c;
  Options options("outer");
  add_outer_options(options, c);
  add_comm_options(options, c);
  std::vector<std::string> keys{"method", "seed"};
  for (const auto& o : options.all())
    // restarts and rate: the local launcher's.
    if (o.name != "restarts" && o.name != "rate") keys.push_back(o.name);
  return keys;
}

void TrainConfig::resolve() {
  if (inner.decay_steps == 0) inner.decay_steps = inner.steps;
  if (inner.lr == 0) inner.min_lr = 0;  // frozen throughout, not warmed up to the decay's floor
  if (outer.interval == 0) outer.interval = outer.method == Method::diloco ? 100 : 50;
  if (outer.momentum < 0) outer.momentum = outer.method == Method::diloco ? 0.3 : 0.5;
  if (outer.gamma < 0) outer.gamma = outer.lr;
  if (!pipeline.activation_grad_codec) pipeline.activation_grad_codec = pipeline.activation_codec;
  // The frozen part of the embedding (model/subspace.h) at min(1, hidden/2048): 0.0625 at the demo's
  // 128 and 0.25 at 512, between the best scales measured there (0.02-0.1 and 0.25-0.3, docs/pipeline.md),
  // and node0's fixed N(0, 1) embedding from 2048 (1B-class Llamas) up.
  if (pipeline.activation_subspace > 0 && init_from.empty() && !pipeline.activation_subspace_token_std)
    pipeline.activation_subspace_token_std = std::min(1.0, double(model.hidden) / 2048);
  // With γ = β the pull folds into the mean of θ: β·mean(Δ) + β·(mean φ − φ_i) = β·(mean θ − φ_i).
  const bool lossless = outer.wire_dtype == CodecSpec::Type::fp32 && outer.topk == 0;
  const bool theta_codec = outer.topk == 0 && outer.message_rank == 0 && !blockwise_code(outer.wire_dtype);
  if (outer.message == NolocoMessage::automatic)
    outer.message = outer.gamma == outer.lr && theta_codec ? NolocoMessage::theta : NolocoMessage::delta_phi;
  if (outer.phi_coding == PhiCoding::automatic) outer.phi_coding = lossless ? PhiCoding::codec : PhiCoding::coset;
  // A shard of a matrix has no factors to send.
  if (outer.diloco_mean == DilocoMean::automatic)
    outer.diloco_mean = outer.message_rank > 0 ? DilocoMean::all_gather : DilocoMean::reduce_scatter;
}

namespace {

void validate_listening(const CommConfig& comm) {
  if (comm.listen_port < 0 || comm.listen_port > 65535)
    invalid(fmt::format("listen_port must be in 0..65535, got {}", comm.listen_port));
  if (comm.advertise.empty()) return;
  if (!parse_host_port("advertise", comm.advertise).port && comm.listen_port == 0)
    invalid(fmt::format("advertise={} needs a port: advertise=HOST:PORT, or listen_port", comm.advertise));
}

void validate_replica_workers(const TrainConfig& c) {
  if (!(c.run.replica_workers > 0))
    invalid(fmt::format("replica_workers must be positive, got {}", c.run.replica_workers));
  if (c.run.replica_workers == 1) return;
  run_layout(c);  // refuses replica_workers with pipeline stages
  if (c.outer.method == Method::ddp)
    invalid(fmt::format("replica_workers with method=ddp: ddp averages gradients over every worker at every step "
                        "already; use replicas={} instead",
                        c.run.replicas * c.run.replica_workers));
}

// The pipeline's keys: stages, their layers, what crosses a boundary.
void validate_pipeline(const TrainConfig& c) {
  const auto& pipeline = c.pipeline;
  if (!(pipeline.stages > 0)) invalid(fmt::format("stages must be positive, got {}", pipeline.stages));
  stage_layer_ranges(c.model.layers, pipeline.stages, pipeline.stage_layers);
  if (c.model.tied_embeddings && pipeline.stages > 1)
    invalid("tie_embeddings with stages > 1 is not implemented (the first and last stage would share one matrix): "
            "set tie_embeddings=false to train the head as a copy");
  if (pipeline.activation_subspace < 0 || pipeline.activation_subspace > c.model.hidden)
    invalid(fmt::format("activation_subspace must be in [0, hidden={}], got {}", c.model.hidden,
                        pipeline.activation_subspace));
  if (pipeline.activation_subspace > 0 && pipeline.stages == 1)
    invalid("activation_subspace needs stages > 1: it constrains what the layers before the last stage write");
  if (const auto& token_std = pipeline.activation_subspace_token_std) {
    if (pipeline.activation_subspace == 0)
      invalid("activation_subspace_token_std applies with activation_subspace > 0");
    if (*token_std < 0) invalid(fmt::format("activation_subspace_token_std must be >= 0, got {}", *token_std));
    if (!c.init_from.empty())
      invalid("activation_subspace_token_std with init_from: an imported model keeps its own embedding, which its "
              "layers were trained to read");
  }
  const bool rotated = pipeline.stages > 1 && pipeline.activation_rotation &&
                       (integer_code(pipeline.activation_codec) ||
                        integer_code(pipeline.activation_grad_codec.value_or(pipeline.activation_codec)));
  if (rotated && (c.outer.quant_block & (c.outer.quant_block - 1)) != 0)
    invalid(fmt::format("activation_rotation needs quant_block a power of two, got {} (or activation_rotation=false)",
                        c.outer.quant_block));
}

// When outer steps happen and how a replica keeps its pace towards them.
void validate_outer_schedule(const TrainConfig& c) {
  const auto& outer = c.outer;
  const auto method = outer.method;
  if (outer.fragments < 1) invalid(fmt::format("fragments must be >= 1, got {}", outer.fragments));
  if (has_outer_steps(method) && outer.fragments > outer.interval)
    invalid(fmt::format("fragments ({}) must not exceed outer_interval ({})", outer.fragments, outer.interval));
  if ((outer.fragments > 1 || outer.overlap) && !has_outer_steps(method))
    invalid("fragments and overlap apply to diloco and noloco");
  if (outer.eager && !outer.overlap) invalid("eager needs overlap=true (it corrects an exchange that arrives late)");
  if (outer.pace == PaceMode::speed && !has_outer_steps(method)) invalid("pace=speed applies to diloco and noloco");
  if (outer.pace == PaceMode::speed && c.pipeline.stages > 1)
    invalid("pace=speed needs stages=1: with random routing a replica's stages are not one machine's, and a slot "
            "one stage worker leaves out would drop the micro-batches routed to it");
  if (!(outer.partner_wait >= 0))
    invalid(fmt::format("partner_wait must be >= 0 (a share of a period), got {}", outer.partner_wait));
  if (outer.partner_wait > 0 && method != Method::noloco)
    invalid("partner_wait is NoLoCo's: DiLoCo's average and DDP's wait for every replica by their nature");
  if (outer.partner_wait > 0 && outer.pace != PaceMode::speed)
    invalid("partner_wait needs pace=speed: a replica left behind catches up by skipping slots, which pace=steps "
            "has not (its replicas would stay out of step and never meet again)");
  slowdown_of(c.run.slowdown, 0);
}

}  // namespace

void TrainConfig::validate() const {
  auto positive = [](const char* key, double v) {
    if (!(v > 0)) invalid(fmt::format("{} must be positive, got {}", key, v));
  };
  auto non_negative = [](const char* key, double v) {
    if (v < 0) invalid(fmt::format("{} must be >= 0, got {}", key, v));
  };
  if (data.path.empty()) invalid("data must name a file");
  if (!(data.val_fraction >= 0 && data.val_fraction < 1))
    invalid(fmt::format("val_fraction must be in [0, 1), got {}", data.val_fraction));
  non_negative("vocab_size", double(data.vocab_size));
  if (data.tokenizer == "bpe" && data.vocab_size < 260) invalid("tokenizer=bpe needs vocab_size >= 260");
  ModelConfig shape = model;
  shape.vocab_size = 1;  // known only once the tokenizer is built
  shape.validate();
  positive("batch", double(inner.batch));
  positive("grad_accum", double(inner.grad_accum));
  positive("steps", double(inner.steps));
  non_negative("warmup", double(inner.warmup));
  non_negative("decay_steps", double(inner.decay_steps));
  non_negative("lr", inner.lr);  // 0: a frozen run, e.g. to check a model's round trip
  non_negative("min_lr", inner.min_lr);
  if (inner.min_lr > inner.lr) invalid(fmt::format("min_lr ({}) must not exceed lr ({})", inner.min_lr, inner.lr));
  if (!(inner.beta1 >= 0 && inner.beta1 < 1)) invalid(fmt::format("beta1 must be in [0, 1), got {}", inner.beta1));
  if (!(inner.beta2 >= 0 && inner.beta2 < 1)) invalid(fmt::format("beta2 must be in [0, 1), got {}", inner.beta2));
  non_negative("weight_decay", inner.weight_decay);
  non_negative("clip", inner.clip);
  positive("eval_interval", double(eval.interval));
  positive("eval_batches", double(eval.batches));
  non_negative("spread_interval", double(eval.spread_interval));
  non_negative("spread_replicas", double(eval.spread_replicas));
  if (eval.spread_replicas == 1) invalid("spread_replicas=1 has no spread: 0 (all) or 2 or more");
  if (eval.spread_interval % eval.interval != 0)
    invalid(fmt::format("spread_interval ({}) must be a multiple of eval_interval ({})", eval.spread_interval,
                        eval.interval));
  positive("log_interval", double(eval.log_interval));
  non_negative("sample_tokens", double(eval.sample_tokens));
  non_negative("threads", double(run.threads));
  non_negative("checkpoint_interval", double(run.checkpoint_interval));
  non_negative("keep_checkpoints", double(run.keep_checkpoints));
  const auto& device = run.device;
  if (device != "cpu" && device != "cuda" && device.rfind("cuda:", 0) != 0)
    invalid(fmt::format("device must be cpu, cuda or cuda:N, got '{}'", device));
  if (run.precision == Precision::bf16 && device.rfind("cuda", 0) != 0) invalid("precision=bf16 needs device=cuda");
  const auto method = outer.method;
  positive("replicas", double(run.replicas));
  non_negative("max_local_workers", double(run.max_local_workers));
  validate_pipeline(*this);
  validate_replica_workers(*this);
  non_negative("outer_interval", double(outer.interval));
  positive("outer_lr", outer.lr);
  if (outer.group_size < 2) invalid(fmt::format("group_size must be >= 2, got {}", outer.group_size));

  if (!(outer.topk >= 0 && outer.topk < 1)) invalid(fmt::format("topk must be in [0, 1), got {}", outer.topk));
  if (outer.message_rank < 0) invalid(fmt::format("message_rank must be >= 0, got {}", outer.message_rank));
  if (outer.message_rank > 0 && outer.topk > 0)
    invalid("message_rank and topk are two ways to shrink a message; set one of them to 0");
  const bool lossy = outer.wire_dtype != CodecSpec::Type::fp32 || outer.topk > 0 || outer.message_rank > 0;
  if (lossy && method == Method::ddp)
    invalid("wire_dtype, topk and message_rank apply to diloco and noloco; ddp all-reduces fp32 gradients");
  if (outer.quant_block < 8 || outer.quant_block > 4096)
    invalid(fmt::format("quant_block must be in [8, 4096], got {}", outer.quant_block));
  if (outer.phi_bits < 2 || outer.phi_bits > 8) invalid(fmt::format("phi_bits must be in [2, 8], got {}", outer.phi_bits));
  const bool own_leftover = (method == Method::diloco && outer.diloco_mean == DilocoMean::all_gather) ||
                            (method == Method::noloco && outer.message == NolocoMessage::delta_phi);
  if (outer.residual == ResidualHome::weights && (!own_leftover || !lossy || !outer.error_feedback))
    invalid("residual=weights needs a lossy codec with error_feedback=true, and diloco_mean=all_gather (diloco) or "
            "noloco_message=delta_phi (noloco)");
  if (!(outer.error_feedback_decay > 0 && outer.error_feedback_decay <= 1))
    invalid(fmt::format("error_feedback_decay must be in (0, 1], got {}", outer.error_feedback_decay));
  if (outer.phi_every < 0) invalid(fmt::format("phi_every must be >= 0, got {}", outer.phi_every));
  validate_outer_schedule(*this);
  if (outer.message_rank > 0 && method == Method::noloco && outer.message != NolocoMessage::delta_phi)
    invalid("message_rank needs noloco_message=delta_phi: theta is not low-rank, its increment is");
  if (outer.message_rank > 0 && method == Method::diloco && outer.diloco_mean != DilocoMean::all_gather)
    invalid("message_rank needs diloco_mean=all_gather: a reduce-scatter shard cuts the matrices");
  if (outer.message == NolocoMessage::theta && outer.gamma != outer.lr)
    invalid(fmt::format("noloco_message=theta needs gamma = outer_lr (got gamma {}, outer_lr {}); use delta_phi",
                        outer.gamma, outer.lr));
  validate_listening(comm);
  positive("peer_timeout", comm.peer_timeout);
  non_negative("restarts", double(comm.restarts));
  positive("heartbeat_timeout", comm.heartbeat_timeout);
  positive("startup_timeout", comm.startup_timeout);
  positive("store_outage", comm.store_outage);
  if (!comm.rate.empty()) parse_bit_rate("rate", comm.rate);
  if (!comm.uplink.empty()) parse_bit_rate("uplink", comm.uplink);
  if (comm.restarts > 0 && !takes_back_restarted(method, pipeline.routing, pipeline.stages))
    invalid("restarts needs method=noloco, and routing=random with pipeline stages (only NoLoCo can take a replica "
            "back mid-run, and only random routing sends micro-batches around a lost worker)");
  for (const auto& point : parse_crash_plan(run.inject_crash)) {
    if (point.rank < 0 || point.step < 0)
      invalid(fmt::format("inject_crash: RANK and STEP must be >= 0 in '{}'", run.inject_crash));
  }
}

RunLayout run_layout(const TrainConfig& c) {
  return RunLayout(int(c.pipeline.stages), int(c.run.replica_workers), int(c.run.replicas));
}

void TrainConfig::validate_workers() const {
  if (outer.method == Method::noloco && outer.group_size > run.replicas)
    invalid(fmt::format("group_size ({}) must not exceed replicas ({})", outer.group_size, run.replicas));
  for (const auto& point : parse_crash_plan(run.inject_crash)) {
    // A hand-over drill is for a worker joining the run: its id comes after the run's workers.
    if (point.mode == CrashPoint::Mode::handover && point.rank < workers())
      invalid(fmt::format("inject_crash: {}:handover names a worker that joins the run (ids {} and up)", point.rank,
                          workers()));
    if (point.mode != CrashPoint::Mode::handover && point.rank >= workers())
      invalid(fmt::format("inject_crash: there is no worker {} (workers 0..{})", point.rank, workers() - 1));
  }
}

double slowdown_of(const std::string& spec, int64_t replica) {
  const auto factor = [&](const std::string& text) {
    const double f = parse_real("slowdown", text);
    if (!(f >= 1 && f <= 1000)) invalid(fmt::format("slowdown factors must be in [1, 1000], got {}", text));
    return f;
  };
  if (spec.empty()) return 1;
  if (spec.find(':') == std::string::npos) return factor(spec);
  double found = 1;
  std::stringstream list(spec);
  for (std::string item; std::getline(list, item, ',');) {
    const auto colon = item.find(':');
    if (colon == std::string::npos)
      invalid(fmt::format("slowdown: '{}' is not REPLICA:FACTOR (in '{}')", item, spec));
    const int64_t r = parse_integer("slowdown", item.substr(0, colon));
    if (r < 0) invalid(fmt::format("slowdown: replica {} is negative (in '{}')", r, spec));
    const double f = factor(item.substr(colon + 1));
    if (r == replica) found = f;
  }
  return found;
}

std::vector<CrashPoint> parse_crash_plan(const std::string& plan) {
  std::vector<CrashPoint> points;
  std::stringstream list(plan);
  for (std::string item; std::getline(list, item, ',');) {
    std::vector<std::string> parts;
    std::stringstream fields(item);
    for (std::string part; std::getline(fields, part, ':');) parts.push_back(part);
    auto mode = CrashPoint::Mode::kill;
    double stall_seconds = 0;
    if (parts.size() == 3 && parts[2] == "checkpoint") mode = CrashPoint::Mode::kill_in_checkpoint;
    if (parts.size() == 3 && parts[2] == "freeze") mode = CrashPoint::Mode::freeze;
    if (parts.size() == 3 && parts[2] == "corrupt") mode = CrashPoint::Mode::corrupt;
    if (parts.size() == 3 && parts[2] == "diverge") mode = CrashPoint::Mode::diverge;
    if (parts.size() == 3 && parts[2].rfind("stall=", 0) == 0) {
      mode = CrashPoint::Mode::stall;
      stall_seconds = parse_real("inject_crash", parts[2].substr(6));
      if (!(stall_seconds > 0)) invalid(fmt::format("inject_crash: a stall must last > 0 seconds, in '{}'", plan));
    }
    if (parts.size() != 2 && (parts.size() != 3 || mode == CrashPoint::Mode::kill))
      invalid(fmt::format(
          "inject_crash must be RANK:STEP[:checkpoint|:freeze|:corrupt|:diverge|:stall=SECONDS], "
          "RANK:startup[:freeze] or RANK:handover[,...], got '{}'",
          plan));
    if (parts.size() == 2 && parts[1] == "handover") {
      points.push_back({parse_integer("inject_crash", parts[0]), 0, CrashPoint::Mode::handover});
      continue;
    }
    if (parts[1] == "startup") {
      if (mode == CrashPoint::Mode::kill_in_checkpoint || mode == CrashPoint::Mode::corrupt ||
          mode == CrashPoint::Mode::diverge || mode == CrashPoint::Mode::stall)
        invalid(fmt::format("inject_crash: a worker starting up writes no checkpoint and sends no message, in '{}'",
                            plan));
      points.push_back({parse_integer("inject_crash", parts[0]), 0,
                        mode == CrashPoint::Mode::freeze ? CrashPoint::Mode::freeze_at_startup
                                                         : CrashPoint::Mode::startup});
      continue;
    }
    points.push_back(
        {parse_integer("inject_crash", parts[0]), parse_integer("inject_crash", parts[1]), mode, stall_seconds});
  }
  return points;
}

std::vector<LayerRange> stage_layer_ranges(int64_t layers, int64_t stages, const std::string& spec) {
  if (stages < 1 || stages > layers)
    invalid(fmt::format("stages must be in [1, layers={}], got {}", layers, stages));
  std::vector<int64_t> counts;
  if (spec.empty()) {
    for (int64_t s = 0; s < stages; ++s) counts.push_back(layers / stages + (s < layers % stages ? 1 : 0));
  } else {
    std::stringstream list(spec);
    for (std::string item; std::getline(list, item, ',');) counts.push_back(parse_integer("stage_layers", item));
    int64_t total = 0;
    for (auto n : counts) {
      if (n < 1) invalid(fmt::format("stage_layers: every stage needs >= 1 layer, got '{}'", spec));
      total += n;
    }
    if (int64_t(counts.size()) != stages || total != layers)
      invalid(fmt::format("stage_layers '{}' must list {} counts summing to layers={}", spec, stages, layers));
  }
  std::vector<LayerRange> ranges;
  int64_t first = 0;
  for (auto n : counts) {
    ranges.push_back({first, first + n});
    first += n;
  }
  return ranges;
}

std::string TrainConfig::to_yaml() const {
  auto copy = *this;
  const auto options = config_options(copy);
  std::string y;
  for (const auto& o : options.all()) {
    YAML::Emitter e;
    e << o.get();
    y += fmt::format("{}: {}\n", o.name, e.c_str());
  }
  return y;
}

const std::vector<std::string>& machine_keys() {
  static const std::vector<std::string> keys{
      "data",         "val_data",         "tokenizer",     "init_from",   "accept_changed_data", "device",
      "precision",    "threads",          "slowdown",      "out",           "checkpoint_interval", "keep_checkpoints", "resume",
      "max_local_workers", "log_interval", "sample_tokens", "sample_prompt", "bind",            "peer_timeout",
      "listen_port",  "advertise",        "live_status",
      "insecure",     "restarts",         "heartbeat_timeout", "startup_timeout", "store_outage", "rate", "uplink", "inject_crash"};
  return keys;
}

std::string TrainConfig::run_yaml() const {
  const auto& local = machine_keys();
  std::string y;
  std::istringstream lines(to_yaml());
  for (std::string line; std::getline(lines, line);)
    if (std::find(local.begin(), local.end(), line.substr(0, line.find(':'))) == local.end()) y += line + "\n";
  return y;
}

std::string run_yaml_differences(const std::string& ours, const std::string& run) {
  const auto values = [](const std::string& yaml) {
    std::map<std::string, std::string> v;
    std::istringstream lines(yaml);
    for (std::string line; std::getline(lines, line);)
      if (const auto colon = line.find(": "); colon != std::string::npos) v[line.substr(0, colon)] = line.substr(colon + 2);
    return v;
  };
  const auto mine = values(ours), theirs = values(run);
  std::string differences;
  for (const auto& [key, value] : theirs) {
    const auto it = mine.find(key);
    const auto here = it == mine.end() ? std::string("(unknown)") : it->second;
    if (here != value) differences += fmt::format("{}{}: {} here, {} in the run", differences.empty() ? "" : "; ", key, here, value);
  }
  for (const auto& [key, value] : mine)
    if (!theirs.count(key))
      differences += fmt::format("{}{}: {} here, unknown to the run", differences.empty() ? "" : "; ", key, value);
  return differences;
}

TrainConfig parse_config(const std::string& yaml_text, const std::vector<std::string>& overrides,
                         const std::string& origin) {
  // Collect key/value pairs first: the preset must apply before any key that overrides it,
  // wherever the two appear.
  std::vector<std::pair<std::string, std::string>> pairs;
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    invalid(fmt::format("{}: not valid YAML: {}", origin, e.msg));
  }
  if (root && !root.IsNull()) {
    if (!root.IsMap()) invalid(fmt::format("{}: expected a mapping of key: value", origin));
    for (const auto& kv : root) {
      if (!kv.first.IsScalar()) invalid(fmt::format("{}: keys must be plain names", origin));
      const auto key = kv.first.as<std::string>();
      for (const auto& [seen, value] : pairs)
        if (seen == key) invalid(fmt::format("{}: key '{}' appears twice", origin, key));
      if (!kv.second.IsScalar()) invalid(fmt::format("{}: value of '{}' must be a single value", origin, key));
      pairs.emplace_back(key, kv.second.as<std::string>());
    }
  }
  for (const auto& o : overrides) {
    const auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0) invalid(fmt::format("override '{}' is not key=value", o));
    pairs.emplace_back(o.substr(0, eq), o.substr(eq + 1));
  }
  std::set<std::string> command_line;
  for (size_t i = pairs.size() - overrides.size(); i < pairs.size(); ++i) command_line.insert(pairs[i].first);
  TrainConfig c;
  auto options = config_options(c);
  std::optional<ModelConfig> imported;
  std::string imported_from;
  for (const auto& [k, v] : pairs) {
    if (!options.has(k)) invalid(fmt::format("unknown config key '{}' (see `noloco train --help`)", k));
    if (k == "init_from" && !v.empty()) {
      imported = read_hf_config(v);
      imported_from = v;
      c.model = *imported;
    }
  }
  if (imported && command_line.count("model"))
    invalid(fmt::format("model= and init_from={} name two models: drop one", imported_from));
  // A config file's model keys yield to the imported model (adopt_imported_model).
  if (imported)
    pairs.erase(std::remove_if(pairs.begin(), pairs.end(),
                               [&](const auto& kv) { return describes_model(kv.first) && !command_line.count(kv.first); }),
                pairs.end());
  for (const auto& [k, v] : pairs) {
    if (k != "model") continue;
    c.preset = v;
    c.model = model_preset(v);
  }
  // The compression preset, for the method the keys name, before the keys that override it.
  for (const auto& [k, v] : pairs)
    if (k == "method" || k == "compression") options.set(k, v);
  apply_compression_preset(c.outer, c.outer.compression, c.outer.method);
  for (const auto& [k, v] : pairs)
    if (k != "model") options.set(k, v);
  if (imported) adopt_imported_model(c, *imported, command_line);
  c.resolve();
  c.validate();
  return c;
}

TrainConfig load_config(const std::string& yaml_path, const std::vector<std::string>& overrides) {
  std::string text;
  if (!yaml_path.empty()) text = read_file(yaml_path);
  return parse_config(text, overrides, yaml_path.empty() ? "config" : yaml_path);
}

}  // namespace noloco
