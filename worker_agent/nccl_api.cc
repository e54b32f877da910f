// LoadNcclApi: NCCL and the CUDA runtime through dlopen (see nccl_api.h). Compiled against
// their headers when the build found them (ELASTIC_HAVE_NCCL); otherwise the backend is absent
// and LoadNcclApi says how to get it.
#include "worker_agent/nccl_api.h"

#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common/mutex.h"

#ifdef ELASTIC_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <link.h>
#include <nccl.h>
#include <spdlog/spdlog.h>
#endif

namespace elastic::worker_agent {

namespace {

// The wheels' libraries the Python package found (SetWheelLibraryPaths).
struct WheelPaths {
  Mutex mu;
  std::vector<std::string> nccl ELASTIC_GUARDED_BY(mu);
  std::vector<std::string> cudart ELASTIC_GUARDED_BY(mu);
};
WheelPaths& Wheels() {
  static WheelPaths* w = new WheelPaths;  // never destroyed: read by threads until exit
  return *w;
}

}  // namespace

void SetWheelLibraryPaths(std::vector<std::string> nccl, std::vector<std::string> cudart) {
  WheelPaths& w = Wheels();
  MutexLock g(w.mu);
  w.nccl = std::move(nccl);
  w.cudart = std::move(cudart);
}

#ifndef ELASTIC_HAVE_NCCL

bool NcclBackendBuilt() { return false; }

StatusOr<int> VisibleCudaDevices(const std::string&) {
  return FailedPrecondition("this build of elastic has no NCCL backend");
}

std::string LoadedNcclLibraries() { return ""; }

StatusOr<std::shared_ptr<NcclApi>> LoadNcclApi(const std::string&, const std::string&) {
  return FailedPrecondition(
      "this build of elastic has no NCCL backend (CMake did not find nccl.h and "
      "cuda_runtime_api.h); rebuild with CUDA and NCCL installed and -DELASTIC_WITH_NCCL=ON, "
      "or use --backend gloo");
}

#else

bool NcclBackendBuilt() { return true; }

namespace {

// A place to load a library from, and why it is tried there (for the log).
struct Candidate {
  std::string path;
  const char* source;
};

// The shared objects this process has loaded already whose file name starts with `prefix`
// (e.g. torch's libnccl.so.2), in load order.
std::vector<std::string> LoadedLibraries(const std::string& prefix) {
  struct Found {
    const std::string* prefix;
    std::vector<std::string> paths;
  } found{&prefix, {}};
  dl_iterate_phdr(
      [](struct dl_phdr_info* info, size_t, void* data) {
        auto* f = static_cast<Found*>(data);
        if (!info->dlpi_name || !*info->dlpi_name) return 0;
        std::string path = info->dlpi_name;
        std::string base = path.substr(path.find_last_of('/') + 1);
        if (base.compare(0, f->prefix->size(), *f->prefix) == 0) f->paths.push_back(path);
        return 0;
      },
      &found);
  return found.paths;
}

constexpr const char* kGiven = "given by ELASTIC_{NCCL,CUDART}_LIBRARY";
constexpr const char* kLoaded = "already loaded in this process, e.g. by torch";
constexpr const char* kWheel = "PyPI's wheel in the worker's Python environment";
constexpr const char* kSystem = "the system's library path";
constexpr const char* kBuild = "found at build time";

// Steps 1-5 of LoadNcclApi (nccl_api.h), for one library.
std::vector<Candidate> Candidates(const std::string& given, const std::string& file_prefix,
                                  const std::vector<std::string>& wheel,
                                  const std::vector<std::string>& system, const char* build) {
  std::vector<Candidate> out;
  if (!given.empty()) out.push_back({given, kGiven});
  for (auto& p : LoadedLibraries(file_prefix)) out.push_back({p, kLoaded});
  for (auto& p : wheel) out.push_back({p, kWheel});
  for (auto& p : system) out.push_back({p, kSystem});
  if (build && *build) out.push_back({build, kBuild});
  return out;
}

std::vector<std::string> WheelNccl() {
  WheelPaths& w = Wheels();
  MutexLock g(w.mu);
  return w.nccl;
}
std::vector<std::string> WheelCudart() {
  WheelPaths& w = Wheels();
  MutexLock g(w.mu);
  return w.cudart;
}

// One dlopen()ed library; symbols resolved by name.
struct Library {
  void* handle = nullptr;
  std::string path;
  const char* source = "";

