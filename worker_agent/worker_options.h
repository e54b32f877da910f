// WorkerOptions: everything a worker reads from its environment, parsed once, here, and
// handed to what needs it (the agent, the communicators, the checkpoint writer). elastic-run
// sets most of these (docs/architecture.md, "Environment"); the tuning switches are in the
// README's table of worker variables, which tests/python/test_worker_env.py checks against
// kWorkerVariables below. No other file of a worker reads an ELASTIC_* variable
// (tests/python/test_worker_env.py checks that); the driver's are read in driver/main.cc.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include "common/common.h"
#include "common/etcd.h"
#include "common/tls.h"

namespace elastic {

// Which communicator carries the device collectives. Gloo is always there (CPU tensors, the
// commit agreement, CPU state sync); NCCL is added beside it for CUDA tensors.
enum class Backend { kGloo, kNccl, kAuto };
const char* BackendName(Backend b);
// "gloo", "nccl" or "auto"; INVALID_ARGUMENT otherwise.
StatusOr<Backend> ParseBackend(const std::string& name);

struct WorkerOptions {
  // Given by elastic-run to every worker.
  std::string driver_addr;  // ELASTIC_DRIVER_ADDR, host:port (required)
  std::string token;        // ELASTIC_JOB_TOKEN (required)
  // ELASTIC_JOB_TLS (elastic-run --tls): the job's CA and the workers' certificate and key
  // (common/tls.h, one line); empty: the driver speaks plain text.
  TlsIdentity tls;
  std::string slot;         // ELASTIC_SLOT, host:local_index (required)
  std::string hostname;     // ELASTIC_HOSTNAME (default: the slot's host)
  std::string iface;        // ELASTIC_IFACE (may be empty)
  std::string worker_id;    // ELASTIC_WORKER_ID: which launch of the slot this process is
  // ELASTIC_RIDE_OUT_FILE (remote slots, driver/launch.h): a file that exists while this
  // worker has lost its driver and rides the outage out, so that the remote side of the
  // launch, whose connection to the driver went with it, leaves the worker running.
  std::string ride_out_file;
  // ELASTIC_STATE_STORE (elastic-run --state-store): where, when its driver is lost, this
  // worker looks up the driver that leads the job now (docs/high-availability.md).
  std::optional<EtcdUrl> state_store;
  std::optional<Backend> backend;         // ELASTIC_BACKEND (elastic-run --backend)
  std::optional<Duration> driver_timeout;  // ELASTIC_DRIVER_TIMEOUT, seconds 0..86400
  bool spare = false;                      // ELASTIC_SPARE: started as a warm spare
  // Checkpoints (elastic-run --checkpoint-dir, --checkpoint-interval, --checkpoint-keep).
  std::string checkpoint_dir;                      // ELASTIC_CHECKPOINT_DIR (empty: none)
  std::optional<Duration> checkpoint_interval;      // ELASTIC_CHECKPOINT_INTERVAL, seconds
  std::optional<int> checkpoint_keep;              // ELASTIC_CHECKPOINT_KEEP, 1..1000
  // Set by the Python package: the signal that dumps this worker's stacks (0: none).
  int stack_signal = 0;  // ELASTIC_STACK_SIGNAL, 0..64

  // Tuning switches, each 0 or 1.
  bool nccl_shrink = true;      // ELASTIC_NCCL_SHRINK: shrink NCCL when members only leave
  bool shm_allreduce = true;    // ELASTIC_SHM_ALLREDUCE: a host's ranks reduce in shared memory
  bool shm_reuse = true;        // ELASTIC_SHM_REUSE: keep the segment for later rounds
  bool shm_collectives = true;  // ELASTIC_SHM_COLLECTIVES: broadcast/allgather/barrier too
  bool gloo_lazy_pairs = true;  // ELASTIC_GLOO_LAZY_PAIRS: one host connects pairs when needed
  bool gloo_full_mesh = false;  // ELASTIC_GLOO_FULL_MESH: every pair, not only Gloo's peers
  size_t shm_slot_bytes = 0;    // ELASTIC_SHM_SLOT_BYTES, 4 KiB..256 MiB (0: the default)
  std::string nccl_library;     // ELASTIC_NCCL_LIBRARY: a path to libnccl.so (else searched)
  std::string cudart_library;   // ELASTIC_CUDART_LIBRARY: a path to libcudart.so
  bool grpc_bdp_probe = false;  // ELASTIC_GRPC_BDP_PROBE: gRPC's HTTP/2 bandwidth probing

  std::string log_level;   // ELASTIC_LOG_LEVEL (empty: info), checked by InitLogging
  std::string test_hooks;  // ELASTIC_TEST_HOOKS (common/test_hook.h), checked when configured

  // Reads and checks every variable above; INVALID_ARGUMENT naming the variable and its value
  // (or the missing required one: run under elastic-run).
  static StatusOr<WorkerOptions> FromEnvironment();
};

// Every variable FromEnvironment reads, for the README's table and its test.
extern const char* const kWorkerVariables[];
extern const size_t kWorkerVariableCount;

}  // namespace elastic
