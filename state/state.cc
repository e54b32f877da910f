#include "state/state.h"

#include <algorithm>

#include <stdexcept>

#include "common/test_hook.h"

namespace elastic {

void State::Commit() {
  TestHook("before_save", version_ + 1);
  Save();
  ++version_;
  TestHook("after_save", version_);
  commit_interrupted_ = true;  // stays so if the hook throws (TakeCommitInterrupted)
  if (commit_hook_) commit_hook_();
  commit_interrupted_ = false;
}

void State::Reset(int rank, int size) {
  OnTopology(rank, size);
  for (auto& cb : reset_callbacks_) cb();
}

void ObjectState::OnTopology(int rank, int size) {
  for (auto* s : samplers_) s->SetRank(rank, size);
}

Status State::LoadCheckpoint(const CheckpointInfo& info) {
  Status s = LoadCheckpointFiles(info);
  if (!s.ok()) return s;
  version_ = info.version;
  return Status::Ok();
}

StatusOr<CheckpointInfo> RestoreNewestCheckpoint(State& state, const std::string& dir,
                                                 std::vector<std::string>* skipped) {
  for (const auto& info : ListCheckpoints(dir, skipped)) {
    Status s = state.LoadCheckpoint(info);
    if (s.ok()) return info;
    if (skipped) skipped->push_back(s.message());
    state.Restore();  // nothing half loaded stays

  }
  return NotFound(dir + " holds no valid checkpoint");
}

void ObjectState::Register(const std::string& name, Serializer serializer) {
  Entry e;
  e.serializer = std::move(serializer);
  e.committed = std::make_shared<const std::string>(e.serializer.save());
  entries_[name] = std::move(e);
}

void ObjectState::Track(const std::string& name, void* data, size_t bytes) {
  Tracked t{data, bytes, std::make_shared<std::vector<char>>(bytes), nullptr};
  if (bytes > 0) std::memcpy(t.committed->data(), data, bytes);
  tracked_[name] = std::move(t);
}

void ObjectState::AddSampler(const std::string& name, ElasticSampler* sampler) {
  samplers_.push_back(sampler);
  Register(name, Serializer{[sampler] { return sampler->Serialize(); },
                            [sampler](const std::string& s) { return sampler->Deserialize(s); }});
}

void ObjectState::Save() {
  for (auto& [name, e] : entries_) e.committed = std::make_shared<const std::string>(e.serializer.save());
  for (auto& [name, t] : tracked_) {
    if (t.committed.use_count() > 1) {
      // A checkpoint still writes the committed copy: this commit goes to the other buffer.
      std::swap(t.committed, t.spare);
      if (!t.committed || t.committed.use_count() > 1) {
        t.committed = std::make_shared<std::vector<char>>(t.bytes);
      }
    }
    if (t.bytes > 0) std::memcpy(t.committed->data(), t.data, t.bytes);
  }
}

void ObjectState::Restore() {
  for (auto& [name, e] : entries_) {
    Status s = e.serializer.load(*e.committed);
    if (!s.ok()) throw std::runtime_error("restoring '" + name + "': " + s.ToString());
  }
  for (auto& [name, t] : tracked_) {
    if (t.bytes > 0) std::memcpy(t.data, t.committed->data(), t.bytes);
  }
}

void ObjectState::PrepareCheckpoints() {
  for (auto& [name, t] : tracked_) {
    if (!t.spare) t.spare = std::make_shared<std::vector<char>>(t.bytes);  // zeroed: touched
  }
}

std::vector<CheckpointFile> ObjectState::CheckpointFiles() {
  std::vector<CheckpointFile> out;
  for (auto& [name, e] : entries_) {
    out.push_back({name, "value", e.committed, e.committed->data(), e.committed->size()});
  }
  for (auto& [name, t] : tracked_) {
    out.push_back({name, "tracked", t.committed, t.committed->data(), t.committed->size()});
  }
  return out;
}

Status ObjectState::LoadCheckpointFiles(const CheckpointInfo& info) {
  // Every value of this state must be in the checkpoint, and nothing else: a checkpoint of
  // another program (or of another version of it) is refused, not half loaded.
  size_t expected = entries_.size() + tracked_.size();
  for (const auto& f : info.files) {
    bool known = f.kind == "value" ? entries_.count(f.name) > 0
                                   : f.kind == "tracked" && tracked_.count(f.name) > 0;
    if (!known) {
      return InvalidArgument(info.path + " holds " + f.kind + " '" + f.name +
                             "', which this program's state does not have");
    }
  }
  if (info.files.size() != expected) {
    return InvalidArgument(info.path + " holds " + std::to_string(info.files.size()) +
                           " values; this program's state has " + std::to_string(expected));
  }
  // Read (and check) everything before changing anything.
  std::map<std::string, std::string> values, tracked;
  for (const auto& f : info.files) {
    std::string bytes;
    Status s = ReadCheckpointFile(info, f, &bytes);
    if (!s.ok()) return s;
    if (f.kind == "tracked" && bytes.size() != tracked_.at(f.name).bytes) {
      return InvalidArgument(info.path + ": tracked buffer '" + f.name + "' has " +
                             std::to_string(bytes.size()) + " bytes, this program's has " +
                             std::to_string(tracked_.at(f.name).bytes));
    }
    (f.kind == "value" ? values : tracked)[f.name] = std::move(bytes);
  }
  for (auto& [name, bytes] : values) {
    Status s = entries_.at(name).serializer.load(bytes);
    if (!s.ok()) return InvalidArgument(info.path + ": loading '" + name + "': " + s.message());
  }
  for (auto& [name, bytes] : tracked) {
    Tracked& t = tracked_.at(name);
    if (t.bytes > 0) std::memcpy(t.data, bytes.data(), t.bytes);
  }
  Save();
  return Status::Ok();
}

namespace {
// A sync's named values travel in chunks of at most this size; their total is bounded (the tracked
// buffers, broadcast in place, are not part of it).
constexpr uint64_t kSyncChunkBytes = 64u << 20;
constexpr uint64_t kMaxSyncBlobBytes = uint64_t{1} << 40;
}  // namespace

void ObjectState::Sync(Communicator& comm, int root) {
  // Named values travel as one length-prefixed blob; tracked buffers are broadcast in place.
  // The blob starts with the root's version; a receiver takes it only once everything came.
  std::string blob;
  if (comm.rank() == root) {
    blob.append(reinterpret_cast<const char*>(&version_), sizeof version_);
    for (auto& [name, e] : entries_) {
      std::string v = e.serializer.save();
      uint64_t n = v.size();
      blob.append(reinterpret_cast<const char*>(&n), sizeof n);
      blob += v;
    }
  }
  uint64_t size = blob.size();
  comm.Broadcast(&size, sizeof size, root);
  if (comm.rank() == root) TestHook("sync_root", version_);
  // The size comes from a peer: bounded, and the blob grows as its chunks arrive, so that a
  // corrupt size cannot make this rank allocate what the root never sends.
  if (size > kMaxSyncBlobBytes) {
    throw std::runtime_error("sync: the root announced a state of " + std::to_string(size) +
                             " bytes, over the limit of " + std::to_string(kMaxSyncBlobBytes));
  }
  if (comm.rank() != root) blob.clear();
  for (uint64_t off = 0; off < size;) {
    // Chunks grow with what has come (1 MiB, then doubling up to 64 MiB): what a rank holds
    // before a chunk arrives is never more than twice what it has received.
    uint64_t n = std::min<uint64_t>({size - off, std::max<uint64_t>(off, 1u << 20),
                                     kSyncChunkBytes});
    if (comm.rank() != root) blob.resize(static_cast<size_t>(off + n));
    comm.Broadcast(blob.data() + off, static_cast<size_t>(n), root);
    off += n;
  }
  int64_t root_version = version_;
  if (comm.rank() != root) {
    if (blob.size() < sizeof root_version) throw std::runtime_error("sync: state blob too short");
    std::memcpy(&root_version, blob.data(), sizeof root_version);
    size_t off = sizeof root_version;
    for (auto& [name, e] : entries_) {
      uint64_t n = 0;
      if (off + sizeof n > blob.size()) throw std::runtime_error("sync: state blob too short");
      std::memcpy(&n, blob.data() + off, sizeof n);
      off += sizeof n;
      if (n > blob.size() - off) throw std::runtime_error("sync: state blob too short");
      Status s = e.serializer.load(blob.substr(off, n));
      if (!s.ok()) throw std::runtime_error("sync of '" + name + "': " + s.ToString());
      off += n;
    }
  }
  for (auto& [name, t] : tracked_) comm.Broadcast(t.data, t.bytes, root);
  Save();
  version_ = root_version;
}

Progress ObjectState::progress() const {
  Progress p{version_};
  if (!samplers_.empty()) {
    const ElasticSampler* s = samplers_.front();
    p.epoch = s->epoch();
    p.cursor = s->cursor();
    p.samples = s->epoch() * s->num_samples() + s->cursor();
    p.epoch_size = s->num_samples();
  }
  return p;
}

}  // namespace elastic