  // The first of `candidates` that loads (RTLD_GLOBAL: NCCL's plugins find it).
  Status Open(const std::vector<Candidate>& candidates, const char* what) {
    std::string errors;
    for (const auto& c : candidates) {
      if (c.path.empty()) continue;
      handle = dlopen(c.path.c_str(), RTLD_NOW | RTLD_GLOBAL);
      if (handle) {
        path = c.path;
        source = c.source;
        return Status();
      }
      const char* e = dlerror();
      errors += "\n  " + c.path + " (" + c.source + "): " + (e ? e : "not found");
    }
    return FailedPrecondition(std::string("cannot load ") + what + ":" + errors);
  }
  template <typename Fn>
  Status Get(const char* name, Fn* out, bool required = true) {
    dlerror();
    void* sym = dlsym(handle, name);
    *out = reinterpret_cast<Fn>(sym);
    if (!sym && required) {
      return FailedPrecondition(std::string(name) + " is missing from " + path);
    }
    return Status();
  }
};

ncclDataType_t NcclType(DataType d) {
  switch (d) {
    case DataType::kF32: return ncclFloat32;
    case DataType::kF64: return ncclFloat64;
    case DataType::kF16: return ncclFloat16;
    case DataType::kBF16: return ncclBfloat16;
    case DataType::kI32: return ncclInt32;
    case DataType::kI64: return ncclInt64;
  }
  return ncclFloat32;
}

ncclRedOp_t NcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
  }
  return ncclSum;
}

Status OpenCudart(Library* lib, const std::string& path) {
  return lib->Open(Candidates(path, "libcudart.so", WheelCudart(),
                              {"libcudart.so.13", "libcudart.so.12", "libcudart.so"},
                              ELASTIC_CUDART_BUILD_PATH),
                   "the CUDA runtime (pip install nvidia-cuda-runtime, or set "
                   "ELASTIC_CUDART_LIBRARY to its path)");
}

class DlNcclApi : public NcclApi {
 public:
  Status Load(const std::string& nccl_path, const std::string& cudart_path) {
    RETURN_IF_ERROR(OpenCudart(&cudart_, cudart_path));
    RETURN_IF_ERROR(nccl_.Open(Candidates(nccl_path, "libnccl.so", WheelNccl(),
                                          {"libnccl.so.2", "libnccl.so"}, ELASTIC_NCCL_BUILD_PATH),
                               "NCCL (pip install nvidia-nccl-cu13, or set ELASTIC_NCCL_LIBRARY "
                               "to its path)"));
    RETURN_IF_ERROR(cudart_.Get("cudaGetDeviceCount", &get_device_count_));
    RETURN_IF_ERROR(cudart_.Get("cudaSetDevice", &set_device_));
    RETURN_IF_ERROR(cudart_.Get("cudaMalloc", &malloc_));
    RETURN_IF_ERROR(cudart_.Get("cudaFree", &free_));
    RETURN_IF_ERROR(cudart_.Get("cudaMemcpyAsync", &memcpy_async_));
    RETURN_IF_ERROR(cudart_.Get("cudaStreamSynchronize", &stream_sync_));
    RETURN_IF_ERROR(cudart_.Get("cudaEventCreateWithFlags", &event_create_));
    RETURN_IF_ERROR(cudart_.Get("cudaEventRecord", &event_record_));
    RETURN_IF_ERROR(cudart_.Get("cudaEventQuery", &event_query_));
    RETURN_IF_ERROR(cudart_.Get("cudaEventDestroy", &event_destroy_));
    RETURN_IF_ERROR(cudart_.Get("cudaGetErrorString", &cuda_error_string_));
    RETURN_IF_ERROR(nccl_.Get("ncclGetVersion", &get_version_));
    RETURN_IF_ERROR(nccl_.Get("ncclGetErrorString", &error_string_));
    RETURN_IF_ERROR(nccl_.Get("ncclGetLastError", &last_error_));
    RETURN_IF_ERROR(nccl_.Get("ncclGetUniqueId", &get_unique_id_));
    RETURN_IF_ERROR(nccl_.Get("ncclCommInitRankConfig", &init_rank_config_));
    RETURN_IF_ERROR(nccl_.Get("ncclCommGetAsyncError", &get_async_error_));
    RETURN_IF_ERROR(nccl_.Get("ncclCommAbort", &comm_abort_));
    RETURN_IF_ERROR(nccl_.Get("ncclAllReduce", &all_reduce_));
    RETURN_IF_ERROR(nccl_.Get("ncclBroadcast", &broadcast_));
    RETURN_IF_ERROR(nccl_.Get("ncclAllGather", &all_gather_));
    RETURN_IF_ERROR(nccl_.Get("ncclCommRevoke", &comm_revoke_, /*required=*/false));
    RETURN_IF_ERROR(nccl_.Get("ncclCommShrink", &comm_shrink_, /*required=*/false));
    if (get_version_(&version_) != ncclSuccess) version_ = 0;
    if (version_ < 21400) {  // non-blocking communicators came with 2.14
      return FailedPrecondition("NCCL " + std::to_string(version_) + " at " + nccl_.path +
                                " is too old: the NCCL backend needs 2.14 or newer");
    }
    return Status();
  }

