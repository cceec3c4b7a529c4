// `import noloco`: the outer methods for a PyTorch user's own model and loop.
//
//   opt = noloco.OuterOptimizer(model.named_parameters(), method="noloco", outer_interval=50)
//   for batch in data:
//       loss(model, batch).backward(); inner.step(); inner.zero_grad()
//       report = opt.step()   # None, or what the outer step did
//
// Everything network-bound runs with the GIL released, so the user's other
// Python threads (a data loader) go on meanwhile.
#include <torch/extension.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "python/configured_llama.h"
#include "python/user_loop_replica.h"

namespace py = pybind11;
using noloco::ConfiguredLlama;
using noloco::UserLoopReplica;
using noloco::UserOuterStep;

namespace {

// Parameters as the user has them: tensors (model.parameters()) or
// (name, tensor) pairs (model.named_parameters()).
std::vector<std::pair<std::string, torch::Tensor>> named_tensors(const py::iterable& params) {
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (const auto& item : params) {
    if (py::isinstance<py::tuple>(item)) {
      const auto pair = item.cast<py::tuple>();
      if (pair.size() != 2) throw py::value_error("params: a pair is (name, tensor)");
      named.emplace_back(pair[0].cast<std::string>(), pair[1].cast<torch::Tensor>());
    } else {
      named.emplace_back("param" + std::to_string(named.size()), item.cast<torch::Tensor>());
    }
  }
  if (named.empty()) throw py::value_error("params: no parameters (an exhausted generator?)");
  return named;
}

// kwargs as the CLI's key=value settings.
std::vector<std::string> key_values(const py::kwargs& kwargs) {
  std::vector<std::string> keys;
  for (const auto& [key, value] : kwargs) {
    const auto text = py::isinstance<py::bool_>(value) ? std::string(value.cast<bool>() ? "true" : "false")
                                                        : py::str(value).cast<std::string>();
    keys.push_back(key.cast<std::string>() + "=" + text);
  }
  return keys;
}

// The user's optimizer (torch.optim) as the state a restarted or joining
// replica takes with the weights: its per-parameter state (AdamW's moments
// and step) under "user_optimizer.<index>.<name>", numbers that are not
// tensors under "user_optimizer_number.<index>.<name>". Its param_groups
// (learning rates, betas) stay the joiner's own: the same script's.
class UserOptimizerState final : public noloco::InnerState {
 public:
  explicit UserOptimizerState(py::object optimizer) : optimizer_(std::move(optimizer)) {}
  ~UserOptimizerState() override {
    py::gil_scoped_acquire gil;
    optimizer_ = py::object();
  }

  void save(noloco::TensorMap& out) const override {
    py::gil_scoped_acquire gil;
    const py::dict state = optimizer_.attr("state_dict")()["state"];
    for (const auto& [index, entries] : state)
      for (const auto& [name, value] : entries.cast<py::dict>()) {
        const auto key = py::str(index).cast<std::string>() + "." + name.cast<std::string>();
        if (py::isinstance<py::float_>(value) || py::isinstance<py::int_>(value))
          out[kNumber + key] = torch::tensor(value.cast<double>(), torch::kFloat64);
        else if (!value.is_none())
          out[kTensor + key] = value.cast<torch::Tensor>().detach().contiguous();
      }
  }

  void load(const noloco::TensorMap& in, int64_t) override {
    py::gil_scoped_acquire gil;
    py::dict state;
    for (const auto& [key, tensor] : in) {
      const bool number = key.rfind(kNumber, 0) == 0;
      if (!number && key.rfind(kTensor, 0) != 0) continue;
      const auto rest = key.substr(number ? kNumber.size() : kTensor.size());
      const auto dot = rest.find('.');
      if (dot == std::string::npos) throw std::runtime_error("the handed-over optimizer state has a malformed key " + key);
      const py::int_ index(std::stoll(rest.substr(0, dot)));
      if (!state.contains(index)) state[index] = py::dict();
      state[index].cast<py::dict>()[py::str(rest.substr(dot + 1))] =
          number ? py::cast(tensor.item<double>()) : py::cast(tensor.clone());
    }
    if (state.empty()) return;  // the donor handed no optimizer state: this one's stays fresh
    py::dict whole = optimizer_.attr("state_dict")();
    whole["state"] = state;
    optimizer_.attr("load_state_dict")(whole);
  }

  int64_t steps_taken() const override { return 0; }  // the optimizer counts its own, in its state

