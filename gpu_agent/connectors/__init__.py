"""Engine connectors: how the agent makes an adapter resident in a serving engine."""
from gpu_agent.connectors.base import ConnectorError, EngineConnector, EngineUnavailable

__all__ = ["ConnectorError", "EngineConnector", "EngineUnavailable", "make_connector"]


def make_connector(kind: str, **kwargs) -> EngineConnector:
    """`builtin`, `vllm` or `sglang`; imported lazily (builtin pulls in torch)."""
    if kind == "vllm":
        from gpu_agent.connectors.vllm import VLLMConnector
        return VLLMConnector(**kwargs)
    if kind == "sglang":
        from gpu_agent.connectors.sglang import SGLangConnector
        return SGLangConnector(**kwargs)
    if kind == "builtin":
        from gpu_agent.connectors.builtin import BuiltinConnector
        return BuiltinConnector(**kwargs)
    raise ValueError(f"unknown engine kind {kind!r} (builtin, vllm, sglang)")