  int version() const override { return version_; }
  std::string Describe() const {
    return "NCCL " + std::to_string(version_ / 10000) + "." +
           std::to_string(version_ / 100 % 100) + "." + std::to_string(version_ % 100) +
           " from " + nccl_.path + " (" + nccl_.source + "); CUDA runtime from " +
           cudart_.path + " (" + cudart_.source + ")";
  }
  bool has_revoke() const override { return comm_revoke_ != nullptr && version_ >= 22807; }
  bool has_shrink() const override { return comm_shrink_ != nullptr && version_ >= 22700; }
  std::string ErrorString(int r) override {
    const char* s = error_string_(static_cast<ncclResult_t>(r));
    return s ? s : "unknown NCCL error " + std::to_string(r);
  }
  std::string LastError(Comm comm) override {
    const char* s = last_error_(static_cast<ncclComm_t>(comm));
    return s ? s : "";
  }

  Status DeviceCount(int* n) override { return Cuda(get_device_count_(n), "cudaGetDeviceCount"); }
  Status SetDevice(int d) override { return Cuda(set_device_(d), "cudaSetDevice"); }
  Status Malloc(void** p, size_t bytes) override { return Cuda(malloc_(p, bytes), "cudaMalloc"); }
  Status Free(void* p) override { return Cuda(free_(p), "cudaFree"); }
  Status MemcpyAsync(void* dst, const void* src, size_t bytes, Stream s) override {
    return Cuda(memcpy_async_(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(s)),
                "cudaMemcpyAsync");
  }
  Status StreamSynchronize(Stream s) override {
    return Cuda(stream_sync_(static_cast<cudaStream_t>(s)), "cudaStreamSynchronize");
  }
  Status EventCreate(Event* e) override {
    cudaEvent_t ev = nullptr;
    Status s = Cuda(event_create_(&ev, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    *e = ev;
    return s;
  }
  Status EventRecord(Event e, Stream s) override {
    return Cuda(event_record_(static_cast<cudaEvent_t>(e), static_cast<cudaStream_t>(s)),
                "cudaEventRecord");
  }
  Status EventQuery(Event e) override {
    cudaError_t r = event_query_(static_cast<cudaEvent_t>(e));
    if (r == cudaErrorNotReady) return Unavailable("not ready");
    return Cuda(r, "cudaEventQuery");
  }
  Status EventDestroy(Event e) override {
    return Cuda(event_destroy_(static_cast<cudaEvent_t>(e)), "cudaEventDestroy");
  }

  int GetUniqueId(std::string* id) override {
    ncclUniqueId uid;
    ncclResult_t r = get_unique_id_(&uid);
    if (r == ncclSuccess) id->assign(uid.internal, sizeof uid.internal);
    return r;
  }
  int CommInitRank(Comm* comm, int nranks, const std::string& id, int rank) override {
    if (id.size() != sizeof(ncclUniqueId)) return ncclInvalidArgument;
    ncclUniqueId uid;
    std::memcpy(uid.internal, id.data(), sizeof uid.internal);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t c = nullptr;
    ncclResult_t r = init_rank_config_(&c, nranks, uid, rank, &config);
    *comm = c;
    return r;
  }
  int CommShrink(Comm parent, const std::vector<int>& exclude, Comm* comm) override {
    if (!comm_shrink_) return ncclInvalidUsage;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    std::vector<int> ex = exclude;
    ncclComm_t c = nullptr;
    ncclResult_t r = comm_shrink_(static_cast<ncclComm_t>(parent), ex.data(),
                                  static_cast<int>(ex.size()), &c, &config, NCCL_SHRINK_ABORT);
    *comm = c;
    return r;
  }
  int CommGetAsyncError(Comm comm, int* async) override {
    ncclResult_t a = ncclSuccess;
    ncclResult_t r = get_async_error_(static_cast<ncclComm_t>(comm), &a);
    *async = a;
    return r;
  }
  int CommAbort(Comm comm) override { return comm_abort_(static_cast<ncclComm_t>(comm)); }
  int CommRevoke(Comm comm) override {
    if (!comm_revoke_) return ncclInvalidUsage;
    return comm_revoke_(static_cast<ncclComm_t>(comm), NCCL_REVOKE_DEFAULT);
  }
  int AllReduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                Comm comm, Stream stream) override {
    return all_reduce_(send, recv, count, NcclType(dtype), NcclOp(op),
                       static_cast<ncclComm_t>(comm), static_cast<cudaStream_t>(stream));
  }
  int Broadcast(const void* send, void* recv, size_t bytes, int root, Comm comm,
                Stream stream) override {
    return broadcast_(send, recv, bytes, ncclInt8, root, static_cast<ncclComm_t>(comm),
                      static_cast<cudaStream_t>(stream));
  }
  int AllGather(const void* send, void* recv, size_t bytes, Comm comm, Stream stream) override {
    return all_gather_(send, recv, bytes, ncclInt8, static_cast<ncclComm_t>(comm),
                       static_cast<cudaStream_t>(stream));
  }

 private:
  Status Cuda(cudaError_t r, const char* what) {
    if (r == cudaSuccess) return Status();
    const char* s = cuda_error_string_ ? cuda_error_string_(r) : nullptr;
    return Internal(std::string(what) + ": " + (s ? s : "CUDA error " + std::to_string(r)));
  }

  Library nccl_, cudart_;
  int version_ = 0;
  cudaError_t (*get_device_count_)(int*) = nullptr;
  cudaError_t (*set_device_)(int) = nullptr;
  cudaError_t (*malloc_)(void**, size_t) = nullptr;
  cudaError_t (*free_)(void*) = nullptr;
  cudaError_t (*memcpy_async_)(void*, const void*, size_t, cudaMemcpyKind, cudaStream_t) = nullptr;
  cudaError_t (*stream_sync_)(cudaStream_t) = nullptr;
  cudaError_t (*event_create_)(cudaEvent_t*, unsigned) = nullptr;
  cudaError_t (*event_record_)(cudaEvent_t, cudaStream_t) = nullptr;
  cudaError_t (*event_query_)(cudaEvent_t) = nullptr;
  cudaError_t (*event_destroy_)(cudaEvent_t) = nullptr;
  const char* (*cuda_error_string_)(cudaError_t) = nullptr;
  ncclResult_t (*get_version_)(int*) = nullptr;
  const char* (*error_string_)(ncclResult_t) = nullptr;
  const char* (*last_error_)(ncclComm_t) = nullptr;
  ncclResult_t (*get_unique_id_)(ncclUniqueId*) = nullptr;
  ncclResult_t (*init_rank_config_)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*) = nullptr;
  ncclResult_t (*get_async_error_)(ncclComm_t, ncclResult_t*) = nullptr;
  ncclResult_t (*comm_abort_)(ncclComm_t) = nullptr;
  ncclResult_t (*comm_revoke_)(ncclComm_t, int) = nullptr;
  ncclResult_t (*comm_shrink_)(ncclComm_t, int*, int, ncclComm_t*, ncclConfig_t*, int) = nullptr;
  ncclResult_t (*all_reduce_)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                              ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*broadcast_)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t,
                             cudaStream_t) = nullptr;
  ncclResult_t (*all_gather_)(const void*, void*, size_t, ncclDataType_t, ncclComm_t,
                              cudaStream_t) = nullptr;
};

}  // namespace

