"""Kafka's windowed rate: the `SampledStat` + `Rate` pair every client quota is measured with.

Reproduced from Kafka's behaviour (clients/.../metrics/stats), with time passed in:
- samples of `window_ms` each; recording into a sample at least one window old moves to the next
  slot, and `samples + 1` slots are kept (the extra one is what "purge obsolete" relies on);
- before measuring, a sample whose last event is `samples x window_ms` old or more is reset;
- the rate divides the sum of all samples by the time since the oldest sample started, padded
  up to `samples - 1` whole windows when fewer have passed. A new client is therefore measured
  over at least 10 s by default, and may burst about 10x its quota before it is throttled.

Memory: a rate holds only what Kafka's `Rate` needs (value, start, last event per sample), and
its slots are created as recordings reach them. The throttle-time sensor, which also reports
avg and max, is the larger `WindowedStat`. A rate whose last recording is `samples x window_ms`
old holds no history (`expired`): every sample would be reset before its next use, so the rate
can be forgotten (`clear`) without changing any measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Kafka's `quota.window.num` and `quota.window.size.seconds` defaults.
DEFAULT_SAMPLES = 11
DEFAULT_WINDOW_MS = 1000


@dataclass(frozen=True, slots=True)
class WindowConfig:
    samples: int = DEFAULT_SAMPLES
    window_ms: int = DEFAULT_WINDOW_MS

    def __post_init__(self) -> None:
        if self.samples < 2:
            raise ValueError(f"quota window samples must be at least 2, got {self.samples}")
        if self.window_ms < 1:
            raise ValueError(f"quota window size must be at least 1 ms, got {self.window_ms}")

    @property
    def history_ms(self) -> int:
        """How long a recording counts: a sample is purged `samples x window_ms` after its last event."""
        return self.samples * self.window_ms


class _Sample:
    """One window of a rate: what Kafka's `Rate` reads (the sum), and the times purging needs."""

    __slots__ = ("last_event_ms", "start_ms", "value")

    def __init__(self, now_ms: int) -> None:
        self.value = 0.0
        self.start_ms = now_ms
        self.last_event_ms = now_ms

    def reset(self, now_ms: int) -> None:
        self.value = 0.0
        self.start_ms = now_ms
        self.last_event_ms = now_ms


class _StatSample(_Sample):
    """A sample that also counts events and keeps the largest value (Kafka's `Avg` and `Max`)."""

    __slots__ = ("events", "max")

    def __init__(self, now_ms: int) -> None:
        super().__init__(now_ms)
        self.events = 0
        self.max = 0.0

    def reset(self, now_ms: int) -> None:
        self.value = 0.0
        self.start_ms = now_ms
        self.last_event_ms = now_ms
        self.events = 0
        self.max = 0.0


