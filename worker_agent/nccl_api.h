// NcclApi: the calls the NCCL backend makes into NCCL and the CUDA runtime, behind one
// interface. The real one (LoadNcclApi) dlopen()s libnccl.so.2 and libcudart at run time, so
// one build of elastic runs on machines with and without CUDA, and a Python worker shares the
// libraries torch already loaded. Tests without a GPU give NcclCommunicator a stand-in.
//
// Handles are opaque pointers (ncclComm_t, cudaStream_t, cudaEvent_t); results are NCCL's
// ncclResult_t codes (kSuccess, kInProgress, else an error) or, for the CUDA calls, a Status.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/common.h"

namespace elastic::worker_agent {

class NcclApi {
 public:
  using Comm = void*;
  using Stream = void*;
  using Event = void*;
  static constexpr int kSuccess = 0;       // ncclSuccess
  static constexpr int kInProgress = 7;    // ncclInProgress
  static constexpr int kUniqueIdBytes = 128;

  virtual ~NcclApi() = default;

  // NCCL_VERSION_CODE of the loaded library (e.g. 22809 for 2.28.9).
  virtual int version() const = 0;
  virtual bool has_revoke() const = 0;  // ncclCommRevoke (NCCL >= 2.28.7)
  virtual bool has_shrink() const = 0;  // ncclCommShrink (NCCL >= 2.27)
  virtual std::string ErrorString(int result) = 0;
  virtual std::string LastError(Comm comm) = 0;

  // CUDA runtime.
  virtual Status DeviceCount(int* count) = 0;  // an error when no driver or device
  virtual Status SetDevice(int device) = 0;
  virtual Status Malloc(void** ptr, size_t bytes) = 0;
  virtual Status Free(void* ptr) = 0;
  // cudaMemcpyAsync with cudaMemcpyDefault (unified addressing tells the direction).
  virtual Status MemcpyAsync(void* dst, const void* src, size_t bytes, Stream stream) = 0;
  virtual Status StreamSynchronize(Stream stream) = 0;
  virtual Status EventCreate(Event* event) = 0;  // with cudaEventDisableTiming
  virtual Status EventRecord(Event event, Stream stream) = 0;
  // OK when the work before the event is done, UNAVAILABLE ("not ready") while it runs, an
  // internal error for a CUDA error.
  virtual Status EventQuery(Event event) = 0;
  virtual Status EventDestroy(Event event) = 0;

  // NCCL. Every communicator is made non-blocking (config.blocking = 0).
  virtual int GetUniqueId(std::string* id) = 0;  // kUniqueIdBytes bytes
  virtual int CommInitRank(Comm* comm, int nranks, const std::string& id, int rank) = 0;
  // ncclCommShrink(parent, exclude, ..., NCCL_SHRINK_ABORT).
  virtual int CommShrink(Comm parent, const std::vector<int>& exclude, Comm* comm) = 0;
  virtual int CommGetAsyncError(Comm comm, int* async_error) = 0;
  virtual int CommAbort(Comm comm) = 0;
  virtual int CommRevoke(Comm comm) = 0;
  virtual int AllReduce(const void* send, void* recv, size_t count, DataType dtype,
                        ReduceOp op, Comm comm, Stream stream) = 0;
  virtual int Broadcast(const void* send, void* recv, size_t bytes, int root, Comm comm,
                        Stream stream) = 0;
  virtual int AllGather(const void* send, void* recv, size_t bytes_per_rank, Comm comm,
                        Stream stream) = 0;
};

// Whether this build has the NCCL backend (built with NCCL's and CUDA's headers).
bool NcclBackendBuilt();

// How many CUDA devices this process sees, through the CUDA runtime alone (NCCL is not loaded):
// an error when the build has no NCCL backend, the runtime cannot be loaded or has no driver.
// `cudart`: a path to try first (WorkerOptions::cudart_library), or "".
StatusOr<int> VisibleCudaDevices(const std::string& cudart = "");

// The process's NCCL and CUDA runtime, loaded once. Each is the first of these that loads, and
// the choice is logged (and told by LoadedNcclLibraries):
//  1. `nccl` / `cudart` when given (WorkerOptions: ELASTIC_NCCL_LIBRARY / ELASTIC_CUDART_LIBRARY);
//  2. the one this process has loaded already: a Python worker's torch loads the libnccl.so.2
//     and libcudart of its wheels at `import torch`, and two NCCLs in one process do not mix;
//  3. PyPI's wheels (nvidia-nccl-cu12/-cu13, nvidia-cuda-runtime) in the worker's Python
//     environment, as the Python package tells them (SetWheelLibraryPaths);
//  4. libnccl.so.2 and libcudart.so.{13,12,} from the system's library path;
//  5. the ones found at build time.
// FAILED_PRECONDITION saying what is missing (and how to fix it) when the build has no NCCL
// backend or a library or symbol cannot be loaded.
StatusOr<std::shared_ptr<NcclApi>> LoadNcclApi(const std::string& nccl = "",
                                               const std::string& cudart = "");

// The libraries of PyPI's NCCL and CUDA runtime wheels of the Python environment, in order of
// preference (step 3 above); the Python package sets them at import, before any load.
void SetWheelLibraryPaths(std::vector<std::string> nccl, std::vector<std::string> cudart);

// After a successful LoadNcclApi: which NCCL and CUDA runtime were loaded, from where and why
// (e.g. "NCCL 2.30.7 from /v/.../libnccl.so.2 (already loaded in this process, e.g. by torch);
// CUDA runtime from ... (...)"); "" before that or when the load failed.
std::string LoadedNcclLibraries();

}  // namespace elastic::worker_agent
