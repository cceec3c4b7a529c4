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
  return d;
}

// None, or the outer step's report (the last, when the step also applied
// what was in flight), with `left` once the replica has left.
py::object report(const std::vector<UserOuterStep>& steps, bool left) {
  if (steps.empty() && !left) return py::none();
  py::dict d = steps.empty() ? py::dict() : as_dict(steps.back());
  if (steps.size() > 1) {
    py::list all;
    for (const auto& s : steps) all.append(as_dict(s));
    d["outer_steps"] = all;
  }
  d["left"] = left;
  return std::move(d);
}

// One of the replica's calls that may wait on the network, without the GIL.
std::vector<UserOuterStep> released(UserLoopReplica& r, std::vector<UserOuterStep> (UserLoopReplica::*call)()) {
  py::gil_scoped_release released;
  return (r.*call)();
}

void bind_outer_optimizer(py::module_& m) {
  py::class_<UserLoopReplica>(m, "OuterOptimizer", R"(Wraps a replica's parameters in an outer method.

Call step() after every step of the inner optimizer. Started under torchrun
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; NOLOCO_RUN_TOKEN the same secret
in every process), one process a replica. Keyword arguments are the CLI's
outer and network keys (outer_interval, outer_lr, compression, overlap, seal,
peer_timeout, ...). The parameters become views of one flat buffer.)")
      .def(py::init([](const py::iterable& params, const std::string& method, const py::kwargs& kwargs) {
             auto named = named_tensors(params);
             auto keys = key_values(kwargs);
             keys.insert(keys.begin(), "method=" + method);
             // torch.distributed from the environment serves a TCPStore at
             // MASTER_PORT, where worker 0 would otherwise host the run's.
             const auto dist = py::module_::import("torch.distributed");
             const bool store_at_master = dist.attr("is_available")().cast<bool>() &&
                                          dist.attr("is_initialized")().cast<bool>();
             py::gil_scoped_release released;
             return std::make_unique<UserLoopReplica>(std::move(named), keys, store_at_master);
           }),
           py::arg("params"), py::arg("method") = "noloco")
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

PYBIND11_MODULE(noloco, m) {
  py::module_::import("torch");  // the tensor type caster needs torch's Python types
  m.doc() = "noloco's outer methods (NoLoCo, DiLoCo) around a PyTorch training loop";
  bind_outer_optimizer(m);
  bind_llama(m);
}
