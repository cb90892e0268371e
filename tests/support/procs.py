"""Process helpers for tests: the same code the demo and benchmarks use."""
from tools.localstack import REPO, extproc_process, free_port, python, running, wait_http, wait_port

__all__ = ["REPO", "extproc_process", "free_port", "python", "running", "wait_http", "wait_port"]
