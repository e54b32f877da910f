#include "rendezvous/convert.h"

namespace elastic::rendezvous {

void ToProto(const Assignment& a, v1::Assignment* out) {
  out->set_round(a.round);
  out->set_rank(a.rank);
  out->set_size(a.size);
  out->set_local_rank(a.local_rank);
  out->set_local_size(a.local_size);
  out->set_cross_rank(a.cross_rank);
  out->set_cross_size(a.cross_size);
  out->set_sync_required(a.sync_required);
}

Assignment FromProto(const v1::Assignment& a) {
  Assignment out;
  out.round = a.round();
  out.rank = a.rank();
  out.size = a.size();
  out.local_rank = a.local_rank();
  out.local_size = a.local_size();
  out.cross_rank = a.cross_rank();
  out.cross_size = a.cross_size();
  out.sync_required = a.sync_required();
  return out;
}

// The enums both ways by an explicit switch: ours to the wire without a default, so that the
// compiler (-Wswitch) names a value added to ours and not mapped; the wire's to ours with one,
// since a peer of another version may send a value this one does not know.
v1::Event::Kind ToProto(EventKind k) {
  switch (k) {
    case EventKind::kMembershipChanging:
      return v1::Event::MEMBERSHIP_CHANGING;
    case EventKind::kAbort:
      return v1::Event::ABORT;
    case EventKind::kShutdown:
      return v1::Event::SHUTDOWN;
  }
  return v1::Event::KIND_UNSPECIFIED;
}

std::optional<EventKind> FromProto(v1::Event::Kind k) {
  switch (k) {
    case v1::Event::MEMBERSHIP_CHANGING:
      return EventKind::kMembershipChanging;
    case v1::Event::ABORT:
      return EventKind::kAbort;
    case v1::Event::SHUTDOWN:
      return EventKind::kShutdown;
    default:
      return std::nullopt;
  }
}

v1::ReportRequest::Kind ToProto(ReportKind k) {
  switch (k) {
    case ReportKind::kCommitted:
      return v1::ReportRequest::COMMITTED;
    case ReportKind::kLeaving:
      return v1::ReportRequest::LEAVING;
    case ReportKind::kFailed:
      return v1::ReportRequest::FAILED;
    case ReportKind::kFinished:
      return v1::ReportRequest::FINISHED;
    case ReportKind::kHeartbeat:
      return v1::ReportRequest::HEARTBEAT;
    case ReportKind::kCheckpointed:
      return v1::ReportRequest::CHECKPOINTED;
    case ReportKind::kCheckpointFailed:
      return v1::ReportRequest::CHECKPOINT_FAILED;
    case ReportKind::kRestored:
      return v1::ReportRequest::RESTORED;
  }
  return v1::ReportRequest::KIND_UNSPECIFIED;
}

std::optional<ReportKind> FromProto(v1::ReportRequest::Kind k) {
  switch (k) {
    case v1::ReportRequest::COMMITTED:
      return ReportKind::kCommitted;
    case v1::ReportRequest::LEAVING:
      return ReportKind::kLeaving;
    case v1::ReportRequest::FAILED:
      return ReportKind::kFailed;
    case v1::ReportRequest::FINISHED:
      return ReportKind::kFinished;
    case v1::ReportRequest::HEARTBEAT:
      return ReportKind::kHeartbeat;
    case v1::ReportRequest::CHECKPOINTED:
      return ReportKind::kCheckpointed;
    case v1::ReportRequest::CHECKPOINT_FAILED:
      return ReportKind::kCheckpointFailed;
    case v1::ReportRequest::RESTORED:
      return ReportKind::kRestored;
    default:
      return std::nullopt;
  }
}

void ToProto(const Event& e, v1::Event* out) {
  out->set_kind(ToProto(e.kind));
  out->set_round(e.round);
  out->set_message(e.message);
}

bool FromProto(const v1::Event& e, Event* out) {
  std::optional<EventKind> kind = FromProto(e.kind());
  if (!kind) return false;
  out->kind = *kind;
  out->round = e.round();
  out->message = e.message();
  return true;
}

void ToProto(const Report& r, v1::ReportRequest* out) {
  out->set_slot(r.slot);
  out->set_kind(ToProto(r.kind));
  out->set_round(r.round);
  out->set_step(r.step);
  out->set_epoch(r.epoch);
  out->set_cursor(r.cursor);
  out->set_message(r.message);
  out->set_version(r.version);
  out->set_rebuild_seconds(r.rebuild_seconds);
  out->set_sync_seconds(r.sync_seconds);
  out->set_samples(r.samples);
  out->set_collectives(r.collectives);
  out->set_in_collective(r.in_collective);
  out->set_stack_signal(r.stack_signal);
  out->set_epoch_size(r.epoch_size);
  out->set_since_collective(r.since_collective);
  out->set_compute_seconds(r.compute_seconds);
  out->set_wait_seconds(r.wait_seconds);
  out->set_seconds(r.seconds);
}

bool FromProto(const v1::ReportRequest& r, Report* out) {
  std::optional<ReportKind> kind = FromProto(r.kind());
  if (!kind) return false;
  out->slot = r.slot();
  out->kind = *kind;
  out->round = r.round();
  out->step = r.step();
  out->epoch = r.epoch();
  out->cursor = r.cursor();
  out->message = r.message();
  out->version = r.version();
  out->rebuild_seconds = r.rebuild_seconds();
  out->sync_seconds = r.sync_seconds();
  out->samples = r.samples();
  out->collectives = r.collectives();
  out->in_collective = r.in_collective();
  out->stack_signal = r.stack_signal();
  out->epoch_size = r.epoch_size();
  out->since_collective = r.since_collective();
  out->compute_seconds = r.compute_seconds();
  out->wait_seconds = r.wait_seconds();
  out->seconds = r.seconds();
  return true;
}

}  // namespace elastic::rendezvous
