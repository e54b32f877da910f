// _elastic: the pybind11 extension behind the Python package `elastic`. It binds the worker
// agent (join, assignment, reports), the communicator of the current round (collectives on raw
// buffers: the Python side hands in the data pointer of a contiguous numpy array or CPU torch
// tensor, so nothing is copied), State with its commit/restore/sync virtuals overridable from
// Python, and elastic::Run. Every call that waits releases the GIL.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <spdlog/spdlog.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "state/state.h"
#include "worker_agent/nccl_api.h"
#include "worker_agent/worker_agent.h"

namespace py = pybind11;
using namespace elastic;

namespace {

// The Python exception classes (elastic.WorkerLostError, elastic.HostsUpdatedInterrupt), set
// by the package at import.
py::object* g_lost = nullptr;
py::object* g_updated = nullptr;

// Runs Python code called from C++ (an override, the training function) and turns the Python
// exceptions that the recovery loop must see back into the C++ ones.
template <typename Fn>
auto CallPython(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (py::error_already_set& e) {
    if (g_lost && e.matches(*g_lost)) {
      std::string what = py::str(e.value());
      throw WorkerLostError(what);
    }
    if (g_updated && e.matches(*g_updated)) {
      std::string what = py::str(e.value());
      throw HostsUpdated(what);
    }
    throw;
  }
}

// State whose save/restore/sync are Python methods (elastic.State subclasses).
class PyState : public State {
 public:
  void Save() override {
    py::gil_scoped_acquire gil;
    CallPython([&] { PYBIND11_OVERRIDE_PURE_NAME(void, State, "save", Save); });
  }
  void Restore() override {
    py::gil_scoped_acquire gil;
    CallPython([&] { PYBIND11_OVERRIDE_PURE_NAME(void, State, "restore", Restore); });
  }
  void Sync(Communicator& /*comm*/, int root) override {
    py::gil_scoped_acquire gil;
    CallPython([&] {
      py::function f = py::get_override(static_cast<const State*>(this), "sync");
      if (!f) throw std::logic_error("elastic.State subclasses must define sync()");
      f(root);
    });
  }
  // Checkpoints: the Python state's checkpoint_files() -> {name: bytes} of its committed
  // state (None: not checkpointed), copied here (on the training thread) so that the write
  // needs no GIL.
  std::vector<CheckpointFile> CheckpointFiles() override {
    py::gil_scoped_acquire gil;
    std::vector<CheckpointFile> out;
    try {
      py::function f = py::get_override(static_cast<const State*>(this), "checkpoint_files");
      if (!f) return out;
      py::object r = f();
      if (r.is_none()) return out;
      for (auto item : r.cast<py::dict>()) {
        auto name = item.first.cast<std::string>();
        auto bytes = std::make_shared<const std::string>(item.second.cast<py::bytes>());
        out.push_back({name, "value", bytes, bytes->data(), bytes->size()});
      }
    } catch (py::error_already_set& e) {
      spdlog::warn("state.checkpoint_files() failed ({}: {}); no checkpoint this time",
                   std::string(py::str(e.type().attr("__name__"))), std::string(py::str(e.value())));
      out.clear();
    } catch (const std::exception& e) {
      spdlog::warn("state.checkpoint_files() failed ({}); no checkpoint this time", e.what());
      out.clear();
    }
    return out;
  }
  void SetVersion(int64_t v) { version_ = v; }

 protected:
  Status LoadCheckpointFiles(const CheckpointInfo& info) override {
    std::vector<std::pair<std::string, std::string>> files;
    for (const auto& e : info.files) {
      std::string bytes;
      Status s = ReadCheckpointFile(info, e, &bytes);
      if (!s.ok()) return s;
      files.emplace_back(e.name, std::move(bytes));
    }
    py::gil_scoped_acquire gil;
    try {
      py::function f = py::get_override(static_cast<const State*>(this), "load_checkpoint");
      if (!f) return FailedPrecondition("this state defines no load_checkpoint()");
      py::dict d;
      for (auto& [name, bytes] : files) d[py::str(name)] = py::bytes(bytes);
      f(d);
    } catch (py::error_already_set& e) {
      return InvalidArgument(info.path + ": load_checkpoint() raised " +
                             std::string(py::str(e.type().attr("__name__"))) + ": " +
                             std::string(py::str(e.value())));
    }
    {
      py::gil_scoped_release release;
      Save();
    }
    return Status::Ok();
  }

 public:
  // What a commit says about training (the driver's status, progress lines and event log): a
  // Python state's optional progress() -> (epoch, cursor, samples, epoch_size) or None. A
  // report never stops training: an error there leaves the step alone in the report.
  Progress progress() const override {
    Progress p{version_};
    py::gil_scoped_acquire gil;
    try {
      py::function f = py::get_override(static_cast<const State*>(this), "progress");
      if (!f) return p;
      py::object r = f();
      if (r.is_none()) return p;
      auto t = r.cast<std::tuple<int64_t, int64_t, int64_t, int64_t>>();
      p.epoch = std::get<0>(t);
      p.cursor = std::get<1>(t);
      p.samples = std::get<2>(t);
      p.epoch_size = std::get<3>(t);
    } catch (py::error_already_set& e) {
      Warn(std::string(py::str(e.type().attr("__name__"))) + ": " +
           std::string(py::str(e.value())));
    } catch (const std::exception& e) {
      Warn(e.what());
    }
    return p;
  }

