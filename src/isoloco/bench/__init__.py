"""Benchmarks of the simulator and the merge rules: `python -m isoloco.bench [--quick]`.

One module per table: `ortho` (fast Iso-C paths against exact SVD), `outer` (each rule's
outer step as a fraction of a round), `throughput` (the simulator against a plain PyTorch
loop), `comm` (bytes per worker per round against the all-gather baseline) and `memory`
(peak memory against R, with and without idle-worker offload). Each exposes a `table`
function returning a `Table`; the pieces underneath return plain numbers so the tests can
check their structure without timing anything.

The machines this runs on are shared and noisy, so every timed figure is a ratio of two
medians measured in the same run, with the cases interleaved (`timing`).
"""
