"""The wire fuzzer's helpers: pool snapshots, the in-process reference, call generators."""