 private:
  static void Warn(const std::string& why) {
    static bool warned = false;
    if (warned) return;
    warned = true;
    spdlog::warn("state.progress() failed ({}); commits report the step only", why);
  }
};

DataType DType(int code) {
  for (DataType t : kDataTypes) {
    if (static_cast<int>(t) == code) return t;
  }
  throw py::value_error("unknown dtype code " + std::to_string(code));
}

ReduceOp Op(int code) {
  for (ReduceOp o : kReduceOps) {
    if (static_cast<int>(o) == code) return o;
  }
  throw py::value_error("unknown reduce op " + std::to_string(code));
}

Communicator& Comm() { return worker_agent::InitAgent().comm(); }

// The NCCL communicator, collectives on `stream` (the caller's current torch stream).
DeviceCommunicator& DeviceComm(uintptr_t stream) {
  DeviceCommunicator* c = worker_agent::InitAgent().device_comm();
  if (!c) {
    throw std::invalid_argument(std::string("a CUDA tensor, but this worker's backend is ") +
                                BackendName(worker_agent::InitAgent().backend()) +
                                " (elastic-run --backend nccl)");
  }
  c->set_stream(reinterpret_cast<void*>(stream));
  return *c;
}

}  // namespace

PYBIND11_MODULE(_elastic, m) {
  m.doc() = "elastic-run worker agent (use the `elastic` package, not this module)";

  // Where the worker must end (worker_agent::WorkerEnd: not under elastic-run, no round to
  // join, scaled away), Python's own way: SystemExit(code), after the message; the library
  // never ends the interpreter itself.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const worker_agent::WorkerEnd& e) {
      if (e.code() == 0) {
        spdlog::info("{}", e.what());
      } else {
        std::string line = std::string(e.what()) + "\n";
        PySys_FormatStderr("%s", line.c_str());
      }
      py::object code = py::int_(e.code());
      PyErr_SetObject(PyExc_SystemExit, code.ptr());
    }
  });

  m.def("_set_exceptions", [](py::object lost, py::object updated) {
    g_lost = new py::object(std::move(lost));  // kept for the life of the process
    g_updated = new py::object(std::move(updated));
    py::register_exception_translator([](std::exception_ptr p) {
      try {
        if (p) std::rethrow_exception(p);
      } catch (const WorkerLostError& e) {
        PyErr_SetString(g_lost->ptr(), e.what());
      } catch (const HostsUpdated& e) {
        PyErr_SetString(g_updated->ptr(), e.what());
      }
    });
  });

  // The signal the package registered faulthandler on: the driver sends it to a hung worker
  // for its Python stacks (worker_agent::SetStackSignal).
  m.def("_set_stack_signal", [](int signal) { worker_agent::SetStackSignal(signal); });
  // PyPI's NCCL and CUDA runtime wheels of this environment, which the NCCL backend loads when
  // the process has none loaded yet (worker_agent/nccl_api.h, LoadNcclApi's step 3).
  m.def("_set_wheel_library_paths",
        [](std::vector<std::string> nccl, std::vector<std::string> cudart) {
          worker_agent::SetWheelLibraryPaths(std::move(nccl), std::move(cudart));
        });
  // Loads NCCL and the CUDA runtime as the NCCL backend would (no GPU needed) and says which
  // were chosen, from where and why; RuntimeError with the reason when they cannot be loaded.
  m.def(
      "_nccl_libraries",
      [](const std::string& nccl, const std::string& cudart) {
        auto api = worker_agent::LoadNcclApi(nccl, cudart);
        if (!api.ok()) throw std::runtime_error(api.status().message());
        return worker_agent::LoadedNcclLibraries();
      },
      py::arg("nccl") = "", py::arg("cudart") = "", py::call_guard<py::gil_scoped_release>());

  // The codes of common/communicator.h's enums, by name: the package's only source of them.
  py::dict dtypes, ops;
  for (DataType t : kDataTypes) dtypes[DataTypeName(t)] = static_cast<int>(t);
  for (ReduceOp o : kReduceOps) ops[ReduceOpName(o)] = static_cast<int>(o);
  m.attr("DTYPES") = dtypes;
  m.attr("REDUCE_OPS") = ops;
  m.def(
      "init", [] { worker_agent::InitAgent(); }, py::call_guard<py::gil_scoped_release>(),
      "Joins the job (round 0) and builds the communicator; idempotent.");
  m.def("assignment", [] {
    const auto& a = worker_agent::InitAgent().assignment();
    py::dict d;
    d["round"] = a.round;
    d["rank"] = a.rank;
    d["size"] = a.size;
    d["local_rank"] = a.local_rank;
    d["local_size"] = a.local_size;
    d["cross_rank"] = a.cross_rank;
    d["cross_size"] = a.cross_size;
    d["sync_required"] = a.sync_required;
    return d;
  });
  m.def("slot", [] { return worker_agent::InitAgent().env().slot; });
  m.def(
      "report_leaving",
      [](const std::string& why) { worker_agent::InitAgent().ReportLeaving(why); },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "check_host_updates", [] { worker_agent::InitAgent().CheckHostUpdates(); },
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "allreduce",
      [](uintptr_t ptr, size_t count, int dtype, int op) {
        Comm().Allreduce(reinterpret_cast<void*>(ptr), count, DType(dtype), Op(op));
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "allreduce_many",
      [](const std::vector<std::tuple<uintptr_t, size_t, int>>& tensors, int op) {
        std::vector<TensorView> views;
        for (const auto& [ptr, count, dtype] : tensors) {
          views.push_back({reinterpret_cast<void*>(ptr), count, DType(dtype)});
        }
        Comm().AllreduceMany(views, Op(op));
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "broadcast",
      [](uintptr_t ptr, size_t bytes, int root) {
        Comm().Broadcast(reinterpret_cast<void*>(ptr), bytes, root);
      },
      py::call_guard<py::gil_scoped_release>());
  m.def("allgather", [](const py::bytes& data) {
    std::string in = data;
    std::vector<std::vector<char>> out;
    {
      py::gil_scoped_release release;
      out = Comm().Allgather(in.data(), in.size());
    }
    py::list result;
    for (const auto& v : out) result.append(py::bytes(v.data(), v.size()));
    return result;
  });
  m.def(
      "barrier", [] { Comm().Barrier(); }, py::call_guard<py::gil_scoped_release>());

  m.def("backend", [] { return std::string(BackendName(worker_agent::InitAgent().backend())); });
  m.def("device", [] {
    DeviceCommunicator* c = worker_agent::InitAgent().device_comm();
    return c ? c->device() : -1;
  });
  m.def(
      "allreduce_cuda",
      [](uintptr_t ptr, size_t count, int dtype, int op, uintptr_t stream) {
        DeviceComm(stream).Allreduce(reinterpret_cast<void*>(ptr), count, DType(dtype), Op(op));
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "allreduce_many_cuda",
      [](const std::vector<std::tuple<uintptr_t, size_t, int>>& tensors, int op,
         uintptr_t stream) {
        std::vector<TensorView> views;
        for (const auto& [ptr, count, dtype] : tensors) {
          views.push_back({reinterpret_cast<void*>(ptr), count, DType(dtype)});
        }
        DeviceComm(stream).AllreduceMany(views, Op(op));
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "broadcast_cuda",
      [](uintptr_t ptr, size_t bytes, int root, uintptr_t stream) {
        DeviceComm(stream).Broadcast(reinterpret_cast<void*>(ptr), bytes, root);
      },
      py::call_guard<py::gil_scoped_release>());

  py::class_<State, PyState>(m, "State")
      .def(py::init<>())
      .def("commit", &State::Commit, py::call_guard<py::gil_scoped_release>(),
           "Saves the state as the next version, then checks for host updates (raises "
           "HostsUpdatedInterrupt at the same commit on every rank).")
      .def_property_readonly("version", &State::version)
      .def("_set_version", [](State& s, int64_t v) { static_cast<PyState&>(s).SetVersion(v); })
      .def(
          "_on_reset",
          [](State& s, py::function fn) {
            s.OnReset([fn] {
              py::gil_scoped_acquire gil;
              CallPython([&] { fn(); });
            });
          },
          "Registers a callback run after every reset (new round).")
      .def("_reset", &State::Reset);

  py::class_<ElasticSampler>(m, "ElasticSampler")
      .def(py::init<int64_t, bool, uint64_t>(), py::arg("num_samples"), py::arg("shuffle"),
           py::arg("seed"))
      .def("set_rank", &ElasticSampler::SetRank)
      .def("next",
           [](ElasticSampler& s, int per_rank, int64_t global_batch) {
             auto b = s.Next(per_rank, global_batch);
             return py::make_tuple(b.indices,
                                   std::vector<bool>(b.padding.begin(), b.padding.end()));
           })
      .def("epoch_done", &ElasticSampler::EpochDone)
      .def("set_epoch", &ElasticSampler::SetEpoch)
      .def_property_readonly("epoch", &ElasticSampler::epoch)
      .def_property_readonly("cursor", &ElasticSampler::cursor)
      .def_property_readonly("num_samples", &ElasticSampler::num_samples)
      .def("serialize", [](const ElasticSampler& s) { return py::bytes(s.Serialize()); })
      .def("deserialize", [](ElasticSampler& s, const py::bytes& b) {
        Status st = s.Deserialize(std::string(b));
        if (!st.ok()) throw py::value_error(st.message());
      });

  m.def(
      "run",
      [](State& state, py::function train) {
        py::gil_scoped_release release;
        worker_agent::RunLoop(state, [&train](State&) {
          py::gil_scoped_acquire gil;
          CallPython([&] { train(); });
        });
      },
      "The recovery loop (elastic::Run) around train(); the package's @elastic.run uses it. "
      "Raises SystemExit where elastic::Run ends the process.");
}
