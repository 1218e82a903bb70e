"""musecore: run Muse Spark Open on whatever hardware you have.

Example::

    import musecore
    model = musecore.load("muse-tiny")                 # the bundled model, on the best device here
    print(model.generate("def fib(n):", max_new_tokens=32))
"""

from musecore.config import MuseConfig
from musecore.model import MuseModel

__all__ = ["MuseConfig", "MuseModel", "load"]
__version__ = "0.1.0"


def load(*args, **kwargs):
    from musecore.api import load as _load
    return _load(*args, **kwargs)
