// Who runs in the next round, and with which ranks: pure functions of the driver's view, so
// they are unit-tested apart from processes and the network (docs/architecture.md, "Rounds").
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

#include "discovery/discovery.h"
#include "rendezvous/types.h"

namespace elastic::driver {

struct PlanInput {
  std::vector<discovery::HostSlots> listed;     // the last good discovery result, as listed
  std::vector<discovery::HostSlots> available;  // listed and not blacklisted
  std::vector<std::string> host_order;          // every host ever listed, first-seen order
  std::set<std::string> alive;                  // slots with a healthy running worker
  std::set<std::string> busy;                   // slots whose process is still going away
  std::set<std::string> spares;                 // slots with a healthy warm spare (--spares)
  // Alive slots that stay although their host is no longer listed: the only holders of the
  // newest committed state, until it has been handed to the others (see Policy).
  std::set<std::string> keep;
  // Alive slots whose worker holds the newest committed version: when the cap leaves out
  // survivors, these are the last to go (a holder left out may exit before a later round
  // could keep it, and take the state with it).
  std::set<std::string> holders;
  // Alive slots and spares not heard from lately (stopped, their link down; a spare not yet
  // connected): when the cap leaves out survivors, these go before the ones that answer, and
  // a new process on a free slot is taken before a silent spare.
  std::set<std::string> silent;
  // Slots planned for no one (a straggler replaced or dropped, driver/stragglers.h): their
  // worker, alive or a spare, is left out, and no new process is planned there.
  std::set<std::string> evicted;
  size_t max_np = 0;                            // 0: no cap
  // Slots kept free of members for warm spares (--spares), unless fewer than `need` members
  // (-np) could run otherwise.
  size_t reserve = 0;
  size_t need = 0;
};

// The members of the next round, in rank order. Survivors keep their place on hosts that are
// still listed (blacklisting only stops new launches), and kept slots (`keep`) stay before all
// others; free slots of available hosts fill up
// to max_np (and to all slots but `reserve`, while at least `need` remain), survivors first
// (holders of the newest commit before the others), then warm spares (they take the place of
// a new process), then free slots. Ranks go host by host in first-seen order, slots in order. Who
// becomes rank 0 is decided when the round forms, from the versions the members say they
// hold (rendezvous::Core), not here.
std::vector<std::string> PlanMembers(const PlanInput& in);

// Whether `slot` (host:index) is one of the slots `listed` gives its host.
bool SlotListed(const std::vector<discovery::HostSlots>& listed, const std::string& slot);

using rendezvous::AssignRanks;
using rendezvous::Slot;

}  // namespace elastic::driver
