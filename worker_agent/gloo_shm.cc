// GlooCommunicator's shared-memory host group while a round connects: the plan each round
// agrees on (which hosts map a segment, reused or new), and the ShmCommunicator and cross-host
// communicator it ends with (the collectives through them are worker_agent/shm_communicator.cc
// and worker_agent/hierarchical.cc). The rest of the communicator is in
// worker_agent/gloo_communicator.cc.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>

#include "common/mutex.h"
#include "common/test_hook.h"
#include "worker_agent/gloo_communicator.h"
#include "worker_agent/shm_communicator.h"
#include "worker_agent/shm_group.h"

namespace elastic::worker_agent {

namespace {

// The keys of the cross-host communicator, apart from the round's own: "x/<cross_rank>".
class PrefixStore : public RoundStore {
 public:
  PrefixStore(RoundStore* inner, std::string prefix) : inner_(inner), prefix_(std::move(prefix)) {}
  Status Set(const std::string& key, const std::string& value) override {
    return inner_->Set(prefix_ + key, value);
  }
  StatusOr<std::vector<std::string>> Get(const std::vector<std::string>& keys,
                                         Duration timeout) override {
    return inner_->Get(Prefixed(keys), timeout);
  }
  StatusOr<std::vector<std::string>> SetAndGet(const std::string& key, const std::string& value,
                                               const std::vector<std::string>& keys,
                                               Duration timeout) override {
    return inner_->SetAndGet(prefix_ + key, value, Prefixed(keys), timeout);
  }

