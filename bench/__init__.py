"""The benchmark (run with scripts/bench); results in bench/results.{md,json}."""
