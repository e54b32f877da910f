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

void ToProto(const Event& e, v1::Event* out) {
  out->set_kind(static_cast<v1::Event::Kind>(static_cast<int>(e.kind)));
  out->set_round(e.round);
  out->set_message(e.message);
}

Event FromProto(const v1::Event& e) {
  Event out;
  out.kind = static_cast<EventKind>(static_cast<int>(e.kind()));
  out.round = e.round();
  out.message = e.message();
  return out;
}

void ToProto(const Report& r, v1::ReportRequest* out) {
  out->set_slot(r.slot);
  out->set_kind(static_cast<v1::ReportRequest::Kind>(static_cast<int>(r.kind)));
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
  int kind = static_cast<int>(r.kind());
  if (kind < 1 || kind > 8) return false;
  out->slot = r.slot();
  out->kind = static_cast<ReportKind>(kind);
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
