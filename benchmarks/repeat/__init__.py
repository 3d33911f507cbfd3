"""The repeat harness: the test suite N times, each on a fresh clone, optionally beside a CPU hog and in a
random order, every failure kept with its test id, seed, load average and log (docs/contributing.md)."""
