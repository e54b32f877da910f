// GlooCommunicator: the Communicator over Gloo's TCP transport.
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/common.h"
#include "common/mutex.h"
#include "worker_agent/communicator_base.h"
#include "worker_agent/gloo_pairs.h"
#include "worker_agent/round_communicator.h"
#include "worker_agent/store.h"
#include "worker_agent/topology.h"

namespace gloo {
class Context;
}

namespace elastic::worker_agent {

class AbortableContext;
class ShmCommunicator;
class ShmGroup;
class ShmKeeper;

struct GlooOptions {
  std::string iface;     // bind to this interface when set ...
  std::string hostname;  // ... else to this local address/host name (default 127.0.0.1)
  Duration connect_timeout = std::chrono::seconds(60);
  Duration collective_timeout = std::chrono::seconds(300);
  size_t fusion_bytes = 64u << 20;
  // Connect every pair (N-1 per rank) instead of the ones Gloo's algorithms use (GlooPeers).
  // The agent sets it from WorkerOptions::gloo_full_mesh (ELASTIC_GLOO_FULL_MESH=1).
  bool full_mesh = false;
  // When some host has more than one rank: ranks of a host allreduce through shared memory
  // and only each host's local rank 0 takes part in a cross-host Gloo ring of its own (the
  // hierarchical allreduce). Every rank must agree (any that cannot map the segment turns it
  // off for all). The agent turns it off for ELASTIC_SHM_ALLREDUCE=0.
  bool shm = true;
  size_t shm_slot_bytes = 0;  // 0: ShmGroup::DefaultSlotBytes
  // Every rank on one host with the shared-memory allreduce: broadcast, allgather and barrier
  // go through the segment too (ELASTIC_SHM_COLLECTIVES=0: over the pairs), and the pairs
  // connect only when something needs them (ELASTIC_GLOO_LAZY_PAIRS=0: when a round forms).
  bool shm_collectives = true;
  bool lazy_pairs = true;
  // Where this process keeps its segment between rounds (the Agent has one; null: a new
  // segment every round). A later round of the same processes on a host reuses it.
  std::shared_ptr<ShmKeeper> shm_keeper;
};

// The ranks `rank` connects to in a communicator of `size`: those at distances +-2^k (mod
// size). Gloo's ring allreduce, allgather and allgatherv use +-1, its broadcast (a binomial
// tree in the root's numbering) and its dissemination barrier +-2^k: about 2 log2(size) pairs
// per rank, not size - 1. Sorted, without `rank`.
std::vector<int> GlooPeers(int rank, int size);

// The factory of GlooCommunicators with `options`: what the Agent builds each round's host
// communicator with.
std::shared_ptr<CommunicatorFactory> MakeGlooFactory(GlooOptions options);

class GlooCommunicator : public CommunicatorBase<RoundCommunicator> {
 public:
  // A communicator for `topo`, not connected yet (INVALID_ARGUMENT for a bad topology, or
  // UNAVAILABLE when the interface or address cannot be bound). Abort() works on it at once.
  // Sets SIGPIPE to ignored for the process when it had the default disposition: a dead peer
  // must not kill this one.
  static StatusOr<std::unique_ptr<GlooCommunicator>> New(const Topology& topo,
                                                         const GlooOptions& options);
  // Connects the pairs through `store`: publishes the addresses of this rank's pairs (one per
  // peer of GlooPeers, or every rank with full_mesh) under key "<rank>", fetches its peers'
  // keys (in the same call), connects the pairs all at once. When some host has several ranks
  // it sets up the hierarchical allreduce (GlooOptions::shm): local rank 0 publishes its
  // segment under "shm/<cross_rank>" first, the others fetch it with their peers' addresses,
  // every rank agrees (AgreeMin), and the local ranks 0 connect a cross-host communicator
  // under keys "x/...". When every rank is on one host and the shared memory is on, the pairs
  // wait for the first broadcast, allgather or barrier (the agreement then goes through the
  // store): `store` must outlive the communicator (ELASTIC_GLOO_LAZY_PAIRS=0: connect here).
  // Blocks up to the connect timeout. ABORTED when Abort() came before or during it (from
  // any thread: the store wait is the caller's to cancel, the pairs are failed here);
  // UNAVAILABLE / DEADLINE_EXCEEDED (with Gloo's message) when peers do not show up. Call
  // once.
  Status Connect(RoundStore* store) override;
  // New() then Connect().
  static StatusOr<std::unique_ptr<GlooCommunicator>> Create(RoundStore* store, const Topology& topo,
                                                            const GlooOptions& options);
  ~GlooCommunicator() override;

