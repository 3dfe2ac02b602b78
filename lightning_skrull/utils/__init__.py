"""Small utilities shared by the package, its tests and its benchmarks."""
