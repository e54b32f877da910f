// The names of the driver's events (the event log, `--event-log`, and what the monitor counts):
// each spelt here and nowhere else in the sources. README.md's "The event log" documents them,
// with their fields; tests/python/test_events_doc.py checks that the two name the same events
// and that no other source file spells one.
#pragma once

namespace elastic::driver::events {

inline constexpr char kDiscovery[] = "discovery";
inline constexpr char kHostAdded[] = "host_added";
inline constexpr char kHostRemoved[] = "host_removed";
inline constexpr char kHostChanged[] = "host_changed";
inline constexpr char kHostBlacklisted[] = "host_blacklisted";
inline constexpr char kWaitingForHosts[] = "waiting_for_hosts";
inline constexpr char kRoundProposed[] = "round_proposed";
inline constexpr char kRoundWithdrawn[] = "round_withdrawn";
inline constexpr char kFence[] = "fence";
inline constexpr char kRoundFormed[] = "round_formed";
inline constexpr char kWorkerStarted[] = "worker_started";
inline constexpr char kSparePromoted[] = "spare_promoted";
inline constexpr char kNewcomerStarted[] = "newcomer_started";
inline constexpr char kNewcomerReady[] = "newcomer_ready";
inline constexpr char kNewcomerPlaced[] = "newcomer_placed";
inline constexpr char kWorkerStartFailed[] = "worker_start_failed";
inline constexpr char kCommitted[] = "committed";
inline constexpr char kWorkerLost[] = "worker_lost";
inline constexpr char kWorkerLeaving[] = "worker_leaving";
inline constexpr char kMemberLeft[] = "member_left";
inline constexpr char kWorkerExited[] = "worker_exited";
inline constexpr char kWorkerHung[] = "worker_hung";
inline constexpr char kRoundHung[] = "round_hung";
inline constexpr char kRecoveryPhase[] = "recovery_phase";
inline constexpr char kHolderKept[] = "holder_kept";
inline constexpr char kStateLost[] = "state_lost";
inline constexpr char kStateRestored[] = "state_restored";
inline constexpr char kDriverResumed[] = "driver_resumed";
inline constexpr char kLeading[] = "leading";
inline constexpr char kLeadershipLost[] = "leadership_lost";
inline constexpr char kStraggler[] = "straggler";
inline constexpr char kStragglerCleared[] = "straggler_cleared";
inline constexpr char kCheckpointWritten[] = "checkpoint_written";
inline constexpr char kCheckpointFailed[] = "checkpoint_failed";
inline constexpr char kProgress[] = "progress";
inline constexpr char kStacksDumped[] = "stacks_dumped";
inline constexpr char kRoundFailed[] = "round_failed";
inline constexpr char kJobEnding[] = "job_ending";
inline constexpr char kJobEnded[] = "job_ended";

// Every name above, in the README's order.
inline constexpr const char* kAll[] = {
    kDiscovery,
    kHostAdded,
    kHostRemoved,
    kHostChanged,
    kHostBlacklisted,
    kWaitingForHosts,
    kRoundProposed,
    kRoundWithdrawn,
    kFence,
    kRoundFormed,
    kWorkerStarted,
    kSparePromoted,
    kNewcomerStarted,
    kNewcomerReady,
    kNewcomerPlaced,
    kWorkerStartFailed,
    kCommitted,
    kWorkerLost,
    kWorkerLeaving,
    kMemberLeft,
    kWorkerExited,
    kWorkerHung,
    kRoundHung,
    kRecoveryPhase,
    kHolderKept,
    kStateLost,
    kStateRestored,
    kDriverResumed,
    kLeading,
    kLeadershipLost,
    kStraggler,
    kStragglerCleared,
    kCheckpointWritten,
    kCheckpointFailed,
    kProgress,
    kStacksDumped,
    kRoundFailed,
    kJobEnding,
    kJobEnded,
};

}  // namespace elastic::driver::events
