"""The chaos soak's stall oracle (tests/soak/soak.py, Soak.stall_problems): how long training
may pause after a fault, by what was in effect during the pause."""
import collections
import pathlib
import sys
import types

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "soak"))
import soak  # noqa: E402

T0 = 1_800_000_000.0


def stall_problems(tmp_path, faults, step_times):
    book = tmp_path / "ledger"
    with open(f"{book}.r0", "w") as f:
        for i, t in enumerate(step_times):
            f.write(f"0 {i} 0 0 1 {int((T0 + t) * 1000)} {i}\n")
    made = []
    for kind, at, until in faults:
        fault = soak.Fault(kind, [], [])
        fault.at, fault.until = T0 + at, T0 + until
        made.append(fault)
    me = types.SimpleNamespace(stalls=collections.defaultdict(float))
    return soak.Soak.stall_problems(me, types.SimpleNamespace(faults=made), str(book))


def steps(start, end):
    return [start + 0.1 * i for i in range(int((end - start) / 0.1) + 1)]


def test_a_member_stopped_across_a_driver_kill_may_hold_training_for_the_rendezvous_timeout(
        tmp_path):
    # Checkpoint soak, seed 923448539, job 3: a stop 1.15 s before a driver-kill, 7 s after a
    # job-kill's restart; the driver that adopted the job lost the stopped member at the
    # rendezvous timeout (30 s), and training went on 33.5 s after the stop. Its bound was
    # the restart's 20 s.
    times = steps(0, 10) + steps(43.5, 50)
    faults = [("job-kill", 3.0, 5.0), ("stop", 10.0, 10.0), ("driver-kill", 11.15, 13.6)]
    assert stall_problems(tmp_path, faults, times) == []
    assert stall_problems(tmp_path, faults[1:], times) == []


def test_a_stop_alone_or_a_driver_kill_alone_keeps_its_own_bound(tmp_path):
    times = steps(0, 10) + steps(43.5, 50)
    stop = stall_problems(tmp_path, [("stop", 10.0, 10.0)], times)
    assert stop == ["training stalled for 33.5 s after a stop fault (bound 16 s)"], stop
    driver = stall_problems(tmp_path, [("driver-kill", 10.0, 12.4)], times)
    assert driver == ["training stalled for 33.5 s after a driver-kill fault (bound 20 s)"], \
        driver


class Ended:
    """A process that has already ended."""

    def poll(self):
        return 0


def test_an_event_written_just_before_the_driver_ended_is_seen(tmp_path):
    # Soak seed 357137594, job 3: both workers finished during the second driver outage; the
    # restarted driver wrote driver_resumed and job_ended 2 ms apart and exited between two
    # reads of its log, and the oracle reported "did not adopt the job: None".
    log = tmp_path / "events.jsonl"
    log.write_text('{"event":"round_formed","round":25}\n'
                   '{"event":"driver_resumed","resumed":true,"round":25}\n'
                   '{"event":"job_ended","code":0}\n')
    found = soak.wait_event(soak.Events(str(log)), "driver_resumed", Ended(), 5.0)
    assert found == {"event": "driver_resumed", "resumed": True, "round": 25}
    assert soak.wait_event(soak.Events(str(log)), "worker_lost", Ended(), 5.0) is None


def quiet(events, windows):
    job = types.SimpleNamespace(ev=types.SimpleNamespace(all=events), quiet=windows)
    return soak.Soak.quiet_problems(soak.Soak, job)


def ev(ts, event, **fields):
    return dict(fields, ts=T0 + ts, event=event)


def test_the_jobs_own_end_during_a_discovery_fault_is_no_membership_change():
    # Netns soak, seed 31494: the job's last step came while the discovery script misbehaved;
    # its members' exits (code 0) and job_ending code 0 were flagged as a membership change.
    members = ["h1:0", "h2:0", "h3:0"]
    events = [ev(0, "round_proposed", round=4), ev(0.1, "round_formed", round=4, members=members),
              ev(10.2, "worker_exited", slot="h1:0", code=0, status="exit status 0"),
              ev(10.3, "worker_exited", slot="h2:0", code=0, status="exit status 0"),
              ev(10.3, "worker_exited", slot="h3:0", code=0, status="exit status 0"),
              ev(10.4, "job_ending", code=0, message="success")]
    assert quiet(events, [(T0 + 10.0, T0 + 11.0)]) == []


def test_spares_stopped_at_the_jobs_end_during_a_discovery_fault_are_no_membership_change():
    # Netns soak, seed 573100237, job 0: after job_ending (code 0) the driver stopped two warm
    # spares with SIGTERM while the discovery script printed garbage; their exits (143, told
    # by their status keepers) were flagged as a membership change.
    members = ["h0:0", "h1:0"]
    events = [ev(0, "round_proposed", round=1), ev(0.1, "round_formed", round=1, members=members),
              ev(11.6, "worker_exited", slot="h0:0", code=0, status="exit status 0"),
              ev(11.6, "worker_exited", slot="h1:0", code=0, status="exit status 0"),
              ev(11.61, "job_ending", code=0, message="success"),
              ev(11.8, "worker_exited", slot="h2:0", code=143, round=-1,
                 status="signal 15 (Terminated) (recorded by its status keeper on h2)"),
              ev(11.8, "worker_exited", slot="h0:1", code=143, round=-1,
                 status="signal 15 (Terminated) (recorded by its status keeper on h0)"),
              ev(11.81, "job_ended", code=0, message="success")]
    assert quiet(events, [(T0 + 9.8, T0 + 13.6)]) == []
    # Before a job_ending, or when the job fails, they stay flagged.
    early = events[:2] + [events[5], events[6]]
    assert len(quiet(early, [(T0 + 9.8, T0 + 13.6)])) == 2
    failed = events[:4] + [ev(11.61, "job_ending", code=1, message="failed")] + events[5:]
    assert len(quiet(failed, [(T0 + 9.8, T0 + 13.6)])) == 4


def test_an_exit_during_a_discovery_fault_that_is_not_the_end_is_flagged_with_the_rule():
    members = ["h1:0", "h2:0", "h3:0"]
    events = [ev(0, "round_proposed", round=4), ev(0.1, "round_formed", round=4, members=members),
              ev(10.2, "worker_exited", slot="h3:0", code=0, status="exit status 0"),
              ev(10.5, "round_proposed", round=5),
              ev(10.6, "round_formed", round=5, members=members[:2]),
              ev(20.0, "worker_exited", slot="h1:0", code=0, status="exit status 0"),
              ev(20.0, "worker_exited", slot="h2:0", code=0, status="exit status 0"),
              ev(20.1, "job_ending", code=0, message="success")]
    problems = quiet(events, [(T0 + 10.0, T0 + 11.0)])
    assert len(problems) == 2, problems
    assert problems[0].startswith("slot h3:0 exited with code 0 (exit status 0) at "), problems
    assert "must keep the last good host set" in problems[0], problems
    assert problems[1].startswith("round 5 proposed at "), problems
    # A job that fails is no normal end: its members' exits stay flagged.
    failed = [e for e in events if e["event"] != "job_ending"] + [
        ev(20.1, "job_ending", code=1, message="reset limit")]
    assert len(quiet(failed, [(T0 + 19.5, T0 + 20.5)])) == 2
