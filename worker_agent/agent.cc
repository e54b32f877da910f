#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <spdlog/spdlog.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "common/mutex.h"
#include "common/test_hook.h"
#include "worker_agent/shm_group.h"
#include "worker_agent/worker_agent.h"

namespace elastic::worker_agent {
namespace {

// The local address that routes to the driver: where peers can reach this worker.
std::string LocalAddressTowards(const std::string& driver_addr) {
  size_t colon = driver_addr.rfind(':');
  std::string host = colon == std::string::npos ? driver_addr : driver_addr.substr(0, colon);
  std::string port = colon == std::string::npos ? "1" : driver_addr.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || !res) return "127.0.0.1";
  std::string out = "127.0.0.1";
  int fd = socket(AF_INET, SOCK_DGRAM, 0);
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {  // UDP: sends nothing
    sockaddr_in local{};
    socklen_t len = sizeof local;
    char buf[INET_ADDRSTRLEN];
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        inet_ntop(AF_INET, &local.sin_addr, buf, sizeof buf)) {
      out = buf;
    }
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
  return out;
}

}  // namespace

AgentImpl::AgentImpl(WorkerOptions env, AgentOptions options)
    : env_(std::move(env)), options_(std::move(options)) {}

StatusOr<std::unique_ptr<AgentImpl>> AgentImpl::Create(WorkerOptions env, AgentOptions options) {
  if (options.gloo.iface.empty()) options.gloo.iface = env.iface;
  if (options.gloo.iface.empty() && options.gloo.hostname.empty()) {
    options.gloo.hostname = LocalAddressTowards(env.driver_addr);
  }
  // What the options leave unset, the environment (WorkerOptions) decides.
  if (!options.backend) options.backend = env.backend.value_or(Backend::kAuto);
  if (!env.nccl_shrink) options.nccl_shrink = false;
  options.gloo.shm = options.gloo.shm && env.shm_allreduce;
  options.gloo.shm_collectives = options.gloo.shm_collectives && env.shm_collectives;
  options.gloo.lazy_pairs = options.gloo.lazy_pairs && env.gloo_lazy_pairs;
  options.gloo.full_mesh = options.gloo.full_mesh || env.gloo_full_mesh;
  if (options.gloo.shm_slot_bytes == 0) options.gloo.shm_slot_bytes = env.shm_slot_bytes;
  // This process's shared-memory segment serves its later rounds on the host when it can
  // (ShmKeeper); ELASTIC_SHM_REUSE=0: a new one every round.
  if (!options.gloo.shm_keeper && env.shm_reuse) {
    options.gloo.shm_keeper = std::make_shared<ShmKeeper>();
  }
  if (!options.comms) options.comms = MakeGlooFactory(options.gloo);
  if (!options.driver_timeout) {
    options.driver_timeout = env.driver_timeout.value_or(std::chrono::seconds(120));
  }
  const bool spare = env.spare;
  // The backend: NCCL when asked (it must load and see a device), or under auto when it can.
  Backend backend = Backend::kGloo;
  std::shared_ptr<NcclApi> nccl_api;
  if (*options.backend != Backend::kGloo) {
    const bool required = *options.backend == Backend::kNccl;
    // The device count first, through the CUDA runtime alone: a CPU machine never loads NCCL.
    int devices = 0;
    StatusOr<std::shared_ptr<NcclApi>> api = FailedPrecondition("not loaded");
    Status why;
    if (options.nccl_api) {
      api = options.nccl_api;
      why = options.nccl_api->DeviceCount(&devices);
    } else {
      auto visible = VisibleCudaDevices(env.cudart_library);
      why = visible.status();
      if (visible.ok()) devices = *visible;
      if (why.ok() && devices > 0) {
        api = LoadNcclApi(env.nccl_library, env.cudart_library);
        why = api.status();
      }
    }
    if (why.ok() && devices == 0) why = FailedPrecondition("no CUDA device is visible");
    if (why.ok()) {
      backend = Backend::kNccl;
      nccl_api = *api;
      spdlog::info("backend: NCCL {} on {} visible CUDA device(s), Gloo beside it",
                   (*api)->version(), devices);
    } else if (required) {
      return FailedPrecondition("--backend nccl: " + why.message() +
                                " (use --backend auto or gloo on machines without GPUs)");
    } else {
      spdlog::debug("backend auto: Gloo ({})", why.message());
    }
  }
  std::unique_ptr<AgentImpl> agent(new AgentImpl(std::move(env), std::move(options)));
  agent->backend_ = backend;
  agent->spare_ = spare;
  if (backend == Backend::kNccl) {
    agent->device_comms_ = MakeNcclFactory(std::move(nccl_api), agent->options_.nccl);
  }
  rendezvous::ClientOptions co;
  co.address = agent->env_.driver_addr;
  co.token = agent->env_.token;
  co.tls = agent->env_.tls;
  co.worker_id = agent->env_.worker_id;
  co.bdp_probe = agent->env_.grpc_bdp_probe;
  agent->client_ = std::make_unique<rendezvous::Client>(co);
  if (agent->env_.state_store) {
    agent->store_ =
        std::make_unique<Etcd>(*agent->env_.state_store, std::chrono::milliseconds(500));
    // While the driver is lost, where the job's driver is now is looked up four times a second
    // (once its leader's lease may have run out), from a thread of its own: the Watch thread
    // may be held by a connection that never opens.
    agent->follower_ = std::thread([a = agent.get()] {
      MutexLock l(a->report_mu_);
      while (!a->report_stop_) {
        a->report_cv_.wait_for(l.native(), std::chrono::milliseconds(250));
        if (a->report_stop_) return;
        if (!a->driver_lost_.load()) {
          a->next_lookup_ = a->no_leader_since_ = TimePoint{};
          continue;
        }
        // Paced by the clock: commits wake this wait too (NoteCommit), several a second.
        const TimePoint now = SteadyClock::now();
        if (now < a->next_lookup_) continue;
        a->next_lookup_ = now + std::chrono::milliseconds(250);
        l.Unlock();
        a->FollowLeader();
        l.Lock();
      }
    });
  }
  agent->watch_ = std::thread([a = agent.get()] { a->WatchLoop(); });
  agent->reporter_ = std::thread([a = agent.get()] { a->ReportLoop(); });
  return agent;
}

