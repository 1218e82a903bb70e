"""musecore: run Muse Spark Open on whatever hardware you have.

Example::

    import musecore
    model = musecore.load("muse-tiny")                 # the bundled model, on the best device here
    print(model.plan)                                  # what runs where, in which format, and why
    print(model.generate("def fib(n):", max_new_tokens=32))
"""

from musecore.config import MuseConfig
from musecore.model import MuseModel

__all__ = ["MuseConfig", "MuseModel", "load", "plan"]
__version__ = "0.1.0"


def load(*args, **kwargs):
    """See :func:`musecore.api.load` (imported lazily: ``import musecore`` stays cheap)."""
    from musecore.api import load as _load
    return _load(*args, **kwargs)


def plan(*args, **kwargs):
    """See :func:`musecore.api.plan`: what would run where and why, without reading weights."""
    from musecore.api import plan as _plan
    return _plan(*args, **kwargs)
