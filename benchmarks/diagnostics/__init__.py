"""One-off measurements, each checking one part of self-admg's design on a real model: what a
step costs (`step_costs`), what the statistics probe costs (`probe_cost`), what the first draft
call costs (`first_call_cost`), whether the controller's plans come true (`plan_calibration`),
how good ADMG's sublayer choice is (`selection_quality`), and whether a temperature-0 mismatch
is a near-tie (`tie_margin`). Run as `python -m benchmarks.diagnostics.NAME --help`.
"""
