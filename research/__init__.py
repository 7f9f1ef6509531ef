"""The studies behind docs/results.md, outside the installed product:
in-process fleets (simulated in virtual or real time, or vLLM engines)
replaying workloads through the bench's drivers and reports, calibration,
`predict` and `--what-if`, the host speed reference, drafter and
speculation studies, scaling and relay capacity. Uses the product's public
modules only (no private names)."""