class WindowedRate:
    """A rate per second over sampled windows, exactly as Kafka measures quota sensors."""

    __slots__ = ("_current", "_last_record_ms", "_samples", "config")

    _sample_type: type[_Sample] = _Sample

    def __init__(self, config: WindowConfig | None = None) -> None:
        self.config = config or DEFAULT_WINDOW
        self._samples: list[_Sample] = []
        self._current = 0
        self._last_record_ms: int | None = None

    def record(self, value: float, now_ms: int) -> None:
        sample = self._current_sample(now_ms)
        if now_ms - sample.start_ms >= self.config.window_ms:
            sample = self._advance(now_ms)
        sample.value += value
        sample.last_event_ms = now_ms
        self._last_record_ms = now_ms

    def unrecord(self, value: float, now_ms: int) -> None:
        """Take back a recorded value (Kafka does this for throttled fetches)."""
        self.record(-value, now_ms)

    def _current_sample(self, now_ms: int) -> _Sample:
        if not self._samples:
            self._current = 0
            self._samples.append(self._sample_type(now_ms))
        return self._samples[self._current]

    def _advance(self, now_ms: int) -> _Sample:
        self._current = (self._current + 1) % (self.config.samples + 1)
        if self._current >= len(self._samples):
            sample = self._sample_type(now_ms)
            self._samples.append(sample)
            return sample
        sample = self._samples[self._current]
        sample.reset(now_ms)
        return sample

    def _purge(self, now_ms: int) -> None:
        expire = self.config.history_ms
        for sample in self._samples:
            if now_ms - sample.last_event_ms >= expire:
                sample.reset(now_ms)

    def window_ms(self, now_ms: int) -> int:
        """The time the rate is measured over (Kafka's `Rate.windowSize`), never below 1 ms."""
        return self.measure_with_window(now_ms)[1]

    def total(self, now_ms: int) -> float:
        self._purge(now_ms)
        return sum(sample.value for sample in self._samples)

    def measure(self, now_ms: int) -> float:
        """Rate per second at `now_ms`."""
        return self.measure_with_window(now_ms)[0]

    def measure_with_window(self, now_ms: int) -> tuple[float, int]:
        """Rate per second and the window it was measured over (the throttle formula needs both).

        `_purge`, `window_ms` and `total` in one pass: it runs for every charged request.
        An empty rate measures as a sample started now would, without allocating one (a scrape
        must not grow a rate that `clear` emptied).
        """
        config = self.config
        expired = now_ms - config.samples * config.window_ms
        total = 0.0
        oldest = now_ms
        for sample in self._samples:
            if sample.last_event_ms <= expired:
                sample.reset(now_ms)
            else:
                total += sample.value
                if sample.start_ms < oldest:
                    oldest = sample.start_ms
        elapsed = now_ms - oldest
        full = elapsed // config.window_ms
        if full < config.samples - 1:
            elapsed += (config.samples - 1 - full) * config.window_ms
        window = max(elapsed, 1)
        return total * 1000.0 / window, window

    def expired(self, now_ms: int) -> bool:
        """Whether every recording is `samples x window_ms` old: the rate then holds no history.

        Samples are only ever touched at or before the last recording (a measurement resets
        expired samples to zero), so each would be reset before it counts again: forgetting
        them changes no later measurement that follows a recording.
        """
        last = self._last_record_ms
        return last is None or now_ms - last >= self.config.history_ms

    def clear(self) -> None:
        """Free the samples of an expired rate (the time of its last recording is kept)."""
        self._samples.clear()
        self._current = 0

    @property
    def idle_since_ms(self) -> int | None:
        """Time of the last recording, for expiring idle buckets (measuring does not count)."""
        return self._last_record_ms


class WindowedStat(WindowedRate):
    """A windowed sensor that also reports the mean and the largest value recorded.

    Kafka's throttle-time sensor (`throttle-time` avg and max) is one per bucket; only buckets
    that were ever throttled have one, so it carries the extra per-sample fields alone.
    """

    __slots__ = ()

    _sample_type = _StatSample

    def record(self, value: float, now_ms: int) -> None:
        sample = self._current_sample(now_ms)
        if now_ms - sample.start_ms >= self.config.window_ms:
            sample = self._advance(now_ms)
        assert isinstance(sample, _StatSample)
        sample.value += value
        if value > sample.max:
            sample.max = value
        sample.events += 1
        sample.last_event_ms = now_ms
        self._last_record_ms = now_ms

    def _stat_samples(self, now_ms: int) -> list[_StatSample]:
        self._purge(now_ms)
        return [sample for sample in self._samples if isinstance(sample, _StatSample)]

    def average(self, now_ms: int) -> float:
        """Mean recorded value over the retained samples (Kafka's `Avg` over the same window)."""
        samples = self._stat_samples(now_ms)
        events = sum(sample.events for sample in samples)
        return sum(sample.value for sample in samples) / events if events else 0.0

    def maximum(self, now_ms: int) -> float:
        """Largest recorded value over the retained samples (Kafka's `Max`)."""
        return max((sample.max for sample in self._stat_samples(now_ms)), default=0.0)


#: Kafka's defaults: 11 samples of 1 s.
DEFAULT_WINDOW = WindowConfig()