AgentImpl::~AgentImpl() {
  StopWatch();
  MutexLock g(comm_mu_);
  comm_.reset();
  nccl_.reset();
  nccl_parent_.reset();
}

void AgentImpl::StopWatch() {
  stopping_.store(true);
  client_->CancelWatch();
  if (watch_.joinable()) watch_.join();
  if (end_watchdog_.joinable()) end_watchdog_.join();  // started by the Watch thread (End)
  {
    MutexLock g(report_mu_);
    report_stop_ = true;
  }
  report_cv_.notify_all();
  if (reporter_.joinable()) reporter_.join();
  if (follower_.joinable()) follower_.join();
}

void AgentImpl::ReportLoop() {
  // A commit report, or else a heartbeat every second: the driver tells a hung worker from
  // its peers waiting for it by what these say (docs/recovery.md, "Hangs and silent workers").
  MutexLock l(report_mu_);
  while (true) {
    report_cv_.wait_for(l.native(), std::chrono::seconds(1), [&]() ELASTIC_REQUIRES(report_mu_) {
      return report_stop_ || pending_.has_value();
    });
    if (report_stop_) return;
    rendezvous::Report r;
    if (pending_) {
      r = std::move(*pending_);
      pending_.reset();
    } else {
      r.kind = rendezvous::ReportKind::kHeartbeat;
    }
    l.Unlock();
    (void)SendReport(std::move(r));
    l.Lock();
    // At most one every 0.5 s: the newest commit by then is the one sent.
    report_cv_.wait_for(l.native(), std::chrono::milliseconds(500),
                        [&]() ELASTIC_REQUIRES(report_mu_) { return report_stop_; });
  }
}

namespace {
// A report of what a commit (or a checkpoint of one) holds.
rendezvous::Report ProgressReport(rendezvous::ReportKind kind, const Progress& p) {
  rendezvous::Report r;
  r.kind = kind;
  r.step = r.version = p.step;
  r.epoch = p.epoch;
  r.cursor = p.cursor;
  r.samples = p.samples;
  r.epoch_size = p.epoch_size;
  return r;
}
}  // namespace

void AgentImpl::NoteCommit(const Progress& p) {
  rendezvous::Report r = ProgressReport(rendezvous::ReportKind::kCommitted, p);
  r.round = current_round_.load();
  {
    MutexLock g(report_mu_);
    pending_ = std::move(r);
  }
  report_cv_.notify_all();
}