  // Gloo's ring, or HierarchicalAllreduce (worker_agent/hierarchical.h) when some host has
  // several ranks; on the caller's thread then, else on the executor thread.
  void Allreduce(void* data, size_t count, DataType dtype, ReduceOp op) override;
  // Buckets of up to GlooOptions::fusion_bytes through one fusion buffer (AllreduceFused).
  void AllreduceMany(const std::vector<TensorView>& tensors, ReduceOp op) override;
  // Broadcast, allgather and barrier go to the host's ShmCommunicator when every rank is on
  // one host (shm_collectives()), else over the pairs, connecting them at the first use when
  // they wait for it.
  void Broadcast(void* data, size_t bytes, int root) override;
  std::vector<std::vector<char>> Allgather(const void* data, size_t bytes) override;
  void Barrier() override;
  void Abort() override;

  // Whether Allreduce goes through shared memory within hosts (GlooOptions::shm).
  bool hierarchical() const { return hier_; }
  // Whether broadcast, allgather and barrier go through the host's shared memory too (every
  // rank on one host with the hierarchical allreduce; ELASTIC_SHM_COLLECTIVES=0 turns it off):
  // such a round never connects its Gloo pairs.
  bool shm_collectives() const { return hier_ && host_ && topo_.cross_size == 1 && shm_flat_; }
  // Whether the pairs are connected (on one host with shared memory and shm_collectives()
  // off: after the first broadcast, allgather or barrier).
  bool pairs_connected() const { return pairs_connected_; }
  // The token of the shared-memory segment this rank uses (0: none); the same token in two
  // rounds means the later one reused the segment (GlooOptions::shm_keeper).
  uint64_t shm_token() const;

  CollectiveStats stats() const override { return collective_stats(); }

