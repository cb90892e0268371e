"""The shared vocabulary has its own error root and imports neither deployable."""
import importlib
import pkgutil

import ace_common
from ace_common.catalog_schema import SchemaError
from ace_common.errors import CommonError


def _modules():
    for info in pkgutil.walk_packages(ace_common.__path__, "ace_common."):
        yield importlib.import_module(info.name)


def test_every_exception_the_package_defines_derives_from_its_root():
    defined = [obj for mod in _modules() for obj in vars(mod).values()
               if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == mod.__name__]
    assert SchemaError in defined
    assert [cls.__qualname__ for cls in defined if not issubclass(cls, CommonError)] == []


def test_a_schema_error_is_a_value_error_and_no_deployable_error():
    """The gateway's state-file errors are no agent errors (issue 19): the root is shared."""
    assert issubclass(SchemaError, ValueError)
    assert [c.__module__ for c in SchemaError.__mro__ if c.__module__.startswith(("gpu_agent", "extproc"))] == []
