"""Where a run's seconds go outside its steps: one log line per phase (imports, data, model, loaders, first batch,
first step, each validation, checkpoint writes, tracker close, exit), each with its own length and the time since
the process started; and whether cuDNN's benchmark is worth its autotuning for the run at hand."""

from __future__ import annotations

import time

from utils.log import LOGGER

# cuDNN's benchmark autotunes every convolution once per input shape; the step it then takes is a few percent
# faster. The extra first-step time divided by the time saved per step (docs/benchmarks.md, "cuDNN benchmark on
# and off") is the number of steps of one shape that pay the autotuning back: this, rounded up.
BENCHMARK_MIN_STEPS_PER_SHAPE = 2500


class PhaseClock:
    """Stamps phases on the log: ``phase NAME: 1.23 s (at 45.6 s)``.

    A stamp without ``seconds`` closes the phase that began at the previous such stamp (the run's main thread); a
    stamp with ``seconds`` reports something timed on its own (a checkpoint written in the background) and leaves
    the main thread's phases alone, so stamps from another thread never split them.
    """

    def __init__(self, origin: float | None = None) -> None:
        self.origin = time.monotonic() if origin is None else origin  # the process's start, where known
        self.last = self.origin

    def stamp(self, phase: str, seconds: float | None = None) -> float:
        """Log the phase; returns its length in seconds."""
        now = time.monotonic()
        if seconds is None:
            seconds, self.last = now - self.last, now
        LOGGER.info(f"phase {phase}: {seconds:.2f} s (at {now - self.origin:.1f} s)")
        return seconds


def benchmark_choice(steps: int, shapes: int, cuda: bool, deterministic: bool) -> tuple[bool, str]:
    """Whether to turn cuDNN's benchmark on for a run of ``steps`` forward passes over ``shapes`` distinct input
    shapes, and why (a line for the log)."""
    if not cuda:
        return False, "kernels: cuDNN benchmark does not apply (no CUDA device)"
    if deterministic:
        return False, "kernels: cuDNN benchmark off (--deterministic)"
    per_shape = steps / max(shapes, 1)
    verdict = per_shape >= BENCHMARK_MIN_STEPS_PER_SHAPE
    return verdict, (
        f"kernels: cuDNN benchmark {'on' if verdict else 'off'}: {steps} steps over {shapes} input shape"
        f"{'s' * (shapes != 1)} ({per_shape:.0f} per shape; autotuning pays back from "
        f"{BENCHMARK_MIN_STEPS_PER_SHAPE})"
    )