 private:
  inline static const std::string kTensor = "user_optimizer.", kNumber = "user_optimizer_number.";
  py::object optimizer_;
};

py::dict as_dict(const UserOuterStep& s) {
  py::dict d;
  d["outer_step"] = s.sync.outer_step;
  d["fragment"] = s.sync.fragment;
  d["members"] = s.sync.members;
  d["group"] = s.sync.group;
  d["arrived"] = s.sync.arrived;
  d["lost"] = s.lost;
  d["bytes"] = s.sync.bytes;
  d["values_received"] = s.sync.values_received;
  d["values_dropped"] = s.sync.values_dropped;
  d["handed_over_to"] = s.handed_over_to;
  if (s.sync.pace) d["trained_steps"] = s.sync.pace->steps;  // pace=speed: its steps in the period
  return d;
}

// None, or the outer step's report (the last, when the step also applied
// what was in flight), with `left` once the replica has left. A leave that
// applied no outer step reports one with no group (the same keys, for the
// caller reading them).
py::object report(const std::vector<UserOuterStep>& steps, bool left) {
  if (steps.empty() && !left) return py::none();
  py::dict d = as_dict(steps.empty() ? UserOuterStep{} : steps.back());
  if (steps.empty()) d["outer_step"] = py::none();
  if (steps.size() > 1) {
    py::list all;
    for (const auto& s : steps) all.append(as_dict(s));
    d["outer_steps"] = all;
  }
  d["left"] = left;
  return std::move(d);
}

// OuterOptimizer.report(loss=None, val_loss=None).
void report_losses(UserLoopReplica& r, std::optional<double> loss, std::optional<double> val_loss) {
  r.report(loss.value_or(std::nan("")), val_loss.value_or(std::nan("")));
}

// One of the replica's calls that may wait on the network, without the GIL.
std::vector<UserOuterStep> released(UserLoopReplica& r, std::vector<UserOuterStep> (UserLoopReplica::*call)()) {
  py::gil_scoped_release released;
  return (r.*call)();
}

constexpr const char* kOuterOptimizerDoc = R"(Wraps a replica's parameters in an outer method.

Call step() after every step of the inner optimizer (pace="speed": ask
trains_now() before each slot, train where it says so, step() for every
slot). Started under torchrun
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; NOLOCO_RUN_TOKEN the same secret
in every process), one process a replica. Keyword arguments are the CLI's
outer and network keys (outer_interval, outer_lr, compression, overlap, seal,
peer_timeout, ...). The parameters become views of one flat buffer.

join=True joins a running noloco run as a new replica (NOLOCO_STORE names the
run's store, tcp://host:port for torchrun's; WORLD_SIZE the replicas it
started with); join="DIR" reads the invitation of `noloco launch --join-dir
DIR`. A joining or restarted replica takes a live one's weights and outer
state at its next outer step; `inner_steps` is then where its loop goes on.
inner_optimizer=opt hands the optimizer's state (AdamW's moments) over too;
without it a joiner's optimizer starts afresh.)";

