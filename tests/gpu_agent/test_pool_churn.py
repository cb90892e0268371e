"""The churn benchmark's claim in small: the pool never fails while per-adapter
contiguous allocation in the same budget does."""

from bench.agent import bench_churn


def test_churn_pool_never_fails():
    rep = bench_churn(300, seed=1)
    assert rep["churn_failures"] == 0
    assert rep["churn_pool_bytes_constant"]
    assert rep["churn_failures_per_adapter_alloc"] > 0
