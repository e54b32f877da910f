// State: what training commits, restores and syncs across membership changes (docs/recovery.md).
//
//   ObjectState holds named values. Save() snapshots them (the commit), Restore() rolls back
//   to the last snapshot, Sync() broadcasts rank 0's values to every rank. Raw buffers added
//   with Track() are snapshotted with one memcpy and synced with one broadcast each.
//
// Not thread-safe: used from the training thread.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "common/communicator.h"
#include "common/status.h"
#include "state/checkpoint.h"

namespace elastic {

// Orders each epoch's indices by a permutation of seed + epoch and keeps a cursor: how many of
// that order committed steps consumed. Rank i of `size` takes perm[cursor:] strided (i,
// i+size, ...), `batch` per step, so one step of all ranks consumes exactly
// perm[cursor : cursor + batch*size]. When the epoch's remainder is short, the ranks that run
// out repeat indices marked as padding, which the cursor never counts.
class ElasticSampler {
 public:
  struct Batch {
    std::vector<int64_t> indices;
    std::vector<bool> padding;  // true: a repeat to fill the step; give it zero weight
  };

  ElasticSampler(int64_t num_samples, bool shuffle, uint64_t seed);

  // The share this rank takes from now on. Call after every reset (Run does, via OnReset).
  void SetRank(int rank, int size);
  // The next step's indices for this rank; advances the cursor by what all ranks consume:
  // batch_per_rank * size, or at most `global_batch` when it is given (> 0). With
  // batch_per_rank = ceil(global_batch / size), every step consumes exactly global_batch
  // indices at any size (the positions beyond it are padding), so the steps, and a model
  // trained on them, do not depend on the number of workers.
  Batch Next(int batch_per_rank, int64_t global_batch = 0);
  // True when the epoch's indices are all consumed.
  bool EpochDone() const { return cursor_ >= num_samples_; }
  // Starts `epoch` (cursor 0, permutation of seed + epoch).
  void SetEpoch(int64_t epoch);
  int64_t epoch() const { return epoch_; }
  int64_t cursor() const { return cursor_; }
  int64_t num_samples() const { return num_samples_; }

  // The state that commits carry: epoch and cursor (the permutation is derived).
  std::string Serialize() const;
  Status Deserialize(const std::string& bytes);

 private:
  void BuildPermutation();
  int64_t num_samples_;
  bool shuffle_;
  uint64_t seed_;
  int64_t epoch_ = 0;
  int64_t cursor_ = 0;
  int rank_ = 0, size_ = 1;
  std::vector<int64_t> perm_;
};

// What a commit says about training, for the driver's reports and event log.
struct Progress {
  int64_t step = 0;      // commits made (the version)
  int64_t epoch = -1;    // of the first registered sampler; -1 when there is none
  int64_t cursor = -1;   // samples of that epoch consumed
  int64_t samples = -1;  // samples consumed over all epochs
  int64_t epoch_size = -1;  // samples in an epoch
};

class State {
 public:
  virtual ~State() = default;
  virtual Progress progress() const { return Progress{version_}; }
  // Snapshot the current values as the committed state.
  virtual void Save() = 0;
  // Roll the values back to the last snapshot.
  virtual void Restore() = 0;
  // Make every rank's values rank `root`'s (then Save()). May throw WorkerLostError.
  virtual void Sync(Communicator& comm, int root) = 0;

  // Save() as the next version, then ask whether the driver announced a membership change; if
  // so (agreed by every rank) throws HostsUpdated right after the save, so no committed work
  // is lost. Set by Run; without it Commit() only saves.
  void Commit();
  // The version of the committed state: how many commits made it (0: none yet, or a newcomer
  // whose sync has not completed). Restore() keeps it; a completed Sync() takes the root's.
  // The worker says it in every Join, and the driver picks rank 0 and the need for a sync
  // from what the members say (docs/recovery.md, "Who holds what is what the workers say").
  int64_t version() const { return version_; }
  void SetCommitHook(std::function<void()> hook) { commit_hook_ = std::move(hook); }
  // Whether the last Commit() ended by an exception of its hook (a peer lost in the commit's
  // agreement, say), after its Save(): no code of the program ran since, so the values are
  // still exactly the committed version, and a Restore() would copy them onto themselves.
  // Run asks once after each exception; this call clears it.
  bool TakeCommitInterrupted() {
    bool was = commit_interrupted_;
    commit_interrupted_ = false;
    return was;
  }
  // Called after every reset (new round), e.g. to rebuild an optimizer.
  void OnReset(std::function<void()> callback) { reset_callbacks_.push_back(std::move(callback)); }
  // A new round gave this rank `rank` of `size`: re-partitions registered samplers, then runs
  // the OnReset callbacks. Run calls it after every join.
  void Reset(int rank, int size);

