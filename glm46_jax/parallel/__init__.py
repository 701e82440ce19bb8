"""The mesh and how arrays lie on it: axes and the logical-axis rules, multi-process start-up, CPU host settings,
and the per-device memory plan."""
