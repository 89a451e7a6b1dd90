"""The next interval's load, predicted from the last ones, with a margin for being wrong.

Holt's linear exponential smoothing (a level and a trend) of the arrival rate, and a plain
exponential average of the mean prompt and output lengths. The margin is `margin_sigmas`
standard deviations of the predictor's own recent one-step errors (the last `window` of them),
so a steady load gets a small margin and a jumpy one a large one. Pure: state in, state out;
no clock and no I/O.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Forecast:
    rate: float  # requests/s expected next interval (the point forecast)
    margin: float  # requests/s added for safety
    prompt_tokens: float
    output_tokens: float

    @property
    def planned_rate(self) -> float:
        return self.rate + self.margin


@dataclass
class LoadPredictor:
    smoothing: float = 0.5  # alpha: weight of the newest rate in the level
    trend_smoothing: float = 0.3  # beta: weight of the newest change in the trend
    margin_sigmas: float = 1.0
    window: int = 12
    level: float | None = None
    trend: float = 0.0
    prompt_tokens: float | None = None
    output_tokens: float | None = None
    errors: deque = field(default_factory=lambda: deque(maxlen=12))

    def __post_init__(self) -> None:
        self.errors = deque(self.errors, maxlen=self.window)

    def observe(self, rate: float, prompt_tokens: float | None, output_tokens: float | None) -> None:
        """One interval's measured arrival rate (req/s) and mean lengths (None: no request finished)."""
        rate = max(0.0, float(rate))
        if self.level is None:
            self.level = rate
        else:
            predicted = max(0.0, self.level + self.trend)
            self.errors.append(rate - predicted)
            previous = self.level
            self.level = self.smoothing * rate + (1 - self.smoothing) * (self.level + self.trend)
            self.trend = self.trend_smoothing * (self.level - previous) + (1 - self.trend_smoothing) * self.trend
        a = self.smoothing
        if prompt_tokens is not None and prompt_tokens > 0:
            self.prompt_tokens = prompt_tokens if self.prompt_tokens is None else a * prompt_tokens + (1 - a) * self.prompt_tokens
        if output_tokens is not None and output_tokens > 0:
            self.output_tokens = output_tokens if self.output_tokens is None else a * output_tokens + (1 - a) * self.output_tokens

    @property
    def ready(self) -> bool:
        return self.level is not None and self.prompt_tokens is not None and self.output_tokens is not None

    def forecast(self, horizon: float = 1.0) -> Forecast:
        """The load `horizon` intervals ahead (1: the next interval): Holt's level plus `horizon`
        trends, with the same margin."""
        if not self.ready:
            raise ValueError("no forecast before one interval with finished requests was observed")
        rate = max(0.0, self.level + self.trend * max(1.0, float(horizon)))
        if len(self.errors) >= 2:
            mean = sum(self.errors) / len(self.errors)
            sd = math.sqrt(sum((e - mean) ** 2 for e in self.errors) / (len(self.errors) - 1))
        else:
            sd = 0.25 * rate  # too few errors to know: a quarter of the rate
        return Forecast(rate=rate, margin=self.margin_sigmas * sd, prompt_tokens=self.prompt_tokens,
                        output_tokens=self.output_tokens)
