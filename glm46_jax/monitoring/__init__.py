"""Watching a run from outside the step: where metric records go (`sinks`, the Prometheus `exporter`), what the
host measures (`metrics`: MFU, device memory), stragglers and the profiler window (`monitor`), the hang
`watchdog`, and `fault_injection`, the test hook that makes a step hang or a process slow (docs/monitoring.md)."""
