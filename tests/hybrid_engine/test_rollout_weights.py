"""The rollout's weight strategies (hybrid_engine/rollout_weights.py) without processes: what each moves when."""
from hybridflow.dataflow.off_policy import RolloutStream, Schedule
from hybridflow.hybrid_engine.rollout_weights import Apart, LockStep, StreamedApart


class FakeSync:
    """An `ApartWeightSync` that records its calls: `push()` sends the actor's weights now, `push(v)` a staged
    copy; the rollout then holds that version."""

    def __init__(self, actor):
        self.actor, self.calls, self.held = actor, [], None

    def push(self, version=None):
        self.calls.append(("push", version))
        self.held = self.actor["version"] if version is None else version
        return {"sync/bytes_received": 1.0}

    def stage(self, version):
        self.calls.append(("stage", version))


def test_lock_step_refreshes_after_each_update_and_on_resume():
    refreshed, released = [], []
    weights = LockStep(lambda step: [step], refresh=lambda: refreshed.append(1) or {"reshard/time_s": 0.5},
                       release=lambda: released.append(1))
    got = weights.take(3, 2)
    assert (got.step, got.version, got.output, got.metrics) == (3, 2, [3], {}) and not weights.ahead
    assert weights.rollout(2, lambda: "out") == "out" and weights.busy_s >= 0
    weights.release()
    assert weights.updated(3) == {"reshard/time_s": 0.5} and released == [1] and refreshed == [1]
    weights.resume(3)
    assert refreshed == [1, 1] and weights.checkpointed() == [] and weights.metrics() == {}


def test_lock_step_generates_in_the_step_when_given_a_generator():
    weights = LockStep(lambda step: step * 10, generate=lambda items, version: (items, version))
    assert weights.take(2, 1).output == (20, 1)


def test_apart_pushes_once_before_the_first_call_after_an_update():
    actor = {"version": 0}
    sync = FakeSync(actor)
    weights = Apart(sync, lambda step: [step])
    assert weights.stale and sync.calls == []  # nothing moves before the rollout is called
    weights.rollout(0, lambda: None)
    weights.rollout(0, lambda: None)
    assert sync.calls == [("push", None)] and not weights.stale
    assert weights.metrics() == {"sync/bytes_received": 1.0} and weights.metrics() == {}  # reported once
    actor["version"] = 1
    assert weights.updated(1) == {} and weights.stale
    weights.rollout(1, lambda: None)
    assert sync.calls == [("push", None)] * 2 and sync.held == 1


def test_streamed_apart_stages_each_published_version_and_loads_it_on_the_streams_thread():
    """one_step over 3 steps: version 0 pushed before the stream starts, each update's weights staged as its
    version and broadcast (push(v)) when a batch first needs them; the batches report their versions."""
    actor = {"version": 0}
    sync = FakeSync(actor)
    generated = []

    def generate(items, version):
        generated.append((items, sync.held))
        return items

    schedule = Schedule.make("one_step", 3)
    weights = StreamedApart(sync, lambda publish, load: RolloutStream(schedule, generate, load, publish,
                                                                      lambda step: f"prompts {step}"))
    assert weights.ahead and sync.calls == [("push", None)]
    versions = []
    try:
        for step in (1, 2, 3):
            got = weights.take(step, step - 1)
            versions.append(got.version)
            assert set(got.metrics) == {"timing/rollout_s", "timing/rollout_wait_s", "offpolicy/dropped_batches"}
            actor["version"] = step
            weights.updated(step)
    finally:
        weights.close()
    assert versions == [0, 0, 1]
    assert ("stage", 1) in sync.calls and ("push", 1) in sync.calls
    assert generated == [("prompts 1", 0), ("prompts 2", 0), ("prompts 3", 1)]  # each from its version
    assert weights.checkpointed() == [weights.stream]