StatusOr<int> VisibleCudaDevices(const std::string& cudart_path) {
  Library cudart;
  RETURN_IF_ERROR(OpenCudart(&cudart, cudart_path));
  cudaError_t (*count)(int*) = nullptr;
  const char* (*error_string)(cudaError_t) = nullptr;
  RETURN_IF_ERROR(cudart.Get("cudaGetDeviceCount", &count));
  RETURN_IF_ERROR(cudart.Get("cudaGetErrorString", &error_string));
  int n = 0;
  cudaError_t r = count(&n);
  if (r != cudaSuccess) {
    const char* why = error_string(r);
    return FailedPrecondition(std::string("cudaGetDeviceCount: ") + (why ? why : "CUDA error"));
  }
  return n;  // the runtime stays loaded (dlclose of the CUDA runtime is not safe)
}

namespace {
struct Loaded {
  Mutex mu;
  std::shared_ptr<DlNcclApi> api ELASTIC_GUARDED_BY(mu);
  Status error ELASTIC_GUARDED_BY(mu);
  bool tried ELASTIC_GUARDED_BY(mu) = false;
};
Loaded& TheLoaded() {
  static Loaded* l = new Loaded;  // never destroyed: the libraries stay loaded until exit
  return *l;
}
}  // namespace

StatusOr<std::shared_ptr<NcclApi>> LoadNcclApi(const std::string& nccl,
                                               const std::string& cudart) {
  // Loaded once per process; a failure is remembered too (the libraries will not appear).
  Loaded& l = TheLoaded();
  MutexLock g(l.mu);
  if (!l.tried) {
    l.tried = true;
    auto dl = std::make_shared<DlNcclApi>();
    l.error = dl->Load(nccl, cudart);
    if (l.error.ok()) {
      l.api = std::move(dl);
      spdlog::info("{}", l.api->Describe());
    }
  }
  if (!l.error.ok()) return l.error;
  return std::shared_ptr<NcclApi>(l.api);
}

std::string LoadedNcclLibraries() {
  Loaded& l = TheLoaded();
  MutexLock g(l.mu);
  return l.api ? l.api->Describe() : "";
}

#endif

}  // namespace elastic::worker_agent
