"""One error base for the whole agent package (gpu_agent.errors.AgentError)."""
import importlib
import pkgutil

import pytest

import gpu_agent
from gpu_agent.errors import AgentError


def _agent_modules():
    for info in pkgutil.walk_packages(gpu_agent.__path__, "gpu_agent."):
        if "._proto" in info.name or info.name.endswith("__main__"):
            continue
        yield importlib.import_module(info.name)


def test_every_exception_the_package_defines_derives_from_agent_error():
    defined = [obj for mod in _agent_modules() for obj in vars(mod).values()
               if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == mod.__name__]
    assert len(defined) >= 15  # the walk found the package's errors
    assert [cls.__qualname__ for cls in defined if not issubclass(cls, AgentError)] == []


@pytest.mark.parametrize("where, name", [("gpu_agent.settings", "SettingsError"),
                                         ("gpu_agent.engine.tokenizer", "ChatTemplateError")])
def test_errors_callers_catch_as_value_error_still_are(where, name):
    assert issubclass(getattr(importlib.import_module(where), name), ValueError)