 private:
  struct Executor;
  GlooCommunicator(std::shared_ptr<AbortableContext> ctx, Topology topo, GlooOptions options);
  // What this rank knows of its host's shared-memory segment before the pairs connect.
  struct ShmPlan {
    bool want = false;                // not turned off (option or ELASTIC_SHM_ALLREDUCE=0)
    std::string fetch_key;            // local ranks but 0: the key of local rank 0's segment
    std::string description;          // its value, fetched with the peers' addresses (local
                                      // rank 0: what it published)
    std::unique_ptr<ShmGroup> group;  // local rank 0: the segment it made or reuses
    std::string why;                  // why this rank cannot take part, if it cannot
  };
  // Some host has more than one rank (every rank knows: fewer hosts than ranks): the
  // hierarchical allreduce is set up.
  bool SomeHostShared() const { return topo_.size > 1 && topo_.cross_size < topo_.size; }
  // Local rank 0 makes the segment (or says "off") and publishes it before the pairs, so that
  // the others fetch it with their peers' addresses, in one call.
  Status PlanShm(RoundStore* store, ShmPlan* plan);
  Status ConnectPairs(RoundStore* store, const std::string& extra_key, std::string* extra_value);
  Status SetUpHierarchy(RoundStore* store, ShmPlan* plan);
  // Local rank 0 of a round that spans hosts: the cross-host communicator among the hosts'
  // local ranks 0 (keys "x/..." of the round's store).
  Status ConnectCross(RoundStore* store);
  // After an agreement that found a rank new to its host's reused segment: the hosts that
  // offered one make a new segment (local rank 0) and map it (the others); installs it.
  Status ReplaceReusedSegment(RoundStore* store, const std::string& key, std::string* why);
  // Local rank 0: a new segment for this round into `group`, and what to publish: its
  // description, or "off" with the reason in `why`.
  std::string NewSegment(std::unique_ptr<ShmGroup>* group, std::string* why) const;
  // The other local ranks: the segment `description` mapped, or null with the reason in `why`.
  std::unique_ptr<ShmGroup> OpenSegment(const std::string& description, std::string* why) const;
  // Elementwise min of `n` values over every rank, by dissemination over the pairs at
  // distances 1, 2, 4, ... (log2(size) rounds, where the ring takes 2(size-1) steps): the
  // agreement on the shared-memory path while a round connects.
  void AgreeMin(int64_t* values, size_t n);
  // The same min, over the pairs when they are connected, else through `store` (keys
  // "agree/<key>/..."): rank 0 gathers every rank's values and puts the min.
  Status Agree(RoundStore* store, const std::string& key, int64_t* values, size_t n);
  // Connects the pairs if they wait for their first use (lazy_store_); ABORTED after an
  // abort. RequirePairs: the same, throwing WorkerLostError (`what`: the collective).
  Status EnsurePairs();
  // Runs `connect`, with an exception as UNAVAILABLE and any failure after Abort() as ABORTED.
  Status Attempt(const std::function<Status()>& connect);
  void RequirePairs(const char* what);
  // Runs a Gloo collective on the executor thread and waits for it or for Abort(). Gloo leaves
  // some waits unwoken when a pair fails (an unbound send queued on a pair that broke): they
  // would last the whole collective timeout. After Abort() every pair is closed, so such a
  // wait can do no more I/O: the caller gives it a short grace to finish, then leaves it to
  // end at Gloo's timeout on its own thread and throws WorkerLostError at once.
  void Guard(const char* what, std::function<void()> fn,
             Duration grace = std::chrono::milliseconds(500));
  // Runs `fn` on the caller's thread with Guard's bookkeeping (the abort checks, the counters
  // of the hang watch, gloo::Exception as WorkerLostError): for work whose every wait ends at
  // an abort by itself (the hierarchical allreduce, the shared-memory collectives). A
  // WorkerLostError also aborts the host's segment, so its other local ranks stop waiting.
  void Inline(const char* what, const std::function<void()>& fn);

  std::shared_ptr<AbortableContext> ctx_;
  GlooOptions options_;
  std::vector<char> fusion_;  // the fusion buffer, grown on first use up to fusion_bytes
  std::atomic<bool> aborted_{false};
  Mutex abort_mu_;                  // serializes Abort() against connecting and the destructor
  std::shared_ptr<void> device_;    // gloo::transport::Device, until the pairs connect
  // gloo::transport::Context being connected.
  std::shared_ptr<void> pairs_ ELASTIC_GUARDED_BY(abort_mu_);
  std::vector<int> peers_;          // the ranks this rank has a pair with, once connected
  std::shared_ptr<Executor> exec_;  // started on the first collective
  // The hierarchical allreduce (worker_agent/hierarchical.h), set while connecting, under
  // abort_mu_: the host's segment while the round agrees on it, then the host's ranks as a
  // communicator of their own (when this host has several), and the cross-host communicator
  // (local rank 0, when there are several hosts).
  std::unique_ptr<ShmGroup> shm_;
  std::unique_ptr<ShmCommunicator> host_;
  std::unique_ptr<GlooCommunicator> cross_;
  bool hier_ = false;
  bool shm_flat_ = true;  // ELASTIC_SHM_COLLECTIVES is not 0
  // One host, shared memory: the pairs connect at their first use, through this store (the
  // round's; whoever called Connect keeps it alive as long as the communicator).
  RoundStore* lazy_store_ = nullptr;
  bool pairs_connected_ = false;
  size_t chunk_bytes_ = 0;  // elements cut into chunks of this many bytes (every rank the same)
};

}  // namespace elastic::worker_agent
