"""The system clock tunerd runs on: monotonic underneath, anchored to the wall clock at start,
following the wall clock's forward steps and never its backward ones."""

from __future__ import annotations

import threading

from tunerd.clock import SystemClock


class Stepped:
    """A wall clock and a monotonic clock a test moves by hand: ``tick`` moves both (time
    passes), ``step`` only the wall clock (NTP or a person set it)."""

    def __init__(self, wall: float = 1_700_000_000.0, monotonic: float = 5_000.0) -> None:
        self.wall_now = wall
        self.monotonic_now = monotonic

    def wall(self) -> float:
        return self.wall_now

    def monotonic(self) -> float:
        return self.monotonic_now

    def tick(self, seconds: float) -> None:
        self.wall_now += seconds
        self.monotonic_now += seconds

    def step(self, seconds: float) -> None:
        self.wall_now += seconds


def _clock(source: Stepped) -> SystemClock:
    return SystemClock(wall=source.wall, monotonic=source.monotonic)


def test_it_starts_at_the_wall_clock_and_runs_with_the_monotonic_one() -> None:
    source = Stepped()
    clock = _clock(source)
    assert clock.now() == 1_700_000_000.0
    source.tick(2.5)
    assert clock.now() == 1_700_000_002.5
    assert clock.monotonic() == 5_002.5
    assert clock.wall() == 1_700_000_002.5


def test_a_backward_step_of_the_wall_clock_never_takes_now_back() -> None:
    source = Stepped()
    clock = _clock(source)
    source.tick(10)
    before = clock.now()
    source.step(-3600)  # the wall clock goes back an hour
    assert clock.now() == before  # not an hour back: where it was
    source.tick(5)
    assert clock.now() == before + 5  # and on from there, at the monotonic clock's pace
    assert clock.wall() == before + 5 - 3600  # the real wall time stays at hand (signatures)


def test_a_forward_step_is_followed() -> None:
    source = Stepped()
    clock = _clock(source)
    source.tick(1)
    source.step(600)  # NTP corrected a slow clock: tunerd's times follow
    assert clock.now() == 1_700_000_601.0
    source.step(-100)  # and back a little: held where it was
    source.tick(1)
    assert clock.now() == 1_700_000_602.0
    source.tick(200)
    source.step(150)  # the wall clock steps past tunerd's time: followed again
    assert clock.now() == source.wall()


def test_now_never_decreases_across_threads() -> None:
    source = Stepped()
    clock = _clock(source)
    seen: list[list[float]] = [[] for _ in range(4)]

    def read(into: list[float]) -> None:
        for _ in range(2000):
            into.append(clock.now())

    def move() -> None:
        for index in range(2000):
            source.tick(0.001)
            source.step(-5.0 if index % 2 else 7.0)

    threads = [threading.Thread(target=read, args=(into,)) for into in seen]
    threads.append(threading.Thread(target=move))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for values in seen:
        assert values == sorted(values)


def test_the_default_reads_the_system() -> None:
    clock = SystemClock()
    first = clock.now()
    assert abs(first - clock.wall()) < 5
    assert clock.now() >= first