void bind_outer_optimizer(py::module_& m) {
  py::class_<UserLoopReplica>(m, "OuterOptimizer", kOuterOptimizerDoc)
      .def(py::init([](const py::iterable& params, const std::string& method, const py::object& join,
                       const py::object& inner_optimizer, const py::kwargs& kwargs) {
             auto named = named_tensors(params);
             auto keys = key_values(kwargs);
             keys.insert(keys.begin(), "method=" + method);
             noloco::UserLoopStart start;
             // torch.distributed from the environment serves a TCPStore at
             // MASTER_PORT, where worker 0 would otherwise host the run's.
             const auto dist = py::module_::import("torch.distributed");
             start.store_at_master =
                 dist.attr("is_available")().cast<bool>() && dist.attr("is_initialized")().cast<bool>();
             if (py::isinstance<py::str>(join) || py::hasattr(join, "__fspath__")) {
               start.join = true;
               start.join_dir = py::module_::import("os").attr("fspath")(join).cast<std::string>();
             } else if (!join.is_none()) {
               start.join = join.cast<bool>();
             }
             std::unique_ptr<noloco::InnerState> inner;
             if (!inner_optimizer.is_none()) {
               if (!py::hasattr(inner_optimizer, "state_dict") || !py::hasattr(inner_optimizer, "load_state_dict"))
                 throw py::value_error("inner_optimizer: not a torch.optim optimizer (no state_dict/load_state_dict)");
               inner = std::make_unique<UserOptimizerState>(inner_optimizer);
             }
             py::gil_scoped_release released;
             return std::make_unique<UserLoopReplica>(std::move(named), keys, start, std::move(inner));
           }),
           py::arg("params"), py::arg("method") = "noloco", py::arg("join") = py::none(),
           py::arg("inner_optimizer") = py::none())
      .def("trains_now", &UserLoopReplica::trains_now,
           "pace=speed: whether this replica trains in the coming slot (ask before each step(); a slow replica "
           "trains in its share of the slots and calls step() for the others too); always True otherwise")
      .def(
          "step",
          [](UserLoopReplica& r) {
            const auto steps = released(r, &UserLoopReplica::step);  // before left(), which it may set
            return report(steps, r.left());
          },
          "After an inner step: None, or a dict of the outer step it took (group, arrived, lost, bytes); "
          "'left' is True once a SIGTERM made the replica leave the run")
      .def(
          "finish",
          [](UserLoopReplica& r) {
            const auto steps = released(r, &UserLoopReplica::finish);  // before left(), which it may set
            return report(steps, r.left());
          },
          "After the last inner step: applies what is in flight and ends this replica's membership")
      .def(
          "leave",
          [](UserLoopReplica& r) { return report(released(r, &UserLoopReplica::leave), true); },
          "Leaves the run now (noloco): what is in flight is applied, the partners stop waiting for this replica")
      .def("report", &report_losses, py::arg("loss") = py::none(), py::arg("val_loss") = py::none(),
           "Shows this replica's training loss (the table) and validation loss (its curve) on the run's live page "
           "(noloco watch, noloco serve), at the current inner step")
      .def("state_dict", &UserLoopReplica::state, "The outer state (slow weights, momentum, residuals) and step count")
      .def("load_state_dict", &UserLoopReplica::load_state, py::arg("state_dict"))
      .def("__enter__", [](UserLoopReplica& r) -> UserLoopReplica& { return r; }, py::return_value_policy::reference)
      .def("__exit__",
           [](UserLoopReplica& r, const py::object&, const py::object&, const py::object&) {
             py::gil_scoped_release released;
             r.finish();
           })
      .def_property_readonly("replica", &UserLoopReplica::replica)
      .def_property_readonly("replicas", &UserLoopReplica::replicas)
      .def_property_readonly("params", &UserLoopReplica::params)
      .def_property_readonly("inner_steps", &UserLoopReplica::inner_steps)
      .def_property_readonly("outer_steps", &UserLoopReplica::outer_steps)
      .def_property_readonly("outer_bytes", &UserLoopReplica::outer_bytes)
      .def_property_readonly("bits_per_param_per_inner_step", &UserLoopReplica::bits_per_param_per_inner_step)
      .def_property_readonly("bytes_sent", [](const UserLoopReplica& r) { return r.traffic().bytes_sent; })
      .def_property_readonly("bytes_received", [](const UserLoopReplica& r) { return r.traffic().bytes_received; })
      .def_property_readonly("bytes_relayed", [](const UserLoopReplica& r) { return r.traffic().bytes_relayed; })
      .def_property_readonly("bytes_punched", [](const UserLoopReplica& r) { return r.traffic().bytes_punched; })
      .def_property_readonly("rejoined",
                             [](const UserLoopReplica& r) -> py::object {
                               if (!r.rejoined()) return py::none();
                               py::dict d;
                               d["step"] = r.rejoined()->step;
                               d["donor"] = r.rejoined()->donor;
                               d["seconds"] = r.rejoined()->seconds;
                               d["joined"] = r.rejoined()->joined;
                               return std::move(d);
                             })
      .def_property_readonly("left", &UserLoopReplica::left)
      .def_property_readonly("finished", &UserLoopReplica::finished);
}

void bind_llama(py::module_& m) {
  py::class_<ConfiguredLlama>(m, "Llama", R"(The CLI's Llama and data for one replica of a run config.

noloco.Llama("configs/shakespeare.yaml", replica=0, out="runs/x", steps=...)
has the weights `noloco train` starts that replica from and gives the same
batch at each step: train_step(step) runs forward and backward (gradients
added to .grad) and returns the loss. Any other key of the config is given as
a keyword argument.)")
      .def(py::init([](const std::string& config, int replica, const py::kwargs& kwargs) {
             const auto overrides = key_values(kwargs);
             py::gil_scoped_release released;
             return std::make_unique<ConfiguredLlama>(config, overrides, replica);
           }),
           py::arg("config"), py::arg("replica") = 0)
      .def("named_parameters", &ConfiguredLlama::named_parameters)
      .def("parameters",
           [](ConfiguredLlama& l) {
             std::vector<torch::Tensor> params;
             for (auto& p : l.named_parameters()) params.push_back(p.second);
             return params;
           })
      .def("train_step", &ConfiguredLlama::train_step, py::arg("step"), py::call_guard<py::gil_scoped_release>())
      .def("evaluate", &ConfiguredLlama::evaluate, py::arg("step"), py::call_guard<py::gil_scoped_release>())
      .def("learning_rate", &ConfiguredLlama::learning_rate, py::arg("step"))
      .def_property_readonly("num_params", [](const ConfiguredLlama& l) { return l.model_config().num_params(); });
}

}  // namespace

PYBIND11_MODULE(_noloco, m) {
  py::module_::import("torch");  // the tensor type caster needs torch's Python types
  m.doc() = "noloco's outer methods (NoLoCo, DiLoCo) around a PyTorch training loop";
  bind_outer_optimizer(m);
  bind_llama(m);
}