void AgentImpl::WatchLoop() {
  // A stream that breaks means the driver is gone or unreachable. Collectives and commits do
  // not need it, so a worker that had reached it trains on and keeps re-opening the stream;
  // only membership changes wait (Join, the round's store). Past the driver timeout it exits,
  // so that no worker outlives a driver that never comes back by more than that. With a
  // timeout of 0, or before the stream ever opened, it exits after a short while, as a
  // blip's allowance.
  const Duration timeout = *options_.driver_timeout;
  auto seconds = [](Duration d) { return std::chrono::duration<double>(d).count(); };
  auto lost_since = SteadyClock::now();
  bool ever_open = false;
  while (!stopping_.load()) {
    bool opened = false;
    Status s = client_->Watch(
        env_.slot, [this](const rendezvous::Event& e) { OnEvent(e); },
        [&] {
          opened = true;
          ever_open = true;
          watch_opened_.store(true);
          if (driver_lost_.exchange(false)) {
            if (!env_.ride_out_file.empty()) unlink(env_.ride_out_file.c_str());
            spdlog::warn("the driver at {} is reachable again after {:.1f} s", client_->address(),
                         seconds(SteadyClock::now() - lost_since));
            warned_reports_.store(false);
          }
        });
    if (stopping_.load()) return;
    TimePoint now = SteadyClock::now();
    if (opened) lost_since = now;
    if (s.code() == Code::kUnauthenticated || s.code() == Code::kInvalidArgument ||
        s.code() == Code::kFailedPrecondition) {
      End("the driver refused this worker's Watch: " + s.ToString());
      return;
    }
    const bool ride_out = ever_open && timeout > Duration::zero();
    if (ride_out && !driver_lost_.load()) {
      lost_since_ns_.store(
          std::chrono::duration_cast<std::chrono::nanoseconds>(lost_since.time_since_epoch())
              .count());
    }
    if (ride_out && !driver_lost_.exchange(true)) {
      if (!env_.ride_out_file.empty()) {
        // Made before the message: the remote side checks for it as soon as its
        // connection to the (dead) driver closes.
        int fd = open(env_.ride_out_file.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
        if (fd >= 0) {
          close(fd);
        } else {
          spdlog::warn("cannot make {} ({}): the remote side of the launch may end this worker",
                       env_.ride_out_file, strerror(errno));
        }
      }
      spdlog::warn(
          "lost the driver at {} ({}); training goes on without it (membership changes wait "
          "for it); this worker exits if it is not back within {:.0f} s (--driver-timeout)",
          client_->address(), s.ToString(), seconds(timeout));
    }
    Duration allowed = ride_out ? timeout : std::chrono::seconds(ever_open ? 3 : 30);
    if (now - lost_since > allowed) {
      End(fmt::format(
          "the driver at {} has been unreachable for {:.1f} s ({}; {}); this worker ends so "
          "that none outlives it",
          client_->address(), seconds(now - lost_since),
          ride_out ? fmt::format("--driver-timeout {:.0f} s", seconds(timeout))
                   : std::string(ever_open ? "--driver-timeout 0" : "it never answered"),
          s.ToString()));
      return;
    }
    if (ride_out) TestHook("watch_lost", 0);
    // Re-open backoff; while the driver is down, every 200 ms is enough to see it return.
    std::this_thread::sleep_for(std::chrono::milliseconds(driver_lost_.load() ? 200 : 100));
  }
}

void AgentImpl::End(const std::string& why) {
  spdlog::critical("{}; the training thread ends at its next commit, collective or join "
                   "(exit 3), and this process within {:.0f} s at the latest",
                   why, std::chrono::duration<double>(kEndGrace).count());
  // The last resort, armed first (an abort below may block, e.g. on a wedged GPU): for a
  // program that does not reach its next collective or commit in time (a training thread
  // stuck elsewhere, or one that caught the end and went on), the process ends here. A
  // process that ends meanwhile stops it (StopWatch, at exit, joins it after the Watch thread).
  end_watchdog_ = std::thread([this, why] {
    const TimePoint until = SteadyClock::now() + kEndGrace;
    while (!stopping_.load() && SteadyClock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (stopping_.load()) return;
    spdlog::critical("the process did not end within {:.0f} s of this worker's end ({}); "
                     "ending it (exit 3)",
                     std::chrono::duration<double>(kEndGrace).count(), why);
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(3);
  });
  {
    MutexLock g(end_mu_);
    end_why_ = why;
  }
  // Closed before the end is visible: the training thread, ending, reports nothing more (a
  // refused stray's report would be pinned on the slot's real process).
  client_->Close(why);
  ended_.store(true);
  MutexLock g(comm_mu_);
  if (comm_) comm_->Abort();
  if (nccl_) nccl_->Abort();
  if (nccl_parent_) nccl_parent_->Abort();
}

void AgentImpl::ThrowIfEnded() const {
  if (!ended_.load()) return;
  MutexLock g(end_mu_);
  throw WorkerEnd(3, "elastic: " + end_why_);
}

void AgentImpl::FollowLeader() {
  // The leader key's value is "ADDRESS\nPID\nHOST" (driver/leadership.h).
  auto leader = store_->Get("leader");
  if (!leader.ok()) {
    spdlog::debug("the state store: {}", leader.status().ToString());
    return;
  }
  const TimePoint now = SteadyClock::now();
  if (!leader->has_value()) {  // no driver leads now: a standby may yet take over
    // A standby leads within a moment of the old lease's end. When none has for a few
    // seconds (none runs, or etcd lost its quorum), once a second is enough.
    if (no_leader_since_ == TimePoint{}) no_leader_since_ = now;
    if (now - no_leader_since_ > std::chrono::seconds(3)) {
      next_lookup_ = now + std::chrono::seconds(1);
    }
    return;
  }
  no_leader_since_ = TimePoint{};
  const std::string& v = (*leader)->value;
  std::string address = v.substr(0, v.find('\n'));
  if (address.empty() || address.size() > 300) return;
  const std::string was = client_->address();
  if (client_->Redirect(address)) {
    spdlog::warn("the job's driver is now the one at {} (the state store {} says so; it was at "
                 "{})",
                 address, env_.state_store->text, was);
    return;
  }
  // Still the driver this worker lost: no other can lead before its lease runs out, so the
  // next lookup waits until then. etcd says the whole seconds left, rounded down: the lease
  // runs out less than a second after that. (Every worker looking four times a second
  // throughout kept etcd busy: at 64 workers on 2 cores, a third of training's rate.)
  if ((*leader)->lease == 0) return;
  auto left = store_->TimeToLive((*leader)->lease);
  if (left.ok() && *left >= 1) {
    next_lookup_ = now + std::chrono::seconds(*left);
    spdlog::debug("the driver at {} still holds its lease for {} s: the next lookup then", address,
                  *left);
  }
}

void AgentImpl::OnEvent(const rendezvous::Event& e) {
  using rendezvous::EventKind;
  switch (e.kind) {
    case EventKind::kMembershipChanging: {
      int64_t prev = changing_round_.load();
      while (e.round > prev && !changing_round_.compare_exchange_weak(prev, e.round)) {
      }
      spdlog::debug("driver: round {} is changing ({})", e.round, e.message);
      // A round that changes while this worker still connects it is left at once: its peers
      // may never connect (one cut off, gone, or removed), and no step was taken in it. Its
      // members are fenced alike, so they leave it too (those already connected at their
      // first collective, as after an abort).
      MutexLock g(comm_mu_);
      if (connecting_round_ >= 0 && connecting_round_ <= e.round && comm_ &&
          comm_round_ == connecting_round_) {
        spdlog::info("driver: round {} changes while this worker connects it ({}); leaving it",
                     e.round, e.message);
        client_->CancelGets(connecting_round_);
        comm_->Abort();
      }
      break;
    }
    case EventKind::kAbort:
      // An abort of the current round, or of a newer one that is still forming: whatever
      // this worker is doing in its current round (a collective running or about to start,
      // a communicator still connecting, a store wait) fails at once, and it goes to Join.
      if (e.round >= current_round_.load()) {
        int64_t prev = changing_round_.load();
        while (e.round > prev && !changing_round_.compare_exchange_weak(prev, e.round)) {
        }
        spdlog::info("driver: a peer of round {} is gone ({}); aborting collectives", e.round,
                     e.message);
        MutexLock g(comm_mu_);
        aborted_round_.store(std::max(aborted_round_.load(), e.round));
        client_->CancelGets(e.round);
        // Checked again under the lock: the training thread may have installed the next
        // round's communicator since, which this abort must not touch.
        if (comm_ && comm_round_ <= e.round) comm_->Abort();
        if (nccl_ && nccl_round_ <= e.round) nccl_->Abort();
        if (nccl_parent_) nccl_parent_->Abort();
      }
      break;
    case EventKind::kShutdown: {
      spdlog::info("driver: the job is shutting down");
      MutexLock g(comm_mu_);
      if (comm_) comm_->Abort();
      if (nccl_) nccl_->Abort();
      break;
    }
  }
}

StatusOr<rendezvous::JoinResult> AgentImpl::Join(int64_t version) {
  if (spare_) {
    spdlog::info(
        "slot {}: initialised, waiting for a place (a warm spare, or a newcomer that "
        "its peers take in at their next commit)",
        env_.slot);
  }
  // A worker that reached the driver rides out its loss from here on, also while it waits
  // for a place (a warm spare, a newcomer): a driver that adopts the job finds it running.
  // The stream opens in parallel with the first Join (WatchLoop): a moment's wait for it.
  if (!outlives_parent_) {
    TimePoint until = SteadyClock::now() + std::chrono::seconds(1);
    while (!watch_opened_.load() && SteadyClock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (watch_opened_.load()) OutliveParent();
  }
  auto joined = client_->Join(env_.slot, current_round_.load(), version, options_.join_timeout);
  if (spare_) {
    // A warm spare (elastic-run --spares) waits for a place as long as the job runs: the
    // driver gives it one, removes it, or stops it. While the driver is unreachable it waits
    // for it, until WatchLoop's --driver-timeout ends the process.
    while (!joined.ok() && (joined.status().code() == Code::kDeadlineExceeded ||
                            joined.status().code() == Code::kUnavailable)) {
      joined = client_->Join(env_.slot, current_round_.load(), version, options_.join_timeout);
    }
    spare_ = false;
  }
  return joined;
}

StatusOr<bool> AgentImpl::JoinNextRound(int64_t version) {
  {
    MutexLock g(comm_mu_);
    comm_.reset();
  }
  auto joined = Join(version);
  if (!joined.ok()) return joined.status().WithContext("joining the next round");
  if (joined->removed) {
    spdlog::info("slot {} was removed by the driver (scale-down)", env_.slot);
    return false;
  }
  assignment_ = joined->assignment;
  current_round_.store(assignment_.round);
  OutliveParent();
  SetTestHookRound(assignment_.round);
  Topology topo{assignment_.rank,       assignment_.size,       assignment_.local_rank,
                assignment_.local_size, assignment_.cross_rank, assignment_.cross_size};
  std::string round = "round " + std::to_string(assignment_.round);
  TimePoint rebuild_start = SteadyClock::now();
  auto made = options_.comms->New(topo);
  if (!made.ok()) return made.status().WithContext(round);
  RoundCommunicator* comm = made->get();
  {
    // Installed before it connects, so that an ABORT can reach it while it does; one that
    // came before (while this worker was still in Join) takes effect at once.
    MutexLock g(comm_mu_);
    comm_ = std::move(made).value();
    comm_round_ = assignment_.round;
    connecting_round_ = assignment_.round;
    if (aborted_round_.load() >= assignment_.round ||
        changing_round_.load() >= assignment_.round) {
      comm_->Abort();
    }
  }
  round_store_ = MakeRpcRoundStore(client_.get(), assignment_.round);
  Status connected = comm->Connect(round_store_.get());
  last_rebuild_ = SteadyClock::now() - rebuild_start;
  {
    MutexLock g(comm_mu_);
    connecting_round_ = -1;
  }
  if (!connected.ok()) {
    MutexLock g(comm_mu_);
    comm_.reset();
    // Whatever stopped the mesh (an abort, a peer that died or never came), the driver
    // re-forms: the caller rolls back and joins again.
    return Status(Code::kAborted, connected.WithContext(round).message());
  }
  if (backend_ == Backend::kNccl) {
    Status built = BuildNccl(topo);
    last_rebuild_ = SteadyClock::now() - rebuild_start;
    if (!built.ok()) {
      MutexLock g(comm_mu_);
      comm_.reset();
      nccl_.reset();
      // A host with too few GPUs is the user's to fix; anything else re-forms.
      if (built.code() == Code::kFailedPrecondition) return built.WithContext(round);
      return Status(Code::kAborted, built.WithContext(round).message());
    }
  }
  return true;
}

void AgentImpl::OutliveParent() {
  // A local worker is started with PR_SET_PDEATHSIG (common/process.h): a program that never
  // reaches the driver dies with it. One that joined rides out a lost driver (WatchLoop), so
  // the setting goes. It belongs to the thread that exec'd the program, the one that calls
  // Init() in every API (threads started later never have it): called from elsewhere, this
  // finds none, and the worker still dies with a local driver.
  if (outlives_parent_ || *options_.driver_timeout <= Duration::zero()) return;
  outlives_parent_ = true;
  int sig = 0;
  if (prctl(PR_GET_PDEATHSIG, &sig) == 0 && sig != 0) {
    prctl(PR_SET_PDEATHSIG, 0);
    spdlog::debug("joined the job: this worker no longer dies with its parent (signal {})", sig);
  }
}

StatusOr<AgentImpl::NcclShrinkPlan> AgentImpl::AgreeNcclShrink() {
  // Shrink when every member was in the same previous communicator and some of it is gone.
  // Each member says (previous round, its NCCL rank there, that communicator's size) over
  // Gloo, so every member takes the same decision.
  NcclShrinkPlan plan;
  if (!options_.nccl_shrink || !device_comms_->can_shrink()) return plan;
  struct Prev {
    int64_t round = -1;
    int32_t rank = -1;
    int32_t size = 0;
  } mine;
  DeviceRoundCommunicator* parent = nccl_parent_.get();
  if (parent && parent->shrinkable()) {
    mine = {last_nccl_round_, parent->device_rank(), parent->size()};
  }
  std::vector<std::vector<char>> all;
  try {
    all = comm_->Allgather(&mine, sizeof mine);
  } catch (const WorkerLostError& e) {
    return Aborted(std::string("agreeing on the NCCL rebuild: ") + e.what());
  }
  std::vector<Prev> prev(all.size());
  for (size_t r = 0; r < all.size(); ++r) std::memcpy(&prev[r], all[r].data(), sizeof(Prev));
  std::vector<bool> present(std::max(prev[0].size, 0), false);
  for (const Prev& p : prev) {
    if (p.round < 0 || p.round != prev[0].round || p.size != prev[0].size || p.rank < 0 ||
        p.rank >= p.size || present[p.rank]) {
      return plan;
    }
    present[p.rank] = true;
  }
  for (int r = 0; r < prev[0].size; ++r) {
    if (!present[r]) plan.exclude.push_back(r);
  }
  plan.shrink = !plan.exclude.empty();
  for (const Prev& p : prev) {  // NCCL numbers survivors in their old order
    plan.rank_of.push_back(
        static_cast<int>(std::count(present.begin(), present.begin() + p.rank, true)));
  }
  return plan;
}

Status AgentImpl::BuildNccl(const Topology& topo) {
  ASSIGN_OR_RETURN(auto made, device_comms_->New(topo, env_.hostname));
  DeviceRoundCommunicator* next = made.get();
  {
    MutexLock g(comm_mu_);
    nccl_parent_ = std::move(nccl_);  // the previous round's, if any: the shrink parent
    nccl_ = std::move(made);
    nccl_round_ = assignment_.round;
    if (aborted_round_.load() >= assignment_.round) nccl_->Abort();
  }
  TimePoint t0 = SteadyClock::now();
  DeviceRoundCommunicator* parent = nccl_parent_.get();
  ASSIGN_OR_RETURN(NcclShrinkPlan plan, AgreeNcclShrink());
  bool shrink = plan.shrink;
  const char* how = "init";
  Status s;
  if (shrink) {
    how = "shrink";
    s = next->ConnectByShrink(parent, plan.exclude, plan.rank_of);
    // Every member falls back together when any shrink failed.
    int32_t ok = s.ok() ? 1 : 0;
    try {
      comm_->Allreduce(&ok, 1, DataType::kI32, ReduceOp::kMin);
    } catch (const WorkerLostError& e) {
      return Aborted(std::string("agreeing on the NCCL shrink: ") + e.what());
    }
    if (!ok) {
      spdlog::warn("NCCL shrink failed on some rank ({}); a fresh init instead",
                   s.ok() ? "not this one" : s.message());
      ASSIGN_OR_RETURN(auto fresh, device_comms_->New(topo, env_.hostname));
      next = fresh.get();
      MutexLock g(comm_mu_);
      nccl_ = std::move(fresh);
      if (aborted_round_.load() >= assignment_.round) nccl_->Abort();
      shrink = false;
    }
  }
  if (!shrink) {
    how = "init";
    auto store = MakeRpcRoundStore(client_.get(), assignment_.round);
    s = next->Connect(store.get());
  }
  {
    MutexLock g(comm_mu_);
    nccl_parent_.reset();  // released with abort
  }
  if (!s.ok()) return s;
  last_nccl_round_ = assignment_.round;
  spdlog::info("NCCL communicator of round {} ({} ranks, device {}): {} in {:.1f} ms",
               assignment_.round, topo.size, next->device(), how,
               std::chrono::duration<double, std::milli>(SteadyClock::now() - t0).count());
  return Status();
}

DeviceRoundCommunicator* AgentImpl::device_comm() { return nccl_.get(); }

Communicator& AgentImpl::comm() {
  if (!comm_) throw std::logic_error("AgentImpl::comm() before a successful JoinNextRound()");
  return *comm_;
}

bool AgentImpl::change_pending() const {
  return current_round_.load() >= 0 && changing_round_.load() >= current_round_.load();
}

void AgentImpl::CheckHostUpdates() {
  int32_t flag = change_pending() ? 1 : 0;
  comm().Allreduce(&flag, 1, DataType::kI32, ReduceOp::kMax);
  if (flag > 0) {
    throw HostsUpdated("the driver announced a membership change after round " +
                       std::to_string(current_round_.load()));
  }
}

namespace {
std::atomic<int> g_stack_signal{0};  // SetStackSignal's (0: none set)
}  // namespace

void SetStackSignal(int signal) {
  if (signal >= 1 && signal <= 64) g_stack_signal.store(signal);
}

Status AgentImpl::SendReport(rendezvous::Report r) {
  r.slot = env_.slot;
  if (r.round < 0) r.round = current_round_.load();
  {
    MutexLock g(comm_mu_);
    if (comm_) {
      // Collectives on either communicator count: a GPU job's steps are NCCL's.
      CollectiveStats stats = comm_->stats();
      TimePoint last = stats.last_start;
      r.collectives = static_cast<int64_t>(stats.started);
      r.in_collective = stats.running;
      r.compute_seconds = stats.compute_seconds;
      r.wait_seconds = stats.wait_seconds;
      if (nccl_ && nccl_round_ == comm_round_) {
        const CollectiveStats device = nccl_->stats();
        r.collectives += static_cast<int64_t>(device.started);
        r.in_collective = r.in_collective || device.running;
        if (device.started > 0) last = std::max(last, device.last_start);
      }
      if (r.collectives > 0) {
        r.since_collective = std::chrono::duration<double>(SteadyClock::now() - last).count();
      }
    }
  }
  const int registered = g_stack_signal.load();
  r.stack_signal = registered > 0 ? registered : env_.stack_signal;
  if (r.message.size() > 4000) r.message.resize(4000);
  Status s = client_->SendReport(r);
  if (s.ok()) return s;
  if (!driver_lost_.load()) {
    spdlog::warn("report to the driver failed: {}", s.ToString());
  } else if (!warned_reports_.exchange(true)) {
    spdlog::info("reports to the driver wait while it is unreachable ({})", s.ToString());
  }
  return s;
}

void AgentImpl::ReportCommitted(const Progress& p, Duration rebuild, Duration sync) {
  // While the driver is unreachable training does not wait for it: the report goes with the
  // later commits, from the background thread (the newest only).
  if (driver_lost_.load()) {
    NoteCommit(p);
    return;
  }
  rendezvous::Report r = ProgressReport(rendezvous::ReportKind::kCommitted, p);
  r.rebuild_seconds = std::chrono::duration<double>(rebuild).count();
  r.sync_seconds = std::chrono::duration<double>(sync).count();
  (void)SendReport(std::move(r));
}

void AgentImpl::ReportLeaving(const std::string& why) {
  rendezvous::Report r;
  r.kind = rendezvous::ReportKind::kLeaving;
  r.message = why;
  (void)SendReport(std::move(r));
}

void AgentImpl::ReportFinished(int64_t version) {
  rendezvous::Report r;
  r.kind = rendezvous::ReportKind::kFinished;
  r.step = version;
  r.version = version;
  Status s = SendReport(r);
  // During a driver outage the FINISHED waits for the driver to come back, as the Watch does:
  // a driver that is restarted in time learns that the job ended and ends it as a success
  // (one that found every worker gone would start the job again). It gives up early enough
  // (a call's timeout before the Watch's deadline) for the program's own code after training
  // to run.
  const Duration call = rendezvous::ClientOptions().call_timeout;
  auto deadline = [&] {
    return TimePoint(std::chrono::duration_cast<SteadyClock::duration>(
               std::chrono::nanoseconds(lost_since_ns_.load()))) +
           *options_.driver_timeout - call - std::chrono::seconds(1);
  };
  bool said = false;
  auto waits = [&] {
    return (s.code() == Code::kUnavailable || s.code() == Code::kDeadlineExceeded) &&
           lost_since_ns_.load() != 0 && !stopping_.load() && SteadyClock::now() < deadline();
  };
  while (!s.ok() && waits()) {
    if (!said) {
      spdlog::info(
          "training finished while the driver is unreachable; waiting for it to come "
          "back (up to the --driver-timeout) to tell it");
      said = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    s = SendReport(r);
  }
  if (!s.ok()) {
    spdlog::warn("the driver did not hear that this worker finished training: {}", s.ToString());
  }
}

void AgentImpl::ReportFailed(const std::string& message) {
  rendezvous::Report r;
  r.kind = rendezvous::ReportKind::kFailed;
  r.message = message;
  (void)SendReport(std::move(r));
}

void AgentImpl::ReportCheckpoint(rendezvous::ReportKind kind, const Progress& p,
                                 const std::string& message, double seconds) {
  rendezvous::Report r = ProgressReport(kind, p);
  r.message = message;
  r.seconds = seconds;
  (void)SendReport(std::move(r));
}

namespace {
std::unique_ptr<AgentImpl>& ProcessAgent() {
  static std::unique_ptr<AgentImpl>* agent = new std::unique_ptr<AgentImpl>();  // never destroyed
  return *agent;
}
}  // namespace

AgentImpl& InitAgent(AgentOptions options) {
  static std::once_flag once;
  // Why the first call ended this worker, thrown again by every later call.
  static std::optional<WorkerEnd>* ended = new std::optional<WorkerEnd>();  // never destroyed
  std::unique_ptr<AgentImpl>& agent = ProcessAgent();
  std::call_once(once, [&] {
    auto env = WorkerOptions::FromEnvironment();
    if (!env.ok()) {
      ended->emplace(2, "elastic: " + env.status().message());
      return;
    }
    // Worker logs go to stderr, so the training program's stdout stays its own.
    Status logging = InitLogging(env->log_level, "worker");
    if (!logging.ok())
      std::fprintf(stderr, "elastic: ELASTIC_LOG_LEVEL: %s\n", logging.message().c_str());
    // The test hooks are the process's (common/test_hook.h): set here, for the process-wide
    // agent, not in AgentImpl::Create, which tests call for several agents of one process.
    if (Status hooks = ConfigureTestHooks(env->test_hooks, env->slot); !hooks.ok()) {
      ended->emplace(2, "elastic: " + hooks.message());
      return;
    }
    auto a = AgentImpl::Create(*env, options);
    if (!a.ok()) {
      ended->emplace(2, "elastic: " + a.status().ToString());
      return;
    }
    agent = std::move(a).value();
    // At exit, the Watch thread stops before static objects (spdlog's registry among them)
    // are destroyed: registered after them, this handler runs before their destructors.
    std::atexit([] { ProcessAgent()->StopWatch(); });
    // A first round whose communicator could not connect (a peer died meanwhile) is
    // retried with the next one, as Run does.
    auto joined = agent->JoinNextRound(0);
    while (!joined.ok() && joined.status().code() == Code::kAborted && !agent->ended()) {
      spdlog::warn("{}; joining the next round", joined.status().message());
      joined = agent->JoinNextRound(0);
    }
    if (!joined.ok()) {
      try {
        agent->ThrowIfEnded();  // the driver refused it, or never answered
        ended->emplace(1, "elastic: " + joined.status().ToString());
      } catch (const WorkerEnd& end) {
        ended->emplace(end);
      }
    } else if (!*joined) {
      ended->emplace(0, "this worker was scaled away before its first round; exiting 0");
    }
  });
  if (*ended) throw **ended;
  return *agent;
}

void EndProcess(const WorkerEnd& end) {
  if (end.code() == 0) {
    spdlog::info("{}", end.what());
  } else {
    std::fprintf(stderr, "%s\n", end.what());
  }
  std::fflush(stdout);
  std::exit(end.code());
}

}  // namespace elastic::worker_agent

namespace elastic {

Agent& Init() {
  try {
    return worker_agent::InitAgent();
  } catch (const worker_agent::WorkerEnd& end) {
    worker_agent::EndProcess(end);
  }
}

}  // namespace elastic