  // Checkpoints (state/checkpoint.h). The committed state as files, sharing the snapshot the
  // last commit made: the files stay that version while later commits are made (they go to
  // other buffers). Empty: this state is not checkpointed. Called on the training thread.
  virtual std::vector<CheckpointFile> CheckpointFiles() { return {}; }
  // Called once when checkpoints are on, before training: allocate now what checkpoints will
  // need, so that no commit pays for it later.
  virtual void PrepareCheckpoints() {}
  // Loads a checkpoint's files into the values and commits them as the checkpoint's version.
  Status LoadCheckpoint(const CheckpointInfo& info);

 protected:
  virtual void OnTopology(int /*rank*/, int /*size*/) {}
  // Loads the files of `info` into the values (ReadCheckpointFile checks each), then Save().
  virtual Status LoadCheckpointFiles(const CheckpointInfo& /*info*/) {
    return FailedPrecondition("this state does not load checkpoints");
  }
  int64_t version_ = 0;

 private:
  std::function<void()> commit_hook_;
  bool commit_interrupted_ = false;  // Commit's hook is running, or threw
  std::vector<std::function<void()>> reset_callbacks_;
};

// Loads the newest checkpoint under `dir` that reads and checks whole into `state` (as its
// version); each one skipped (incomplete, corrupt, another program's) is said in `skipped`.
// NotFound when none loads.
StatusOr<CheckpointInfo> RestoreNewestCheckpoint(State& state, const std::string& dir,
                                                 std::vector<std::string>* skipped);

struct Serializer {
  std::function<std::string()> save;
  std::function<Status(const std::string&)> load;
};

class ObjectState : public State {
 public:
  // Registers a value by pointer (it must outlive the state): trivially copyable types,
  // std::vector of them, std::string; anything else through a Serializer.
  template <typename T>
  void Register(const std::string& name, T* value) {
    Register(name, MakeSerializer(value));
  }
  void Register(const std::string& name, Serializer serializer);
  // A raw buffer: commit is one memcpy, sync one broadcast.
  void Track(const std::string& name, void* data, size_t bytes);
  // Registers the sampler (not owned): its cursor and epoch commit with the state, and every
  // Reset re-partitions it for the new rank and size.
  void AddSampler(const std::string& name, ElasticSampler* sampler);

  void Save() override;
  void Restore() override;
  void Sync(Communicator& comm, int root) override;
  Progress progress() const override;
  // One file per registered value (its serialised bytes) and per tracked buffer (raw). Each
  // tracked buffer has a second committed copy (PrepareCheckpoints): a commit made while a
  // checkpoint holds the committed copy writes into the other one.
  std::vector<CheckpointFile> CheckpointFiles() override;
  // Allocates (and touches) the second buffer of every tracked buffer.
  void PrepareCheckpoints() override;

 private:
  template <typename T>
  static Serializer MakeSerializer(T* v) {
    if constexpr (std::is_same_v<T, std::string>) {
      return {[v] { return *v; },
              [v](const std::string& s) {
                *v = s;
                return Status::Ok();
              }};
    } else if constexpr (std::is_trivially_copyable_v<T>) {
      return {[v] { return std::string(reinterpret_cast<const char*>(v), sizeof(T)); },
              [v](const std::string& s) {
                if (s.size() != sizeof(T)) return InvalidArgument("size mismatch");
                std::memcpy(v, s.data(), sizeof(T));
                return Status::Ok();
              }};
    } else {
      using E = typename T::value_type;
      static_assert(std::is_same_v<T, std::vector<E>> && std::is_trivially_copyable_v<E>,
                    "register this type with a Serializer");
      return {[v] {
                return std::string(reinterpret_cast<const char*>(v->data()), v->size() * sizeof(E));
              },
              [v](const std::string& s) {
                if (s.size() % sizeof(E) != 0) return InvalidArgument("size mismatch");
                v->resize(s.size() / sizeof(E));
                std::memcpy(v->data(), s.data(), s.size());
                return Status::Ok();
              }};
    }
  }

  struct Entry {
    Serializer serializer;
    std::shared_ptr<const std::string> committed;  // shared with a checkpoint being written
  };
  struct Tracked {
    void* data;
    size_t bytes;
    std::shared_ptr<std::vector<char>> committed;  // shared with a checkpoint being written
    std::shared_ptr<std::vector<char>> spare;      // the other buffer, once one was needed
  };
  void OnTopology(int rank, int size) override;
  Status LoadCheckpointFiles(const CheckpointInfo& info) override;
  std::map<std::string, Entry> entries_;
  std::map<std::string, Tracked> tracked_;
  std::vector<ElasticSampler*> samplers_;
};

}  // namespace elastic
