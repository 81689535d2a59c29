"""A broker's wall clock off the others' (a box without a real-time clock): on PYTHONPATH, it moves `time.time` by the
seconds written in the file GPUBROKER_TEST_CLOCK_OFFSET names, read again when it changes (NTP stepping the clock)."""

import os
import time

_path = os.environ.get("GPUBROKER_TEST_CLOCK_OFFSET")
if _path:
    _real, _real_ns, _monotonic = time.time, time.time_ns, time.monotonic
    _offset = [0.0, float("-inf")]  # seconds, and when last read (on the monotonic clock)

    def _current() -> float:
        if _monotonic() - _offset[1] > 0.2:
            try:
                with open(_path) as file:
                    _offset[0] = float(file.read().strip() or 0)
            except (OSError, ValueError):
                pass
            _offset[1] = _monotonic()
        return _offset[0]

    time.time = lambda: _real() + _current()
    time.time_ns = lambda: _real_ns() + int(_current() * 1e9)