 private:
  std::vector<std::string> Prefixed(const std::vector<std::string>& keys) const {
    std::vector<std::string> k;
    for (const auto& key : keys) k.push_back(prefix_ + key);
    return k;
  }
  RoundStore* inner_;
  std::string prefix_;
};

}  // namespace

uint64_t GlooCommunicator::shm_token() const {
  return host_ ? host_->token() : shm_ ? shm_->token() : 0;
}

std::string GlooCommunicator::NewSegment(std::unique_ptr<ShmGroup>* group,
                                         std::string* why) const {
  auto made = ShmGroup::Create(topo_.local_size, options_.shm_slot_bytes);
  if (!made.ok()) {
    *why = made.status().message();
    return "off";
  }
  *group = std::move(made).value();
  TestHook("shm_made", 0);
  return (*group)->Describe();
}

std::unique_ptr<ShmGroup> GlooCommunicator::OpenSegment(const std::string& description,
                                                        std::string* why) const {
  auto opened = ShmGroup::Open(description, topo_.local_rank, topo_.local_size);
  if (!opened.ok()) {
    *why = opened.status().message();
    return nullptr;
  }
  return std::move(opened).value();
}

Status GlooCommunicator::PlanShm(RoundStore* store, ShmPlan* plan) {
  if (!SomeHostShared()) return Status::Ok();
  plan->want = options_.shm;
  if (topo_.local_size < 2) return Status::Ok();
  const std::string key = "shm/" + std::to_string(topo_.cross_rank);
  if (topo_.local_rank != 0) {
    plan->fetch_key = key;
    return Status::Ok();
  }
  // Local rank 0 always answers, so that the others never wait for a segment that will not
  // come.
  plan->description = "off";
  if (plan->want) {
    const size_t slot = options_.shm_slot_bytes;
    std::unique_ptr<ShmGroup> kept = options_.shm_keeper ? options_.shm_keeper->Take() : nullptr;
    if (kept && kept->Fits(topo_.local_size) && (slot == 0 || slot == kept->slot_bytes()) &&
        kept->AllMappersQuiet()) {
      kept->Reuse(0, topo_.local_size);
      plan->description = kept->DescribeReuse();
      plan->group = std::move(kept);
    } else {
      kept.reset();  // unmapped before a new one is made
      plan->description = NewSegment(&plan->group, &plan->why);
    }
  }
  return store->Set(key, plan->description);
}

Status GlooCommunicator::SetUpHierarchy(RoundStore* store, ShmPlan* plan) {
  if (!SomeHostShared()) return Status::Ok();
  std::unique_ptr<ShmGroup> group = std::move(plan->group);
  std::string why = plan->why;  // why this rank cannot take part (empty: it can, or it is off)
  uint64_t token = 0;
  const bool offered = topo_.local_size > 1 && plan->want &&
                       ShmGroup::ParseReuse(plan->description, &token);
  bool missing = false;  // its host reuses a segment this rank does not hold
  if (topo_.local_size > 1 && topo_.local_rank != 0 && plan->want &&
      plan->description != "off") {
    std::unique_ptr<ShmGroup> kept = options_.shm_keeper ? options_.shm_keeper->Take() : nullptr;
    if (offered) {
      if (kept && kept->token() == token && kept->Fits(topo_.local_size)) {
        kept->Reuse(topo_.local_rank, topo_.local_size);
        group = std::move(kept);
      } else {
        missing = true;
      }
    } else {
      kept.reset();  // a new segment replaces it
      group = OpenSegment(plan->description, &why);
    }
  }
  // 2: this rank takes part (alone on its host, or holding the segment); 1: it would, but its
  // host reuses a segment it does not hold (it is new there); 0: it cannot, or it is off.
  int64_t vote = 0;
  if (plan->want) vote = topo_.local_size == 1 || group ? 2 : missing ? 1 : 0;
  {
    MutexLock g(abort_mu_);
    if (aborted_.load()) return Aborted("the communicator was aborted while connecting");
    shm_ = std::move(group);
  }
  // Every rank agrees, and on the chunk: the cross-host ring reduces a chunk at a time, so
  // every host must cut the same chunks (the smallest slot). After it every local rank has
  // mapped the segment, so its name can go.
  int64_t agree[2] = {vote, shm_ ? static_cast<int64_t>(shm_->slot_bytes()) : INT64_MAX};
  RETURN_IF_ERROR(Agree(store, "shm", agree, 2));
  const bool replaced = agree[0] == 1;
  if (replaced) {
    // A rank new to its host's reused segment: the hosts that reused one make a new one, and
    // every rank agrees again.
    if (offered) {
      RETURN_IF_ERROR(ReplaceReusedSegment(
          store, "shm/" + std::to_string(topo_.cross_rank) + "/new", &why));
    }
    agree[0] = plan->want && (topo_.local_size == 1 || shm_) ? 2 : 0;
    agree[1] = shm_ ? static_cast<int64_t>(shm_->slot_bytes()) : INT64_MAX;
    RETURN_IF_ERROR(Agree(store, "shm-again", agree, 2));
  }
  if (shm_) shm_->Unlink();
  chunk_bytes_ = static_cast<size_t>(agree[1]);
  if (agree[0] != 2) {
    if (!why.empty()) {
      spdlog::info("hierarchical shared-memory allreduce off for this round: {}", why);
    }
    MutexLock g(abort_mu_);
    shm_.reset();
    return Status::Ok();
  }
  if (topo_.local_rank == 0 && topo_.cross_size > 1) RETURN_IF_ERROR(ConnectCross(store));
  hier_ = true;
  if (topo_.local_rank == 0 && topo_.local_size > 1) {
    spdlog::debug("rank {}: shared-memory segment {:x} for {} local ranks: {}", topo_.rank,
                  shm_->token(), topo_.local_size,
                  offered && !replaced ? "kept from an earlier round"
                  : replaced           ? "new (a rank was new to some host's kept one)"
                                       : "new");
  }
  if (shm_) {
    // The host's ranks from now on: a communicator of their own over the segment.
    MutexLock g(abort_mu_);
    host_ = std::make_unique<ShmCommunicator>(topo_, std::move(shm_), chunk_bytes_,
                                              options_.collective_timeout);
    if (aborted_.load()) host_->Abort();
  }
  return Status::Ok();
}

Status GlooCommunicator::ConnectCross(RoundStore* store) {
  GlooOptions cross_options = options_;
  cross_options.shm = false;
  Topology cross{topo_.cross_rank, topo_.cross_size, 0, 1, topo_.cross_rank, topo_.cross_size};
  ASSIGN_OR_RETURN(std::unique_ptr<GlooCommunicator> made, New(cross, cross_options));
  GlooCommunicator* c = made.get();
  {
    MutexLock g(abort_mu_);
    cross_ = std::move(made);
    if (aborted_.load()) cross_->Abort();
  }
  PrefixStore prefixed(store, "x/");
  return c->Connect(&prefixed);
}

Status GlooCommunicator::ReplaceReusedSegment(RoundStore* store, const std::string& key,
                                              std::string* why) {
  {
    MutexLock g(abort_mu_);
    shm_.reset();
  }
  std::unique_ptr<ShmGroup> group;
  if (topo_.local_rank == 0) {
    RETURN_IF_ERROR(store->Set(key, NewSegment(&group, why)));
  } else {
    ASSIGN_OR_RETURN(std::vector<std::string> got, store->Get({key}, options_.connect_timeout));
    if (got.size() == 1 && got[0] != "off") group = OpenSegment(got[0], why);
  }
  MutexLock g(abort_mu_);
  if (aborted_.load()) return Aborted("the communicator was aborted while connecting");
  shm_ = std::move(group);
  return Status::Ok();
}

}  // namespace elastic::worker_agent
