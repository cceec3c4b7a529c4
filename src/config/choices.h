// The closed choices of a run (method, routing, ...), parsed once from their
// names into enums, and the questions about them that more than one part of
// the program asks (which methods survive a lost worker). Names are the
// config values users write; the first name of a value is how it prints.
#pragma once
#include <array>
#include <cstdint>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "wire/codec.h"

namespace noloco {

enum class Method { none, ddp, diloco, noloco };
enum class Routing { random, fixed };
enum class Schedule { gpipe, one_f_one_b };
// What a NoLoCo replica sends: θ alone (the pull folds into the mean when
// γ = β) or Δ and φ (any γ); automatic until the config is resolved.
enum class NolocoMessage { automatic, theta, delta_phi };
// How a delta_phi message sends φ: through the wire codec, or coset-coded
// against the receiver's own φ; automatic until the config is resolved.
enum class PhiCoding { automatic, codec, coset };
enum class Precision { fp32, bf16 };
// How compressed DiLoCo forms the mean of Δ (optim/diloco.h): shards
// averaged by their owners and the mean compressed again, or every replica's
// message compressed once and gathered by all; automatic until resolved.
enum class DilocoMean { automatic, reduce_scatter, all_gather };
// Where what a lossy DiLoCo message left out goes: into the next message
// (error feedback), or back into the replica's own weights.
enum class ResidualHome { message, weights };
// steps: every replica trains H inner steps between outer steps; speed: each at its own speed (optim/pace.h).
enum class PaceMode { steps, speed };
// The outer messages' compression as one choice (config/train_config.h's
// preset): none leaves the codec keys as they are.
enum class OuterCompression { none, sparse, topk };

template <class E>
struct ChoiceNames;
template <>
struct ChoiceNames<Method> {
  static constexpr std::array<std::pair<Method, const char*>, 4> all{
      {{Method::none, "none"}, {Method::ddp, "ddp"}, {Method::diloco, "diloco"}, {Method::noloco, "noloco"}}};
};
template <>
struct ChoiceNames<Routing> {
  static constexpr std::array<std::pair<Routing, const char*>, 2> all{
      {{Routing::random, "random"}, {Routing::fixed, "fixed"}}};
};
template <>
struct ChoiceNames<Schedule> {
  static constexpr std::array<std::pair<Schedule, const char*>, 2> all{
      {{Schedule::gpipe, "gpipe"}, {Schedule::one_f_one_b, "1f1b"}}};
};
template <>
struct ChoiceNames<NolocoMessage> {
  static constexpr std::array<std::pair<NolocoMessage, const char*>, 4> all{{{NolocoMessage::automatic, "auto"},
                                                                            {NolocoMessage::automatic, ""},
                                                                            {NolocoMessage::theta, "theta"},
                                                                            {NolocoMessage::delta_phi, "delta_phi"}}};
};
template <>
struct ChoiceNames<PhiCoding> {
  static constexpr std::array<std::pair<PhiCoding, const char*>, 4> all{{{PhiCoding::automatic, "auto"},
                                                                        {PhiCoding::automatic, ""},
                                                                        {PhiCoding::codec, "codec"},
                                                                        {PhiCoding::coset, "coset"}}};
};
template <>
struct ChoiceNames<Precision> {
  static constexpr std::array<std::pair<Precision, const char*>, 2> all{
      {{Precision::fp32, "fp32"}, {Precision::bf16, "bf16"}}};
};
// Wire codecs (wire_dtype, activation_codec): the names of wire/codec.h's
// one table of codec types.
template <>
struct ChoiceNames<CodecSpec::Type> {
  static constexpr auto all = [] {
    std::array<std::pair<CodecSpec::Type, const char*>, std::size(kCodecTypes)> names{};
    for (size_t i = 0; i < names.size(); ++i) {
      names[i].first = kCodecTypes[i].type;
      names[i].second = kCodecTypes[i].name;
    }
    return names;
  }();
};
// A codec or `same` (unset): activation_grad_codec, as the activations.
template <>
struct ChoiceNames<std::optional<CodecSpec::Type>> {
  static constexpr auto all = [] {
    std::array<std::pair<std::optional<CodecSpec::Type>, const char*>, std::size(kCodecTypes) + 1> names{};
    names[0].second = "same";
    for (size_t i = 0; i < std::size(kCodecTypes); ++i) {
      names[i + 1].first = kCodecTypes[i].type;
      names[i + 1].second = kCodecTypes[i].name;
    }
    return names;
  }();
};

template <>
struct ChoiceNames<DilocoMean> {
  static constexpr std::array<std::pair<DilocoMean, const char*>, 4> all{{{DilocoMean::automatic, "auto"},
                                                                         {DilocoMean::automatic, ""},
                                                                         {DilocoMean::reduce_scatter, "reduce_scatter"},
                                                                         {DilocoMean::all_gather, "all_gather"}}};
};
template <>
struct ChoiceNames<PaceMode> {
  static constexpr std::array<std::pair<PaceMode, const char*>, 2> all{
      {{PaceMode::steps, "steps"}, {PaceMode::speed, "speed"}}};
};
template <>
struct ChoiceNames<ResidualHome> {
  static constexpr std::array<std::pair<ResidualHome, const char*>, 2> all{
      {{ResidualHome::message, "message"}, {ResidualHome::weights, "weights"}}};
};
template <>
struct ChoiceNames<OuterCompression> {
  static constexpr std::array<std::pair<OuterCompression, const char*>, 3> all{
      {{OuterCompression::none, "none"}, {OuterCompression::sparse, "sparse"}, {OuterCompression::topk, "topk"}}};
};

// Whether E is a choice (has names above).
template <class E, class = void>
struct is_choice : std::false_type {};
template <class E>
struct is_choice<E, std::void_t<decltype(ChoiceNames<E>::all)>> : std::true_type {};

template <class E>
std::string choice_name(E value) {
  for (const auto& [e, name] : ChoiceNames<E>::all)
    if (e == value) return name;
  return "?";
}

// Throws std::invalid_argument "KEY must be a, b or c, got 'TEXT'".
template <class E>
E parse_choice(const std::string& key, const std::string& text) {
  std::string names;
  const auto& all = ChoiceNames<E>::all;
  for (size_t i = 0; i < all.size(); ++i) {
    if (text == all[i].second) return all[i].first;
    if (*all[i].second == '\0') continue;
    names += names.empty() ? "" : (i + 1 == all.size() ? " or " : ", ");
    names += all[i].second;
  }
  throw std::invalid_argument(key + " must be " + names + ", got '" + text + "'");
}

// Whether a run goes on when one of its workers is lost: NoLoCo replicas
// (and independent ones) need no particular peer, and a pipeline can send a
// lost worker's micro-batches elsewhere only with random routing.
inline bool survives_lost_workers(Method method, Routing routing, int64_t stages) {
  return (method == Method::noloco || method == Method::none) && (stages == 1 || routing == Routing::random);
}
// Whether a failed worker can be restarted mid-run and take a live
// replica's state: only NoLoCo has no step where every replica must be there.
inline bool takes_back_restarted(Method method, Routing routing, int64_t stages) {
  return method == Method::noloco && survives_lost_workers(method, routing, stages);
}
// Whether new workers can join the running run (noloco join): NoLoCo
// replicas meet in groups drawn afresh at each outer step, and random routing
// draws a pipeline's routes over whoever serves a stage.
inline bool takes_joiners(Method method, Routing routing, int64_t stages) {
  return takes_back_restarted(method, routing, stages);
}
// Whether the method exchanges slow weights every H steps (and so has a wire codec, fragments, overlap).
inline bool has_outer_steps(Method method) { return method == Method::diloco || method == Method::noloco; }

}  // namespace noloco
