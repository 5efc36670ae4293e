"""Benchmark suites (``make bench``): each measures ratios side by side in one run and reports them."""
